"""``owner_watch``: a worker's check that the process that started it has exited, under every start method."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from multiprocessing.connection import wait

import pytest

from simstream.workers.supervisor import owner_watch

pytestmark = pytest.mark.timeout(120)


def _worker(results, started) -> None:
    gone = owner_watch()
    results.put(("while the owner lives", gone()))
    started.set()
    wait([mp.parent_process().sentinel], timeout=30.0)  # the owner closing its files, as it exits
    # the owner's pidfd (what gone() polls) reports the exit a moment later, once the process has ended
    deadline = time.monotonic() + 10.0
    while not gone() and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    results.put(("after the owner exited", gone()))


def _owner(method: str, results, started) -> None:
    worker = mp.get_context(method).Process(target=_worker, args=(results, started))
    worker.start()
    results.put(("worker", worker.pid))
    started.wait(60.0)
    # a queue's put is sent by a feeder thread, which os._exit would kill before it sent the pid
    results.close()
    results.join_thread()
    os._exit(0)  # no join, no atexit: the worker is orphaned


@pytest.mark.parametrize("method", mp.get_all_start_methods())
def test_owner_watch_turns_true_once_the_owner_exits(method):
    ctx = mp.get_context(method)
    results, started = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_owner, args=(method, results, started))
    owner.start()
    received = {}
    try:
        while len(received) < 3:
            key, value = results.get(timeout=60.0)
            received[key] = value
    except queue.Empty:
        pytest.fail(f"only {received} arrived within 60 s")
    finally:
        owner.join(timeout=30.0)
        if "worker" in received:
            try:
                os.kill(received["worker"], 9)
            except ProcessLookupError:
                pass
    assert received["while the owner lives"] is False
    assert received["after the owner exited"] is True


def test_owner_watch_is_false_in_a_process_nobody_started():
    if mp.parent_process() is not None:
        pytest.skip("the test runner itself was started by multiprocessing")
    assert owner_watch()() is False
