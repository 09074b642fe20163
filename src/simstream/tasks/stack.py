"""Stack one coloured cube on another."""

from __future__ import annotations

import numpy as np

from .base import COLOURS, CUBE_HALF, Goal, ManipulationTask, SceneView
from .registry import register_task

__all__ = ["Stack"]


@register_task("stack")
class Stack(ManipulationTask):
    """``"stack the {a} cube on the {b} cube"``; the ordered pair ``a != b`` is drawn per episode.

    Success: cube ``a`` rests on ``b`` (centres within 2 cm horizontally, ``a`` one edge higher within
    1 cm), ``b`` still on the table, the fingers open, and both cubes slower than 5 cm/s.
    """

    def sample_goal(self, rng: np.random.Generator) -> Goal:
        subject, target = rng.choice(len(COLOURS), size=2, replace=False)
        return Goal(subject=COLOURS[int(subject)], target=COLOURS[int(target)])

    def goals(self) -> tuple[Goal, ...]:
        return tuple(Goal(a, b) for a in COLOURS for b in COLOURS if a != b)

    def instruction(self, goal: Goal) -> str:
        return f"stack the {goal.subject} cube on the {goal.target} cube"

    def place_phrase(self, goal: Goal) -> str:
        return f"place the {goal.subject} cube on the {goal.target} cube"

    def release_point(self, scene: SceneView, goal: Goal) -> tuple[np.ndarray, float | None]:
        # Open 4 mm above contact: the cube drops onto the other instead of being pressed into it.
        point = scene.cube_pos(goal.target) + np.array([0.0, 0.0, 2 * CUBE_HALF + 0.004])
        return point, scene.cube_yaw(goal.target)

    def is_success(self, scene: SceneView, goal: Goal) -> bool:
        top, bottom = scene.cube_pos(goal.subject), scene.cube_pos(goal.target)
        aligned = float(np.linalg.norm(top[:2] - bottom[:2])) < 0.02
        on_top = abs(top[2] - bottom[2] - 2 * CUBE_HALF) < 0.01
        grounded = bottom[2] < CUBE_HALF + 0.005
        released = scene.finger_opening() > self.released_opening
        still = max(scene.cube_speed(goal.subject), scene.cube_speed(goal.target)) < 0.05
        return aligned and on_top and grounded and released and still
