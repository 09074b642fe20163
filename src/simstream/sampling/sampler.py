"""Sample chunks and causal context windows: select in O(batch), gather, verify, retry torn items.

The sampler holds no lock against producers. It notes each selected row's seqlock version, copies the
frames, and re-reads the versions: an item whose row was claimed by a producer meanwhile is drawn again.
With per-episode quotas, selection, copy and debit happen under the quota lock so that a batch is charged
all-or-nothing; producers take that lock only to publish fresh quotas. ``check_failed`` (the engine's
failure check) runs before a batch is charged and while the quota lock is held elsewhere, so a producer
killed while holding it ends the wait with its error instead of a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDict

from .._bounded import held
from ..buffer.index import EligibilityIndex
from ..buffer.storage import TrajectoryStorage
from ..errors import DataBudgetExhaustedError, DataUnavailableError
from .gather import BatchGatherer, ChunkFrames
from .windows import IndexTables, WindowSelection, candidate_rows, draw_rows, draw_starts

__all__ = ["WindowSampler"]

_MAX_TORN_ROUNDS = 64
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


class WindowSampler:
    """Turns requests into copied batches. Owns no shared memory; reads storage and index."""

    def __init__(self, storage: TrajectoryStorage, index: EligibilityIndex, quota=None) -> None:
        self.storage = storage
        self.index = index
        self.quota = quota
        self.tables = IndexTables(index)
        self.gatherer = BatchGatherer(storage)

    def sample_chunks(
        self,
        batch_size: int,
        chunk_size: int,
        mode: str,
        generator: torch.Generator | None,
        *,
        out: TensorDict | None = None,
        check_failed: Callable[[], None] | None = None,
    ) -> TensorDict:
        """``batch_size`` windows of ``chunk_size`` valid frames; every key copied."""
        steps = self.storage.max_steps

        def frames(selection: WindowSelection) -> ChunkFrames:
            return ChunkFrames(torch.from_numpy(selection.rows * steps + selection.starts), chunk_size)

        unavailable = (
            "[OnlineDataEngine] No unlocked valid chunk satisfies "
            f"sampling_mode={mode!r} and chunk_size={chunk_size}."
        )
        request = _Request(batch_size, chunk_size, mode, generator, None, frames, unavailable)
        return self._sample(request, out, check_failed)

    def sample_contexts(
        self,
        batch_size: int,
        history_length: int,
        prediction_horizon: int,
        mode: str,
        generator: torch.Generator | None,
        generations: tuple[int, ...] | None = None,
        check_failed: Callable[[], None] | None = None,
    ) -> TensorDict:
        """Contexts ``[batch, H + F - 1]`` around uniformly drawn anchors at position ``H - 1``."""
        steps, pad = self.storage.max_steps, self.storage.pad_index
        positions = np.arange(history_length + prediction_horizon - 1) - (history_length - 1)
        wanted = None if generations is None else np.asarray(generations, dtype=np.int64)

        def frames(selection: WindowSelection) -> torch.Tensor:
            times = selection.starts[:, None] + positions
            inside = (times >= selection.run_lo[:, None]) & (times < selection.run_hi[:, None])
            return torch.from_numpy(np.where(inside, selection.rows[:, None] * steps + times, pad))

        unavailable = (
            f"[OnlineDataEngine] No unlocked valid chunk satisfies sampling_mode={mode!r} and chunk_size=1."
        )
        request = _Request(batch_size, 1, mode, generator, wanted, frames, unavailable)
        batch = self._sample(request, None, check_failed)
        batch.set("loss_mask", batch.get("valid") & torch.from_numpy(positions >= 0))
        return batch

    # -----------------------------------------------------------------------------------------------
    def _rows_of(self, generations: np.ndarray | None) -> np.ndarray | None:
        """Bool mask of the rows holding one of ``generations`` now (``None``: every row)."""
        if generations is None:
            return None
        # a copy: producers write the live table, and isin() reads its input more than once
        return np.isin(self.index.generation.numpy().copy(), generations)

    def _select(self, request: _Request, count: int) -> WindowSelection:
        tables = self.tables.views()
        chunk, mode, generator = request.chunk, request.mode, request.generator
        drawn = draw_rows(tables, count, chunk, mode, generator, self._rows_of(request.generations))
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

    def _sample(self, request: _Request, out: TensorDict | None, check_failed) -> TensorDict:
        if self.quota is not None:
            return self._sample_with_quota(request, out, check_failed)
        selection = self._select(request, request.batch_size)
        batch = self.gatherer.gather(request.frames(selection), out)
        for _ in range(_MAX_TORN_ROUNDS):
            torn = self._torn(selection, request.generations)
            if torn.size == 0:
                return batch
            redo = self._select(request, torn.size)
            scratch = self.gatherer.empty(torn.size, batch.batch_size[1])
            redone = self.gatherer.gather(request.frames(redo), scratch)
            self.gatherer.replace_items(batch, torch.from_numpy(torn), redone)
            selection.replace(torn, redo)
        raise DataUnavailableError(
            f"{request.unavailable} Producers rewrote the selected rows {_MAX_TORN_ROUNDS} times in a row."
        )

    def _sample_with_quota(self, request: _Request, out: TensorDict | None, check_failed) -> TensorDict:
        quota = self.quota
        batch_size, chunk, mode, generator, generations, frames, unavailable = request
        with held(quota.lock, check_failed):
            for _ in range(_MAX_TORN_ROUNDS):
                tables = self.tables.views()
                row_filter = self._rows_of(generations)
                filter_tensor = None if row_filter is None else torch.from_numpy(row_filter)
                candidates = candidate_rows(self.index, chunk, mode, filter_tensor)
                if candidates.numel() == 0:
                    raise DataUnavailableError(unavailable)
                remaining = int(quota.remaining(candidates).sum())
                if remaining < batch_size:
                    raise DataBudgetExhaustedError(
                        "Eligible unlocked episode quotas cannot supply a complete batch of "
                        f"{batch_size} chunks; remaining={remaining}."
                    )
                rows = quota.draw_rows(candidates, batch_size, generator=generator).numpy()
                selection = draw_starts(tables, rows, tables.version[rows], chunk, mode, generator)
                batch = self.gatherer.gather(frames(selection), out)
                if self._torn(selection, generations).size:
                    continue
                if check_failed is not None:
                    check_failed()
                quota.debit(torch.from_numpy(selection.rows))
                return batch
        raise DataUnavailableError(
            f"{unavailable} Producers rewrote the selected rows {_MAX_TORN_ROUNDS} times in a row."
        )
