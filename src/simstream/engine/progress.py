"""Shared producer progress: generations requested and completed, and the engine's counters."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable

from .._bounded import held

__all__ = ["ProducerProgress"]

_COUNTERS = (
    "requested_generation",
    "successful_episodes",
    "failed_episodes",
    "generated_frames",
    "sampled_chunks",
    "sample_count",
    "next_episode_id",
    "production_ns",
)

_WAKE_CAP_S = 0.05
"""Longest sleep between two looks at the state: a backstop for a wake-up that another waiter cleared."""


class ProducerProgress:
    """Counters in one shared int64 array guarded by its lock, plus each worker's completed generation.

    ``completed_generation`` is derived: the smallest generation every worker has finished, i.e. the
    last generation in which every slot was rewritten once. Owners waiting for a generation sleep in
    :meth:`wait_for_change`, which a worker cuts short when it completes a generation or fails (and the
    supervisor's monitor when a worker dies silently).
    """

    def __init__(self, num_workers: int, ctx: mp.context.BaseContext) -> None:
        self._values = ctx.Array("q", len(_COUNTERS) + num_workers)
        self._num_workers = num_workers
        self._changed = ctx.Event()

    @property
    def lock(self):
        return self._values.get_lock()

    def get(self, name: str) -> int:
        return self._values[_COUNTERS.index(name)]

    def set(self, name: str, value: int) -> None:
        self._values[_COUNTERS.index(name)] = value

    def add(self, name: str, value: int) -> int:
        """Add ``value`` under the lock and return the new total."""
        position = _COUNTERS.index(name)
        with self.lock:
            self._values[position] += value
            return self._values[position]

    def worker_completed(self, worker: int) -> int:
        return self._values[len(_COUNTERS) + worker]

    def set_worker_completed(self, worker: int, generation: int) -> None:
        self._values[len(_COUNTERS) + worker] = generation
        self.notify()

    def notify(self) -> None:
        """Wake the owner's :meth:`wait_for_change` (a worker completed a generation, failed or died)."""
        self._changed.set()

    def wait_for_change(self, timeout: float) -> None:
        """Sleep until a worker calls :meth:`notify` or ``timeout`` seconds pass; then re-check the state.

        Clearing after the wake cannot lose a change: a worker writes its state before it notifies, and
        the caller reads the state after this returns.
        """
        self._changed.wait(timeout)
        self._changed.clear()

    def wait_for_completed(self, generation: int, deadline: float, check: Callable[[], None]) -> bool:
        """Sleep until every worker completed ``generation`` (``True``) or ``deadline`` passes (``False``).

        Args:
            generation: The generation to wait for.
            deadline: ``time.monotonic()`` value at which to give up.
            check: Called before every look at the state; it ends the wait by raising (a failure, a
                cancellation). Workers wake the wait through :meth:`notify`.
        """
        while True:
            check()
            if self.completed_generation >= generation:
                return True
            if time.monotonic() >= deadline:
                return False
            self.wait_for_change(min(_WAKE_CAP_S, max(0.0, deadline - time.monotonic())))

    @property
    def completed_generation(self) -> int:
        base = len(_COUNTERS)
        return min(self._values[base : base + self._num_workers])

    def snapshot(self, check: Callable[[], None] | None = None) -> dict[str, int]:
        """Every counter plus ``completed_generation``; ``check`` bounds the lock wait (see ``held``)."""
        with held(self.lock, check):
            values = {name: self._values[i] for i, name in enumerate(_COUNTERS)}
            values["completed_generation"] = self.completed_generation
        return values
