"""A name -> task-class registry filled by the ``@register_task`` decorator.

Task modules are pure Python (numpy only), so registering and listing tasks never imports a simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .base import ManipulationTask

__all__ = [
    "episode_instruction",
    "get_task",
    "list_tasks",
    "register_task",
    "task_instructions",
    "task_tags",
]

_T = TypeVar("_T", bound=type)
_TASKS: dict[str, type[ManipulationTask]] = {}
_TAGS: dict[str, tuple[str, ...]] = {}


def register_task(name: str, *, tags: tuple[str, ...] = ()) -> Callable[[_T], _T]:
    """Class decorator that registers a task under ``name``.

    Args:
        name: The public task name (``make_source(name)``); must be unique.
        tags: Free-form labels, e.g. ``("benchmark",)``.

    Raises:
        ValueError: if ``name`` is empty or already registered to another class.

    Examples:
        >>> @register_task("my_task")  # doctest: +SKIP
        ... class MyTask(ManipulationTask): ...
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_task name must be a non-empty str, got {name!r}")

    def decorator(cls: _T) -> _T:
        existing = _TASKS.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"task {name!r} is already registered to {existing.__qualname__}")
        cls.name = name
        _TASKS[name] = cls
        _TAGS[name] = tuple(tags)
        return cls

    return decorator


def list_tasks() -> list[str]:
    """Names of all registered tasks, sorted."""
    return sorted(_TASKS)


def task_tags(name: str) -> tuple[str, ...]:
    """Tags a task was registered with."""
    get_task(name)
    return _TAGS[name]


def get_task(name: str) -> type[ManipulationTask]:
    """The task class registered under ``name``.

    Raises:
        ValueError: naming the registered tasks when ``name`` is unknown.
    """
    try:
        return _TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"task must be one of {list_tasks()}, got {name!r}") from None


def task_instructions(name: str, *, subtasks: bool = False) -> tuple[str, ...]:
    """Every task text the task ``name`` can produce, and with ``subtasks`` every phase text too.

    Useful to fill a language registry before any episode exists.
    """
    from .base import Phase

    task = get_task(name)()
    texts = list(task.instructions())
    if subtasks:
        texts += [task.subtask_instruction(goal, phase) for goal in task.goals() for phase in Phase]
    return tuple(dict.fromkeys(texts))


def episode_instruction(name: str, seed: int) -> str:
    """The task text of the episode that ``reset(seed)`` of task ``name`` starts (no simulation)."""
    import numpy as np

    task = get_task(name)()
    # TaskEnv.reset draws the goal first from default_rng(seed), before the scene.
    return task.instruction(task.sample_goal(np.random.default_rng(seed)))
