"""Publish one window into the shared buffer: claim, write, publish (``docs/design.md``, "Write protocol").

This half of a producer knows shared memory and nothing of sources. A local producer process claims the
rows, lets its source write into them (:func:`~simstream.engine.window.generate_window`), then finishes
the window; the Ray backend's ingest path in the owner claims the rows once a window arrived by value,
copies its payload in and finishes it the same way. Both are the single writer of their producer's rows
and progress row.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..buffer.writer import EpisodeWriter
from .shared import EngineShared
from .window import GeneratedWindow, reported_frames

__all__ = ["Closing", "WindowPublisher"]


class Closing(Exception):
    """Raised by a publisher's lock-wait check once the engine is closing (never leaves the producer)."""


class WindowPublisher:
    """Claims, writes and publishes the windows of one producer.

    Owns the producer's lifecycle-log reservation between :meth:`begin` and :meth:`finish` (given back by
    :meth:`abandon` when the window is not published).

    Args:
        shared: The engine's shared objects.
        worker: The producer's index (its progress row).
        closing: True once the producer must stop; ends every bounded wait.
    """

    def __init__(self, shared: EngineShared, worker: int, closing: Callable[[], bool]) -> None:
        self.shared = shared
        self.worker = worker
        self.closing = closing
        self.writer = EpisodeWriter(
            shared.storage,
            shared.index,
            shared.language,
            shared.run_id,
            shared.check_unwritten_frames,
            record_gate=shared.record_gate,  # a recorder's copy comes before any overwrite
        )
        self._reserved_records = 0
        """Lifecycle-log slots reserved for the current window's ``published`` records."""

    def _raise_if_closing(self) -> None:
        if self.closing():
            raise Closing

    def begin(self, start: int, end: int) -> bool:
        """Reserve the window's lifecycle records (logging its evictions), then claim its rows.

        Returns:
            ``False`` when the engine closed while waiting for log space (nothing claimed).
        """
        if self.shared.events is not None and not self._log_evictions(start, end):
            return False
        self.writer.claim(start, end, check=self._raise_if_closing)  # Closing: nothing claimed
        return True

    def reset(self, start: int, end: int) -> None:
        """Rows back to unwritten before another attempt."""
        self.writer.reset_metadata(start, end)

    def finish(self, start: int, end: int, window: GeneratedWindow, generation: int) -> None:
        """Check and write the window's rows, then publish them (they become sampleable).

        Raises:
            ValueError: a reported float frame is unwritten; the rows stay claimed.
            Closing: the engine closed while waiting for the publication lock.
        """
        progress = self.shared.progress
        self.writer.write(start, window.episodes, window.attempt, check=self._raise_if_closing)
        self._publish(start, end, generation)
        progress.add_for_worker(self.worker, "successful_episodes", end - start)
        progress.add_for_worker(self.worker, "generated_frames", reported_frames(window.episodes))

    def count_failed(self, episodes: int) -> None:
        """Count episodes of failed attempts (never published)."""
        self.shared.progress.add_for_worker(self.worker, "failed_episodes", episodes)

    def abandon(self) -> None:
        """Give back the log space of a window that will not be published (stopped or failed)."""
        if self._reserved_records:
            reserved, self._reserved_records = self._reserved_records, 0
            try:  # a stopped holder of the log's lock is waited for only until the engine closes
                self.shared.events.release(reserved, check=self._raise_if_closing)
            except Closing:  # closing: the reservation no longer matters
                pass

    def _publish(self, start: int, end: int, generation: int) -> None:
        shared, progress = self.shared, self.shared.progress
        check = self._raise_if_closing
        with shared.publish_lock.held(check):
            first_id = progress.allocate_episode_ids(end - start)
            if shared.quota is not None:
                with shared.quota.lock.held(check):
                    ids = torch.arange(first_id, first_id + end - start)
                    shared.quota.publish(torch.arange(start, end), ids, generation)
                    window = self.writer.publish(start, end, generation, first_id)
            else:
                window = self.writer.publish(start, end, generation, first_id)
            if shared.events is not None:
                records = [
                    self._record("published", row, window.published_monotonic_ns) for row in range(start, end)
                ]
                shared.events.append(records, reserved=True, check=check)
                self._reserved_records -= len(records)

    def _log_evictions(self, start: int, end: int) -> bool:
        events, index = self.shared.events, self.shared.index
        published = [row for row in range(start, end) if int(index.episode_id[row]) >= 0]
        # one reservation for both kinds: other workers cannot take the space between the two appends
        if not events.reserve(end - start + len(published), self.closing):
            return False
        self._reserved_records = end - start
        if published:
            now = time.monotonic_ns()
            records = [self._record("evicted", row, now) for row in published]
            events.append(records, reserved=True, check=self._raise_if_closing)
        return True

    def _record(self, kind: str, row: int, monotonic_ns: int) -> dict:
        storage, index = self.shared.storage, self.shared.index
        valid = storage.metadata("valid")[row].clone()
        return {
            "kind": kind,
            "run_id": self.shared.run_id,
            "episode_id": int(index.episode_id[row]),
            "generation": int(index.generation[row]),
            "slot": row,
            "monotonic_ns": monotonic_ns,
            "valid_mask": valid,
            "anchor_mask": valid & (storage.metadata("continuity_id")[row] >= 0),
        }
