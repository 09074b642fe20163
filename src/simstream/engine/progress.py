"""Shared producer progress: the generation protocol and the engine's counters, without a shared lock.

Every counter has exactly one writer process, so no lock guards it and no process can wedge another
through it (see ``docs/design.md``, "No unbounded waits"):

* **producer rows** — producer ``i`` alone writes row ``i`` (its completed generation, episodes, frames,
  production time, pid);
* **consumer rows** — each sampling process (the owner, every ``DataLoader`` worker) claims a row of its
  own through :class:`~simstream._sync.ProcessSlots` and adds the chunks it delivered; readers sum them;
* **requested generation** — written only under the request lock, which producers never take (they only
  read it), so a stopped producer can never hold up a consumer that asks for a refill.

Wake-ups are :class:`~simstream._sync.Doorbell` rings, which never block the ringer: one per producer
(a generation was requested, or the engine is closing) and one for the owner (a producer completed a
generation or failed, or the supervisor saw a death).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from .._sync import Doorbell, ProcessSlots, SharedLock

__all__ = ["ProducerProgress"]

_SHARED = ("requested_generation", "refill_base", "next_episode_id")
_PRODUCER = (
    "completed_generation",
    "successful_episodes",
    "failed_episodes",
    "generated_frames",
    "production_ns",
    "pid",
    "restarts",
)
_NODE_ID_BYTES = 64
_CONSUMER_ROWS = 64
"""Sampling processes with a row of their own; any beyond share one more row under a lock."""

_REQUEST_WAIT_S = 0.01
"""Longest wait of a sample for the request lock: a holder keeps it for microseconds; a stopped one
must not hold up sampling (the request is simply made by a later sample)."""

_WAKE_CAP_S = 0.05
"""Longest sleep between two looks at the state: a backstop for a ring that another waiter consumed."""


class ProducerProgress:
    """The generation protocol and counters of one engine, in one shared int64 table.

    ``completed_generation`` is derived: the smallest generation every producer has finished, i.e. the
    last generation in which every slot was rewritten once.

    Args:
        num_workers: Producer processes.
        ctx: Multiprocessing context that allocates the shared state.
    """

    def __init__(self, num_workers: int, ctx: mp.context.BaseContext) -> None:
        self._num_workers = num_workers
        size = len(_SHARED) + num_workers * len(_PRODUCER) + _CONSUMER_ROWS + 1
        self._raw = ctx.RawArray("q", size)
        self._node_ids = ctx.RawArray("c", num_workers * _NODE_ID_BYTES)
        """Ray backend: each producer's node id (hex), written by the ingest process."""
        self._consumer_slots = ProcessSlots(_CONSUMER_ROWS)
        self._overflow_lock = SharedLock()
        self._request_lock = SharedLock()
        self._owner_bell = Doorbell(ctx)
        self._producer_bells = [Doorbell(ctx) for _ in range(num_workers)]
        self._views()

    def _views(self) -> None:
        values = np.frombuffer(self._raw, dtype=np.int64)
        producers_end = len(_SHARED) + self._num_workers * len(_PRODUCER)
        self._shared = values[: len(_SHARED)]
        self._producers = values[len(_SHARED) : producers_end].reshape(self._num_workers, len(_PRODUCER))
        self._sampled = values[producers_end:]
        self._pid = os.getpid()
        self._local = threading.Lock()
        self._unrecorded = 0
        """Chunks this process delivered that wait to go into the shared overflow row (its lock was busy)."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("_shared", "_producers", "_sampled", "_pid", "_local", "_unrecorded"):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()

    # -- generations ---------------------------------------------------------------------------------
    @property
    def requested_generation(self) -> int:
        return int(self._shared[0])

    @property
    def completed_generation(self) -> int:
        return int(self._producers[:, 0].min())

    def worker_completed(self, worker: int) -> int:
        return int(self._producers[worker, 0])

    def set_worker_completed(self, worker: int, generation: int) -> None:
        """Producer ``worker`` finished ``generation``; wakes the owner."""
        self._producers[worker, 0] = generation
        self.notify()

    @property
    def request_lock(self) -> SharedLock:
        """The lock every refill request takes (its waits name it, see ``EngineShared.request_refill``)."""
        return self._request_lock

    def request_generation(self, check: Callable[[], None] | None) -> int:
        """Coalescing refill request: a new generation only when none is outstanding.

        Args:
            check: Called while another requester holds the request lock; ends the wait by raising.

        Returns:
            The generation that will satisfy the request.
        """
        with self._request_lock.held(check):
            requested = self.requested_generation
            if requested <= self.completed_generation:
                requested += 1
                self._shared[0] = requested
                self.wake_producers()
        return requested

    def request_after_samples(self, refill_after: int, check: Callable[[], None] | None) -> None:
        """Request a generation once ``refill_after`` chunks were delivered since the last such request.

        Chunks delivered while a refill is outstanding count toward the next one. The test is made
        without any lock first: the request lock is taken only when a request is due.
        """
        if not self._refill_due(refill_after):
            return
        try:  # another requester (maybe stopped) holds it: its request coalesces with ours
            with self._request_lock.held(_busy_after_short_wait(check), slice_s=_REQUEST_WAIT_S / 4):
                if self._refill_due(refill_after):
                    self._shared[1] = self.sampled_total()
                    self._shared[0] = self.requested_generation + 1
                    self.wake_producers()
        except _RequestBusy:
            pass  # the next sample looks again

    def _refill_due(self, refill_after: int) -> bool:
        return (
            self.sampled_total() - int(self._shared[1]) >= refill_after
            and self.requested_generation <= self.completed_generation
        )

    def wake_producers(self) -> None:
        for bell in self._producer_bells:
            bell.ring()

    def wait_for_request(self, worker: int, timeout: float) -> None:
        """In producer ``worker``: sleep until woken (a request, closing) or ``timeout`` seconds pass."""
        self._producer_bells[worker].wait(timeout)

    # -- the owner's waits ---------------------------------------------------------------------------
    def notify(self) -> None:
        """Wake the owner's waits (a producer completed a generation, failed or died). Never blocks."""
        self._owner_bell.ring()

    def wait_for_change(self, timeout: float) -> None:
        """Sleep until :meth:`notify` or ``timeout`` seconds pass; callers then re-check the state."""
        self._owner_bell.wait(timeout)

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

    # -- counters ------------------------------------------------------------------------------------
    def add_for_worker(self, worker: int, name: str, value: int) -> None:
        """In producer ``worker`` (the row's only writer): add ``value`` to its counter ``name``."""
        self._producers[worker, _PRODUCER.index(name)] += value

    def set_worker_pid(self, worker: int, pid: int) -> None:
        self._producers[worker, _PRODUCER.index("pid")] = pid

    def set_worker_restarts(self, worker: int, restarts: int) -> None:
        """Restarts of producer ``worker`` so far (Ray backend; written by its ingest, the row's writer)."""
        self._producers[worker, _PRODUCER.index("restarts")] = restarts

    def set_worker_node(self, worker: int, node_id: str | None) -> None:
        """The node producer ``worker`` runs on (Ray backend; ``None``: not known yet)."""
        data = (node_id or "").encode()[:_NODE_ID_BYTES].ljust(_NODE_ID_BYTES, b"\0")
        start = worker * _NODE_ID_BYTES
        self._node_ids[start : start + _NODE_ID_BYTES] = data

    def worker_node(self, worker: int) -> str | None:
        start = worker * _NODE_ID_BYTES
        return bytes(self._node_ids[start : start + _NODE_ID_BYTES]).rstrip(b"\0").decode() or None

    def allocate_episode_ids(self, count: int) -> int:
        """First of ``count`` fresh episode ids; the caller holds the publication lock."""
        first = int(self._shared[2])
        self._shared[2] = first + count
        return first

    def record_sampled(self, count: int, check: Callable[[], None] | None) -> None:
        """Add ``count`` delivered chunks to this process's own row (no shared lock unless rows ran out)."""
        if self._pid != os.getpid():  # forked: the thread lock may have been copied while taken
            self._pid, self._local, self._unrecorded = os.getpid(), threading.Lock(), 0  # the parent's count
        slot = self._consumer_slots.mine()
        if slot is None:
            self._record_in_overflow_row(count, check)
            return
        with self._local:
            self._sampled[slot] += count

    def _record_in_overflow_row(self, count: int, check: Callable[[], None] | None) -> None:
        """Add ``count`` to the row that every process past the first ``_CONSUMER_ROWS`` shares, under its
        lock. A holder keeps it for microseconds; one that keeps it longer (stopped: SIGSTOP, a debugger)
        must not hold up this sample, whose batch is already copied: the count then waits in this process
        and goes in with a later one."""
        with self._local:
            self._unrecorded += count
        try:
            with (
                self._overflow_lock.held(_busy_after_short_wait(check), slice_s=_REQUEST_WAIT_S / 4),
                self._local,
            ):
                self._sampled[_CONSUMER_ROWS] += self._unrecorded
                self._unrecorded = 0
        except _RequestBusy:
            pass

    def sampled_total(self) -> int:
        return int(self._sampled.sum())

    def snapshot(self) -> dict[str, int]:
        """Every counter, summed over producers and consumers (no lock; each value is current)."""
        totals = self._producers.sum(axis=0)
        values = {name: int(totals[i]) for i, name in enumerate(_PRODUCER) if name not in ("pid", "restarts")}
        values["requested_generation"] = self.requested_generation
        values["completed_generation"] = self.completed_generation
        values["sampled_chunks"] = self.sampled_total()
        return values

    def producer_rows(self) -> list[dict[str, int]]:
        """One dict per producer: ``index``, ``pid``, ``episodes``, ``failed_episodes``, ``frames``,
        ``completed_generation``, ``restarts``, ``node_id`` (Ray backend; else ``None``)."""
        return [
            {
                "index": worker,
                "pid": int(row[_PRODUCER.index("pid")]),
                "episodes": int(row[_PRODUCER.index("successful_episodes")]),
                "failed_episodes": int(row[_PRODUCER.index("failed_episodes")]),
                "frames": int(row[_PRODUCER.index("generated_frames")]),
                "completed_generation": int(row[0]),
                "restarts": int(row[_PRODUCER.index("restarts")]),
                "node_id": self.worker_node(worker),
            }
            for worker, row in enumerate(self._producers.copy())
        ]


class _RequestBusy(Exception):
    """The request lock (or the overflow row's) stayed taken past a sample's short wait."""


def _busy_after_short_wait(check: Callable[[], None] | None) -> Callable[[], None]:
    """A lock wait's check for a sample: ``check``, then ``_RequestBusy`` once ``_REQUEST_WAIT_S`` passed."""
    deadline = time.monotonic() + _REQUEST_WAIT_S

    def busy() -> None:
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            raise _RequestBusy

    return busy
