"""The vision demo's episode source: a built-in task's expert episodes, several cameras rendered per frame.

``TaskSourceSpec`` renders one camera into ``obs/image``; a visuomotor policy wants two views (the scene from
the front and the gripper from the wrist), so this source writes one ``uint8 [3, S, S]`` field per camera,
``obs/images/<camera>`` (LeRobot's ``observation.images.<camera>``), next to the usual low-dimensional fields.
``obs/objects`` (the cube poses) stays in the buffer for diagnostics; the vision policy never reads it
(:func:`simstream.bc.vision.policy_keys`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from .._validation import require, require_int, require_number
from ..sources import Episode, Field
from .policy import NUM_JOINTS

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["CameraEpisodeSource", "CameraSourceSpec", "image_key", "measure_bare_rate"]


def image_key(camera: str) -> str:
    """The buffer field of ``camera``'s frames: ``obs/images/<camera>``."""
    return f"obs/images/{camera}"


@dataclass(frozen=True)
class CameraSourceSpec:
    """A ``SourceSpec``: expert episodes of ``task`` with ``cameras`` rendered at ``image_size`` every frame.

    Cheap and picklable; MuJoCo starts in :meth:`build`, inside the producer. Payload fields: ``obs/state``
    float32 [23], ``obs/objects`` float32 [21], ``actions`` float32 [8], ``rewards`` float32 and one
    ``obs/images/<camera>`` uint8 [3, image_size, image_size] per camera.

    ``action_noise > 0`` perturbs the robot as in DART (Laskey et al., 2017): the env executes the expert's
    joint targets plus Gaussian noise of that standard deviation (radians, drawn afresh each step from the
    episode's seed), while ``actions`` records the expert's own command. The stream then shows the expert
    correcting perturbed states and, now and then, retrying a missed grasp: situations a policy meets
    when its own small errors add up, which an unperturbed expert never shows it.
    """

    task: str = "pick_place"
    cameras: tuple[str, ...] = ("front", "wrist")
    image_size: int = 64
    num_envs: int = 1
    max_episode_steps: int = 200
    action_noise: float = 0.0

    fps: ClassVar[int] = 20
    action_semantics: ClassVar[str] = "expert_controller_command"

    def __post_init__(self) -> None:
        from simstream.tasks import CAMERAS, get_task

        get_task(self.task)
        require(
            isinstance(self.cameras, tuple) and bool(self.cameras) and set(self.cameras) <= set(CAMERAS)
            and len(set(self.cameras)) == len(self.cameras),
            "CameraSourceSpec", "cameras", f"a nonempty tuple of distinct cameras from {CAMERAS}",
            self.cameras,
        )  # fmt: skip
        require_int("CameraSourceSpec", "image_size", self.image_size, 16, 512)
        require_int("CameraSourceSpec", "num_envs", self.num_envs, 1)
        require_int("CameraSourceSpec", "max_episode_steps", self.max_episode_steps, 1)
        require_number("CameraSourceSpec", "action_noise", self.action_noise, 0, 0.5)

    def fields(self) -> dict[str, Field]:
        """Payload names and per-frame layouts."""
        from simstream.tasks.spec import low_dim_fields

        fields = low_dim_fields()
        for camera in self.cameras:
            fields[image_key(camera)] = Field((3, self.image_size, self.image_size), torch.uint8)
        return fields

    def build(self, worker_index: int, seed: int) -> CameraEpisodeSource:
        """The worker-local source (imports MuJoCo); runs in the producer."""
        return CameraEpisodeSource(self, worker_index=worker_index, seed=seed)


