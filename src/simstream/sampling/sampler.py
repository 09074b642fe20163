"""Sample chunks and causal context windows: select in O(batch), gather, verify, retry torn items.

The sampler holds no lock against producers. It notes each selected row's seqlock version, copies the
frames, and re-reads the versions: an item whose row was claimed by a producer meanwhile is drawn again.
With per-episode quotas, selection, copy and debit happen under the quota lock so that a batch is charged
all-or-nothing; producers take that lock only to publish fresh quotas. ``check_failed`` (the engine's
failure check) runs before a batch is charged and while the quota lock is held elsewhere, so a producer
killed while holding it ends the wait with its error instead of a hang.

A request that finds no eligible window can be short of data only for a moment: the rows that would
serve it may be claimed by a producer (odd seqlock version) that is about to publish them. Such a request
is tried again, with a backoff of 0.2 ms doubling to 5 ms, for up to ``wait_s`` seconds, and ``check_ready``
(the engine's failure, state and liveness checks) runs before every retry, so a producer's published error
always wins over the wait. It gives up at once when every row has been seen published and unchanged
through a whole try that still found nothing, and ``rewrite_pending`` (the engine: a refill is requested
and not complete) says no rewrite is about to start: no rewrite under way or asked for can help then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDict

from .._sync import with_deadline
from ..buffer.index import EligibilityIndex
from ..buffer.storage import TrajectoryStorage
from ..errors import DataBudgetExhaustedError, DataUnavailableError
from .gather import BatchGatherer, ChunkFrames
from .keys import refuse_ambiguous_keys, select_keys
from .windows import (
    IndexTables,
    WindowSelection,
    draw_by_rejection,
    draw_rows,
    draw_starts,
    eligible_rows,
    uniform,
)

__all__ = ["WindowSampler"]

_MAX_TORN_ROUNDS = 64
_QUOTA_ROUNDS = 16
"""Rounds of redrawing the draws over a row's quota, as ``EpisodeQuota.draw_rows`` has, before the rest of
the batch is drawn from the remaining deliveries."""
_FIRST_BACKOFF_S = 2e-4
_MAX_BACKOFF_S = 5e-3
FrameMap = Callable[[WindowSelection], "torch.Tensor | ChunkFrames"]
"""Selected windows -> their frames: ``[n, L]`` flat indices (padding frame for padded positions)."""


class _Request(NamedTuple):
    """One sampling call, as selection, copy and redraws need it."""

    batch_size: int
    chunk: int
    """Window length the run tables are checked against (1 for context anchors)."""
    mode: str
    generator: torch.Generator | None
    generations: np.ndarray | None
    """Draw only from rows holding these generations (``None``: any row)."""
    frames: FrameMap
    unavailable: str
    """Message of the ``DataUnavailableError`` when nothing can be drawn."""
    columns: tuple[int, ...] | None
    """Stored keys to copy (positions in storage order; ``None``: every key)."""


class _Retries:
    """Bounded retries of a request that found no eligible window (see the module docstring).

    ``settled[r]``: row ``r`` kept one even version through the latest try that found nothing, so it was
    published then and could not serve the request. Only the latest try counts: a row that settled
    earlier and has been claimed since may be rewritten with an episode that serves it.
    """

    def __init__(self, version: np.ndarray, wait_s: float) -> None:
        self._version = version
        self._deadline = time.monotonic() + wait_s
        self._delay = 0.0  # the first retry is immediate: a row may have been published just now
        self._before = version
        self.settled = np.zeros(version.shape, dtype=bool)

    def next_try(self, check_ready: Callable[[], None] | None) -> bool:
        """Wait before the next try, then run ``check_ready``; ``False`` once the bound has passed."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            return False
        if self._delay:
            time.sleep(min(self._delay, left))
        self._delay = min(max(2 * self._delay, _FIRST_BACKOFF_S), _MAX_BACKOFF_S)
        if check_ready is not None:
            check_ready()
        self._before = self._version.copy()
        return True

    def hopeless(self) -> bool:
        """After a try that found nothing: whether every row has settled."""
        after = self._version.copy()
        self.settled = (after == self._before) & ((after & 1) == 0)
        return bool(self.settled.all())


