"""Worker side of a built-in task source: expert episodes recorded frame by frame into buffer rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .._seeding import derived_seed
from ..sources import Episode, Segment
from .base import Phase
from .env import TaskEnv
from .expert import ScriptedExpert

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .spec import TaskSourceSpec

__all__ = ["ExpertEpisode", "TaskEpisodeSource", "episode_seed", "record_episode"]

_OBS_FIELDS = {"state": "obs/state", "objects": "obs/objects", "image": "obs/image"}


@dataclass
class ExpertEpisode:
    """One recorded expert episode: frame arrays (``[length, ...]``), its report and its phases."""

    frames: dict[str, np.ndarray]
    """Field name (``"obs/state"``, ``"actions"``, ...) -> frames ``t < length``."""
    episode: Episode
    """The report a rollout returns for the row."""
    phases: tuple[Phase, ...]
    """Expert phase of every frame."""
    seed: int
    """The ``reset`` seed."""


def episode_seed(seed: int, worker_index: int, counter: int) -> int:
    """The reset seed of a worker's ``counter``-th episode: a hash of the three, so that workers and
    windows (retries included) get different episodes while a rerun reproduces them."""
    return derived_seed(seed, worker_index, counter, bits=64)


def _segments(env: TaskEnv, phases: Sequence[Phase]) -> list[Segment]:
    segments, start = [], 0
    for t in range(1, len(phases) + 1):
        if t == len(phases) or phases[t] != phases[start]:
            segments.append(Segment(start, t, env.subtask_instruction(phases[start])))
            start = t
    return segments


def record_episode(
    env: TaskEnv,
    expert: ScriptedExpert,
    seed: int,
    *,
    should_stop: Callable[[], bool] | None = None,
    buffers: dict[str, np.ndarray] | None = None,
) -> ExpertEpisode | None:
    """Run one expert episode from ``env.reset(seed)`` until success or ``env.max_episode_steps``.

    Frame ``t`` holds the observation before action ``t``, the action and its reward. ``buffers``
    (``[T, ...]`` per field) are reused when given: the returned frames are then views into them.

    Returns:
        The episode, or ``None`` once ``should_stop()`` (polled before every control step) is true.
    """
    horizon = env.max_episode_steps
    obs = env.reset(seed)
    expert.reset()
    if buffers is None:
        buffers = {_OBS_FIELDS[k]: np.empty((horizon, *v.shape), v.dtype) for k, v in obs.items()}
        buffers["actions"] = np.empty((horizon, env.action_dim), np.float32)
        buffers["rewards"] = np.empty((horizon,), np.float32)
    phases: list[Phase] = []
    success = False
    for t in range(horizon):
        if should_stop is not None and should_stop():
            return None
        action = expert.act()
        for key, value in obs.items():
            buffers[_OBS_FIELDS[key]][t] = value
        buffers["actions"][t] = action
        phases.append(expert.acting_phase)
        obs, reward, success, truncated, _ = env.step(action)
        buffers["rewards"][t] = reward
        if success or truncated:
            break
    length = len(phases)
    episode = Episode(
        length=length,
        success=success,
        instruction=env.instruction,
        segments=_segments(env, phases),
        terminated=success,
        truncated=not success,
    )
    frames = {name: array[:length] for name, array in buffers.items()}
    return ExpertEpisode(frames=frames, episode=episode, phases=tuple(phases), seed=seed)


class TaskEpisodeSource:
    """The ``EpisodeSource`` of a built-in task inside one producer worker.

    Owns one :class:`TaskEnv` (and its renderer), the expert and an episode counter. Row ``i`` of a
    rollout gets the episode with seed ``episode_seed(seed, worker_index, counter)``; the counter keeps
    counting across rollouts and retries, so a retried window holds new episodes.
    """

    def __init__(self, spec: TaskSourceSpec, *, worker_index: int, seed: int) -> None:
        self.spec = spec
        self.worker_index = worker_index
        self.seed = seed
        self.episodes_started = 0
        self.env = TaskEnv(
            spec.task,
            image_size=spec.image_size,
            camera=spec.camera,
            max_episode_steps=spec.max_episode_steps,
        )
        self.expert = ScriptedExpert(self.env)
        horizon = spec.max_episode_steps
        self._buffers = {
            name: np.empty((horizon, *f.shape), torch.empty((), dtype=f.dtype).numpy().dtype)
            for name, f in spec.fields().items()
        }

    def rollout(
        self, rows: TensorDict, *, attempt: int, should_stop: Callable[[], bool]
    ) -> list[Episode] | None:
        """Fill each row of ``rows`` (``[num_envs, T]``) with one expert episode."""
        expected = (self.spec.num_envs, self.spec.max_episode_steps)
        if tuple(rows.batch_size[:2]) != expected:
            raise ValueError(f"rows must have batch size {list(expected)}, got {rows.batch_size}")
        targets = {name: rows.get(tuple(name.split("/"))) for name in self._buffers}
        episodes = []
        for row in range(self.spec.num_envs):
            seed = episode_seed(self.seed, self.worker_index, self.episodes_started)
            self.episodes_started += 1
            record = record_episode(
                self.env, self.expert, seed, should_stop=should_stop, buffers=self._buffers
            )
            if record is None:
                return None
            length = record.episode.length
            for name, target in targets.items():
                target[row, :length].copy_(torch.from_numpy(record.frames[name]))
            episodes.append(record.episode)
        return episodes

    def close(self) -> None:
        """Release the renderer."""
        self.env.close()
