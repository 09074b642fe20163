"""Shared producer progress: generations requested and completed, and the engine's counters."""

from __future__ import annotations

import multiprocessing as mp

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


class ProducerProgress:
    """Counters in one shared int64 array guarded by its lock, plus each worker's completed generation.

    ``completed_generation`` is derived: the smallest generation every worker has finished, i.e. the
    last generation in which every slot was rewritten once.
    """

    def __init__(self, num_workers: int, ctx: mp.context.BaseContext) -> None:
        self._values = ctx.Array("q", len(_COUNTERS) + num_workers)
        self._num_workers = num_workers

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

    @property
    def completed_generation(self) -> int:
        base = len(_COUNTERS)
        return min(self._values[base : base + self._num_workers])

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            values = {name: self._values[i] for i, name in enumerate(_COUNTERS)}
            values["completed_generation"] = self.completed_generation
        return values
