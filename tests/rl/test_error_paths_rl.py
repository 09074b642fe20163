"""Error paths of the async-RL config, runner and shared structures: each names the field and the rule."""

from __future__ import annotations

import multiprocessing as mp
import re

import pytest
import torch

from simstream.rl import APPOConfig, APPORunner, RolloutRing, RunnerConfig, WeightBuffer
from tests.rl.collectors import ToyRunner
from tests.rl.fault_env import env_id
from tests.support.errors import assert_names_the_value

pytestmark = pytest.mark.timeout(60)
CTX = mp.get_context("spawn")


def _tiny(**overrides) -> APPOConfig:
    base = dict(
        env_id=env_id("none"), num_envs=2, steps_per_rollout=16, minibatch_size=16, num_epochs=2,
        hidden_sizes=(16,), stats_window=2, mode="serial", runner=RunnerConfig(shutdown_timeout_s=10.0),
    )  # fmt: skip
    return APPOConfig(**{**base, **overrides})


# ------------------------------------------------------------------------------------- APPOConfig
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"env_id": ""}, "APPOConfig.env_id must be a gym id, got ''"),
        ({"env_id": None}, "APPOConfig.env_id must be a gym id, got None"),
        ({"steps_per_rollout": 0}, "APPOConfig.steps_per_rollout must be an int "),
        ({"num_epochs": 0}, "APPOConfig.num_epochs must be an int "),
        ({"minibatch_size": 0}, "APPOConfig.minibatch_size must be an int "),
        # accepted: one frame's normalised advantage is 0, so the policy never learned
        ({"minibatch_size": 1}, "APPOConfig.minibatch_size must be an int >= 2, got 1"),
        ({"target_update_interval": 0}, "APPOConfig.target_update_interval must be an int "),
        ({"learner_num_threads": -1}, "APPOConfig.learner_num_threads must be an int in [0, "),
        ({"stats_window": 0}, "APPOConfig.stats_window must be an int in [1, 1000000], got 0"),
        ({"seed": -1}, "APPOConfig.seed must be an int in [0, 9223372036854775807], got -1"),
        ({"num_slots": 2.0}, "APPOConfig.num_slots must be an int "),
        ({"max_policy_lag": 1.5}, "APPOConfig.max_policy_lag must be an int "),
        ({"hidden_sizes": (64, 0)}, "APPOConfig.hidden_sizes must be a non-empty tuple of ints >= 1"),
        ({"hidden_sizes": (64, True)}, "APPOConfig.hidden_sizes must be a non-empty tuple of ints >= 1"),
        ({"clip_ratio": 0}, "APPOConfig.clip_ratio must be a finite number > 0, got 0"),
        ({"max_grad_norm": -1.0}, "APPOConfig.max_grad_norm must be a finite number > 0, got -1.0"),
        ({"rho_bar": 0.0}, "APPOConfig.rho_bar must be a finite number > 0, got 0.0"),
        ({"c_bar": float("nan")}, "APPOConfig.c_bar must be a finite number > 0, got nan"),
        ({"reward_scale": 0}, "APPOConfig.reward_scale must be a finite number > 0, got 0"),
        ({"desired_kl": 0}, "APPOConfig.desired_kl must be None or a finite number > 0, got 0"),
        ({"gamma": -0.1}, "APPOConfig.gamma must be a number in [0, 1], got -0.1"),
        ({"gae_lambda": 1.5}, "APPOConfig.gae_lambda must be a number in [0, 1], got 1.5"),
        ({"value_coef": -1}, "APPOConfig.value_coef must be a finite number >= 0, got -1"),
        ({"init_log_std": -6}, "APPOConfig.init_log_std must be a number in [-5, 2], got -6"),
        ({"runner": None}, "APPOConfig.runner must be a RunnerConfig, got None"),
        ({"runner": {"hang_timeout_s": 1.0}}, "APPOConfig.runner must be a RunnerConfig, got {"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_appo_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        APPOConfig(**kwargs)
    assert_names_the_value(error, kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hang_timeout_s": True}, "RunnerConfig.hang_timeout_s must be a number in (0, 1e6], got True"),
        ({"poll_interval_s": 0}, "RunnerConfig.poll_interval_s must be a number in (0, 0.5], got 0"),
        (
            {"startup_timeout_s": "60"},
            "RunnerConfig.startup_timeout_s must be a number in (0, 1e6], got '60'",
        ),
    ],
    ids=lambda v: str(v)[:40],
)
def test_runner_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RunnerConfig(**kwargs)


