"""Everything the owner, the producer workers and the consumers share, created once by the owner."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._sync import SharedFlag, SharedLock, with_deadline
from ..buffer.index import EligibilityIndex
from ..buffer.storage import TrajectoryStorage
from ..language import SharedLanguageRegistry
from ..workers.channel import ErrorChannel
from .progress import ProducerProgress

if TYPE_CHECKING:
    from ..buffer.events import LifecycleEventLog
    from ..buffer.gate import RecordGate
    from ..buffer.quota import EpisodeQuota

__all__ = ["EngineShared"]


@dataclass
class EngineShared:
    """The shared objects of one engine; pickled into workers and consumers at process creation."""

    storage: TrajectoryStorage
    index: EligibilityIndex
    language: SharedLanguageRegistry
    channel: ErrorChannel
    progress: ProducerProgress
    publish_lock: SharedLock
    """Serialises publications of all workers: episode ids, quotas and lifecycle records stay in order.
    Producers alone take it."""
    close_flag: SharedFlag
    """Set when the owner stops the engine; workers leave at the next check."""
    state_code: object
    """``OnlineDataEngineState`` index of the owner-driven state."""
    quota: EpisodeQuota | None
    events: LifecycleEventLog | None
    run_id: int
    max_generation_attempts: int
    check_unwritten_frames: bool = True
    """Reject a window whose float payload holds NaN in a reported frame (``EpisodeWriter.write``)."""
    record_gate: RecordGate | None = None
    """Per-row "recorded up to episode id": claims wait for an attached recorder (``buffer/gate.py``).
    Created with the rest when not given: 24 bytes per row."""

    def __post_init__(self) -> None:
        if self.record_gate is None:
            from ..buffer.gate import RecordGate

            self.record_gate = RecordGate(self.index.buffer_size)

    def raise_if_failed(self) -> None:
        """Raise the published failure, if any (the check of every bounded wait on a shared lock)."""
        error = self.channel.error()
        if error is not None:
            # the same object every time: without a fresh traceback each raise would add its frames to
            # the last one's (a loop that retries a failed engine grew it by thousands of frames)
            raise error.with_traceback(None)

    def wake_all(self) -> None:
        """Ring every producer's doorbell (a request, or closing). Never blocks."""
        self.progress.wake_producers()

    def request_generation(self, timeout_s: float) -> int:
        """Coalescing refill request: a new generation only when none is outstanding.

        Returns:
            The generation that will satisfy the request.

        Raises:
            TimeoutError: another requester (a stopped consumer) held the request lock ``timeout_s``.
        """
        lock = self.progress.request_lock
        check = with_deadline(self.raise_if_failed, timeout_s, "The refill-request lock", lock)
        return self.progress.request_generation(check)

    def record_samples(self, count: int, refill_after: int | None) -> None:
        """Count delivered chunks; with ``refill_after`` request a generation once that many accumulated.

        Takes no lock a producer takes: the count goes to this process's own row, and the request lock is
        shared by requesters only.
        """
        progress = self.progress
        progress.record_sampled(count, self.raise_if_failed)
        if refill_after is not None:
            progress.request_after_samples(refill_after, self.raise_if_failed)

    @staticmethod
    def context() -> mp.context.BaseContext:
        return mp.get_context("forkserver")
