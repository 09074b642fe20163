"""Choose sampleable windows from the eligibility index in O(batch).

Distribution (episode-uniform, as in the reference engine): a row is drawn uniformly among the rows that
hold at least one eligible window for the request, then a start uniformly among that row's eligible
starts. Rows are drawn by rejection from all rows (exact): each round draws enough rows for the items
still missing at the acceptance rate seen so far, and takes the first accepted ones in draw order. Only
once the draws for one request would pass a quarter of the buffer's rows (at most a few rows in a thousand
eligible) does the explicit candidate list, a scan of every row, serve the items still missing: the scan
costs about as much per row as a draw. Either way the call costs O(batch) unless eligible rows are rare.

The arithmetic runs in NumPy on zero-copy views of the shared tables: for a batch of a few hundred items
a NumPy operation costs about a microsecond, a torch operation several, and selection is a dozen of them.
Random numbers still come from the caller's ``torch.Generator``, so a seed reproduces the batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..buffer.index import EPISODE, SEGMENT, EligibilityIndex

__all__ = [
    "IndexTables",
    "WindowSelection",
    "candidate_rows",
    "draw_by_rejection",
    "draw_rows",
    "draw_starts",
    "eligible_rows",
]

_SCAN_COST = 4
"""A draw by rejection costs about as much as scanning this many rows for the candidate list: past
``buffer_size / _SCAN_COST`` draws for one request, the scan is cheaper."""
_MARGIN = 1.5
"""Draws per round: the missing items over the acceptance rate so far, times this, plus a few."""
_EMPTY_CONFIRMATIONS = 3


@dataclass
class WindowSelection:
    """Sampled windows: row, start, the enclosing run ``[run_lo, run_hi)`` and the row version read.

    Every field is an int64 (``ok``: bool) NumPy array of one entry per item.
    """

    rows: np.ndarray
    starts: np.ndarray
    run_lo: np.ndarray
    run_hi: np.ndarray
    versions: np.ndarray
    ok: np.ndarray
    """False where the tables changed under the reader (the item must be drawn again)."""

    def replace(self, items: np.ndarray, other: WindowSelection) -> None:
        """Overwrite ``items`` with the windows of ``other`` (one per item, in order)."""
        for name in ("rows", "starts", "run_lo", "run_hi", "versions", "ok"):
            getattr(self, name)[items] = getattr(other, name)


class IndexTables:
    """NumPy views of one :class:`EligibilityIndex`'s shared tensors (same memory, no copy).

    Built lazily per process: views are never pickled, and a pickled index rebuilds them on first use.
    """

    def __init__(self, index: EligibilityIndex) -> None:
        self.index = index
        self._pid = -1

    def __getstate__(self) -> dict:
        return {"index": self.index}

    def __setstate__(self, state: dict) -> None:
        self.index = state["index"]
        self._pid = -1

    def views(self) -> IndexTables:
        if self._pid != os.getpid():
            index = self.index
            self.version = index.version.numpy()
            self.longest_run = index.longest_run.numpy()
            self.longest_point_run = index.longest_point_run.numpy()
            self.num_runs = index.num_runs.numpy()
            self.run_lo = index.run_lo.numpy()
            self.run_hi = index.run_hi.numpy()
            self.first_lo = self.run_lo[:, :, 0]  # [mode, row]: plain 1-D lookups on the fast path
            self.first_hi = self.run_hi[:, :, 0]
            self.num_points = index.num_points.numpy()
            self.point = index.point.numpy()
            self.generation = index.generation.numpy()
            self.buffer_size = index.buffer_size
            self._pid = os.getpid()
        return self

    def longest(self, mode: str) -> np.ndarray:
        if mode == "boundary":
            return self.longest_point_run
        return self.longest_run[EPISODE if mode == "episode" else SEGMENT]


def uniform(count: int, generator: torch.Generator | None) -> np.ndarray:
    """``count`` float64 draws in ``[0, 1)`` from the caller's torch generator."""
    return torch.rand(count, generator=generator, dtype=torch.float64).numpy()


