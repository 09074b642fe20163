"""The worker side of ``make_source``: rollouts into buffer rows, seeding, interruption, truncation."""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict

from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.sources import EpisodeSource, validate_episodes
from simstream.tasks import list_tasks, make_source


def zero_rows(spec) -> TensorDict:
    """A plain TensorDict of zeros shaped like the engine's view: payload keys, ``[num_envs, T]``."""
    batch = [spec.num_envs, spec.max_episode_steps]
    rows = TensorDict({}, batch_size=batch)
    for name, field in spec.fields().items():
        rows.set(tuple(name.split("/")), torch.zeros(*batch, *field.shape, dtype=field.dtype))
    return rows


def never() -> bool:
    return False


@pytest.mark.parametrize("name", list_tasks())
def test_rollout_writes_frames_before_length_only(name):
    spec = pickle.loads(pickle.dumps(make_source(name, num_envs=2, image_size=32)))
    source = spec.build(worker_index=0, seed=0)
    assert isinstance(source, EpisodeSource)
    rows = zero_rows(spec)
    episodes = validate_episodes(
        source.rollout(rows, attempt=0, should_stop=never), spec.num_envs, spec.max_episode_steps
    )
    source.close()
    for row, episode in enumerate(episodes):
        length = episode.length
        assert episode.success and episode.terminated and not episode.truncated
        assert episode.instruction and len(episode.segments) >= 4
        for key in ("state", "objects", "image"):
            frames = rows["obs", key][row]
            assert frames[:length].flatten(1).any(dim=1).all(), f"obs/{key} has unwritten frames"
            assert not frames[length:].any(), f"obs/{key} written past the episode"
        assert rows["actions"][row, :length].any(dim=1).all()
        assert not rows["actions"][row, length:].any()
        assert rows["rewards"][row, length - 1] == 1.0 and rows["rewards"][row].sum() == 1.0
        image = rows["obs", "image"][row, 0]
        assert image.dtype == torch.uint8 and image.float().std() > 10.0
    assert not torch.equal(rows["obs", "objects"][0, 0], rows["obs", "objects"][1, 0])


def test_rollouts_are_reproducible_and_distinct_per_worker_and_window():
    spec = make_source("pick_place", num_envs=1)
    first_window = []
    for worker in (0, 0, 1):
        source = spec.build(worker_index=worker, seed=3)
        rows = zero_rows(spec)
        source.rollout(rows, attempt=0, should_stop=never)
        first_window.append(rows)
        if worker == 1:
            second = zero_rows(spec)
            source.rollout(second, attempt=1, should_stop=never)
        source.close()
    same, other_worker = first_window[0], first_window[2]
    assert (same == first_window[1]).all(), "same (seed, worker) must give bit-identical rows"
    assert not torch.equal(same["obs", "objects"][:, 0], other_worker["obs", "objects"][:, 0])
    assert not torch.equal(second["obs", "objects"][:, 0], other_worker["obs", "objects"][:, 0])


def test_should_stop_interrupts_the_rollout():
    spec = make_source("stack", num_envs=2)
    source = spec.build(worker_index=0, seed=0)
    calls = []

    def stop_after_ten() -> bool:
        calls.append(1)
        return len(calls) > 10

    assert source.rollout(zero_rows(spec), attempt=0, should_stop=stop_after_ten) is None
    assert len(calls) == 11
    source.close()


def test_episodes_are_truncated_at_capacity():
    spec = make_source("pick_place", num_envs=2, max_episode_steps=12)
    source = spec.build(worker_index=0, seed=0)
    rows = zero_rows(spec)
    episodes = source.rollout(rows, attempt=0, should_stop=never)
    validate_episodes(episodes, 2, 12)
    for episode in episodes:
        assert episode.length == 12 and not episode.success
        assert episode.truncated and not episode.terminated
    assert rows["obs", "state"].flatten(2).any(dim=2).all()
    source.close()


def test_rollout_rejects_rows_of_the_wrong_shape():
    spec = make_source("pick_place", num_envs=2, max_episode_steps=50)
    source = spec.build(worker_index=0, seed=0)
    wrong = zero_rows(make_source("pick_place", num_envs=1, max_episode_steps=50))
    with pytest.raises(ValueError, match=r"rows must have batch size \[2, 50\]"):
        source.rollout(wrong, attempt=0, should_stop=never)
    source.close()


def test_engine_streams_expert_episodes():
    spec = make_source("pick_place", num_envs=2, max_episode_steps=150)
    cfg = OnlineDataEngineCfg(source=spec, buffer_size=2, action_dim=8, shutdown_timeout=10.0)
    with OnlineDataEngine(cfg) as engine:
        batch = engine.sample_batch(4, 8)
        assert batch["obs", "state"].shape == (4, 8, 23)
        assert batch["actions"].shape == (4, 8, 8)
        texts = engine.resolve_language(batch)
    assert "pick up" in repr(texts)
