"""A synthetic episode source: no simulator, controllable cost, the reference benchmark's layout.

Used by ``simstream stream``, the benchmarks and anyone who wants to exercise the engine without MuJoCo.
Each episode is a smooth random walk with ``num_segments`` labelled sub-tasks; ``work_us_per_step`` burns
CPU per frame to stand in for a simulator step, so production throughput can be measured honestly.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ._validation import require_int, require_number
from .sources import Episode, Field, Segment

__all__ = ["SyntheticSpec"]

_COLOURS = ("red", "green", "blue", "yellow")


_STOP_POLL_S = 0.01
"""Longest burn between two looks at ``should_stop``."""


@dataclass(frozen=True)
class SyntheticSpec:
    """Picklable spec of the synthetic source (field layout of the reference streaming workload)."""

    num_envs: int = 4
    """Rows written per rollout."""
    max_episode_steps: int = 300
    """Row capacity T."""
    min_length: int = 200
    """Shortest episode; lengths are uniform in ``[min_length, max_episode_steps]``."""
    state_dim: int = 64
    qpos_dim: int = 14
    action_dim: int = 14
    image_size: int | None = None
    """Side of an optional ``obs/image`` uint8 ``[3, S, S]`` field."""
    num_segments: int = 4
    work_us_per_step: float = 0.0
    """CPU time burnt per frame (a stand-in for simulation cost)."""

    def __post_init__(self) -> None:
        for name in ("num_envs", "max_episode_steps", "min_length", "state_dim", "qpos_dim", "action_dim"):
            require_int("SyntheticSpec", name, getattr(self, name), 1)
        if self.min_length > self.max_episode_steps:
            raise ValueError(
                f"SyntheticSpec.min_length must be <= max_episode_steps ({self.max_episode_steps}), "
                f"got {self.min_length}"
            )
        for name in ("qpos_dim", "action_dim"):  # both are slices of the state's walk
            require_int("SyntheticSpec", name, getattr(self, name), 1, self.state_dim)
        require_int("SyntheticSpec", "num_segments", self.num_segments, 1, self.min_length)
        if self.image_size is not None:
            require_int("SyntheticSpec", "image_size", self.image_size, 1, 4096)
        require_number("SyntheticSpec", "work_us_per_step", self.work_us_per_step, 0, 1e6)

    def fields(self) -> Mapping[str, Field]:
        fields = {
            "obs/state": Field((self.state_dim,)),
            "obs/qpos": Field((self.qpos_dim,)),
            "actions": Field((self.action_dim,)),
            "rewards": Field(()),
        }
        if self.image_size is not None:
            fields["obs/image"] = Field((3, self.image_size, self.image_size), torch.uint8)
        return fields

    def build(self, worker_index: int, seed: int) -> SyntheticSource:
        return SyntheticSource(self, seed)


class SyntheticSource:
    """Worker-side synthetic source; deterministic for a given seed."""

    def __init__(self, spec: SyntheticSpec, seed: int) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(seed)

    def rollout(self, rows, *, attempt: int, should_stop) -> list[Episode] | None:
        spec = self.spec
        episodes = []
        for row in range(rows.batch_size[0]):
            if should_stop():
                return None
            length = int(self.rng.integers(spec.min_length, spec.max_episode_steps + 1))
            walk = np.cumsum(self.rng.normal(0, 0.05, (length, spec.state_dim)), axis=0, dtype=np.float32)
            rows["obs", "state"][row, :length] = torch.from_numpy(walk)
            rows["obs", "qpos"][row, :length] = torch.from_numpy(walk[:, : spec.qpos_dim])
            rows["actions"][row, :length] = torch.from_numpy(
                np.diff(walk[:, : spec.action_dim], axis=0, prepend=0)
            )
            rows["rewards"][row, :length] = torch.linspace(0, 1, length)
            if spec.image_size is not None:
                rows["obs", "image"][row, :length] = int(self.rng.integers(0, 256))
            colour = _COLOURS[int(self.rng.integers(len(_COLOURS)))]
            cuts = np.linspace(0, length, spec.num_segments + 1).astype(int)
            segments = [
                Segment(int(lo), int(hi), f"phase {k} with the {colour} block")
                for k, (lo, hi) in enumerate(itertools.pairwise(cuts))
            ]
            if not self._burn(length, should_stop):
                return None
            episodes.append(
                Episode(length, instruction=f"move the {colour} block", segments=segments, terminated=True)
            )
        return episodes

    def _burn(self, frames: int, should_stop) -> bool:
        """Spend ``frames * work_us_per_step`` of CPU, looking at ``should_stop`` every 10 ms; ``False``
        when it asked to stop (a slow simulator must still let ``stop()`` end its rollout)."""
        if self.spec.work_us_per_step <= 0:
            return True
        now = time.perf_counter()
        deadline = now + frames * self.spec.work_us_per_step * 1e-6
        while now < deadline:
            look = min(deadline, now + _STOP_POLL_S)
            while now < look:
                now = time.perf_counter()
            if should_stop():
                return False
        return True

    def close(self) -> None:
        pass