class WindowSampler:
    """Turns requests into copied batches. Owns no shared memory; reads storage and index."""

    def __init__(self, storage: TrajectoryStorage, index: EligibilityIndex, quota=None) -> None:
        self.storage = storage
        self.index = index
        self.quota = quota
        self.tables = IndexTables(index)
        self.gatherer = BatchGatherer(storage)
        self._selections: dict[tuple, tuple[int, ...]] = {}

    def sample_chunks(
        self,
        batch_size: int,
        chunk_size: int,
        mode: str,
        generator: torch.Generator | None,
        *,
        out: TensorDict | None = None,
        keys: object = None,
        check_failed: Callable[[], None] | None = None,
        check_ready: Callable[[], None] | None = None,
        wait_s: float = 0.0,
        rewrite_pending: Callable[[], bool] | None = None,
    ) -> TensorDict:
        """``batch_size`` windows of ``chunk_size`` valid frames of the keys named by ``keys`` (all: None).

        ``keys`` is checked (:func:`~simstream.sampling.keys.select_keys`, plus ``valid``) before anything
        is drawn or copied. With nothing eligible, retries for up to ``wait_s`` seconds while rows are
        being written, or ``rewrite_pending()`` says they are about to be (``check_ready`` before each
        retry).
        """
        columns = self._columns(keys, ())
        if out is None:
            self.gatherer.check_fits(batch_size, chunk_size, columns)
        steps = self.storage.max_steps

        def frames(selection: WindowSelection) -> ChunkFrames:
            return ChunkFrames(torch.from_numpy(selection.rows * steps + selection.starts), chunk_size)

        unavailable = (
            "[OnlineDataEngine] No unlocked valid chunk satisfies "
            f"sampling_mode={mode!r} and chunk_size={chunk_size}."
        )
        request = _Request(batch_size, chunk_size, mode, generator, None, frames, unavailable, columns)
        return self._sample(request, out, check_failed, check_ready, wait_s, rewrite_pending)

    def sample_contexts(
        self,
        batch_size: int,
        history_length: int,
        prediction_horizon: int,
        mode: str,
        generator: torch.Generator | None,
        generations: tuple[int, ...] | None = None,
        check_failed: Callable[[], None] | None = None,
        *,
        keys: object = None,
        check_ready: Callable[[], None] | None = None,
        wait_s: float = 0.0,
        rewrite_pending: Callable[[], bool] | None = None,
    ) -> TensorDict:
        """Contexts ``[batch, H + F - 1]`` around uniformly drawn anchors at position ``H - 1``.

        ``keys``, the waits and ``rewrite_pending`` as in :meth:`sample_chunks`; ``loss_mask`` is always
        added (and may be named).
        """
        columns = self._columns(keys, ("loss_mask",))
        self.gatherer.check_fits(batch_size, history_length + prediction_horizon - 1, columns)
        steps, pad = self.storage.max_steps, self.storage.pad_index
        positions = np.arange(history_length + prediction_horizon - 1) - (history_length - 1)
        wanted = None if generations is None else np.asarray(generations, dtype=np.int64)

        def frames(selection: WindowSelection) -> torch.Tensor:
            times = selection.starts[:, None] + positions
            inside = (times >= selection.run_lo[:, None]) & (times < selection.run_hi[:, None])
            return torch.from_numpy(np.where(inside, selection.rows[:, None] * steps + times, pad))

        among = "" if wanted is None else f", among episodes of generations {sorted(set(wanted.tolist()))}"
        unavailable = (  # the reference's wording first (callers match it), then what was asked
            f"[OnlineDataEngine] No unlocked valid chunk satisfies sampling_mode={mode!r} and chunk_size=1 "
            f"(the anchor frame of a context of history_length={history_length} and "
            f"prediction_horizon={prediction_horizon}{among})."
        )
        request = _Request(batch_size, 1, mode, generator, wanted, frames, unavailable, columns)
        batch = self._sample(request, None, check_failed, check_ready, wait_s, rewrite_pending)
        batch.set("loss_mask", batch.get("valid") & torch.from_numpy(positions >= 0))
        return batch

    # -----------------------------------------------------------------------------------------------
    def _columns(self, keys: object, derived: tuple[str, ...]) -> tuple[int, ...] | None:
        """The stored keys ``keys`` names plus ``valid`` (``derived``: names the sampler adds itself)."""
        if keys is None:
            return None
        refuse_ambiguous_keys(keys)  # before the cache: a bare tuple and the list of its names share a key
        try:  # a request names the same keys batch after batch: resolve them once
            cache_key = (tuple(keys) if isinstance(keys, list) else keys, derived)
            columns = self._selections.get(cache_key)
        except TypeError:  # an unhashable entry, which select_keys reports
            cache_key, columns = None, None
        if columns is None:
            entries = [keys] if isinstance(keys, str) else keys
            if derived and isinstance(entries, (list, tuple)):  # "loss_mask" or ("loss_mask",)
                entries = [key for key in entries if not _names_one_of(key, derived)]
            columns = select_keys(self.gatherer.paths, entries)
            if cache_key is not None:
                if len(self._selections) > 64:
                    self._selections.clear()
                self._selections[cache_key] = columns
        return columns

    def _select(self, request: _Request, count: int) -> WindowSelection:
        tables = self.tables.views()
        chunk, mode, generator = request.chunk, request.mode, request.generator
        drawn = draw_rows(tables, count, chunk, mode, generator, request.generations)
        if drawn is None:
            raise DataUnavailableError(request.unavailable)
        return draw_starts(tables, *drawn, chunk, mode, generator)

    def _torn(self, selection: WindowSelection, generations: np.ndarray | None = None) -> np.ndarray:
        """Items to draw again: unsampleable when selected, or their row changed since (seqlock).

        With ``generations``, also items whose row holds another generation: the row filter was built
        before the rows' versions were noted, so a row republished in between passed it. The generation
        is read before the versions are read again, so an unchanged version vouches for it.
        """
        stale = ~selection.ok
        if generations is not None:
            stale |= ~np.isin(self.index.generation.numpy()[selection.rows], generations)
        changed = self.tables.views().version[selection.rows] != selection.versions
        return np.flatnonzero(stale | changed)

    def _sample(
        self,
        request: _Request,
        out: TensorDict | None,
        check_failed: Callable[[], None] | None,
        check_ready: Callable[[], None] | None,
        wait_s: float,
        rewrite_pending: Callable[[], bool] | None = None,
    ) -> TensorDict:
        if out is not None:  # refused before anything is drawn: the caller's generator stays where it was
            self.gatherer.check_out(out, request.batch_size, request.chunk, request.columns)
        lock_wait_s = max(wait_s, 1.0)  # a stopped holder of the quota lock ends the wait too, after it
        try:
            try:
                return self._try(request, out, check_failed, lock_wait_s)
            except DataUnavailableError as error:
                unavailable = error
            retries = _Retries(self.tables.views().version, wait_s)
            while retries.next_try(check_ready):
                try:
                    return self._try(request, out, check_failed, lock_wait_s)
                except DataUnavailableError as error:
                    unavailable = error
                # rows published and unchanged cannot serve it; a refill asked for will rewrite them
                if retries.hopeless() and not (rewrite_pending is not None and rewrite_pending()):
                    break
            raise unavailable
        finally:
            if out is not None:
                self.gatherer.forget_checked()  # a call that failed keeps no reference to the caller's out

    def _try(self, request: _Request, out: TensorDict | None, check_failed, lock_wait_s: float) -> TensorDict:
        if self.quota is not None:
            return self._sample_with_quota(request, out, check_failed, lock_wait_s)
        columns = request.columns
        selection = self._select(request, request.batch_size)
        batch = self.gatherer.gather(request.frames(selection), out, columns)
        for _ in range(_MAX_TORN_ROUNDS):
            torn = self._torn(selection, request.generations)
            if torn.size == 0:
                return batch
            redo = self._select(request, torn.size)
            scratch = self.gatherer.empty(torn.size, batch.batch_size[1], columns)
            redone = self.gatherer.gather(request.frames(redo), scratch, columns)
            self.gatherer.replace_items(batch, torch.from_numpy(torn), redone)
            selection.replace(torn, redo)
        raise DataUnavailableError(
            f"{request.unavailable} Producers rewrote the selected rows {_MAX_TORN_ROUNDS} times in a row."
        )

    def _sample_with_quota(
        self, request: _Request, out: TensorDict | None, check_failed, lock_wait_s: float
    ) -> TensorDict:
        quota = self.quota
        _, chunk, mode, generator, generations, frames, unavailable, columns = request
        # the lock's wait alone is bounded, and only while its holder is a stopped process: a live holder
        # (another request's long copy) is waited for, and a deadline on every check would fail a request
        # that simply took long
        with quota.lock.held(with_deadline(check_failed, lock_wait_s, "The quota lock", quota.lock)):
            for _ in range(_MAX_TORN_ROUNDS):
                tables = self.tables.views()
                rows, versions = self._draw_within_quota(tables, request)
                selection = draw_starts(tables, rows, versions, chunk, mode, generator)
                batch = self.gatherer.gather(frames(selection), out, columns)
                if self._torn(selection, generations).size:
                    continue
                if check_failed is not None:
                    check_failed()
                quota.debit(torch.from_numpy(selection.rows))
                return batch
        raise DataUnavailableError(
            f"{unavailable} Producers rewrote the selected rows {_MAX_TORN_ROUNDS} times in a row."
        )

    def _draw_within_quota(self, tables: IndexTables, request: _Request) -> tuple[np.ndarray, np.ndarray]:
        """The batch's rows: each drawn uniformly among the eligible rows with quota left, a row keeping as
        many draws as its quota allows (earlier draws first) and the excess drawn again, as
        :meth:`EpisodeQuota.draw_rows` does; after its rounds, the rest from the remaining deliveries.

        Draws come by rejection from all rows (O(batch)) until rows with quota left prove rare; from then
        on, for the rest of the batch, from the list of every eligible row (a scan, O(buffer_size)), which
        also decides a batch that cannot be filled.

        Raises:
            DataUnavailableError: no eligible row.
            DataBudgetExhaustedError: the eligible rows' quotas cannot supply the batch.
        """
        quota, count, generator = self.quota, request.batch_size, request.generator
        rows, versions = np.empty(count, np.int64), np.empty(count, np.int64)
        kept, todo = np.empty(0, np.int64), np.arange(count)
        candidates: np.ndarray | None = None  # the scan, made once rejection runs out of draws

        def left(of: np.ndarray) -> np.ndarray:
            """Quota left to each row of ``of`` after the draws this batch kept."""
            return quota.remaining_of(of) - _occurrences(kept, of)

        for _ in range(_QUOTA_ROUNDS):
            if candidates is None:
                drawn, drawn_versions, ok = draw_by_rejection(
                    tables, todo.size, request.chunk, request.mode, generator, request.generations,
                    lambda of: left(of) > 0,
                )  # fmt: skip
                missing = np.flatnonzero(~ok)
                if missing.size:
                    candidates = self._eligible_rows_with_quota(tables, request)
            else:
                drawn, drawn_versions = np.empty(todo.size, np.int64), np.empty(todo.size, np.int64)
                missing = np.arange(todo.size)
            if missing.size:  # uniform among the listed rows with quota left, as a rejected draw would be
                active = candidates[left(candidates) > 0]
                if active.size == 0:
                    raise self._exhausted(candidates, count)
                picked = active[(uniform(missing.size, generator) * active.size).astype(np.int64)]
                drawn[missing], drawn_versions[missing] = picked, tables.version[picked]
            fits = _rank_within_value(np.concatenate([kept, drawn]))[kept.size :] < quota.remaining_of(drawn)
            rows[todo[fits]], versions[todo[fits]] = drawn[fits], drawn_versions[fits]
            kept, todo = np.concatenate([kept, drawn[fits]]), todo[~fits]
            if todo.size == 0:
                return rows, versions
        if candidates is None:
            candidates = self._eligible_rows_with_quota(tables, request)
        units = np.repeat(candidates, np.clip(left(candidates), 0, todo.size))  # one per delivery left
        if units.size < todo.size:
            raise self._exhausted(candidates, count)
        picked = units[torch.randperm(units.size, generator=generator).numpy()[: todo.size]]
        rows[todo], versions[todo] = picked, tables.version[picked]
        return rows, versions

    def _eligible_rows_with_quota(self, tables: IndexTables, request: _Request) -> np.ndarray:
        """Every eligible row now (a scan); raises when there is none, or when their quotas together cannot
        supply the batch."""
        candidates = eligible_rows(tables, request.chunk, request.mode, request.generations)
        if candidates.size == 0:
            raise DataUnavailableError(request.unavailable)
        if self._capped_remaining(candidates, request.batch_size) < request.batch_size:
            raise self._exhausted(candidates, request.batch_size)
        return candidates

    def _capped_remaining(self, candidates: np.ndarray, batch_size: int) -> int:
        # each row capped at the batch: huge budgets summed over many rows would wrap int64, and under the
        # batch size the capped sum is the exact one the message reports
        return int(np.clip(self.quota.remaining_of(candidates), 0, batch_size).sum())

    def _exhausted(self, candidates: np.ndarray, batch_size: int) -> DataBudgetExhaustedError:
        """The error for a batch these rows' quotas cannot fill."""
        return DataBudgetExhaustedError(
            "Eligible unlocked episode quotas cannot supply a complete batch of "
            f"{batch_size} chunks; remaining={self._capped_remaining(candidates, batch_size)}."
        )


def _occurrences(values: np.ndarray, of: np.ndarray) -> np.ndarray:
    """How often each entry of ``of`` occurs in ``values``."""
    if values.size == 0:
        return np.zeros(of.shape, np.int64)
    unique, counts = np.unique(values, return_counts=True)
    at = np.minimum(np.searchsorted(unique, of), unique.size - 1)
    return np.where(unique[at] == of, counts[at], 0)


def _rank_within_value(values: np.ndarray) -> np.ndarray:
    """For each entry, how many equal entries precede it (0 for the first occurrence)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.ones(values.size, dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    position = np.arange(values.size)
    rank = np.empty(values.size, np.int64)
    rank[order] = position - np.maximum.accumulate(np.where(starts, position, 0))
    return rank


def _names_one_of(key: object, names: tuple[str, ...]) -> bool:
    """Whether ``key`` is one of the top-level ``names``, as a str or a tuple of one str."""
    if isinstance(key, tuple) and len(key) == 1:
        key = key[0]
    return isinstance(key, str) and key in names