# ------------------------------------------------------------------------------------------ runner
def test_starting_the_collector_twice_is_refused():
    with ToyRunner() as runner:
        runner.learn(1)
        pid = runner.collector_pid
        with pytest.raises(RuntimeError, match=re.escape("ToyRunner: the collector was already started")):
            runner._start_collector({"counter": runner.counter, "ticked": runner.ticked, "mode": "ok"})
        assert runner.collector_pid == pid  # the running collector is kept


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"save_interval": -1}, "APPORunner.learn.save_interval must be an int "),
        ({"save_interval": 1.5}, "APPORunner.learn.save_interval must be an int "),
        ({"save_interval": None}, "APPORunner.learn.save_interval must be an int "),
        ({"max_iterations": True}, "APPORunner.learn.max_iterations must be an int "),
        ({"max_env_frames": True}, "APPORunner.learn.max_env_frames must be None or a whole number >= 1"),
        ({"max_wall_s": 0}, "APPORunner.learn.max_wall_s must be None or a finite number > 0, got 0"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_learn_names_the_bad_argument_before_anything_starts(kwargs, message):
    runner = APPORunner(_tiny())
    try:
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            runner.learn(**{"max_iterations": 1, "log_dir": None, **kwargs})
        assert_names_the_value(error, kwargs)
        assert runner.ring is None and runner.iterations_done == 0  # nothing was allocated or trained
    finally:
        runner.close()


def test_resume_from_a_path_that_cannot_be_read_says_why(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} cannot be read: Is a directory")):
        APPORunner(_tiny(), resume=str(tmp_path))
    missing = tmp_path / "missing.pt"
    with pytest.raises(ValueError, match=re.escape(f"{missing} cannot be read: No such file or directory")):
        APPORunner(_tiny(), resume=str(missing))


def test_resume_from_an_empty_file_or_another_payload_is_refused(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(f"{empty} is not a checkpoint torch.load can read (")):
        APPORunner(_tiny(), resume=str(empty))
    listed = tmp_path / "list.pt"
    torch.save([1, 2, 3], listed)
    with pytest.raises(
        ValueError, match=re.escape(f"{listed} is not an APPORunner checkpoint: it has no ['learner'")
    ):
        APPORunner(_tiny(), resume=str(listed))


def test_load_checkpoint_of_a_directory_on_a_live_runner_changes_nothing(tmp_path):
    runner = APPORunner(_tiny())
    try:
        version = runner.policy_version
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path} cannot be read: ")):
            runner.load_checkpoint(str(tmp_path))
        assert runner.policy_version == version and runner.iterations_done == 0
    finally:
        runner.close()


def _corrupted(good: dict, entry: str) -> dict:
    """``good`` with new model weights and one entry broken, the way a hand-edited or truncated file has."""
    state = {**good, "learner": dict(good["learner"])}
    state["learner"]["model"] = {name: value + 1 for name, value in good["learner"]["model"].items()}
    if entry == "target_normalizer":
        state["learner"]["target_normalizer"] = {"bogus": 1}
    elif entry == "optimizer":
        del state["learner"]["optimizer"]
    elif entry == "updates":
        state["learner"]["updates"] = float("inf")  # int() raises OverflowError
    else:
        state[entry] = float("inf") if entry == "iterations" else "x"
    return state


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "target_normalizer",
            "its learner state cannot be restored (KeyError: 'mean'); the runner is unchanged",
        ),
        (
            "optimizer",
            "its learner state cannot be restored (KeyError: 'optimizer'); the runner is unchanged",
        ),
        ("policy_version", "its policy_version is not an integer ('x')"),
        ("env_frames", "its env_frames is not an integer ('x')"),
        ("iterations", "its iterations is not an integer (inf)"),
        ("updates", "its learner state cannot be restored (OverflowError: "),
    ],
)
def test_a_checkpoint_that_fails_half_way_leaves_the_runner_as_it_was(tmp_path, entry, message):
    """The learner's parts were restored one after another and the counters converted after them: a bad
    entry raised a KeyError or a bare int() error with the model already replaced, beside the old
    counters (a policy no version described)."""
    runner = APPORunner(_tiny(mode="serial"))
    try:
        runner.learn(1, log_dir=None)
        good = torch.load(runner.save_checkpoint(str(tmp_path / "good.pt")), weights_only=True)
        before = {name: value.clone() for name, value in runner.learner.state_dict()["model"].items()}
        counts = runner.policy_version, runner.iterations_done, runner.trained_frames
        bad = tmp_path / "bad.pt"
        torch.save(_corrupted(good, entry), bad)
        with pytest.raises(ValueError, match=re.escape(f"{bad}: {message}")):
            runner.load_checkpoint(str(bad))
        after = runner.learner.state_dict()
        assert all(torch.equal(after["model"][name], value) for name, value in before.items())
        assert (runner.policy_version, runner.iterations_done, runner.trained_frames) == counts
        assert after["optimizer"]["state"] and after["updates"] == good["learner"]["updates"]
        runner.learn(1, log_dir=None)  # and it trains on
    finally:
        runner.close()


# ------------------------------------------------------------------------ WeightBuffer / RolloutRing
@pytest.mark.parametrize("size", [0, -3, 2.5, "4"])
def test_weight_buffer_refuses_an_empty_size(size):
    with pytest.raises(ValueError, match=re.escape(f"WeightBuffer.size must be an int >= 1, got {size!r}")):
        WeightBuffer(size)


def test_weight_buffer_publish_names_the_expected_size():
    buffer = WeightBuffer(3)
    with pytest.raises(ValueError, match=re.escape("WeightBuffer.publish expects 3 values, got 6")):
        buffer.publish(torch.zeros(2, 3), 0)
    assert buffer.version == -1  # nothing was published


@pytest.mark.parametrize(
    ("slots", "overflow", "message"),
    [
        (1, "block", "RolloutRing.num_slots must be an int >= 2, got 1"),
        (0, "drop_oldest", "RolloutRing.num_slots must be an int >= 2, got 0"),
        (2, "lossy", "RolloutRing.overflow must be 'block' or 'drop_oldest', got 'lossy'"),
        (2, None, "RolloutRing.overflow must be 'block' or 'drop_oldest', got None"),
    ],
)
def test_rollout_ring_names_the_bad_argument(slots, overflow, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RolloutRing({"x": ((1,), torch.float32)}, slots, overflow, CTX)
