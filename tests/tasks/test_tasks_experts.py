"""Conformance of every registered task: expert success, determinism, segments, observations, images."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from simstream.tasks import (
    COLOURS,
    ScriptedExpert,
    episode_instruction,
    list_tasks,
    make_env,
    record_episode,
)
from simstream.tasks.base import Phase

NUM_SEEDS = 50
MIN_SUCCESS = 0.98
# Phase changes the expert may make: forward, or back to reach after losing the cube.
ALLOWED = {
    (Phase.REACH, Phase.GRASP),
    (Phase.GRASP, Phase.LIFT),
    (Phase.GRASP, Phase.REACH),
    (Phase.LIFT, Phase.PLACE),
    (Phase.LIFT, Phase.REACH),
    (Phase.PLACE, Phase.REACH),
}


@pytest.fixture(scope="module", params=list_tasks())
def expert_runs(request):
    env = make_env(request.param)
    expert = ScriptedExpert(env)
    records = [record_episode(env, expert, seed) for seed in range(NUM_SEEDS)]
    env.close()
    return request.param, records


def test_expert_success_rate(expert_runs):
    name, records = expert_runs
    successes = [r.seed for r in records if r.episode.success]
    rate = len(successes) / len(records)
    lengths = [r.episode.length for r in records]
    assert rate >= MIN_SUCCESS, f"{name}: expert success {rate:.0%} over {len(records)} seeds"
    assert max(lengths) < 200, f"{name}: longest expert episode {max(lengths)} steps"


def test_episode_flags_and_rewards(expert_runs):
    _, records = expert_runs
    for record in records:
        episode, rewards = record.episode, record.frames["rewards"]
        assert len(rewards) == episode.length == len(record.phases)
        assert episode.terminated == episode.success and episode.truncated == (not episode.success)
        assert rewards[-1] == float(episode.success) and not rewards[:-1].any()
        actions = record.frames["actions"]
        assert actions.dtype == np.float32 and np.isfinite(actions).all()
        assert ((actions[:, 7] == 0.0) | (actions[:, 7] == 1.0)).all()


def test_segments_follow_the_expert_phases(expert_runs):
    name, records = expert_runs
    plain = 0
    for record in records:
        episode, goal_words = record.episode, episode_instruction(name, record.seed).split()
        segments = list(episode.segments)
        assert segments[0].start == 0 and segments[-1].end == episode.length
        assert all(a.end == b.start for a, b in pairwise(segments))
        phases = [record.phases[s.start] for s in segments]
        for phase, segment in zip(phases, segments):
            assert set(record.phases[segment.start : segment.end]) == {phase}
        assert phases[0] == Phase.REACH and set(pairwise(phases)) <= ALLOWED
        if episode.success:
            assert phases[-1] == Phase.PLACE
        plain += phases == [Phase.REACH, Phase.GRASP, Phase.LIFT, Phase.PLACE]
        colour = next(w for w in goal_words if w in COLOURS)
        for phase, segment in zip(phases, segments):
            assert segment.instruction.startswith(f"{phase.value} the {colour} cube")
        assert episode.instruction == " ".join(goal_words)
    assert plain >= 0.9 * len(records), f"only {plain} episodes without a retry"


def test_each_frames_action_belongs_to_the_phase_it_is_labelled_with(expert_runs):
    """The gripper command tells the phases apart: open while reaching, closed while grasping and lifting.
    A frame where the expert ends a phase carries that phase's action, so it belongs to that segment (the
    first frame of every grasp segment commanded "open" when frames took the phase after the step)."""
    _, records = expert_runs
    for record in records:
        gripper = record.frames["actions"][:, 7]
        for segment in record.episode.segments:
            phase, commands = record.phases[segment.start], set(gripper[segment.start : segment.end].tolist())
            if phase == Phase.REACH:
                assert commands == {1.0}, (record.seed, segment)
            elif phase in (Phase.GRASP, Phase.LIFT):
                assert commands == {0.0}, (record.seed, segment)
            else:  # place: carried closed, then opened to let go
                assert gripper[segment.start] == 0.0 and gripper[segment.end - 1] == 1.0, (
                    record.seed,
                    segment,
                )


@pytest.mark.parametrize("name", list_tasks())
def test_same_seed_is_bit_identical(name):
    env_a, env_b = make_env(name), make_env(name)
    expert_a, expert_b = ScriptedExpert(env_a), ScriptedExpert(env_b)
    record_episode(env_a, expert_a, 123)  # a used env must not remember the previous episode
    first = record_episode(env_a, expert_a, 7)
    second = record_episode(env_b, expert_b, 7)
    assert first.episode == second.episode
    for key, frames in first.frames.items():
        assert frames.tobytes() == second.frames[key].tobytes(), key


@pytest.mark.parametrize("name", list_tasks())
def test_initial_state_is_randomized(name):
    env = make_env(name)
    first = [env.reset(seed) for seed in range(4)]
    for a, b in pairwise(first):
        assert not np.array_equal(a["objects"], b["objects"])
        assert not np.array_equal(a["state"][:7], b["state"][:7])
    instructions = set()
    for seed in range(30):
        env.reset(seed)
        instructions.add(env.instruction)
    assert len(instructions) > 1


@pytest.mark.parametrize("name", list_tasks())
def test_observations_do_not_share_memory(name):
    env = make_env(name, image_size=16)
    first = env.reset(0)
    step = env.step(env.home_action())[0]
    again = env.observation()
    for key in first:
        assert not np.shares_memory(first[key], step[key]), key
        assert not np.shares_memory(step[key], again[key]), key
        kept = again[key].copy()
        step[key][...] = 0
        np.testing.assert_array_equal(env.observation()[key], kept)
    env.close()


def test_positions_read_after_a_step_are_those_of_the_joints_beside_them():
    """mj_step computes positions before it integrates: the tool, the cubes and the cameras read after a
    step were one 2-ms sub-step older than the joint angles in the same observation (up to 0.8 mm of the
    tool)."""
    import mujoco

    from simstream.tasks.scene import COLOURS

    env = make_env("pick_place")
    env.reset(3)
    expert = ScriptedExpert(env)
    expert.reset()
    for _ in range(12):  # moving: the arm reaches, so positions change between sub-steps
        env.step(expert.act())
        scene = env.scene
        fresh = mujoco.MjData(scene.model)
        fresh.qpos[:], fresh.qvel[:] = scene.data.qpos, scene.data.qvel
        mujoco.mj_forward(scene.model, fresh)
        np.testing.assert_array_equal(scene.tcp_pos(), fresh.site("tcp").xpos)
        for colour in COLOURS:
            np.testing.assert_array_equal(scene.cube_pos(colour), fresh.body(f"{colour}_cube").xpos)
        np.testing.assert_array_equal(scene.data.cam_xpos, fresh.cam_xpos)  # the wrist camera moves too
        np.testing.assert_array_equal(scene.data.cam_xmat, fresh.cam_xmat)
    env.close()


@pytest.mark.parametrize("camera", ["front", "wrist"])
def test_image_shape_and_content(camera):
    env = make_env("pick_place", image_size=(48, 64), camera=camera)
    image = env.reset(0)["image"]
    assert image.shape == (3, 48, 64) and image.dtype == np.uint8
    assert image.std() > 10.0, "blank image"
    other = env.reset(1)["image"]
    assert not np.array_equal(image, other)
    env.close()
    env.close()  # idempotent


def test_env_api_contract():
    env = make_env("pick_place", max_episode_steps=3)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(env.home_action())
    obs = env.reset(5)
    assert obs["state"].shape == (23,) and obs["objects"].shape == (21,)
    assert env.instruction == episode_instruction("pick_place", 5)
    assert env.subtask_instruction("lift").startswith("lift the")
    with pytest.raises(ValueError, match="action must be 8 finite numbers"):
        env.step(np.zeros(7))
    with pytest.raises(ValueError, match="action must be 8 finite numbers"):
        env.step(np.full(8, np.nan))
    flags = [env.step(env.home_action())[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(env.home_action())
    assert (env.action_low < env.action_high).all() and env.action_high[7] == 1.0
    with pytest.raises(ValueError, match="camera must be one of"):
        make_env("pick_place", camera="side")
