"""Simulator-free parts of a table-top task: goals, language, the expert's phases and success rules.

A task never imports MuJoCo. It reads the physics through the small :class:`SceneView` protocol that
:class:`simstream.tasks.scene.TabletopScene` implements, so the registry can be listed in processes that
never simulate (the owner, ``DataLoader`` workers).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Protocol

import numpy as np

__all__ = [
    "ACTION_DIM",
    "CAMERAS",
    "COLOURS",
    "CUBE_HALF",
    "OBJECTS_DIM",
    "STATE_DIM",
    "Goal",
    "ManipulationTask",
    "Phase",
    "SceneView",
    "normalize_image_size",
    "quarter_turn",
]

COLOURS: tuple[str, ...] = ("red", "green", "blue")
"""Cube colours, also the order of the cubes in ``obs/objects``."""
CAMERAS: tuple[str, ...] = ("front", "wrist", "top")
"""Cameras of the scene that can render ``obs/image``."""
GL_BACKEND_FIX = (
    "Use EGL (libegl1 + Mesa) or set MUJOCO_GL=osmesa (apt libosmesa6) before mujoco is first imported"
)
"""What to do when MuJoCo's rendering backend cannot load (said where its import and its renderer fail)."""
CUBE_HALF = 0.02
"""Half the edge of a cube (4 cm cubes), metres."""
STATE_DIM = 23
"""``obs/state``: 7 joint positions, 7 joint velocities, 2 finger openings, TCP position (3), TCP
quaternion (4, w-first)."""
OBJECTS_DIM = 7 * len(COLOURS)
"""``obs/objects``: per cube in :data:`COLOURS` order, position (3) and quaternion (4, w-first)."""
ACTION_DIM = 8
"""``actions``: 7 absolute joint position targets (rad) and the gripper command in [0, 1] (1 = open)."""


class Phase(Enum):
    """Phases of the scripted expert; each becomes one segment with its own instruction."""

    REACH = "reach"
    GRASP = "grasp"
    LIFT = "lift"
    PLACE = "place"


@dataclass(frozen=True)
class Goal:
    """What one episode asks for: move the ``subject`` cube (onto ``target`` when it is set)."""

    subject: str
    target: str | None = None


class SceneView(Protocol):
    """The physical quantities a task reads (implemented by ``TabletopScene``)."""

    def cube_pos(self, colour: str) -> np.ndarray: ...
    def cube_yaw(self, colour: str) -> float: ...
    def cube_speed(self, colour: str) -> float: ...
    def finger_opening(self) -> float: ...
    def bin_center(self) -> np.ndarray: ...
    def bin_inner_half(self) -> float: ...
    def bin_rim_height(self) -> float: ...


def normalize_image_size(image_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``None``, ``n`` or ``(H, W)`` as ``None`` or ``(H, W)``.

    Raises:
        ValueError: unless every side is an int in [8, 2048].
    """
    if image_size is None:
        return None
    error = ValueError(f"image_size must be None, an int or (H, W) in [8, 2048], got {image_size!r}")
    if isinstance(image_size, numbers.Integral):
        size: tuple = (image_size, image_size)
    elif isinstance(image_size, (tuple, list)):
        size = tuple(image_size)
    else:  # a float, a string, ...
        raise error
    if len(size) != 2 or not all(_integer(n) and 8 <= n <= 2048 for n in size):
        raise error
    return (int(size[0]), int(size[1]))


def _integer(value: object) -> bool:
    """An integer of any integral type (NumPy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def quarter_turn(angle: float) -> float:
    """``angle`` wrapped into ``[-pi/4, pi/4)``: a cube looks the same every quarter turn."""
    return (angle + math.pi / 4) % (math.pi / 2) - math.pi / 4


class ManipulationTask:
    """A pick-and-place style task: which cube goes where, how it is phrased, and when it succeeded.

    Owns no state; every method is a pure function of its arguments. Subclasses set the language and
    :meth:`release_point` / :meth:`is_success`; the expert's reach / grasp / lift phases are shared.
    """

    name: ClassVar[str] = ""
    """Set by ``@register_task``."""
    released_opening: ClassVar[float] = 0.03
    """Finger opening (m, each finger) above which the cube counts as released (cube: 0.02)."""

    def sample_goal(self, rng: np.random.Generator) -> Goal:
        """Draw the episode's goal; uses ``rng`` only."""
        return Goal(subject=COLOURS[int(rng.integers(len(COLOURS)))])

    def instruction(self, goal: Goal) -> str:
        """The episode's task text."""
        raise NotImplementedError

    def place_phrase(self, goal: Goal) -> str:
        """The subtask text of the place phase."""
        raise NotImplementedError

    def subtask_instruction(self, goal: Goal, phase: Phase) -> str:
        """The text of one expert phase, e.g. ``"grasp the red cube"``."""
        if phase == Phase.PLACE:
            return self.place_phrase(goal)
        return f"{phase.value} the {goal.subject} cube"

    def goals(self) -> tuple[Goal, ...]:
        """Every goal :meth:`sample_goal` can return."""
        return tuple(Goal(subject=c) for c in COLOURS)

    def instructions(self) -> tuple[str, ...]:
        """Every task text this task can produce (for a language registry)."""
        return tuple(self.instruction(g) for g in self.goals())

    def release_point(self, scene: SceneView, goal: Goal) -> tuple[np.ndarray, float | None]:
        """Where the held cube's centre should be when the gripper opens, and the cube yaw wanted there
        (``None``: any)."""
        raise NotImplementedError

    def is_success(self, scene: SceneView, goal: Goal) -> bool:
        """Whether the goal holds now (the cube released and at rest where it belongs)."""
        raise NotImplementedError
