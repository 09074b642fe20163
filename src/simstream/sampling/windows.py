"""Choose sampleable windows from the eligibility index in O(batch).

Distribution (episode-uniform, as in the reference engine): a row is drawn uniformly among the rows that
hold at least one eligible window for the request, then a start uniformly among that row's eligible
starts. Rows are drawn by rejection from all rows first (exact, O(batch) when most rows are eligible) and
from the explicit candidate list only for the items still rejected after a few rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..buffer.index import EPISODE, SEGMENT, EligibilityIndex

__all__ = ["WindowSelection", "candidate_rows", "draw_rows", "draw_starts"]

_REJECTION_ROUNDS = 4


@dataclass
class WindowSelection:
    """Sampled windows: row, start, the enclosing run ``[run_lo, run_hi)`` and the row version read."""

    rows: torch.Tensor
    starts: torch.Tensor
    run_lo: torch.Tensor
    run_hi: torch.Tensor
    versions: torch.Tensor
    ok: torch.Tensor
    """False where the tables changed under the reader (the item must be drawn again)."""


def _eligible(
    index: EligibilityIndex, rows: torch.Tensor, chunk: int, mode: str, row_filter: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    versions = index.version[rows]
    ok = ((versions & 1) == 0) & (index.longest(mode)[rows] >= chunk)
    if row_filter is not None:
        ok &= row_filter[rows]
    return ok, versions


def candidate_rows(
    index: EligibilityIndex, chunk: int, mode: str, row_filter: torch.Tensor | None = None
) -> torch.Tensor:
    """All rows that hold an eligible window right now (O(buffer_size); used off the fast path)."""
    ok = index.stable_rows() & (index.longest(mode) >= chunk)
    if row_filter is not None:
        ok &= row_filter
    return ok.nonzero().squeeze(1)


def draw_rows(
    index: EligibilityIndex,
    count: int,
    chunk: int,
    mode: str,
    generator: torch.Generator | None,
    row_filter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``count`` rows uniform over eligible rows and their versions, or ``None`` if no row is eligible."""
    rows = torch.randint(0, index.buffer_size, (count,), generator=generator)
    ok, versions = _eligible(index, rows, chunk, mode, row_filter)
    for _ in range(_REJECTION_ROUNDS):
        missing = (~ok).nonzero().squeeze(1)
        if missing.numel() == 0:
            return rows, versions
        redraw = torch.randint(0, index.buffer_size, (missing.numel(),), generator=generator)
        redraw_ok, redraw_versions = _eligible(index, redraw, chunk, mode, row_filter)
        rows[missing], ok[missing], versions[missing] = redraw, redraw_ok, redraw_versions
    missing = (~ok).nonzero().squeeze(1)
    if missing.numel():
        candidates = candidate_rows(index, chunk, mode, row_filter)
        if candidates.numel() == 0:
            return None
        picked = candidates[torch.randint(0, candidates.numel(), (missing.numel(),), generator=generator)]
        rows[missing] = picked
        versions[missing] = index.version[picked]
    return rows, versions


def draw_starts(
    index: EligibilityIndex,
    rows: torch.Tensor,
    versions: torch.Tensor,
    chunk: int,
    mode: str,
    generator: torch.Generator | None,
) -> WindowSelection:
    """A start uniform among each row's eligible starts for windows of ``chunk`` frames."""
    if mode == "boundary":
        lo, hi, run_lo, run_hi = _boundary_intervals(index, rows, chunk)
    else:
        table = EPISODE if mode == "episode" else SEGMENT
        width = max(int(index.num_runs[table, rows].max()), 1) if rows.numel() else 1
        run_lo = index.run_lo[table, rows, :width].long()
        run_hi = index.run_hi[table, rows, :width].long()
        present = torch.arange(width) < index.num_runs[table, rows, None]
        lo, hi = run_lo, torch.where(present, run_hi - chunk, run_lo - 1)
    counts = (hi - lo + 1).clamp_min(0)
    cumulative = counts.cumsum(1)
    total = cumulative[:, -1]
    u = (torch.rand(rows.numel(), generator=generator, dtype=torch.float64) * total).long()
    u = torch.minimum(u, (total - 1).clamp_min(0))
    pick = (cumulative <= u[:, None]).sum(1).clamp_max(counts.shape[1] - 1)[:, None]
    before = (cumulative - counts).gather(1, pick).squeeze(1)
    starts = lo.gather(1, pick).squeeze(1) + (u - before)
    return WindowSelection(
        rows=rows,
        starts=starts,
        run_lo=run_lo.gather(1, pick).squeeze(1),
        run_hi=run_hi.gather(1, pick).squeeze(1),
        versions=versions,
        ok=(total > 0) & ((versions & 1) == 0),
    )


def _boundary_intervals(index: EligibilityIndex, rows: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    # Each change point p inside run [s, e) admits starts [max(s, p-C+1), min(e-C, p-1)]; consecutive
    # points of one run give overlapping intervals, so each is cut to start after its predecessor's end.
    width = max(int(index.num_points[rows].max()), 1) if rows.numel() else 1
    p, s, e = (index.point[k, rows, :width].long() for k in range(3))
    present = torch.arange(width) < index.num_points[rows, None]
    lo = torch.maximum(s, p - chunk + 1)
    hi = torch.where(present, torch.minimum(e - chunk, p - 1), lo - 1)
    previous_hi = torch.full_like(hi, -1)
    previous_hi[:, 1:] = torch.where(s[:, 1:] == s[:, :-1], hi[:, :-1], -1)
    lo = torch.maximum(lo, previous_hi + 1)
    return lo, hi, s, e
