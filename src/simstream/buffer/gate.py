"""The record gate: a producer does not overwrite a published episode that a recorder has not copied yet.

A recorder (``simstream.lerobot.LeRobotRecorder``) copies published rows beside the sampler. For it never to
lose an episode, :meth:`EpisodeWriter.claim` calls :meth:`RecordGate.before_claim`, which, while a recorder
is attached in ``"wait"`` mode, waits until every row about to be claimed is recorded:

    row r may be claimed  <=>  episode_id[r] < 0  or  recorded[r] >= episode_id[r]

``skipped[r]`` and ``waited_ns[r]`` (how long claims starting at row ``r`` waited for the recorder) have
one writer each (the producer owning row ``r``); ``recorded[r]`` is the recorder's, except in ``"skip"``
mode. There a claim never waits for the recorder's copies: it counts the unrecorded episode it
overwrites in ``skipped`` and marks it as settled in ``recorded``, under a lock that the recorder also
takes (for microseconds) to settle a copy (:meth:`RecordGate.settle`), so an episode whose copy
completes while a claim overtakes it is counted as recorded or as skipped, never both. The wait of
``"wait"`` mode is sliced (1 ms growing to 20 ms) and runs the caller's check between slices (a
producer's stop check raises once the engine closes or its owner is gone); a recorder that detaches
(closes, or its thread fails) sets the mode back to off, which ends every wait.

The recorder looks at the index on a timer (a tenth of a second), which keeps it off the producers' cores
between looks. A claim that must wait rings the gate's doorbell before its first sleep, so a producer
blocked on the recorder wakes it at once (:meth:`wait_for_demand`). Publications ring nothing: a wake-up
per publication, rung under the publication lock, cost the producers more CPU per episode than the
recorder's own copies (``BENCHMARKS.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .._sync import Doorbell, SharedLock, with_deadline

__all__ = ["RecordGate"]

_OFF, _WAIT, _SKIP = 0, 1, 2
_MODES = {"off": _OFF, "wait": _WAIT, "skip": _SKIP}
_FIRST_SLICE_S, _LAST_SLICE_S = 0.001, 0.02
"""A waiting claim sleeps 1 ms, then twice as long each time, up to 20 ms."""
_STOPPED_HOLDER_S = 30.0
"""A wait for the settle lock fails (``TimeoutError``) once its holder has been stopped this long."""


class RecordGate:
    """Per-row "recorded up to episode id" in shared memory, and the recorder's mode.

    Owns: ``recorded``, ``skipped`` and ``waited_ns`` (``[buffer_size]`` int64), ``mode`` (one int64) and
    the doorbell a waiting claim rings (a semaphore), and the lock under which skip mode settles an
    episode (recorded or skipped). Allocated by the engine's owner and pickled into
    producers with the rest of the shared state.
    """

    def __init__(self, buffer_size: int, ctx: Any = None) -> None:
        self._demand = Doorbell(ctx)
        self._settle_lock = SharedLock()
        self.recorded = torch.full((buffer_size,), -1, dtype=torch.int64).share_memory_()
        self.skipped = torch.zeros(buffer_size, dtype=torch.int64).share_memory_()
        self.waited_ns = torch.zeros(buffer_size, dtype=torch.int64).share_memory_()
        self.mode = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._mode_view = self.mode.numpy()
        """NumPy view of ``mode``: every claim reads it, and a tensor read costs several microseconds."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_mode_view"]  # a view pickles as a private copy; rebuilt on the shared tensor
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._mode_view = self.mode.numpy()

    @staticmethod
    def shared_bytes(buffer_size: int) -> int:
        """Bytes of shared memory :meth:`__init__` allocates."""
        return 8 * (3 * buffer_size + 1)

    def attach(self, mode: str) -> None:
        """Start gating claims: ``"wait"`` (producers wait for the recorder) or ``"skip"`` (they count)."""
        if mode not in ("wait", "skip"):
            raise ValueError(f"RecordGate mode must be 'wait' or 'skip', got {mode!r}")
        self.mode[0] = _MODES[mode]

    def detach(self) -> None:
        """Stop gating: every waiting claim proceeds at its next slice."""
        self.mode[0] = _OFF

    @property
    def attached(self) -> bool:
        return int(self.mode[0]) != _OFF

    def uncopied(self, episode_id: torch.Tensor) -> int:
        """In ``"wait"`` mode, how many published episodes (``episode_id``: the index's per-row ids) the
        recorder has not copied yet: producers wait for it before overwriting them. 0 in other modes."""
        if int(self._mode_view[0]) != _WAIT:
            return 0
        return int((episode_id > self.recorded).sum())

    def mark_recorded(self, row: int, episode_id: int) -> None:
        """The recorder copied ``episode_id`` out of ``row``: the row may be claimed again."""
        self.recorded[row] = episode_id

    def settle(
        self, row: int, episode_id: int, unchanged: Callable[[], bool], check: Callable[[], None] | None
    ) -> bool:
        """In the recorder, after copying ``episode_id`` out of ``row``: keep the copy or not.

        Returns ``True`` (and marks the episode recorded) when ``unchanged()`` says the row still holds
        the episode as copied and, in skip mode, no claim has counted it as skipped; ``False`` otherwise:
        the copy is discarded. ``check`` bounds the wait for the skip-mode lock (it raises to give up).
        """
        if int(self._mode_view[0]) != _SKIP:
            if not unchanged():
                return False
            self.recorded[row] = episode_id
            return True
        with self._settling(check):
            if int(self.recorded[row]) >= episode_id or not unchanged():
                return False
            self.recorded[row] = episode_id
            return True

    def wait_for_demand(self, timeout: float) -> bool:
        """In the recorder: sleep until a claim waits for a row (or :meth:`wake`) or ``timeout`` seconds pass.

        Returns ``True`` when woken; callers look at the index again either way.
        """
        return self._demand.wait(timeout)

    def wake(self) -> None:
        """End the recorder's :meth:`wait_for_demand` now (it is closing)."""
        self._demand.ring()

    def total_skipped(self) -> int:
        return int(self.skipped.sum())

    def total_waited_s(self) -> float:
        """Seconds producers' claims have spent waiting for a recorder, summed over producers."""
        return int(self.waited_ns.sum()) / 1e9

    def _settling(self, check: Callable[[], None] | None):
        """Hold the settle lock (its holders keep it for microseconds): ``check`` runs between waits, and a
        holder stopped (SIGSTOP) for ``_STOPPED_HOLDER_S`` ends the wait with ``TimeoutError``."""
        lock = self._settle_lock
        return lock.held(with_deadline(check, _STOPPED_HOLDER_S, "The record gate's settle lock", lock))

    def _skip(self, start: int, end: int, episode_id: torch.Tensor, check: Callable[[], None] | None) -> None:
        """Count the unrecorded episodes of rows ``[start, end)`` as skipped and settle them, under the
        lock :meth:`settle` takes: a copy the recorder has not settled yet is then discarded."""
        with self._settling(check):
            ids = episode_id[start:end]
            recorded = self.recorded[start:end]
            pending = ids > recorded
            if bool(pending.any()):
                self.skipped[start:end] += pending.to(torch.int64)
                self.recorded[start:end] = torch.maximum(recorded, ids)

    def before_claim(
        self, start: int, end: int, episode_id: torch.Tensor, check: Callable[[], None] | None = None
    ) -> None:
        """Return once rows ``[start, end)`` may be claimed (see the module docstring).

        Args:
            start, end: The rows about to be claimed.
            episode_id: The index's per-row published episode id (``-1``: none).
            check: Runs between wait slices; raises to abandon the claim (e.g. the engine is closing).
        """
        slice_s, began = _FIRST_SLICE_S, None
        try:
            while True:
                mode = int(self._mode_view[0])
                if mode == _OFF:
                    return
                pending = episode_id[start:end] > self.recorded[start:end]
                if not bool(pending.any()):
                    return
                if mode == _SKIP:
                    self._skip(start, end, episode_id, check)
                    return
                if began is None:
                    began = time.monotonic_ns()
                    self._demand.ring()  # before the first sleep: the recorder copies now, not on its timer
                if check is not None:
                    check()
                time.sleep(slice_s)
                slice_s = min(slice_s * 2, _LAST_SLICE_S)
        finally:
            if began is not None:
                self.waited_ns[start] += time.monotonic_ns() - began
