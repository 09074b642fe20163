"""Pick up one coloured cube and place it in the bin."""

from __future__ import annotations

import numpy as np

from .base import CUBE_HALF, Goal, ManipulationTask, SceneView
from .registry import register_task

__all__ = ["PickPlace"]


@register_task("pick_place", tags=("default",))
class PickPlace(ManipulationTask):
    """``"pick up the {colour} cube and place it in the bin"``; the colour is drawn per episode.

    Success: the cube's centre lies inside the bin's walls (1 cm margin) below the rim, the fingers are
    open and the cube moves slower than 5 cm/s.
    """

    def instruction(self, goal: Goal) -> str:
        return f"pick up the {goal.subject} cube and place it in the bin"

    def place_phrase(self, goal: Goal) -> str:
        return f"place the {goal.subject} cube in the bin"

    def release_point(self, scene: SceneView, goal: Goal) -> tuple[np.ndarray, float | None]:
        # Release 2.5 cm above the floor: low enough not to bounce out, high enough to miss the walls.
        point = scene.bin_center() + np.array([0.0, 0.0, CUBE_HALF + 0.025])
        return point, None

    def is_success(self, scene: SceneView, goal: Goal) -> bool:
        offset = scene.cube_pos(goal.subject) - scene.bin_center()
        inside = bool(np.all(np.abs(offset[:2]) < scene.bin_inner_half() - 0.01))
        below_rim = scene.cube_pos(goal.subject)[2] < scene.bin_rim_height()
        released = scene.finger_opening() > self.released_opening
        return inside and below_rim and released and scene.cube_speed(goal.subject) < 0.05