Accept = Callable[[np.ndarray], np.ndarray]
"""A further test of drawn rows (bool per row), e.g. that a row has sampling quota left."""


def _eligible(
    tables: IndexTables,
    rows: np.ndarray,
    chunk: int,
    mode: str,
    generations: np.ndarray | None,
    accept: Accept | None,
) -> tuple[np.ndarray, np.ndarray]:
    versions = tables.version[rows]
    ok = ((versions & 1) == 0) & (tables.longest(mode)[rows] >= chunk)
    if generations is not None:
        ok &= np.isin(tables.generation[rows], generations)
    if accept is not None:
        ok &= accept(rows)
    return ok, versions


def eligible_rows(
    tables: IndexTables, chunk: int, mode: str, generations: np.ndarray | None = None
) -> np.ndarray:
    """Every row that holds an eligible window now (of ``generations``): :func:`candidate_rows`, a scan,
    O(buffer_size)."""
    row_filter = None
    if generations is not None:  # a copy: producers write the live table, and isin() reads it twice
        row_filter = torch.from_numpy(np.isin(tables.generation.copy(), generations))
    return candidate_rows(tables.index, chunk, mode, row_filter).numpy()


def candidate_rows(
    index: EligibilityIndex, chunk: int, mode: str, row_filter: torch.Tensor | None = None
) -> torch.Tensor:
    """All rows that hold an eligible window right now (O(buffer_size); used off the fast path).

    Versions and tables are read by separate passes, so while producers publish one window and claim the
    next, one pass can miss the rows just published and the other the rows just claimed. An empty answer
    is therefore confirmed by reading again: a buffer with nothing eligible stays empty on every read.
    """
    for _ in range(_EMPTY_CONFIRMATIONS):
        ok = index.stable_rows() & (index.longest(mode) >= chunk)
        if row_filter is not None:
            ok &= row_filter
        rows = ok.nonzero().squeeze(1)
        if rows.numel():
            break
    return rows


