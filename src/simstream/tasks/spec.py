"""``make_source``: the picklable source description the engine's owner holds for a built-in task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..sources import Field
from .base import ACTION_DIM, CAMERAS, OBJECTS_DIM, STATE_DIM, normalize_image_size
from .registry import get_task

if TYPE_CHECKING:
    from .source import TaskEpisodeSource

__all__ = ["TaskSourceSpec", "low_dim_fields", "make_source"]


def low_dim_fields() -> dict[str, Field]:
    """The built-in tasks' low-dimensional payload: state, object poses, actions and rewards."""
    return {
        "obs/state": Field((STATE_DIM,)),
        "obs/objects": Field((OBJECTS_DIM,)),
        "actions": Field((ACTION_DIM,)),
        "rewards": Field(()),
    }


@dataclass(frozen=True)
class TaskSourceSpec:
    """A ``SourceSpec`` for a built-in MuJoCo task with its scripted expert.

    Cheap and picklable: it holds names and sizes only, and MuJoCo is imported by :meth:`build`, inside
    the producer worker. Payload fields: ``obs/state`` float32 [23], ``obs/objects`` float32 [21],
    ``obs/image`` uint8 [3, H, W] (with ``image_size``), ``actions`` float32 [8], ``rewards`` float32.
    """

    task: str = "pick_place"
    """Registered task name (``list_tasks()``)."""
    num_envs: int = 1
    """Episodes (buffer rows) per rollout."""
    max_episode_steps: int = 200
    """Row capacity T; episodes that have not succeeded by then are truncated (expert: 57-81 steps)."""
    image_size: tuple[int, int] | None = None
    """``(H, W)`` of ``obs/image``; ``None`` records no image (an int n means ``(n, n)``)."""
    camera: str = "front"
    """Camera that renders ``obs/image``: one of ``CAMERAS``."""

    fps: ClassVar[int] = 20
    """Control rate of the built-in tasks (a LeRobot recording's ``fps``)."""
    action_semantics: ClassVar[str] = "expert_controller_command"
    """Stored actions are the expert's joint-target commands."""

    def __post_init__(self) -> None:
        get_task(self.task)
        for name in ("num_envs", "max_episode_steps"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"TaskSourceSpec.{name} must be an int >= 1, got {value!r}")
        if self.camera not in CAMERAS:
            raise ValueError(f"TaskSourceSpec.camera must be one of {CAMERAS}, got {self.camera!r}")
        # Accept an int for convenience; store the canonical (H, W) so equal specs compare equal.
        object.__setattr__(self, "image_size", normalize_image_size(self.image_size))

    def fields(self) -> dict[str, Field]:
        """Payload names and per-frame layouts."""
        fields = low_dim_fields()
        if self.image_size is not None:
            fields["obs/image"] = Field((3, *self.image_size), torch.uint8)
        return fields

    def build(self, worker_index: int, seed: int) -> TaskEpisodeSource:
        """Create the worker-local source (imports MuJoCo); run it in the producer worker."""
        from .source import TaskEpisodeSource

        return TaskEpisodeSource(self, worker_index=worker_index, seed=seed)


def make_source(
    name: str,
    *,
    num_envs: int = 1,
    image_size: int | tuple[int, int] | None = None,
    camera: str = "front",
    max_episode_steps: int = 200,
) -> TaskSourceSpec:
    """The episode source of the built-in task ``name``: scripted-expert demonstrations with language.

    Args:
        name: A registered task (``list_tasks()``): ``"pick_place"`` or ``"stack"``.
        num_envs: Episodes per rollout (rows per window).
        image_size: ``None`` (state only), ``n`` or ``(H, W)`` to record ``obs/image``.
        camera: ``"front"``, ``"wrist"`` or ``"top"``.
        max_episode_steps: Row capacity T at 20 Hz.

    Raises:
        ValueError: naming the argument and its accepted range.

    Examples:
        >>> spec = make_source("pick_place", num_envs=2, image_size=64)
        >>> sorted(spec.fields())
        ['actions', 'obs/image', 'obs/objects', 'obs/state', 'rewards']
    """
    return TaskSourceSpec(
        task=name,
        num_envs=num_envs,
        max_episode_steps=max_episode_steps,
        image_size=image_size,  # type: ignore[arg-type]  # normalized in __post_init__
        camera=camera,
    )
