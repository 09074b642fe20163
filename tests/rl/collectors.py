"""A minimal ``AsyncRunner`` subclass and its collector, importable by spawned children.

The collector bumps a shared counter and beats; the learner waits (through ``_wait_until``) for the
counter to pass each iteration. ``mode`` selects a fault.
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from simstream._sync import Doorbell
from simstream.rl import APPORunner, AsyncRunner, RunnerConfig


class Releasable:
    """Stands in for a shared resource; records that ``close()`` released it."""

    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


class ToyRunner(AsyncRunner):
    """Learner waits for a shared counter the collector increments."""

    def __init__(self, mode: str = "ok", target: str | None = None, config: RunnerConfig | None = None):
        super().__init__(config or RunnerConfig(shutdown_timeout_s=5.0))
        self.mode = mode
        self.target = target
        self.counter = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.ticked = Doorbell(mp.get_context("spawn"))
        """Rung by the collector after each increment: the learner waits on it instead of polling. Not an
        Event: a collector killed inside ``Event.set()`` leaves its lock taken, and the next wait hangs."""
        self.resource = self._register_shared(Releasable())
        self.seen_kwargs: tuple[str, ...] = ()

    def _get_default_device(self) -> str:
        return "cpu"

    def _build_learner(self):
        return None

    def _collector_target(self) -> str:
        return self.target or super()._collector_target()

    @staticmethod
    def _collector_fn(stop_event, heartbeat, counter, ticked, mode) -> None:
        torch.set_num_threads(1)
        while not stop_event.is_set():
            heartbeat()
            counter += 1
            ticked.ring()
            if mode == "return_early" and int(counter) >= 5:
                return
            stop_event.wait(0.01)  # the time one collection step takes

    def learn(self, max_iterations: int, save_interval: int = 50, log_dir: str | None = None) -> int:
        if self._process() is None:
            self._start_collector({"counter": self.counter, "ticked": self.ticked, "mode": self.mode})
        for i in range(max_iterations):
            self._wait_until(lambda s, i=i: self._counted_past(i, s), 30.0, "count")
        return int(self.counter)

    def _counted_past(self, count: int, slice_s: float) -> bool | None:
        """``True`` once the counter passed ``count``; else wait up to ``slice_s`` for a tick (``None``)."""
        if int(self.counter) > count:
            return True
        self.ticked.wait(slice_s)  # a ring after the check is kept: the wait returns at once
        return True if int(self.counter) > count else None


def take_one(queue) -> None:
    """Reads one item from ``queue`` (unblocks a feeder thread stuck on a full pipe)."""
    queue.get(timeout=60)


def hammer_ring(ring, rollouts: int) -> None:
    """Writer for the torn-read test: fills each slot element by element with its rollout number."""
    torch.set_num_threads(1)
    for number in range(rollouts):
        slot = ring.acquire(should_stop=lambda: False)
        row = ring.data["x"][slot]
        for i in range(row.numel()):
            row[i] = float(number)
        ring.commit(slot, number)


class LockDeathRunner(AsyncRunner):
    """Its collector takes the rollout ring's lock and is SIGKILLed holding it (an OOM kill, say)."""

    def __init__(self) -> None:
        from simstream.rl import RolloutRing

        super().__init__(RunnerConfig(shutdown_timeout_s=5.0))
        self.ring = self._register_shared(
            RolloutRing({"x": ((4,), torch.float32)}, 2, "block", mp.get_context("spawn"))
        )

    def _get_default_device(self) -> str:
        return "cpu"

    def _build_learner(self):
        return None

    @staticmethod
    def _collector_fn(stop_event, heartbeat, ring) -> None:
        import os
        import signal

        heartbeat()
        ring._lock.acquire(None)
        os.kill(os.getpid(), signal.SIGKILL)

    def learn(self, max_iterations: int = 1, save_interval: int = 50, log_dir: str | None = None):
        self._start_collector({"ring": self.ring})

        def poll(slice_s: float):
            taken = self.ring.take(1)
            if taken:
                return taken
            self.ring.wait_filled(slice_s)
            return None

        return self._wait_until(poll, 60.0, "rollout")


def _collector_stopped_in_the_ring_lock(stop_event, heartbeat, spec, ring, weights) -> None:
    """The APPO collector, stopped (SIGSTOP, as a debugger would) inside its third claim of a ring slot,
    which it makes holding the ring's lock."""
    import os
    import signal

    from simstream.rl.collector import run_appo_collector
    from simstream.rl.ring import RolloutRing

    claim, claims = RolloutRing._claim, [0]

    def stopping_claim(self):
        claims[0] += 1
        if claims[0] == 3:
            os.kill(os.getpid(), signal.SIGSTOP)
        return claim(self)

    RolloutRing._claim = stopping_claim
    run_appo_collector(stop_event, heartbeat, spec, ring, weights)


class StoppedInTheRingLock(APPORunner):
    """An APPO runner whose collector is stopped holding the rollout ring's lock."""

    _collector_fn = staticmethod(_collector_stopped_in_the_ring_lock)