def draw_by_rejection(
    tables: IndexTables,
    count: int,
    chunk: int,
    mode: str,
    generator: torch.Generator | None,
    generations: np.ndarray | None = None,
    accept: Accept | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Up to ``count`` rows uniform over the eligible rows (of ``generations``, passing ``accept``), drawn
    from all rows with at most ``max(buffer_size / 4, 2 * count)`` draws.

    Returns:
        ``(rows, versions, ok)``: ``ok`` is false for the items not found within the draws.
    """
    size = tables.buffer_size
    budget = max(size // _SCAN_COST, 2 * count)
    rows = (uniform(count, generator) * size).astype(np.int64)
    ok, versions = _eligible(tables, rows, chunk, mode, generations, accept)
    drawn, accepted = count, int(ok.sum())
    while True:
        missing = np.flatnonzero(~ok)
        if missing.size == 0:
            break
        wanted = int(missing.size * _MARGIN * drawn / accepted) + 8 if accepted else 2 * drawn
        wanted = min(wanted, budget - drawn)
        if wanted <= 0:
            break
        redraw = (uniform(wanted, generator) * size).astype(np.int64)
        good, redraw_versions = _eligible(tables, redraw, chunk, mode, generations, accept)
        drawn += wanted
        hits = np.flatnonzero(good)
        accepted += hits.size
        hits = hits[: missing.size]  # the first accepted draws, in draw order: uniform over the eligible
        targets = missing[: hits.size]
        rows[targets], versions[targets], ok[targets] = redraw[hits], redraw_versions[hits], True
    return rows, versions, ok


def draw_rows(
    tables: IndexTables,
    count: int,
    chunk: int,
    mode: str,
    generator: torch.Generator | None,
    generations: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """``count`` rows uniform over eligible rows (of ``generations``) and their versions, or ``None`` if no
    row is eligible."""
    rows, versions, ok = draw_by_rejection(tables, count, chunk, mode, generator, generations)
    missing = np.flatnonzero(~ok)
    if missing.size:
        candidates = eligible_rows(tables, chunk, mode, generations)
        if candidates.size == 0:
            return None
        picked = candidates[(uniform(missing.size, generator) * candidates.size).astype(np.int64)]
        rows[missing] = picked
        versions[missing] = tables.version[picked]
    return rows, versions


def draw_starts(
    tables: IndexTables,
    rows: np.ndarray,
    versions: np.ndarray,
    chunk: int,
    mode: str,
    generator: torch.Generator | None,
) -> WindowSelection:
    """A start uniform among each row's eligible starts for windows of ``chunk`` frames."""
    if mode == "boundary":
        lo, hi, run_lo, run_hi = _boundary_intervals(tables, rows, chunk)
    else:
        table = EPISODE if mode == "episode" else SEGMENT
        num_runs = tables.num_runs[table, rows]
        width = max(int(num_runs.max()), 1) if rows.size else 1
        if width == 1:  # one run per row (every episode without continuity breaks): no table walk
            return _single_run_starts(tables, table, rows, versions, num_runs, chunk, generator)
        run_lo = tables.run_lo[table, rows, :width].astype(np.int64)
        run_hi = tables.run_hi[table, rows, :width].astype(np.int64)
        present = np.arange(width) < num_runs[:, None]
        lo, hi = run_lo, np.where(present, run_hi - chunk, run_lo - 1)
    counts = np.maximum(hi - lo + 1, 0)
    cumulative = counts.cumsum(1)
    total = cumulative[:, -1]
    u = np.minimum((uniform(rows.size, generator) * total).astype(np.int64), np.maximum(total - 1, 0))
    pick = np.minimum((cumulative <= u[:, None]).sum(1), counts.shape[1] - 1)[:, None]
    before = np.take_along_axis(cumulative - counts, pick, 1)[:, 0]
    starts = np.take_along_axis(lo, pick, 1)[:, 0] + (u - before)
    return WindowSelection(
        rows=rows,
        starts=np.where(total > 0, starts, 0),  # a stale table must not point outside the row
        run_lo=np.take_along_axis(run_lo, pick, 1)[:, 0],
        run_hi=np.take_along_axis(run_hi, pick, 1)[:, 0],
        versions=versions,
        ok=(total > 0) & ((versions & 1) == 0),
    )


def _single_run_starts(
    tables: IndexTables,
    table: int,
    rows: np.ndarray,
    versions: np.ndarray,
    num_runs: np.ndarray,
    chunk: int,
    generator: torch.Generator | None,
) -> WindowSelection:
    run_lo = tables.first_lo[table][rows].astype(np.int64)
    run_hi = tables.first_hi[table][rows].astype(np.int64)
    total = np.maximum(run_hi - run_lo - (chunk - 1), 0)
    total *= num_runs > 0
    ok = total > 0
    # floor(u * total) < total for u < 1; a row without a window starts at 0 and is drawn again
    starts = (uniform(rows.size, generator) * total).astype(np.int64)
    starts += run_lo
    starts *= ok
    ok &= (versions & 1) == 0
    return WindowSelection(rows, starts, run_lo, run_hi, versions, ok)


def _boundary_intervals(tables: IndexTables, rows: np.ndarray, chunk: int) -> tuple[np.ndarray, ...]:
    # Each change point p inside run [s, e) admits starts [max(s, p-C+1), min(e-C, p-1)]; consecutive
    # points of one run give overlapping intervals, so each is cut to start after its predecessor's end.
    num_points = tables.num_points[rows]
    width = max(int(num_points.max()), 1) if rows.size else 1
    p, s, e = (tables.point[k, rows, :width].astype(np.int64) for k in range(3))
    present = np.arange(width) < num_points[:, None]
    lo = np.maximum(s, p - chunk + 1)
    hi = np.where(present, np.minimum(e - chunk, p - 1), lo - 1)
    previous_hi = np.full_like(hi, -1)
    previous_hi[:, 1:] = np.where(s[:, 1:] == s[:, :-1], hi[:, :-1], -1)
    lo = np.maximum(lo, previous_hi + 1)
    return lo, hi, s, e
