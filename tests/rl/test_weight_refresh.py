"""The collector applies a policy published mid-rollout at the next step and stamps every step's version."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from simstream.rl import APPOConfig
from simstream.rl.appo_runner import APPORunner
from simstream.rl.collector import CollectorSpec, RolloutCollector, describe_env, ring_fields
from simstream.rl.learner import APPOLearner
from simstream.rl.model import packed_size
from simstream.rl.ring import RolloutRing
from simstream.rl.weights import WeightBuffer

ENV = "InvertedPendulum-v5"
STEPS, SWITCH_AT = 12, 5


def _collect_one_rollout(refresh_each_step: bool, switch_at: int = SWITCH_AT):
    """Collect one rollout in-process; version 1 is published just before step ``switch_at``."""
    obs_dim, act_dim = describe_env(ENV)
    cfg = APPOConfig(env_id=ENV, num_envs=3, steps_per_rollout=STEPS, minibatch_size=8, hidden_sizes=(8,))
    policies = [APPOLearner(cfg, obs_dim, act_dim, "cpu") for _ in range(2)]
    with torch.no_grad():  # make version 1 a clearly different policy with different statistics
        for p in policies[1].model.parameters():
            p.add_(0.5)
    policies[1].normalizer.update(torch.randn(64, obs_dim) * 3 + 1)
    spec = CollectorSpec(
        env_id=ENV, num_envs=3, steps=STEPS, seed=0, obs_dim=obs_dim, act_dim=act_dim, hidden_sizes=(8,),
        init_log_std=cfg.init_log_std, gamma=0.99, reward_scale=1.0, normalize_obs=True, sync=False,
        refresh_each_step=refresh_each_step,
    )  # fmt: skip
    ring = RolloutRing(ring_fields(spec), 2, "block", mp.get_context("spawn"))
    weights = WeightBuffer(packed_size(policies[0].model, obs_dim))
    weights.publish(policies[0].snapshot(), 0)
    collector = RolloutCollector(spec, ring, weights)
    calls = []

    def should_stop() -> bool:  # called once before every step
        calls.append(None)
        if len(calls) == switch_at + 1:
            weights.publish(policies[1].snapshot(), 1)
        return False

    try:
        assert collector.pull_weights(lambda: False, -1)
        assert collector.collect(should_stop)
        taken = ring.take(1)
        data = ring.gather(taken)
        ring.free(taken)
    finally:
        collector.close()
        ring.release()
        weights.release()
    return taken[0], {k: v[0] for k, v in data.items()}, policies


def _logp_under(policy: APPOLearner, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return policy.model.distribution(policy.normalizer.normalize(obs)).log_prob(actions).sum(-1)


def test_a_policy_published_mid_rollout_is_used_from_the_next_step_and_stamped():
    taken, data, policies = _collect_one_rollout(refresh_each_step=True)
    assert data["versions"].tolist() == [0] * SWITCH_AT + [1] * (STEPS - SWITCH_AT)
    assert taken.version == 0  # the ring stamps the oldest version (the lag cap sees the worst step)
    for t in range(STEPS):
        version = int(data["versions"][t])
        expected = _logp_under(policies[version], data["obs"][t], data["actions"][t])
        other = _logp_under(policies[1 - version], data["obs"][t], data["actions"][t])
        assert torch.allclose(data["logp"][t], expected, atol=1e-5), t
        assert not torch.allclose(data["logp"][t], other, atol=1e-3), t


def test_a_rollout_whose_first_step_uses_newer_weights_is_stamped_with_them():
    """Weights published while the collector waited for a slot are used from step 0: the stamp is the
    oldest version a step used, not the one held before the rollout (which would read as stale)."""
    taken, data, _ = _collect_one_rollout(refresh_each_step=True, switch_at=0)
    assert data["versions"].tolist() == [1] * STEPS
    assert taken.version == 1


def test_rollout_refresh_keeps_one_version_per_rollout():
    taken, data, policies = _collect_one_rollout(refresh_each_step=False)
    assert data["versions"].tolist() == [0] * STEPS and taken.version == 0
    expected = _logp_under(policies[0], data["obs"], data["actions"])
    assert torch.allclose(data["logp"], expected, atol=1e-5)


@pytest.mark.parametrize("refresh", ["step", "rollout"])
def test_async_runner_reports_the_per_step_policy_lag(refresh):
    cfg = APPOConfig(
        env_id=ENV, num_envs=2, steps_per_rollout=16, minibatch_size=16, num_epochs=2, hidden_sizes=(16,),
        weight_refresh=refresh,
    )  # fmt: skip
    with APPORunner(cfg) as runner:
        runner.learn(8, log_dir=None)
    lags = [row["rl/policy_lag"] for row in runner.history]
    assert all(0 <= lag <= row["rl/policy_lag_max"] for lag, row in zip(lags, runner.history))
    if refresh == "rollout":
        # One version per rollout and equal-length rollouts: an update's mean lag times the number of rollouts
        # it took is the sum of whole per-rollout lags, whatever that number was.
        summed = [lag * row["rl/rollouts_per_update"] for lag, row in zip(lags, runner.history)]
        assert all(abs(total - round(total)) < 1e-9 for total in summed), summed
