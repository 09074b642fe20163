"""Shared fixtures: every test must leave no process, shared-memory file or thread behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")


def _shm_files() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


_TRANSIENT_SHM_S = 2.0
"""How long a new /dev/shm file may take to go away before it counts as left behind."""


def _new_shm_files(before: set[str]) -> set[str]:
    return {f for f in _shm_files() - before if not f.startswith("sem.")}


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


def _extra_threads(before: set[str]) -> list[threading.Thread]:
    # multiprocessing's queue feeders and file-descriptor sharer ("(_serve)") live as long as the process
    # once started; pt_ threads are torch's
    return [
        t
        for t in threading.enumerate()
        if t.is_alive()
        and t.name not in before
        and not t.name.startswith(("QueueFeederThread", "pt_"))
        and not t.name.endswith("(_serve)")
    ]


@pytest.fixture(autouse=True)
def wide_cli_errors(monkeypatch):
    """tyro draws a CLI error in a box as wide as ``COLUMNS`` (80 when unset) and wraps it there, which
    split a long temporary path inside the message a test looks for (a ``pytest -n`` worker's are longer)."""
    monkeypatch.setenv("COLUMNS", "1000")


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves child processes, /dev/shm files or extra threads running."""
    shm_before, threads_before = _shm_files(), _threads()
    yield
    # give what the test stopped up to 5 s to finish exiting, waiting on each (join), not polling
    deadline = time.monotonic() + 5.0
    for child in mp.active_children():
        child.join(max(0.0, deadline - time.monotonic()))
    for thread in _extra_threads(threads_before):
        thread.join(max(0.0, deadline - time.monotonic()))
    children = mp.active_children()
    extra_threads = {thread.name for thread in _extra_threads(threads_before)}
    leaked_shm = _new_shm_files(shm_before)
    if not os.environ.get("CI"):
        # Other local processes (a second test run, a benchmark) also create segments: only count ours.
        leaked_shm = {f for f in leaked_shm if str(os.getpid()) in f}
    # Another worker of this run (pytest -n) may be between creating and unlinking a segment (torch names
    # one for a moment before it passes the descriptor on): only what stays counts.
    settled = time.monotonic() + _TRANSIENT_SHM_S
    while leaked_shm and time.monotonic() < settled:
        threading.Event().wait(0.02)
        leaked_shm &= _new_shm_files(shm_before)
    assert not children, f"test left child processes running: {children}"
    assert not extra_threads, f"test left threads running: {extra_threads}"
    assert not leaked_shm, f"test left shared-memory files: {leaked_shm}"


@pytest.fixture
def ctrl_c_raises():
    """Python's usual Ctrl-C handler for the test: a shell that runs a job in the background (CI) makes it
    ignore SIGINT, and then a raised SIGINT would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def in_private_network_namespace() -> bool:
    """True inside ``unshare -n`` (only the loopback interface exists), where Ray binds to 127.0.0.1."""
    import socket

    return [name for _, name in socket.if_nameindex()] == ["lo"]


_RAY_TESTS = os.path.join(os.path.dirname(__file__), "ray_backend")


def pytest_ignore_collect(collection_path, config):
    """The Ray tests start servers: they run only in a private network namespace (``make test`` runs
    them there in a step of their own), never in the main run."""
    if str(collection_path).startswith(_RAY_TESTS) and not in_private_network_namespace():
        return True
    return None


def pytest_report_header(config):
    if not in_private_network_namespace():
        return "tests/ray_backend: not collected outside a private network namespace (see make test-ray)"
    return None
