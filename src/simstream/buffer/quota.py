"""Per-episode sampling quotas in shared memory: how often each published source episode may be served.

Every freshly published episode gets ``budget`` deliveries (never topped up, never refunded, never moved
to another episode); ``hard_limit`` is a further ceiling checked at every debit. A row re-published with
a new episode starts over, because quotas follow source episodes, not buffer rows.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from typing import Any

import numpy as np
import torch

from .._sync import SharedLock

__all__ = ["EpisodeQuota"]

_INT64_MAX = 2**63 - 1
_EPISODE, _GENERATION, _ASSIGNED, _DELIVERED = range(4)
_HIGH_WATER, _LIFETIME = range(2)
_PUBLISH_ERROR = "Sampling quota publication requires fresh monotonic episode identities"
# draw_rows redraws only the excess of the previous round; a handful of rounds settle any realistic
# batch, and the exact fallback after that keeps the call bounded whatever the residuals look like.
_MAX_DRAW_ROUNDS = 16


def _shared_int64(ctx: Any, shape: tuple[int, ...]) -> tuple[Any, torch.Tensor]:
    raw = ctx.RawArray("B", math.prod(shape) * 8)
    return raw, torch.frombuffer(raw, dtype=torch.int64).view(shape)


class EpisodeQuota:
    """Owns the shared quota table ``[num_rows, 4]`` = ``(episode_id, generation, assigned, delivered)``.

    Unpublished rows hold ``(-1, -1, 0, 0)``. Shared meta: the highest published episode id (``-1`` at
    first) and the lifetime number of deliveries, retired episodes included. Formula:
    ``remaining(row) = min(assigned, hard_limit) - delivered``.

    No method takes :attr:`lock`: the caller holds it around a whole operation (for example select rows,
    gather the batch, :meth:`debit`), so that concurrent consumers cannot overspend a row between steps.

    Args:
        num_rows: Buffer rows (slots) tracked.
        budget: Deliveries granted to each freshly published episode, ``1 <= budget <= hard_limit``.
        hard_limit: Ceiling on deliveries per episode, at most ``2**63 - 1``.
        run_id: Engine run id, repeated in snapshots.
        ctx: Multiprocessing context that allocates the shared state (default: forkserver).

    Raises:
        ValueError: If an argument is outside its range.

    Examples:
        >>> quota = EpisodeQuota(num_rows=2, budget=3, hard_limit=3, run_id=0)
        >>> quota.publish(torch.tensor([0, 1]), torch.tensor([0, 1]), generation=1)
        >>> quota.debit(torch.tensor([0, 0]))
        >>> quota.remaining(torch.tensor([0, 1])).tolist()
        [1, 3]
    """

    def __init__(self, num_rows: int, budget: int, hard_limit: int, run_id: int, ctx: Any = None) -> None:
        for name, value in (("num_rows", num_rows), ("budget", budget), ("hard_limit", hard_limit)):
            if type(value) is not int or not 1 <= value <= _INT64_MAX:
                raise ValueError(f"EpisodeQuota.{name} must be an int in [1, 2**63 - 1], got {value!r}")
        if budget > hard_limit:
            raise ValueError(f"EpisodeQuota.budget must be <= hard_limit={hard_limit}, got {budget!r}")
        if type(run_id) is not int:
            raise ValueError(f"EpisodeQuota.run_id must be an int, got {run_id!r}")
        ctx = ctx if ctx is not None else multiprocessing.get_context("forkserver")
        self.num_rows = num_rows
        self.budget = budget
        self.hard_limit = hard_limit
        self.run_id = run_id
        self.clock_origin_monotonic_ns = time.monotonic_ns()
        self.lock = SharedLock()
        self._raw_rows, self._rows = _shared_int64(ctx, (num_rows, 4))
        self._raw_meta, self._meta = _shared_int64(ctx, (2,))
        self._rows[:, _EPISODE] = -1
        self._rows[:, _GENERATION] = -1
        self._meta[_HIGH_WATER] = -1

    # Tensor views are rebuilt from the raw arrays, which pickle only while a child is being created.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_rows"], state["_meta"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rows = torch.frombuffer(self._raw_rows, dtype=torch.int64).view(self.num_rows, 4)
        self._meta = torch.frombuffer(self._raw_meta, dtype=torch.int64)

    @property
    def max_published_episode_id(self) -> int:
        """Highest episode id ever published (``-1`` before the first publication)."""
        return int(self._meta[_HIGH_WATER])

    def publish(self, rows: torch.Tensor, episode_ids: torch.Tensor, generation: int) -> None:
        """Gives each row in ``rows`` a fresh quota for its new episode: ``(ep, generation, budget, 0)``.

        Args:
            rows: Distinct row ids in ``[0, num_rows)``, 1-D integer tensor, non-empty.
            episode_ids: One id per row, strictly increasing and above every id published before.
            generation: Fill generation, at least 1.

        Raises:
            ValueError: ``"Sampling quota publication requires fresh monotonic episode identities"`` if
                any rule above is broken; nothing changes then.
        """
        if not _is_int_vector(rows) or not _is_int_vector(episode_ids):
            raise ValueError(_PUBLISH_ERROR)
        # NumPy for the checks and the store: a publication costs a few microseconds, not ~50
        rows = rows.to(device="cpu", dtype=torch.int64).numpy()
        episode_ids = episode_ids.to(device="cpu", dtype=torch.int64).numpy()
        fresh = (
            rows.size >= 1
            and episode_ids.shape == rows.shape
            and type(generation) is int
            and generation >= 1
            and int(rows.min()) >= 0
            and int(rows.max()) < self.num_rows
            and np.unique(rows).size == rows.size
            and bool((episode_ids[1:] > episode_ids[:-1]).all())
            and int(episode_ids[0]) > self.max_published_episode_id
        )
        if not fresh:
            raise ValueError(_PUBLISH_ERROR)
        table = self._rows.numpy()
        table[rows, _EPISODE] = episode_ids
        table[rows, _GENERATION] = generation
        table[rows, _ASSIGNED] = self.budget
        table[rows, _DELIVERED] = 0
        self._meta.numpy()[_HIGH_WATER] = episode_ids[-1]

    def remaining(self, rows: torch.Tensor) -> torch.Tensor:
        """Deliveries each row may still serve: ``min(assigned, hard_limit) - delivered`` (int64)."""
        return torch.from_numpy(
            np.asarray(self.remaining_of(rows.to(device="cpu", dtype=torch.int64).numpy()))
        )

    def remaining_of(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`remaining` for a NumPy array of rows (the sampler's per-draw test: no tensor overhead)."""
        table = self._rows.numpy()
        return np.minimum(table[rows, _ASSIGNED], self.hard_limit) - table[rows, _DELIVERED]

    def debit(self, rows: torch.Tensor) -> None:
        """Charges one delivery per occurrence in ``rows``, all or nothing.

        Args:
            rows: 1-D integer tensor of row ids in ``[0, num_rows)``; duplicates are charged each time.

        Raises:
            ValueError: If ``rows`` is not such a tensor.
            OverflowError: If the lifetime delivery counter would pass the int64 range.
            RuntimeError: If a row would exceed ``min(assigned, hard_limit)``. Nothing changes on error.
        """
        if not _is_int_vector(rows):
            raise ValueError("EpisodeQuota.debit rows must be a 1-D integer tensor")
        # NumPy throughout: every batch is charged, and each tensor operation costs microseconds
        rows = rows.to(device="cpu", dtype=torch.int64).numpy()
        if rows.size == 0:
            return
        charged, counts = np.unique(rows, return_counts=True)  # O(batch), not O(num_rows)
        if int(charged[0]) < 0 or int(charged[-1]) >= self.num_rows:
            raise ValueError(f"EpisodeQuota.debit rows must lie in [0, {self.num_rows})")
        meta = self._meta.numpy()
        if int(meta[_LIFETIME]) > _INT64_MAX - rows.size:
            raise OverflowError("Lifetime sampling delivery counter would overflow int64")
        if bool((counts > self.remaining_of(charged)).any()):
            raise RuntimeError("Sampling quota reservation exceeded its source budget")
        self._rows.numpy()[charged, _DELIVERED] += counts
        meta[_LIFETIME] += rows.size

    def draw_rows(
        self,
        candidate_rows: torch.Tensor,
        batch_size: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Draws ``batch_size`` rows among ``candidate_rows``, none more often than its remaining quota.

        Every candidate with a positive residual is about equally likely per draw, so sampling stays
        uniform over episodes and only shifts away from rows whose quota runs out. Each round draws the
        missing count uniformly from the rows that still have residual, keeps a row's draws up to its
        residual (first come, first kept) and redraws the excess; after a bounded number of rounds the
        rest is drawn exactly from the remaining deliveries. Nothing is debited.

        Args:
            candidate_rows: 1-D integer tensor of eligible row ids (duplicates are ignored).
            batch_size: Rows to draw, at least 0.
            generator: Source of randomness; the same generator state gives the same rows.

        Returns:
            int64 tensor ``[batch_size]`` of row ids in random order.

        Raises:
            ValueError: If a candidate is out of range or ``batch_size`` exceeds their remaining quota.
        """
        if type(batch_size) is not int or batch_size < 0:
            raise ValueError(f"EpisodeQuota.draw_rows batch_size must be an int >= 0, got {batch_size!r}")
        rows = torch.unique(candidate_rows.to(device="cpu", dtype=torch.int64))
        if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= self.num_rows):
            raise ValueError(f"EpisodeQuota.draw_rows candidate_rows must lie in [0, {self.num_rows})")
        residual = self.remaining(rows).clamp(min=0)
        keep = residual > 0
        rows, residual = rows[keep], residual[keep]
        if int(residual.clamp(max=batch_size).sum()) < batch_size:  # capped: a sum that cannot wrap
            raise ValueError(
                f"EpisodeQuota.draw_rows batch_size={batch_size} exceeds the candidates' remaining "
                f"quota {sum(residual.tolist())}"
            )
        chosen: list[torch.Tensor] = []
        missing = batch_size
        for _ in range(_MAX_DRAW_ROUNDS):
            if missing == 0:
                break
            active = (residual > 0).nonzero().flatten()
            picks = active[torch.randint(active.numel(), (missing,), generator=generator)]
            kept = picks[_rank_within_value(picks) < residual[picks]]
            residual -= torch.bincount(kept, minlength=residual.numel())
            chosen.append(kept)
            missing -= kept.numel()
        if missing:
            units = torch.repeat_interleave(torch.arange(residual.numel()), residual.clamp(max=missing))
            order = torch.randperm(units.numel(), generator=generator)[:missing]
            chosen.append(units[order])
        picked = torch.cat(chosen) if chosen else torch.empty(0, dtype=torch.int64)
        return rows[picked]

    def snapshot(self, locked_rows_mask: torch.Tensor | None = None) -> list[dict[str, int | bool]]:
        """One plain dict per published row (``episode_id >= 0``), in row order.

        Args:
            locked_rows_mask: Bool ``[num_rows]`` marking rows inside the current write window, or
                ``None`` for none.

        Returns:
            Dicts with ``run_id``, ``episode_id``, ``generation``, ``slot``, ``assigned``, ``delivered``,
            ``remaining`` and ``locked``.
        """
        table = self._rows.clone()
        slots = (table[:, _EPISODE] >= 0).nonzero().flatten()
        locked = torch.zeros(self.num_rows, dtype=torch.bool)
        if locked_rows_mask is not None:
            locked = locked_rows_mask.to(device="cpu", dtype=torch.bool).reshape(self.num_rows)
        remaining = table[:, _ASSIGNED].clamp(max=self.hard_limit) - table[:, _DELIVERED]
        columns = zip(
            slots.tolist(),
            table[slots].tolist(),
            remaining[slots].tolist(),
            locked[slots].tolist(),
        )
        return [
            {
                "run_id": self.run_id,
                "episode_id": values[_EPISODE],
                "generation": values[_GENERATION],
                "slot": slot,
                "assigned": values[_ASSIGNED],
                "delivered": values[_DELIVERED],
                "remaining": left,
                "locked": is_locked,
            }
            for slot, values, left, is_locked in columns
        ]

    def total_delivered(self) -> int:
        """Deliveries ever debited, including those of episodes whose rows were re-published."""
        return int(self._meta[_LIFETIME])

    def unlocked_remaining(self, eligible_rows_mask: torch.Tensor) -> int:
        """Sum of :meth:`remaining` over published rows where ``eligible_rows_mask`` ([num_rows]) is set."""
        mask = eligible_rows_mask.to(device="cpu", dtype=torch.bool).reshape(self.num_rows)
        mask = mask & (self._rows[:, _EPISODE] >= 0)
        return sum(self.remaining(mask.nonzero().flatten()).tolist())  # Python ints: huge budgets cannot wrap

    def state_dict(self) -> dict[str, Any]:
        """Copies of the quota table and meta counters (take :attr:`lock` for a consistent copy)."""
        return {"rows": self._rows.clone(), "meta": self._meta.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` of a quota with the same ``num_rows``."""
        self._rows.copy_(state["rows"])
        self._meta.copy_(state["meta"])


def _is_int_vector(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype != torch.bool
    )


def _rank_within_value(values: torch.Tensor) -> torch.Tensor:
    """For each element, how many equal elements precede it (0 for the first occurrence)."""
    order = torch.sort(values, stable=True).indices
    ordered = values[order]
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    position = torch.arange(values.numel())
    run_start = torch.cummax(torch.where(starts, position, 0), dim=0).values
    rank = torch.empty_like(values)
    rank[order] = position - run_start
    return rank
