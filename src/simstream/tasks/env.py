"""A gym-like environment around one registered task, for closed-loop evaluation of learned policies."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import ACTION_DIM, CAMERAS, Goal, ManipulationTask, Phase, normalize_image_size
from .registry import get_task
from .scene import HOME_QPOS, TabletopScene

__all__ = ["TaskEnv", "make_env"]


class TaskEnv:
    """One simulated table-top scene running one task, stepped at 20 Hz.

    ``reset(seed)`` returns the first observation, ``step(action)`` returns ``(obs, reward, terminated,
    truncated, info)``. Observations are dicts of fresh numpy arrays: ``"state"`` float32 [23],
    ``"objects"`` float32 [21] and, with ``image_size``, ``"image"`` uint8 [3, H, W]. The action is float32
    [8]: 7 absolute joint targets (rad, clipped to the limits) and the gripper in [0, 1] (1 = open).
    The reward is 1.0 on the step that reaches the goal, which also terminates the episode; the episode
    is truncated after ``max_episode_steps`` steps. Same seed, same actions => bit-identical episode.

    Examples:
        >>> env = TaskEnv("pick_place")  # doctest: +SKIP
        >>> obs = env.reset(seed=0); env.instruction  # doctest: +SKIP
        'pick up the blue cube and place it in the bin'
        >>> obs, reward, terminated, truncated, info = env.step(env.home_action())  # doctest: +SKIP
    """

    action_dim = ACTION_DIM

    def __init__(
        self,
        task: str | ManipulationTask,
        *,
        image_size: int | tuple[int, int] | None = None,
        camera: str = "front",
        max_episode_steps: int = 200,
    ) -> None:
        if camera not in CAMERAS:
            raise ValueError(f"camera must be one of {CAMERAS}, got {camera!r}")
        if type(max_episode_steps) is not int or max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be an int >= 1, got {max_episode_steps!r}")
        self.task = get_task(task)() if isinstance(task, str) else task
        self.image_size = normalize_image_size(image_size)
        self.camera = camera
        self.max_episode_steps = max_episode_steps
        self.scene = TabletopScene()
        self.action_low = np.append(self.scene.joint_low, 0.0).astype(np.float32)
        self.action_high = np.append(self.scene.joint_high, 1.0).astype(np.float32)
        self.goal: Goal | None = None
        self.elapsed_steps = 0

    @property
    def instruction(self) -> str:
        """The current episode's task text (after :meth:`reset`)."""
        return self.task.instruction(self._require_goal())

    def subtask_instruction(self, phase: Phase | str) -> str:
        """The current episode's text for one expert phase (``"reach"``, ``"grasp"``, ...)."""
        return self.task.subtask_instruction(self._require_goal(), Phase(phase))

    def reset(self, seed: int | None = None) -> dict[str, np.ndarray]:
        """Draw a goal and a randomized initial state from ``seed``; return the first observation."""
        rng = np.random.default_rng(seed)
        self.goal = self.task.sample_goal(rng)
        self.scene.reset(rng)
        self.elapsed_steps = 0
        return self.observation()

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        """Apply ``action`` for one control step (50 ms)."""
        goal = self._require_goal()
        if self.elapsed_steps >= self.max_episode_steps:
            raise RuntimeError("the episode is over (truncated); call reset() before step()")
        self.scene.apply(action)
        self.elapsed_steps += 1
        success = self.task.is_success(self.scene, goal)
        truncated = not success and self.elapsed_steps >= self.max_episode_steps
        return self.observation(), float(success), success, truncated, {"success": success}

    def observation(self) -> dict[str, np.ndarray]:
        """The current observation (fresh arrays)."""
        obs = {"state": self.scene.state(), "objects": self.scene.objects()}
        if self.image_size is not None:
            obs["image"] = self.scene.render(self.camera, self.image_size)
        return obs

    def home_action(self) -> np.ndarray:
        """The action that holds the home posture with the gripper open."""
        return np.append(HOME_QPOS, 1.0).astype(np.float32)

    def close(self) -> None:
        """Release the renderer; call it in the process that rendered."""
        self.scene.close()

    def _require_goal(self) -> Goal:
        if self.goal is None:
            raise RuntimeError("call reset() before using the environment")
        return self.goal


def make_env(
    name: str,
    *,
    image_size: int | tuple[int, int] | None = None,
    camera: str = "front",
    max_episode_steps: int = 200,
) -> TaskEnv:
    """A :class:`TaskEnv` for the registered task ``name`` (see :func:`simstream.tasks.list_tasks`)."""
    return TaskEnv(name, image_size=image_size, camera=camera, max_episode_steps=max_episode_steps)
