"""Shared fixtures: every test must leave no process, shared-memory file or thread behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")


def _shm_files() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves child processes, /dev/shm files or extra threads running."""
    shm_before, threads_before = _shm_files(), _threads()
    yield
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        children = mp.active_children()
        # multiprocessing's queue feeders and file-descriptor sharer ("(_serve)") live as long as the
        # process once started; pt_ threads are torch's
        extra_threads = {
            t
            for t in _threads() - threads_before
            if not t.startswith(("QueueFeederThread", "pt_")) and not t.endswith("(_serve)")
        }
        if not children and not extra_threads:
            break
        time.sleep(0.05)
    leaked_shm = {f for f in _shm_files() - shm_before if not f.startswith("sem.")}
    if not os.environ.get("CI"):
        # Other local processes (a second test run, a benchmark) also create segments: only count ours.
        leaked_shm = {f for f in leaked_shm if str(os.getpid()) in f}
    assert not children, f"test left child processes running: {children}"
    assert not extra_threads, f"test left threads running: {extra_threads}"
    assert not leaked_shm, f"test left shared-memory files: {leaked_shm}"
