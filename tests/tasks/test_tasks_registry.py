"""Registry, specs and language of the built-in tasks: everything that must work without MuJoCo."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

import simstream.tasks as tasks
from simstream.tasks import registry
from simstream.tasks.base import ManipulationTask


def test_builtin_tasks_are_registered():
    assert {"pick_place", "stack"} <= set(tasks.list_tasks())
    assert tasks.get_task("stack").name == "stack"
    assert "default" in tasks.task_tags("pick_place")


def test_unknown_task_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"task must be one of \[.*'pick_place'.*got 'nope'"):
        tasks.get_task("nope")
    with pytest.raises(ValueError, match="got 'nope'"):
        tasks.make_source("nope")


def test_register_task_decorator_and_duplicates():
    @tasks.register_task("_test_only", tags=("test",))
    class Dummy(ManipulationTask):
        pass

    try:
        assert tasks.get_task("_test_only") is Dummy and Dummy.name == "_test_only"
        with pytest.raises(ValueError, match="already registered"):
            tasks.register_task("_test_only")(type("Other", (ManipulationTask,), {}))
    finally:
        registry._TASKS.pop("_test_only")
        registry._TAGS.pop("_test_only")
    with pytest.raises(ValueError, match="non-empty str"):
        tasks.register_task("")


def test_import_does_not_load_mujoco():
    code = (
        "import sys, pickle, simstream, simstream.tasks as t\n"
        "spec = t.make_source('pick_place', num_envs=2, image_size=32)\n"
        "spec.fields(); pickle.dumps(spec); t.list_tasks(); t.task_instructions('stack', subtasks=True)\n"
        "t.episode_instruction('stack', 3)\n"
        "assert 'mujoco' not in sys.modules, 'mujoco was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["pick_place", "stack"])
def test_spec_is_picklable_and_declares_fields(name):
    spec = tasks.make_source(name, num_envs=3, image_size=48, camera="wrist", max_episode_steps=150)
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec and clone.image_size == (48, 48)
    assert (spec.num_envs, spec.max_episode_steps) == (3, 150)
    fields = spec.fields()
    assert fields["obs/state"].shape == (tasks.STATE_DIM,)
    assert fields["obs/objects"].shape == (tasks.OBJECTS_DIM,)
    assert fields["obs/image"].shape == (3, 48, 48) and fields["obs/image"].dtype == torch.uint8
    assert fields["actions"].shape == (tasks.ACTION_DIM,) and fields["rewards"].shape == ()
    assert spec.action_semantics == "expert_controller_command"
    assert "obs/image" not in tasks.make_source(name).fields()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_envs": 0}, r"num_envs must be an int >= 1, got 0"),
        ({"num_envs": 1.5}, r"num_envs must be an int >= 1"),
        ({"max_episode_steps": 0}, r"max_episode_steps must be an int >= 1, got 0"),
        ({"camera": "side"}, r"camera must be one of \('front', 'wrist', 'top'\), got 'side'"),
        ({"image_size": 4}, r"image_size must be None, an int or \(H, W\) in \[8, 2048\]"),
        ({"image_size": (32,)}, r"image_size must be None"),
        ({"image_size": (32, 4096)}, r"image_size must be None"),
        ({"image_size": 64.0}, r"image_size must be None, an int or \(H, W\) in \[8, 2048\], got 64\.0"),
        ({"image_size": "64"}, r"image_size must be None"),
        ({"image_size": True}, r"image_size must be None"),
    ],
)
def test_make_source_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tasks.make_source("pick_place", **kwargs)


def test_instructions_cover_every_colour():
    pick = tasks.task_instructions("pick_place")
    assert pick == tuple(f"pick up the {c} cube and place it in the bin" for c in tasks.COLOURS)
    stack = tasks.task_instructions("stack")
    assert len(stack) == 6 and "stack the red cube on the blue cube" in stack
    subtasks = tasks.task_instructions("pick_place", subtasks=True)
    assert "grasp the green cube" in subtasks and "place the blue cube in the bin" in subtasks
    seen = {tasks.episode_instruction("stack", seed) for seed in range(40)}
    assert seen == set(stack)


def test_image_size_accepts_numpy_integers():
    import numpy as np

    spec = tasks.make_source("pick_place", image_size=np.int64(32))
    assert spec.image_size == (32, 32) and type(spec.image_size[0]) is int
    assert tasks.make_source("pick_place", image_size=(np.int32(16), 24)).image_size == (16, 24)


@pytest.mark.parametrize("backend", ["nonexistent", "osmesa"])
def test_a_mujoco_that_cannot_load_its_gl_backend_is_named_in_the_error(backend):
    """mujoco's GL setup raises an AttributeError when osmesa's library is missing; escaping the lazy
    import, it read as "cannot import name 'ScriptedExpert'", hiding the cause and the fix."""
    import ctypes.util
    import os

    if backend == "osmesa" and ctypes.util.find_library("OSMesa"):
        pytest.skip("OSMesa is installed here: mujoco loads with it")
    code = "from simstream.tasks import ScriptedExpert"
    # mujoco picks PyOpenGL's platform from MUJOCO_GL unless PYOPENGL_PLATFORM is set (a test or a renderer
    # of this process may have set it)
    env = {**{k: v for k, v in os.environ.items() if k != "PYOPENGL_PLATFORM"}, "MUJOCO_GL": backend}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"ImportError: simstream.tasks.ScriptedExpert needs MuJoCo, whose import failed with MUJOCO_GL="
        f"{backend!r}: "
    ), last
    assert "set MUJOCO_GL=osmesa (apt libosmesa6)" in last


def test_a_missing_mujoco_is_named_as_missing_not_as_a_gl_problem():
    code = "import sys; sys.modules['mujoco'] = None; from simstream.tasks import TaskEnv"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last
        == "ImportError: simstream.tasks.TaskEnv needs MuJoCo, which is not installed: pip install mujoco"
    )
