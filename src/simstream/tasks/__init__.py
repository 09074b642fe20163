"""Built-in MuJoCo table-top manipulation tasks with scripted experts, as episode sources.

Importing this package registers the tasks and never imports MuJoCo: ``make_source`` returns a cheap,
picklable spec and the simulator starts inside ``spec.build()`` in the producer worker. ``TaskEnv``,
``make_env``, ``ScriptedExpert`` and ``record_episode`` are loaded (with MuJoCo) on first access.

Examples:
    >>> from simstream.tasks import list_tasks, make_source
    >>> list_tasks()
    ['pick_place', 'stack']
    >>> spec = make_source("stack", num_envs=4)
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from . import pick_place, stack  # noqa: F401  (registers the built-in tasks)
from .base import (
    ACTION_DIM,
    CAMERAS,
    COLOURS,
    GL_BACKEND_FIX,
    OBJECTS_DIM,
    STATE_DIM,
    Goal,
    ManipulationTask,
    Phase,
)
from .registry import (
    episode_instruction,
    get_task,
    list_tasks,
    register_task,
    task_instructions,
    task_tags,
)
from .spec import TaskSourceSpec, make_source

__all__ = [
    "ACTION_DIM",
    "CAMERAS",
    "COLOURS",
    "OBJECTS_DIM",
    "STATE_DIM",
    "ExpertEpisode",
    "Goal",
    "ManipulationTask",
    "Phase",
    "ScriptedExpert",
    "TaskEnv",
    "TaskEpisodeSource",
    "TaskSourceSpec",
    "episode_instruction",
    "get_task",
    "list_tasks",
    "make_env",
    "make_source",
    "record_episode",
    "register_task",
    "task_instructions",
    "task_tags",
]

# Attributes whose modules import MuJoCo: loaded on first access only (PEP 562).
_LAZY = {
    "TaskEnv": "env",
    "make_env": "env",
    "ScriptedExpert": "expert",
    "ExpertEpisode": "source",
    "TaskEpisodeSource": "source",
    "record_episode": "source",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        try:
            module = import_module(f"{__name__}.{_LAZY[name]}")
        except Exception as error:
            # any exception but ImportError escaping here (mujoco's GL setup raises an AttributeError when
            # its backend cannot load) reads as "cannot import name" to `from simstream.tasks import ...`
            raise ImportError(_lazy_import_failure(name, error)) from error
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _lazy_import_failure(name: str, error: Exception) -> str:
    """What to say when the module of ``name`` failed to import: MuJoCo missing, its GL backend, or else."""
    if isinstance(error, ModuleNotFoundError) and error.name == "mujoco":
        return f"simstream.tasks.{name} needs MuJoCo, which is not installed: pip install mujoco"
    frames = traceback.extract_tb(error.__traceback__)
    if any(f"{os.sep}mujoco{os.sep}" in frame.filename for frame in frames):
        backend = os.environ.get("MUJOCO_GL")
        return (
            f"simstream.tasks.{name} needs MuJoCo, whose import failed with MUJOCO_GL={backend!r}: "
            f"{type(error).__name__}: {error}. {GL_BACKEND_FIX}"
        )
    return f"importing simstream.tasks.{name} failed: {type(error).__name__}: {error}"
