"""The eligibility index: per-row run tables that producers write at publication.

This is the only code that knows which windows may be sampled. For every row it keeps, per sampling
mode, the maximal runs of frames a window may lie in:

* ``episode`` runs: valid frames with one continuity id ``>= 0``;
* ``segment`` runs: valid, accepted frames with one continuity id and one segment id ``>= 0``;
* ``boundary`` points: each segment change ``p`` inside an accepted run ``[s, e)`` (valid, accepted, one
  continuity id); a window ``[t, t + C)`` crosses it when ``s <= t``, ``t + C <= e`` and ``t < p < t + C``.

A window of ``C`` frames starting at ``t`` is eligible in ``episode``/``segment`` mode iff
``lo <= t <= hi - C`` for one run ``[lo, hi)``. Tables are computed by the producer (O(T) per row, outside
any lock) so that sampling costs O(batch) instead of rebuilding masks over the whole buffer.

Consistency is a per-row seqlock: ``version[r]`` is odd while row ``r`` is being written. A reader notes
the (even) version, reads tables and frames, and re-reads the version; if it changed, the read is discarded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["EPISODE", "SEGMENT", "EligibilityIndex", "RowTables", "compute_row_tables", "segment_row_tables"]

EPISODE, SEGMENT = 0, 1
"""Run modes of the run tables; boundary sampling has its own tables."""


@dataclass(frozen=True)
class RowTables:
    """Run tables of one row, ready to publish."""

    runs: tuple[np.ndarray, np.ndarray]
    """Per run mode (episode, segment): an ``[n, 2]`` int array of ``[lo, hi)`` runs."""
    boundaries: np.ndarray
    """``[m, 3]`` int array of ``(p, s, e)``: segment change ``p`` inside accepted run ``[s, e)``."""
    valid_frames: int


def _runs(ok: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """``[lo, hi)`` runs of frames where ``ok`` holds, cut wherever ``ok`` or any of ``keys`` changes."""
    n = len(ok)
    if n == 0:
        return np.zeros((0, 2), dtype=np.int64)
    cut = np.ones(n + 1, dtype=bool)
    cut[1:n] = ok[1:] != ok[:-1]
    for key in keys:  # each compared alone: a combined key of several ids can collide or overflow
        cut[1:n] |= key[1:] != key[:-1]
    edges = np.flatnonzero(cut)
    keep = ok[edges[:-1]]
    runs = np.empty((int(keep.sum()), 2), dtype=np.int64)
    runs[:, 0] = edges[:-1][keep]
    runs[:, 1] = edges[1:][keep]
    return runs


def compute_row_tables(continuity: np.ndarray, segment_id: np.ndarray, accepted: np.ndarray) -> RowTables:
    """Run tables of one row from the metadata of its ``length`` valid frames."""
    length = len(continuity)
    in_region = continuity >= 0
    episode = _runs(in_region, continuity)
    in_segment = in_region & (segment_id >= 0) & accepted
    segment = _runs(in_segment, continuity, segment_id)
    accepted_runs = _runs(in_region & accepted, continuity)
    points = []
    for lo, hi in accepted_runs:
        changes = np.flatnonzero(segment_id[lo + 1 : hi] != segment_id[lo : hi - 1]) + lo + 1
        points.extend((int(p), int(lo), int(hi)) for p in changes)
    boundaries = np.array(points, dtype=np.int64).reshape(-1, 3)
    return RowTables(runs=(episode, segment), boundaries=boundaries, valid_frames=length)


def segment_row_tables(length: int, segments: Sequence[tuple[int, int, bool]]) -> RowTables:
    """The tables :func:`compute_row_tables` gives a row without continuity breaks, from its segments.

    ``segments`` are ``(start, end, accepted)`` inside ``[0, length]``, the non-empty ones sorted and
    disjoint (what ``validate_episodes`` enforces); empty ones cover no frame and are skipped. With one
    continuity region the runs follow from the segment list alone: the row's whole length, each accepted
    segment, and the change points between touching accepted segments (touching across a skipped empty
    one too: the segment id still changes there). A producer then skips scanning the row's metadata
    (several times faster per episode).
    """
    episode = np.array([[0, length]] if length else [], dtype=np.int64).reshape(-1, 2)
    accepted = [(start, end) for start, end, ok in segments if ok and start < end]
    segment = np.array(accepted, dtype=np.int64).reshape(-1, 2)
    touching: list[list[tuple[int, int]]] = []  # accepted segments grouped into accepted runs
    for start, end in accepted:
        if touching and touching[-1][-1][1] == start:
            touching[-1].append((start, end))
        else:
            touching.append([(start, end)])
    points = [(start, run[0][0], run[-1][1]) for run in touching for start, _ in run[1:]]
    boundaries = np.array(points, dtype=np.int64).reshape(-1, 3)
    return RowTables(runs=(episode, segment), boundaries=boundaries, valid_frames=length)


class EligibilityIndex:
    """Shared per-row tables: seqlock versions, generations, run tables and boundary points.

    Owns only integers (a few ``[buffer_size, T]`` int32 tables); it never touches frames. Producers call
    :meth:`begin_write` / :meth:`write_tables` / :meth:`end_write` on the rows they own; samplers read.
    """

    def __init__(self, buffer_size: int, max_steps: int) -> None:
        rows, steps = buffer_size, max_steps
        self.buffer_size, self.max_steps = rows, steps
        self.version = torch.zeros(rows, dtype=torch.int64).share_memory_()
        self.generation = torch.full((rows,), -1, dtype=torch.int64).share_memory_()
        self.episode_id = torch.full((rows,), -1, dtype=torch.int64).share_memory_()
        self.valid_frames = torch.zeros(rows, dtype=torch.int64).share_memory_()
        self.run_lo = torch.zeros((2, rows, steps), dtype=torch.int32).share_memory_()
        self.run_hi = torch.zeros((2, rows, steps), dtype=torch.int32).share_memory_()
        self.num_runs = torch.zeros((2, rows), dtype=torch.int32).share_memory_()
        self.longest_run = torch.zeros((2, rows), dtype=torch.int32).share_memory_()
        # boundary points: (p, s, e) per change point, plus the longest accepted run holding one
        self.point = torch.zeros((3, rows, steps), dtype=torch.int32).share_memory_()
        self.num_points = torch.zeros(rows, dtype=torch.int32).share_memory_()
        self.longest_point_run = torch.zeros(rows, dtype=torch.int32).share_memory_()
        self._arrays: dict[str, np.ndarray] | None = None

    @staticmethod
    def shared_bytes(buffer_size: int, max_steps: int) -> int:
        """Bytes of shared memory :meth:`__init__` allocates (exact Python ints: no overflow)."""
        per_row_int64 = 4  # version, generation, episode_id, valid_frames
        per_row_int32 = 2 * 2 + 2  # num_runs and longest_run per mode; num_points, longest_point_run
        per_frame_int32 = 2 * 2 + 3  # run_lo and run_hi per mode; point (p, s, e)
        return buffer_size * (8 * per_row_int64 + 4 * per_row_int32 + 4 * per_frame_int32 * max_steps)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_arrays"] = None  # NumPy views are per process; the tensors travel as shared memory
        return state

    def _numpy(self) -> dict[str, np.ndarray]:
        """Zero-copy NumPy views of the tables: scalar and short writes cost ~0.3 us instead of ~3 us."""
        if self._arrays is None:
            names = ("num_runs", "longest_run", "run_lo", "run_hi", "point", "num_points")
            names += ("version", "generation", "episode_id")
            arrays = {name: getattr(self, name).numpy() for name in names}
            arrays.update(longest_point_run=self.longest_point_run.numpy(), valid=self.valid_frames.numpy())
            self._arrays = arrays
        return self._arrays

    # -- producer side ---------------------------------------------------------------------------------
    def begin_write(self, start: int, end: int) -> None:
        """Make rows ``[start, end)`` odd (unsampleable) before anything of them changes."""
        a = self._numpy()  # one NumPy slice op each: a window of any size costs ~0.5 us per table
        # odd whatever it was: a row left odd by an abandoned claim stays unsampleable (+= 1 made it even)
        a["version"][start:end] = (a["version"][start:end] + 1) | 1
        a["num_runs"][:, start:end] = 0
        a["longest_run"][:, start:end] = 0
        a["num_points"][start:end] = 0
        a["longest_point_run"][start:end] = 0
        a["valid"][start:end] = 0
        a["generation"][start:end] = -1
        a["episode_id"][start:end] = -1

    def write_tables(self, row: int, tables: RowTables) -> None:
        """Store one row's tables (the row must be odd)."""
        a = self._numpy()
        for mode, runs in enumerate(tables.runs):
            n = len(runs)
            a["num_runs"][mode, row] = n
            # written even without runs: a value left from an earlier layout would keep the row eligible
            a["longest_run"][mode, row] = (runs[:, 1] - runs[:, 0]).max() if n else 0
            if n:
                a["run_lo"][mode, row, :n] = runs[:, 0]
                a["run_hi"][mode, row, :n] = runs[:, 1]
        points = tables.boundaries
        m = len(points)
        a["num_points"][row] = m
        a["longest_point_run"][row] = (points[:, 2] - points[:, 1]).max() if m else 0
        if m:
            a["point"][:, row, :m] = points.T
        a["valid"][row] = tables.valid_frames

    def write_segment_tables(self, rows: np.ndarray, lengths: np.ndarray, spans: np.ndarray) -> None:
        """Store the tables of rows without continuity breaks (the rows must be odd), all in one pass.

        Stores what :meth:`write_tables` stores for ``segment_row_tables(length, segments)`` of each row,
        with a fixed number of NumPy operations however many rows there are.

        Args:
            rows: ``[n]`` row ids.
            lengths: ``[n]`` valid frames of each row.
            spans: ``[m, 3]`` ``(i, start, end)``: the accepted, non-empty segments of row ``rows[i]``,
                sorted by ``i`` then ``start`` (disjoint within a row).
        """
        a = self._numpy()
        count = len(rows)
        a["valid"][rows] = lengths
        nonempty = rows[lengths > 0]
        a["num_runs"][EPISODE, rows] = lengths > 0  # the whole row is the one episode run
        a["run_lo"][EPISODE, nonempty, 0] = 0
        a["run_hi"][EPISODE, nonempty, 0] = lengths[lengths > 0]
        a["longest_run"][EPISODE, rows] = lengths
        owner, lo, hi = spans[:, 0], spans[:, 1], spans[:, 2]
        rank = np.arange(len(spans)) - np.searchsorted(owner, owner)  # position among its row's runs
        a["num_runs"][SEGMENT, rows] = np.bincount(owner, minlength=count)
        a["run_lo"][SEGMENT, rows[owner], rank] = lo
        a["run_hi"][SEGMENT, rows[owner], rank] = hi
        longest = np.zeros(count, dtype=np.int64)
        np.maximum.at(longest, owner, hi - lo)
        a["longest_run"][SEGMENT, rows] = longest
        # a change point where an accepted segment touches the previous one of its row; both lie in the
        # accepted run made of all the touching segments around them
        touching = np.zeros(len(spans), dtype=bool)
        touching[1:] = (owner[1:] == owner[:-1]) & (lo[1:] == hi[:-1])
        group = np.cumsum(~touching) - 1
        last = np.ones(len(spans), dtype=bool)
        last[:-1] = ~touching[1:]
        run_start, run_end = lo[~touching][group][touching], hi[last][group][touching]
        point_owner = owner[touching]
        point_rank = np.arange(len(point_owner)) - np.searchsorted(point_owner, point_owner)
        a["point"][:, rows[point_owner], point_rank] = np.stack([lo[touching], run_start, run_end])
        a["num_points"][rows] = np.bincount(point_owner, minlength=count)
        longest = np.zeros(count, dtype=np.int64)
        np.maximum.at(longest, point_owner, run_end - run_start)
        a["longest_point_run"][rows] = longest

    def end_write(self, start: int, end: int, generation: int, episode_ids: torch.Tensor) -> None:
        """Publish rows ``[start, end)``: stamp generation and episode ids, then make them even."""
        a = self._numpy()
        a["generation"][start:end] = generation
        a["episode_id"][start:end] = np.asarray(episode_ids)
        a["version"][start:end] += 1

    # -- reader side -----------------------------------------------------------------------------------
    def stable_rows(self) -> torch.Tensor:
        """Bool mask of rows not being written right now."""
        return (self.version & 1) == 0

    def longest(self, mode: str) -> torch.Tensor:
        """Per row, the longest window any start may have in ``mode`` (0: nothing sampleable)."""
        if mode == "boundary":
            return self.longest_point_run
        return self.longest_run[EPISODE if mode == "episode" else SEGMENT]