class CameraEpisodeSource:
    """Owns one ``TaskEnv`` (one renderer, reused for every camera), the scripted expert and a seed counter.

    Seeds follow ``TaskEpisodeSource``: episode ``k`` of worker ``w`` resets with
    ``episode_seed(seed, w, k)``.
    """

    def __init__(self, spec: CameraSourceSpec, *, worker_index: int, seed: int) -> None:
        from simstream.tasks import ScriptedExpert, TaskEnv

        self.spec, self.worker_index, self.seed = spec, worker_index, seed
        self.episodes_started = 0
        self.env = TaskEnv(spec.task, max_episode_steps=spec.max_episode_steps)
        self.expert = ScriptedExpert(self.env)
        self._size = (spec.image_size, spec.image_size)
        horizon = spec.max_episode_steps
        self._buffers = {
            name: np.empty((horizon, *f.shape), torch.empty((), dtype=f.dtype).numpy().dtype)
            for name, f in spec.fields().items()
        }

    def record(self, seed: int, should_stop: Callable[[], bool] | None = None) -> Episode | None:
        """Run one expert episode into the reused frame buffers; ``None`` once ``should_stop()``."""
        from simstream.tasks.source import _segments

        env, buffers, cameras = self.env, self._buffers, self.spec.cameras
        obs = env.reset(seed)
        self.expert.reset()
        phases, success = [], False
        noise = self.spec.action_noise
        rng = np.random.default_rng(seed) if noise > 0 else None
        for t in range(env.max_episode_steps):
            if should_stop is not None and should_stop():
                return None
            action = self.expert.act()
            buffers["obs/state"][t], buffers["obs/objects"][t] = obs["state"], obs["objects"]
            for camera in cameras:
                buffers[image_key(camera)][t] = env.scene.render(camera, self._size)
            buffers["actions"][t] = action
            phases.append(self.expert.acting_phase)
            if rng is not None:  # executed, not recorded: the stream keeps the expert's own command
                action = action.copy()
                action[:NUM_JOINTS] += rng.normal(0.0, noise, NUM_JOINTS).astype(np.float32)
            obs, reward, success, truncated, _ = env.step(action)
            buffers["rewards"][t] = reward
            if success or truncated:
                break
        return Episode(
            length=len(phases), success=success, instruction=env.instruction,
            segments=_segments(env, phases), terminated=success, truncated=not success,
        )  # fmt: skip

    def rollout(
        self, rows: TensorDict, *, attempt: int, should_stop: Callable[[], bool]
    ) -> list[Episode] | None:
        """Fill each row of ``rows`` (``[num_envs, T]``) with one expert episode."""
        from simstream.tasks.source import episode_seed

        targets = {name: rows.get(tuple(name.split("/"))) for name in self._buffers}
        episodes = []
        for row in range(self.spec.num_envs):
            seed = episode_seed(self.seed, self.worker_index, self.episodes_started)
            self.episodes_started += 1
            episode = self.record(seed, should_stop)
            if episode is None:
                return None
            for name, target in targets.items():
                target[row, : episode.length].copy_(torch.from_numpy(self._buffers[name][: episode.length]))
            episodes.append(episode)
        return episodes

    def close(self) -> None:
        """Release the renderer."""
        self.env.close()


def measure_bare_rate(spec: CameraSourceSpec, episodes: int = 2, seed: int = 0) -> dict[str, float]:
    """The source alone, in this process: rendered expert episodes per second and rendering's share.

    The reference for the stream's rate: ``num_workers`` producers can at best publish ``num_workers`` times
    this many episodes per second (fewer when the trainer shares their cores).
    """
    source = spec.build(worker_index=2**20, seed=seed)  # a worker index no producer uses
    try:
        source.record(0)  # warm-up: creates the GL context
        began, frames = time.perf_counter(), 0
        for k in range(episodes):
            frames += source.record(k + 1).length  # type: ignore[union-attr]
        elapsed = time.perf_counter() - began
        render_began = time.perf_counter()
        for _ in range(20):  # one frame = every camera once
            for camera in spec.cameras:
                source.env.scene.render(camera, source._size)
        render_s_per_frame = (time.perf_counter() - render_began) / 20
    finally:
        source.close()
    return {
        "episodes_per_s": episodes / elapsed,
        "frames_per_s": frames / elapsed,
        "render_ms_per_frame": 1000 * render_s_per_frame,
        "render_share": min(1.0, render_s_per_frame * frames / elapsed),
    }
