"""Chunk-size samplers: how many frames each sampled chunk has.

Each sampler owns its own ``random.Random`` (seeded or not), so chunk sizes never depend on, or disturb,
the global RNG that augmentations or model code use.
"""

from __future__ import annotations

import math
import numbers
import random
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence

from .._validation import finite_number

__all__ = ["ChunkSizeSampler", "GMMChunkSampler", "UniformChunkSampler"]


class ChunkSizeSampler(ABC):
    """Draws a chunk length (``>= 1``) per call. Subclass it to plug in your own distribution."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(_checked_seed(seed))
        self._seeded_by_user = seed is not None
        """``OnlineDataset`` without a seed of its own keeps a seeded sampler's draws in the main process,
        and reseeds an unseeded one from torch's RNG, so ``torch.manual_seed`` covers chunk sizes too."""

    def seed(self, seed: int | None) -> None:
        """Reseed (``DataLoader`` workers call this with a per-worker seed).

        A subclass whose ``__init__`` does not call this class's gets its ``_rng`` here.
        """
        seed = _checked_seed(seed)
        rng = self.__dict__.get("_rng")
        if rng is None:
            self._rng = random.Random(seed)
        else:
            rng.seed(seed)

    @abstractmethod
    def __call__(self) -> int: ...


class UniformChunkSampler(ChunkSizeSampler):
    """Uniform integer chunk size in ``[low, high]`` (both inclusive).

    Examples:
        >>> sampler = UniformChunkSampler(4, 8, seed=0)
        >>> 4 <= sampler() <= 8
        True
    """

    def __init__(self, low: int, high: int, seed: int | None = None) -> None:
        if not _is_int(low) or low < 1:
            raise ValueError(f"low must be an int ≥ 1, got {low!r}.")
        if not _is_int(high) or high < low:
            raise ValueError(f"high must be an int ≥ low ({low}), got {high!r}.")
        super().__init__(seed)
        self.low, self.high = low, high

    def __call__(self) -> int:
        return self._rng.randint(self.low, self.high)

    def __repr__(self) -> str:
        return f"UniformChunkSampler(low={self.low}, high={self.high})"


class GMMChunkSampler(ChunkSizeSampler):
    """Chunk size from a mixture of Gaussians, rounded half away from zero, clipped to ``[low, high]``.

    Args:
        means: Component means.
        stds: Component standard deviations (``> 0``).
        weights: Non-negative component weights (normalised); uniform when ``None``.
        low: Optional lower bound (``>= 1``); sizes are always at least 1.
        high: Optional upper bound (``>= 1`` and ``>= low``).
        seed: Optional seed of this sampler's own RNG.
    """

    def __init__(
        self,
        means: Sequence[float],
        stds: Sequence[float],
        weights: Sequence[float] | None = None,
        low: int | None = None,
        high: int | None = None,
        seed: int | None = None,
    ) -> None:
        if len(means) == 0:
            raise ValueError("means must not be empty.")
        if len(stds) != len(means):
            raise ValueError(f"stds must have {len(means)} entries like means, got {len(stds)}.")
        if not all(finite_number(m) for m in means):
            raise ValueError(f"every mean must be finite (a number, not a bool), got {list(means)}.")
        if not all(finite_number(s) and s > 0 for s in stds):
            raise ValueError(f"every std must be finite and > 0 (a number, not a bool), got {list(stds)}.")
        if weights is None:
            weights = [1.0] * len(means)
        if len(weights) != len(means):
            raise ValueError(f"weights must have {len(means)} entries like means, got {len(weights)}.")
        if not all(finite_number(w) and w >= 0 for w in weights):
            raise ValueError(
                f"every weight must be finite and ≥ 0 (a number, not a bool), got {list(weights)}."
            )
        largest = max(float(w) for w in weights)
        if largest <= 0:
            raise ValueError("weights must sum to a positive value.")
        weights = [float(w) / largest for w in weights]  # a sum of large finite weights stays finite
        total = sum(weights)
        if low is not None and (not _is_int(low) or low < 1):
            raise ValueError(f"low must be None or an int ≥ 1, got {low!r}.")
        if high is not None and (not _is_int(high) or high < 1):
            raise ValueError(f"high must be None or an int ≥ 1, got {high!r}.")
        if low is not None and high is not None and high < low:
            raise ValueError(f"high must be ≥ low ({low}), got {high}.")
        super().__init__(seed)
        self.means, self.stds = [float(m) for m in means], [float(s) for s in stds]
        self.weights = [w / total for w in weights]
        self.low, self.high = low, high
        self._cdf = []
        running = 0.0
        for w in self.weights:
            running += w
            self._cdf.append(running)

    def __call__(self) -> int:
        u = self._rng.random()
        component = next((i for i, c in enumerate(self._cdf) if u <= c), len(self._cdf) - 1)
        value = self._rng.gauss(self.means[component], self.stds[component])
        if not math.isfinite(value):  # a draw past the float range (means and stds near 1e308)
            value = math.copysign(sys.float_info.max, value)
        chunk = max(1, math.floor(abs(value) + 0.5) * (1 if value >= 0 else -1))
        if self.low is not None:
            chunk = max(self.low, chunk)
        if self.high is not None:
            chunk = min(self.high, chunk)
        return chunk

    def __repr__(self) -> str:
        return (
            f"GMMChunkSampler(means={self.means}, stds={self.stds}, weights={self.weights}, "
            f"low={self.low}, high={self.high})"
        )


def _checked_seed(seed: object) -> int | None:
    if seed is None:
        return None
    if not _is_int(seed):
        raise ValueError(f"seed must be None or an int, got {seed!r}.")
    return int(seed)


def _is_int(value: object) -> bool:
    """An integer of any integral type (Python or NumPy), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
