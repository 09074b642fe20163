"""Publish windows into the shared buffer: claim, write, publish (``docs/design.md``, "Write protocol").

This half of a producer knows shared memory and nothing of sources. A local producer process claims a
window's rows, lets its source write into them (:func:`~simstream.engine.window.generate_window`), then
finishes the window; the Ray backend's ingest process claims the rows of all the windows one call
returned (consecutive, disjoint) at once, copies their payloads in and finishes them together. One
window is the case of one; both are the single writer of their producer's rows and progress row.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..buffer.events import EVICTED, PUBLISHED
from ..buffer.writer import EpisodeWriter, PublishedWindow
from .shared import EngineShared
from .window import GeneratedWindow, reported_frames

__all__ = ["Closing", "WindowPublisher"]


class Closing(Exception):
    """Raised by a publisher's lock-wait check once the engine is closing (never leaves the producer)."""


class WindowPublisher:
    """Claims, writes and publishes the windows of one producer, one window or several together.

    Several consecutive windows (rows ``[start, end)``, ``window_rows`` each, disjoint) are published as
    one: one claim of all their rows, one write pass, one hold of the publication lock and one lifecycle
    append, with the same records, episode ids and order as publishing them one by one. A window whose
    check fails is never visible, and neither are the claimed windows after it; the windows before it are
    published first, as one by one. One window is the case ``window_rows == end - start``.

    Owns the producer's lifecycle-log reservation between :meth:`begin` and :meth:`finish` (given back by
    :meth:`abandon` when the windows are not published), and the ``evicted`` records of all windows but
    the first, which are appended just before each window's ``published`` ones (the first window's once
    its rows are claimed): the order of one-by-one publication.

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
        """Lifecycle-log slots reserved and not appended yet (the claimed windows' remaining records)."""
        self._pending_evictions: tuple[_Columns, np.ndarray] | None = None
        """``evicted`` records of the claimed windows after the first, with each record's window number."""

    def _raise_if_closing(self) -> None:
        if self.closing():
            raise Closing

    def begin(self, start: int, end: int, window_rows: int | None = None) -> bool:
        """Reserve the windows' lifecycle records, claim their rows, then log the first window's
        evictions (the episodes the claim took out of the buffer).

        Args:
            start, end: The rows of the windows, ``window_rows`` each (default: one window).

        Returns:
            ``False`` when the engine closed while waiting for log space (nothing claimed).

        Raises:
            Closing: the engine closed while the claim waited (for a recorder, a lock); nothing was
                claimed and no eviction logged (:meth:`abandon` gives the reservation back). The same
                holds for any other error of the claim (a wait that timed out).
        """
        window_rows = window_rows or end - start
        if (end - start) % window_rows:
            raise ValueError(f"rows [{start}, {end}) are not whole windows of {window_rows} rows")
        if self.shared.events is not None and not self._reserve_records(start, end, window_rows):
            return False
        try:
            self.writer.claim(start, end, check=self._raise_if_closing)
        except BaseException:
            # nothing claimed (closing, or a wait that timed out): nothing was evicted
            self._pending_evictions = None
            raise
        if self._pending_evictions is not None:
            self._log_first_evictions()
        return True

    def reset(self, start: int, end: int) -> None:
        """Rows back to unwritten before another attempt."""
        self.writer.reset_metadata(start, end)

    def finish(self, start: int, end: int, windows: Sequence[GeneratedWindow], generation: int) -> None:
        """Check and write the windows' rows, then publish them together (they become sampleable).

        Args:
            start, end: The claimed rows, ``(end - start) / len(windows)`` per window, in order.
            windows: The generated windows.
            generation: Their fill generation.

        Raises:
            ValueError: a reported float frame is unwritten. The windows before the one that holds it are
                published first (as one by one would have); its rows and those after it stay claimed, never
                visible.
            Closing: the engine closed while waiting for the publication lock.
        """
        window_rows = (end - start) // len(windows)
        episodes = [episode for window in windows for episode in window.episodes]
        attempts = [window.attempt for window in windows for _ in window.episodes]
        check = self._raise_if_closing
        try:
            self.writer.write(start, episodes, attempts, check=check, window_rows=window_rows)
        except ValueError:
            whole = self._windows_before_unwritten_frames(start, episodes, window_rows)
            if whole:  # nothing was written: the rows of those windows are claimed and hold their payloads
                self.finish(start, start + whole * window_rows, windows[:whole], generation)
            raise
        self._publish(start, end, generation, window_rows)
        progress = self.shared.progress
        progress.add_for_worker(self.worker, "successful_episodes", end - start)
        progress.add_for_worker(self.worker, "generated_frames", reported_frames(episodes))

    def _windows_before_unwritten_frames(self, start: int, episodes, window_rows: int) -> int:
        """How many whole windows precede the first row with an unwritten reported frame (0 when none)."""
        if not self.shared.check_unwritten_frames:
            return 0
        lengths = np.fromiter((episode.length for episode in episodes), dtype=np.int64, count=len(episodes))
        offset = self.shared.storage.first_row_with_unwritten_frames(start, lengths)
        return 0 if offset is None else offset // window_rows

    def count_failed(self, episodes: int) -> None:
        """Count episodes of failed attempts (never published)."""
        self.shared.progress.add_for_worker(self.worker, "failed_episodes", episodes)

    def abandon(self) -> None:
        """Give back the log space of windows that will not be published (stopped or failed); their rows
        were claimed, so the ``evicted`` records still pending are appended first."""
        pending, self._pending_evictions = self._pending_evictions, None
        if not self._reserved_records:
            return
        events = self.shared.events
        try:  # a stopped holder of the log's lock is waited for only until the engine closes
            if pending is not None:
                events.append_columns(*pending[0], reserved=True, check=self._raise_if_closing)
                self._reserved_records -= len(pending[1])
            reserved, self._reserved_records = self._reserved_records, 0
            events.release(reserved, check=self._raise_if_closing)
        except Closing:  # closing: the reservation no longer matters
            self._reserved_records = 0

    def _publish(self, start: int, end: int, generation: int, window_rows: int) -> None:
        shared, progress = self.shared, self.shared.progress
        check = self._raise_if_closing
        # Every lock is taken before the rows become visible: a Closing raised while waiting leaves the
        # windows unpublished, and once they are published their records go in without another wait.
        # Order: publication, quota, log. The log's lock is taken last and held for microseconds, so the
        # owner's drain never waits for a sampler's batch (samplers hold the quota lock while they copy).
        quota, events = shared.quota, shared.events
        quota_held = quota.lock.held(check) if quota is not None else contextlib.nullcontext()
        log_held = events.holding(check) if events is not None else contextlib.nullcontext()
        with shared.publish_lock.held(check), quota_held, log_held:  # taken in this order
            first_id = progress.allocate_episode_ids(end - start)
            if quota is not None:
                ids = torch.arange(first_id, first_id + end - start)
                quota.publish(torch.arange(start, end), ids, generation)
            window = self.writer.publish(start, end, generation, first_id)
            if events is not None:
                self._append_records(window, window_rows)

    def _append_records(self, window: PublishedWindow, window_rows: int) -> None:
        """One append of every window's ``evicted`` (pending) and ``published`` records, window by window."""
        rows = np.arange(window.start, window.end)
        columns = self._columns(
            PUBLISHED, rows, window.episode_ids.numpy(), window.generation, window.published_monotonic_ns
        )
        pending, self._pending_evictions = self._pending_evictions, None
        if pending is not None:
            evicted, evicted_windows = pending
            order_key = np.concatenate([2 * evicted_windows, 2 * ((rows - window.start) // window_rows) + 1])
            order = np.argsort(order_key, kind="stable")
            columns = tuple(np.concatenate([a, b])[order] for a, b in zip(evicted, columns))
        count = len(columns[0])
        self.shared.events.append_columns(*columns, reserved=True, check=self._raise_if_closing)
        self._reserved_records -= count

    def _reserve_records(self, start: int, end: int, window_rows: int) -> bool:
        """Reserve both kinds of records of the windows and note their evictions (read before the claim
        clears the rows' episode ids); ``False`` when the engine closed first."""
        events, index = self.shared.events, self.shared.index
        published = np.flatnonzero(index.episode_id.numpy()[start:end] >= 0)
        # one reservation for both kinds: other workers cannot take the space between the appends
        if not events.reserve(end - start + len(published), self.closing):
            return False
        self._reserved_records = end - start + len(published)
        if len(published):
            rows = published + start
            old_ids, old_generations = index.episode_id.numpy()[rows], index.generation.numpy()[rows]
            evicted = self._columns(EVICTED, rows, old_ids, old_generations, time.monotonic_ns())
            self._pending_evictions = (evicted, published // window_rows)
        return True

    def _log_first_evictions(self) -> None:
        """Append the first window's ``evicted`` records, now that its rows are claimed; the later
        windows' stay pending until just before their ``published`` ones."""
        evicted, windows = self._pending_evictions
        first = windows == 0
        if first.any():
            self.shared.events.append_columns(
                *(c[first] for c in evicted), reserved=True, check=self._raise_if_closing
            )
            self._reserved_records -= int(first.sum())
        later = ~first
        self._pending_evictions = (tuple(c[later] for c in evicted), windows[later]) if later.any() else None

    def _columns(self, kind: int, rows: np.ndarray, episode_ids, generations, monotonic_ns: int) -> _Columns:
        """Lifecycle records of ``rows`` as :meth:`LifecycleEventLog.append_columns` takes them."""
        storage = self.shared.storage
        count = len(rows)
        scalars = np.empty((count, 5), dtype=np.int64)
        scalars[:, 0] = self.shared.run_id
        scalars[:, 1] = episode_ids
        scalars[:, 2] = generations
        scalars[:, 3] = rows
        scalars[:, 4] = monotonic_ns
        valid = storage.metadata_array("valid")[rows]  # advanced indexing: a copy
        anchor = valid & (storage.metadata_array("continuity_id")[rows] >= 0)
        return np.full(count, kind, dtype=np.int64), scalars, valid, anchor


_Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(kind, scalars, valid_mask, anchor_mask)`` of :meth:`LifecycleEventLog.append_columns`."""
