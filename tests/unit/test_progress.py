"""``ProducerProgress``: shared counters, per-worker generations, and the owner's wake-up."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from simstream.engine.progress import ProducerProgress

pytestmark = pytest.mark.timeout(120)


def _complete(progress: ProducerProgress, worker: int, generation: int) -> None:
    progress.set_worker_completed(worker, generation)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_completing_a_generation_wakes_the_waiting_owner(method):
    ctx = mp.get_context(method)
    progress = ProducerProgress(2, ctx)
    woke = threading.Event()

    def owner() -> None:
        progress.wait_for_change(600.0)  # far past the bounds below: only the worker can end it in time
        woke.set()

    thread = threading.Thread(target=owner, daemon=True)
    thread.start()
    worker = ctx.Process(target=_complete, args=(progress, 1, 3))
    worker.start()
    worker.join(60.0)
    assert worker.exitcode == 0
    assert woke.wait(60.0), "the owner slept through the worker's completed generation"
    assert progress.worker_completed(1) == 3 and progress.completed_generation == 0  # worker 0: none yet


def test_a_change_before_the_wait_is_not_lost():
    progress = ProducerProgress(1, mp.get_context("fork"))
    progress.set_worker_completed(0, 1)
    woke = threading.Event()
    thread = threading.Thread(target=lambda: (progress.wait_for_change(600.0), woke.set()), daemon=True)
    thread.start()
    assert woke.wait(60.0)
    assert progress.completed_generation == 1
