"""Sample chunks and causal context windows: select in O(batch), gather, verify, retry torn items.

The sampler holds no lock against producers. It notes each selected row's seqlock version, copies the
frames, and re-reads the versions: an item whose row was claimed by a producer meanwhile is drawn again.
With per-episode quotas, selection, copy and debit happen under the quota lock so that a batch is charged
all-or-nothing; producers take that lock only to publish fresh quotas.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict

from ..buffer.index import EligibilityIndex
from ..buffer.storage import TrajectoryStorage
from ..errors import DataBudgetExhaustedError, DataUnavailableError
from .gather import BatchGatherer
from .windows import WindowSelection, candidate_rows, draw_rows, draw_starts

__all__ = ["WindowSampler"]

_MAX_TORN_ROUNDS = 64
FrameMap = Callable[[WindowSelection], torch.Tensor]


class WindowSampler:
    """Turns requests into copied batches. Owns no shared memory; reads storage and index."""

    def __init__(self, storage: TrajectoryStorage, index: EligibilityIndex, quota=None) -> None:
        self.storage = storage
        self.index = index
        self.quota = quota
        self.gatherer = BatchGatherer(storage)

    def sample_chunks(
        self,
        batch_size: int,
        chunk_size: int,
        mode: str,
        generator: torch.Generator | None,
        *,
        out: TensorDict | None = None,
        before_charge: Callable[[], None] | None = None,
    ) -> TensorDict:
        """``batch_size`` windows of ``chunk_size`` valid frames; every key copied."""
        steps = self.storage.max_steps
        offsets = torch.arange(chunk_size)

        def frames(selection: WindowSelection) -> torch.Tensor:
            return (selection.rows * steps + selection.starts)[:, None] + offsets

        unavailable = (
            "[OnlineDataEngine] No unlocked valid chunk satisfies "
            f"sampling_mode={mode!r} and chunk_size={chunk_size}."
        )
        return self._sample(
            batch_size, chunk_size, mode, generator, None, frames, unavailable, out, before_charge
        )

    def sample_contexts(
        self,
        batch_size: int,
        history_length: int,
        prediction_horizon: int,
        mode: str,
        generator: torch.Generator | None,
        generations: tuple[int, ...] | None = None,
        before_charge: Callable[[], None] | None = None,
    ) -> TensorDict:
        """Contexts ``[batch, H + F - 1]`` around uniformly drawn anchors at position ``H - 1``."""
        steps, pad = self.storage.max_steps, self.storage.pad_index
        positions = torch.arange(history_length + prediction_horizon - 1) - (history_length - 1)
        row_filter = None
        if generations is not None:
            row_filter = torch.isin(self.index.generation, torch.tensor(generations, dtype=torch.int64))

        def frames(selection: WindowSelection) -> torch.Tensor:
            times = selection.starts[:, None] + positions
            inside = (times >= selection.run_lo[:, None]) & (times < selection.run_hi[:, None])
            return torch.where(inside, selection.rows[:, None] * steps + times, pad)

        unavailable = (
            f"[OnlineDataEngine] No unlocked valid chunk satisfies sampling_mode={mode!r} and chunk_size=1."
        )
        batch = self._sample(
            batch_size, 1, mode, generator, row_filter, frames, unavailable, None, before_charge
        )
        batch.set("loss_mask", batch.get("valid") & (positions >= 0))
        return batch

    # -----------------------------------------------------------------------------------------------
    def _select(
        self, count: int, chunk: int, mode: str, generator, row_filter, unavailable: str
    ) -> WindowSelection:
        drawn = draw_rows(self.index, count, chunk, mode, generator, row_filter)
        if drawn is None:
            raise DataUnavailableError(unavailable)
        return draw_starts(self.index, *drawn, chunk, mode, generator)

    def _torn(self, selection: WindowSelection) -> torch.Tensor:
        return ~selection.ok | (self.index.version[selection.rows] != selection.versions)

    def _sample(
        self,
        batch_size,
        chunk,
        mode,
        generator,
        row_filter,
        frames: FrameMap,
        unavailable,
        out,
        before_charge,
    ) -> TensorDict:
        if self.quota is not None:
            return self._sample_with_quota(
                batch_size, chunk, mode, generator, row_filter, frames, unavailable, before_charge
            )
        selection = self._select(batch_size, chunk, mode, generator, row_filter, unavailable)
        batch = self.gatherer.gather(frames(selection), out)
        for _ in range(_MAX_TORN_ROUNDS):
            torn = self._torn(selection).nonzero().squeeze(1)
            if torn.numel() == 0:
                return batch
            redo = self._select(torn.numel(), chunk, mode, generator, row_filter, unavailable)
            batch[torn] = self.gatherer.gather(frames(redo))
            for name in ("rows", "starts", "run_lo", "run_hi", "versions", "ok"):
                getattr(selection, name)[torn] = getattr(redo, name)
        raise DataUnavailableError(
            f"{unavailable} Producers rewrote the selected rows {_MAX_TORN_ROUNDS} times in a row."
        )

    def _sample_with_quota(
        self, batch_size, chunk, mode, generator, row_filter, frames: FrameMap, unavailable, before_charge
    ) -> TensorDict:
        quota = self.quota
        with quota.lock:
            for _ in range(_MAX_TORN_ROUNDS):
                candidates = candidate_rows(self.index, chunk, mode, row_filter)
                if candidates.numel() == 0:
                    raise DataUnavailableError(unavailable)
                remaining = int(quota.remaining(candidates).sum())
                if remaining < batch_size:
                    raise DataBudgetExhaustedError(
                        "Eligible unlocked episode quotas cannot supply a complete batch of "
                        f"{batch_size} chunks; remaining={remaining}."
                    )
                rows = quota.draw_rows(candidates, batch_size, generator=generator)
                selection = draw_starts(self.index, rows, self.index.version[rows], chunk, mode, generator)
                batch = self.gatherer.gather(frames(selection))
                if self._torn(selection).any():
                    continue
                if before_charge is not None:
                    before_charge()
                quota.debit(selection.rows)
                return batch
        raise DataUnavailableError(
            f"{unavailable} Producers rewrote the selected rows {_MAX_TORN_ROUNDS} times in a row."
        )
