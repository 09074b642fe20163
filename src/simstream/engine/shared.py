"""Everything the owner, the producer workers and the consumers share, created once by the owner."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._bounded import held
from ..buffer.index import EligibilityIndex
from ..buffer.storage import TrajectoryStorage
from ..language import SharedLanguageRegistry
from ..workers.channel import ErrorChannel
from .progress import ProducerProgress

if TYPE_CHECKING:
    from ..buffer.events import LifecycleEventLog
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
    publish_lock: object
    """Serialises publications of all workers: episode ids, quotas and lifecycle records stay in order."""
    close_event: object
    """Set when the owner stops the engine; workers leave at the next check."""
    wake_events: list
    """One per worker; set whenever a new generation is requested."""
    state_code: object
    """``OnlineDataEngineState`` index of the owner-driven state."""
    quota: EpisodeQuota | None
    events: LifecycleEventLog | None
    run_id: int
    max_generation_attempts: int

    def raise_if_failed(self) -> None:
        """Raise the published failure, if any (the check of every bounded wait on a shared lock)."""
        error = self.channel.error()
        if error is not None:
            raise error

    def wake_all(self) -> None:
        for event in self.wake_events:
            event.set()

    def request_generation(self) -> int:
        """Coalescing refill request: a new generation only when none is outstanding.

        Returns:
            The generation that will satisfy the request.
        """
        progress = self.progress
        with held(progress.lock, self.raise_if_failed):
            requested = progress.get("requested_generation")
            if requested <= progress.completed_generation:
                requested += 1
                progress.set("requested_generation", requested)
                self.wake_all()
        return requested

    def record_samples(self, count: int, refill_after: int | None) -> None:
        """Count delivered chunks; with ``refill_after`` request a generation once that many accumulated.

        The counter resets only when a request is actually made, so chunks sampled while a refill is
        outstanding still count toward the next one.
        """
        progress = self.progress
        with held(progress.lock, self.raise_if_failed):
            progress.set("sampled_chunks", progress.get("sampled_chunks") + count)
            if refill_after is None:
                return
            pending = progress.get("sample_count") + count
            requested = progress.get("requested_generation")
            if pending >= refill_after and requested <= progress.completed_generation:
                pending = 0
                progress.set("requested_generation", requested + 1)
                self.wake_all()
            progress.set("sample_count", pending)

    @staticmethod
    def context() -> mp.context.BaseContext:
        return mp.get_context("forkserver")
