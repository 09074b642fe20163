"""Error paths of the ``inspect`` and ``eval`` arguments, the behaviour-cloning configs and checkpoints, and
the task registry and environment: each names the field (or file) and the rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from simstream.bc import DemoConfig
from simstream.bc.camera_source import CameraSourceSpec
from simstream.bc.checkpoint import PolicyCheckpoint, load_checkpoint, save_checkpoint
from simstream.bc.evaluate import RolloutConfig
from simstream.bc.policy import ChunkPolicy, PolicyConfig
from simstream.bc.text import HashedTextEmbedding
from simstream.cli.eval import EvalArgs, write_video
from simstream.cli.inspect import InspectArgs
from tests.support.errors import assert_names_the_value

_INT64_MAX = 2**63 - 1


# ------------------------------------------------------------------------------------------ inspect
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"episodes": 0}, "InspectArgs.episodes must be an int "),
        ({"show": 0}, "InspectArgs.show must be an int "),
        ({"frames": 0}, "InspectArgs.frames must be an int "),
        ({"frames": 2.0}, "InspectArgs.frames must be an int "),
        ({"image_size": 15}, "InspectArgs.image_size must be an int in [16, 2048], got 15"),
        ({"seed": -1}, "InspectArgs.seed must be an int "),
        ({"camera": "side"}, "InspectArgs.camera must be one of ('front', 'wrist', 'top'), got 'side'"),
        ({"task": "nope"}, "task must be one of ["),
        ({"out": Path("strip.gif")}, "InspectArgs.out must be a .png or .jpg file, got 'strip.gif'"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_inspect_args_name_the_bad_field(kwargs, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default strip path is checked relative to the working directory
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        InspectArgs(**kwargs)
    assert_names_the_value(error, kwargs)


def test_inspect_out_that_is_a_folder_is_refused(tmp_path):
    folder = tmp_path / "strip.png"
    folder.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"InspectArgs.out must be a file, got {str(folder)!r}")):
        InspectArgs(out=folder)


# --------------------------------------------------------------------------------------------- eval
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"episodes": 0}, "EvalArgs.episodes must be an int "),
        ({"video_episodes": 0}, "EvalArgs.video_episodes must be an int "),
        ({"fps": 0}, "EvalArgs.fps must be an int "),
        ({"num_threads": 0}, "EvalArgs.num_threads must be an int "),  # its upper bound may change
        ({"episodes": True}, "EvalArgs.episodes must be an int "),
        ({"image_size": 8}, "EvalArgs.image_size must be an int in [16, 2048], got 8"),
        ({"execute_steps": 1.5}, "EvalArgs.execute_steps must be an int "),
        ({"seed_offset": -1}, "EvalArgs.seed_offset must be an int "),
        ({"seed_offset": 0.5}, "EvalArgs.seed_offset must be an int "),
        ({"ensemble_decay": float("inf")}, "EvalArgs.ensemble_decay must be None or a finite number >= 0"),
        ({"gripper_threshold": 0}, "EvalArgs.gripper_threshold must be None or a number in (0, 1), got 0"),
        ({"video": Path("v.avi")}, "EvalArgs.video must end in .gif or .mp4, got 'v.avi'"),
        ({"video": Path("v")}, "EvalArgs.video must end in .gif or .mp4, got 'v'"),
        ({"video": Path("v.mp4"), "image_size": 17}, "EvalArgs.image_size must be even for an .mp4 video"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_eval_args_name_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        EvalArgs(checkpoint=Path("checkpoint.pt"), **kwargs)
    assert_names_the_value(error, kwargs)


@pytest.mark.parametrize("name", ["video", "json_out"])
def test_eval_output_that_is_a_folder_is_refused(name, tmp_path):
    folder = tmp_path / ("v.gif" if name == "video" else "r.json")
    folder.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"EvalArgs.{name} must be a file, got {str(folder)!r}")):
        EvalArgs(checkpoint=Path("checkpoint.pt"), **{name: folder})


def test_an_mp4_the_writer_cannot_encode_says_what_to_install(tmp_path, monkeypatch):
    import imageio.v3 as iio
    import numpy as np

    def no_encoder(*args, **kwargs):
        raise OSError("no backend can write .mp4")

    monkeypatch.setattr(iio, "imwrite", no_encoder)
    path = tmp_path / "v.mp4"
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            f"cannot write {str(path)!r}: no backend can write .mp4. MP4 needs `pip install imageio-ffmpeg`"
        ),
    ):
        write_video(path, [[np.zeros((16, 16, 3), np.uint8)]], fps=20)


# ------------------------------------------------------------------------------------- DemoConfig
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        *[
            ({name: 0}, f"DemoConfig.{name} must be an int >= 1, got 0")
            for name in ("buffer_size", "num_workers", "batch_size", "eval_every")
        ],
        ({"num_threads": 0}, "DemoConfig.num_threads must be an int "),  # its upper bound may change
        ({"eval_episodes": 0}, "DemoConfig.eval_episodes must be an int "),
        ({"batch_size": 8.0}, "DemoConfig.batch_size must be an int "),
        ({"max_episode_steps": 99}, "DemoConfig.max_episode_steps must be an int "),
        ({"history": 0}, "DemoConfig.history must be an int in [1, 200], got 0"),
        ({"horizon": 201}, "DemoConfig.horizon must be an int in [1, 200], got 201"),
        (
            {"max_episode_steps": 100, "horizon": 101},
            "DemoConfig.horizon must be an int in [1, 100], got 101",
        ),
        ({"refill_threshold": -1}, "DemoConfig.refill_threshold must be an int "),
        ({"eval_episodes_during": -1}, "DemoConfig.eval_episodes_during must be an int "),
        ({"seed": -1}, f"DemoConfig.seed must be an int in [0, {_INT64_MAX}], got -1"),
        ({"lr": 0}, "DemoConfig.lr must be a finite number > 0, got 0"),
        ({"time_limit_s": 0}, "DemoConfig.time_limit_s must be a finite number > 0, got 0"),
        ({"action_noise": -0.1}, "DemoConfig.action_noise must be a number in [0, 0.5], got -0.1"),
        ({"object_aux_weight": 101}, "DemoConfig.object_aux_weight must be a number in [0, 100], got 101"),
        ({"device": 0}, "DemoConfig.device must be 'cpu', 'cuda' or 'cuda:N', got 0"),
        ({"device": "cuda:x"}, "DemoConfig.device must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
        ({"cameras": "front"}, "DemoConfig.cameras must be one or more distinct cameras of"),
        ({"name": ""}, "DemoConfig.name must be a folder name"),
        ({"name": ".."}, "DemoConfig.name must be a folder name"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_demo_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        DemoConfig(**kwargs)
    assert_names_the_value(error, kwargs)


def test_demo_config_refuses_a_record_path_that_is_a_file_or_the_replayed_dataset(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a dataset")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"DemoConfig.record must be a dataset folder (new or to append to), got the file {str(afile)!r}"
        ),
    ):
        DemoConfig(record=afile)
    dataset = tmp_path / "ds"
    with pytest.raises(
        ValueError,
        match=re.escape(f"DemoConfig.record must not be the dataset the demo replays ({str(dataset)!r})"),
    ):
        DemoConfig(dataset=dataset, record=tmp_path / "." / "ds")


# ------------------------------------------------------------------------------------------ camera spec
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_envs": 0}, "CameraSourceSpec.num_envs must be an int "),
        ({"num_envs": 2.0}, "CameraSourceSpec.num_envs must be an int "),
        ({"image_size": 513}, "CameraSourceSpec.image_size must be an int in [16, 512], got 513"),
        ({"max_episode_steps": True}, "CameraSourceSpec.max_episode_steps must be an int "),
        ({"action_noise": "0.1"}, "CameraSourceSpec.action_noise must be a number in [0, 0.5], got '0.1'"),
        ({"cameras": ["front"]}, "CameraSourceSpec.cameras must be a nonempty tuple of distinct cameras"),
        ({"cameras": ()}, "CameraSourceSpec.cameras must be a nonempty tuple of distinct cameras"),
        ({"cameras": ("wrist", "wrist")}, "CameraSourceSpec.cameras must be a nonempty tuple of distinct"),
        ({"task": "nope"}, "task must be one of ["),
    ],
    ids=lambda v: str(v)[:40],
)
def test_camera_source_spec_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        CameraSourceSpec(**kwargs)
    assert_names_the_value(error, kwargs)


# ----------------------------------------------------------------------------------- bc checkpoints
def _checkpoint(info=None) -> PolicyCheckpoint:
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    return PolicyCheckpoint(policy, HashedTextEmbedding(8), "pick_place", RolloutConfig(), info or {})


def test_load_checkpoint_of_a_folder_asks_for_the_file_in_it(tmp_path):
    with pytest.raises(
        FileNotFoundError,
        match=re.escape(f"checkpoint {str(tmp_path)!r} is a folder; give the file in it (checkpoint.pt)"),
    ):
        load_checkpoint(tmp_path)


def test_load_checkpoint_of_a_missing_file(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match=re.escape(f"checkpoint {str(path)!r} does not exist")):
        load_checkpoint(path)


def test_load_checkpoint_says_why_a_file_cannot_be_read(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "c.pt", _checkpoint())

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(ValueError, match=re.escape(f"{str(path)!r} cannot be read: Permission denied")):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "payload",
    [{"format": "something-else"}, [1, 2, 3], {"weights": torch.zeros(2)}],
    ids=["other-format", "list", "no-format"],
)
def test_load_checkpoint_refuses_another_format(tmp_path, payload):
    path = tmp_path / "other.pt"
    torch.save(payload, path)
    with pytest.raises(
        ValueError,
        match=re.escape(f"{str(path)!r} is not a simstream policy checkpoint (expected format "),
    ):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("info", "fragment"),
    [
        ({(1, 2): "pair"}, "PolicyCheckpoint.info has a key (1, 2); dict keys must be strings or numbers"),
        ({None: 1}, "PolicyCheckpoint.info has a key None; dict keys must be strings or numbers"),
        ({b"raw": 1}, "PolicyCheckpoint.info has a key b'raw'; dict keys must be strings or numbers"),
        (
            {"outer": {(3,): 1}},
            "PolicyCheckpoint.info['outer'] has a key (3,); dict keys must be strings or numbers",
        ),
    ],
    ids=["tuple", "None", "bytes", "nested"],
)
def test_save_checkpoint_refuses_keys_a_checkpoint_cannot_hold(tmp_path, info, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        save_checkpoint(tmp_path / "k.pt", _checkpoint(info))
    assert not (tmp_path / "k.pt").exists()


# ---------------------------------------------------------------------------- task registry and env
def test_register_task_refuses_a_name_that_is_not_a_string():
    from simstream.tasks import register_task

    for name in (None, 3, b"task"):
        with pytest.raises(
            ValueError, match=re.escape(f"register_task name must be a non-empty str, got {name!r}")
        ):
            register_task(name)


@pytest.mark.parametrize(
    "call",
    ["task_tags", "task_instructions", "episode_instruction", "make_env"],
)
def test_task_helpers_name_the_registered_tasks_for_an_unknown_one(call):
    import simstream.tasks as tasks

    args = ("nope", 0) if call == "episode_instruction" else ("nope",)
    with pytest.raises(ValueError, match=r"task must be one of \[.*'pick_place'.*\], got 'nope'"):
        getattr(tasks, call)(*args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_episode_steps": 0}, "max_episode_steps must be an int >= 1, got 0"),
        ({"max_episode_steps": 2.0}, "max_episode_steps must be an int >= 1, got 2.0"),
        ({"max_episode_steps": True}, "max_episode_steps must be an int >= 1, got True"),
        ({"camera": "back"}, "camera must be one of ('front', 'wrist', 'top'), got 'back'"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_task_env_names_the_bad_argument(kwargs, message):
    from simstream.tasks import TaskEnv

    with pytest.raises(ValueError, match=re.escape(message)):
        TaskEnv("pick_place", **kwargs)


def test_task_env_before_reset_asks_for_reset(tmp_path, monkeypatch):
    from simstream.tasks import TaskEnv

    monkeypatch.chdir(tmp_path)  # MuJoCo writes MUJOCO_LOG.TXT into the working directory
    env = TaskEnv("pick_place", max_episode_steps=5)
    try:
        with pytest.raises(RuntimeError, match=re.escape("call reset() before using the environment")):
            env.instruction  # noqa: B018
        with pytest.raises(RuntimeError, match=re.escape("call reset() before using the environment")):
            env.subtask_instruction("reach")
    finally:
        env.close()
