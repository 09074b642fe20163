"""In-process tests of the pure parts: diagnosis, configs, ring, weight seqlock, V-trace, loss, guards."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import signal
import threading

import numpy as np
import pytest
import torch

from simstream.rl import (
    APPOConfig,
    CollectorDiedError,
    NonFiniteError,
    RolloutRing,
    RunnerConfig,
    WeightBuffer,
    format_collector_death,
)
from simstream.rl import ring as ring_module
from simstream.rl.appo import PPOLoss, check_finite, ppo_loss, vtrace
from simstream.rl.learner import APPOLearner
from simstream.rl.model import ActorCritic, ObsNormalizer, pack_policy, packed_size, unpack_policy
from simstream.rl.ring import FREE, READING, READY, WRITING

pytestmark = pytest.mark.timeout(60)
CTX = mp.get_context("spawn")


# ---------------------------------------------------------------- format_collector_death
def test_format_collector_death_takes_the_exit_code_alone():
    """Suites written against the reference call it with the exit code only."""
    report = format_collector_death(135)
    assert "shell-style signal 7" in report and "SIGBUS" in report and "shared memory" in report
    assert "SIGBUS" in format_collector_death(-7)
    assert "SIGKILL" in format_collector_death(137) and "OOM" in format_collector_death(137)


@pytest.mark.parametrize(
    ("exitcode", "traceback_text", "fragments"),
    [
        pytest.param(1, "Traceback ...\nValueError: boom",
                     ["Collector process crashed.", "traceback (exit code 1):", "ValueError: boom"],
                     id="traceback"),
        pytest.param(None, "Traceback ...\nKeyError: 'x'", ["crashed. Its Python traceback:", "KeyError"],
                     id="traceback-no-code"),
        pytest.param(-9, None, ["killed by signal 9 (SIGKILL)", "OOM killer", "dmesg | grep -i oom"],
                     id="sigkill"),
        pytest.param(-7, None, ["signal 7 (SIGBUS)", "shared memory", "/dev/shm is full"], id="sigbus"),
        pytest.param(-11, None, ["signal 11 (SIGSEGV)", "segmentation fault"], id="sigsegv"),
        pytest.param(-6, None, ["signal 6 (SIGABRT)", "abort()"], id="sigabrt"),
        pytest.param(-15, None, ["signal 15 (SIGTERM)"], id="sigterm-no-hint"),
        pytest.param(135, None,
                     ["exited with code 135 (shell-style signal 7, SIGBUS)", "shared memory", "/dev/shm"],
                     id="135"),
        pytest.param(137, None, ["code 137 (shell-style signal 9, SIGKILL)", "OOM"], id="137"),
        pytest.param(139, None, ["shell-style signal 11, SIGSEGV"], id="139"),
        pytest.param(3, None, ["exited with code 3 without sending a Python traceback"], id="plain"),
        pytest.param(None, None, ["died (exit code unknown)"], id="unknown"),
        pytest.param(-64, "   ", ["signal 64 (SIG"], id="blank-traceback-unnamed-signal"),
    ],
)  # fmt: skip
def test_format_collector_death_branches(exitcode, traceback_text, fragments):
    report = format_collector_death(exitcode, traceback_text)
    for fragment in fragments:
        assert fragment in report, report
    if exitcode == -15:
        assert "Hint" not in report


def test_collector_died_error_keeps_its_fields_and_pickles():
    import pickle

    error = CollectorDiedError("report text", -9, None)
    assert isinstance(error, RuntimeError) and str(error) == "report text"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.report, copy.exitcode, copy.traceback_text) == ("report text", -9, None)


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_envs": 0}, "APPOConfig.num_envs must be an int in [1, 4096], got 0"),
        ({"num_envs": 100_000}, "APPOConfig.num_envs must be an int in [1, 4096], got 100000"),
        ({"seed": 2**64 - 16}, "APPOConfig.seed must be an int in [0, 9223372036854775807], got 1844674"),
        ({"stats_window": 10**20}, "APPOConfig.stats_window must be an int in [1, 1000000], got 1000000"),
        ({"learner_num_threads": 100_000}, "APPOConfig.learner_num_threads must be an int in [0, "),
        ({"num_slots": 1}, "APPOConfig.num_slots must be an int >= 2, got 1"),
        (
            {"overflow": "drop_newest"},
            "APPOConfig.overflow must be 'block' or 'drop_oldest', got 'drop_newest'",
        ),
        ({"max_policy_lag": -1}, "APPOConfig.max_policy_lag must be an int >= 0, got -1"),
        ({"gamma": 1.5}, "APPOConfig.gamma must be a number in [0, 1], got 1.5"),
        ({"learning_rate": 0.0}, "APPOConfig.learning_rate must be a finite number > 0, got 0.0"),
        ({"hidden_sizes": ()}, "APPOConfig.hidden_sizes must be a non-empty tuple of ints >= 1, got ()"),
        (
            {"hidden_sizes": [64]},
            "APPOConfig.hidden_sizes must be a non-empty tuple of ints >= 1, got [64]",
        ),
        ({"normalize_obs": "False"}, "APPOConfig.normalize_obs must be True or False, got 'False'"),
        ({"normalize_obs": None}, "APPOConfig.normalize_obs must be True or False, got None"),
        (
            {"minibatch_size": 4096},
            "APPOConfig.minibatch_size must be <= num_envs * steps_per_rollout = 1024",
        ),
        ({"desired_kl": -1.0}, "APPOConfig.desired_kl must be None or a finite number > 0, got -1.0"),
        ({"entropy_coef": math.inf}, "APPOConfig.entropy_coef must be a finite number >= 0, got inf"),
        ({"init_log_std": True}, "APPOConfig.init_log_std must be a number in [-5, 2], got True"),
        (
            {"weight_refresh": "update"},
            "APPOConfig.weight_refresh must be 'step' or 'rollout', got 'update'",
        ),
        (
            {"mode": "lockstep"},
            "APPOConfig.mode must be one of 'async', 'sync', 'serial', got 'lockstep'",
        ),
    ],
)
def test_appo_config_rejects_bad_values_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as info:
        APPOConfig(**kwargs)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("mode", ["async", "sync", "serial"])
def test_the_mode_is_one_typed_setting(mode):
    assert APPOConfig(mode=mode).mode == mode
    # the two booleans it replaces, which could both be set, are gone
    for old in ("sync", "serial"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            APPOConfig(**{old: True})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hang_timeout_s": 0}, "RunnerConfig.hang_timeout_s must be a number in (0, 1e6], got 0"),
        ({"data_timeout_s": 1e7}, "RunnerConfig.data_timeout_s must be a number in (0, 1e6], got 10000000.0"),
        (
            {"startup_timeout_s": float("nan")},
            "RunnerConfig.startup_timeout_s must be a number in (0, 1e6], got nan",
        ),
        (
            {"poll_interval_s": 2.0},
            "RunnerConfig.poll_interval_s must be a number in (0, 0.5], got 2.0. Longer slices",
        ),
        ({"shutdown_timeout_s": -1}, "RunnerConfig.shutdown_timeout_s must be a number in [0, 1e6], got -1"),
        (
            {"shutdown_timeout_s": math.inf},
            "RunnerConfig.shutdown_timeout_s must be a number in [0, 1e6], got inf",
        ),
    ],
)
def test_runner_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError) as info:
        RunnerConfig(**kwargs)
    assert str(info.value).startswith(message)


# ---------------------------------------------------------------- ring
def _ring(overflow="block", slots=3) -> RolloutRing:
    return RolloutRing({"x": ((4,), torch.float32)}, slots, overflow, CTX)


def _write(ring: RolloutRing, value: float, version: int) -> int:
    slot = ring.acquire(should_stop=lambda: True)
    assert slot is not None
    ring.data["x"][slot].fill_(value)
    ring.commit(slot, version)
    return slot


def test_ring_block_mode_back_pressure_and_order():
    ring = _ring("block")
    for i in range(3):
        _write(ring, i, version=i)
    assert ring.acquire(should_stop=lambda: True) is None  # full: a blocked writer leaves when stopped
    taken = ring.take(max_count=2)
    assert [t.version for t in taken] == [0, 1] and [t.seq for t in taken] == [0, 1]
    assert ring.states().count(READING) == 2
    data = ring.gather(taken)
    assert data["x"][:, 0].tolist() == [0.0, 1.0]
    ring.free(taken)
    stats = ring.stats()
    assert (stats.committed, stats.consumed, stats.dropped_overflow, stats.dropped_stale) == (3, 2, 0, 0)


def test_ring_drop_oldest_counts_and_never_takes_a_slot_being_read():
    ring = _ring("drop_oldest", slots=2)
    _write(ring, 1.0, 0)
    _write(ring, 2.0, 1)
    held = ring.take(max_count=1)  # the reader holds the oldest
    _write(ring, 3.0, 2)  # must overwrite the other READY slot, not the READING one
    assert ring.stats().dropped_overflow == 1
    assert ring.gather(held)["x"][0, 0] == 1.0
    assert sorted(ring.states()) == [READY, READING]
    ring.free(held)
    assert [t.version for t in ring.take(5)] == [2]


def test_ring_drops_rollouts_older_than_the_lag_cap():
    ring = _ring()
    _write(ring, 0.0, 3)
    _write(ring, 0.0, 9)
    taken = ring.take(max_count=5, min_version=5)
    assert [t.version for t in taken] == [9]
    assert ring.stats().dropped_stale == 1
    assert ring.states().count(FREE) == 2


def test_ring_gather_detects_a_broken_invariant():
    ring = _ring()
    _write(ring, 0.0, 0)
    taken = ring.take(1)
    ring._meta[taken[0].slot, 0] = WRITING  # simulate a writer touching a slot it does not own
    with pytest.raises(RuntimeError, match="changed while it was read"):
        ring.gather(taken)


def test_ring_commit_requires_a_claimed_slot():
    ring = _ring()
    with pytest.raises(RuntimeError, match="not held by the writer"):
        ring.commit(0, 0)
    assert READY not in ring.states()


def test_ring_abandon_frees_only_a_slot_being_written():
    ring = _ring(slots=2)
    slot = ring.acquire(should_stop=lambda: True)
    ring.abandon(slot)  # a rollout cut short: the writer gives its slot back
    assert ring.states() == [FREE, FREE]
    _write(ring, 1.0, 0)
    ready = ring.states().index(READY)
    ring.abandon(ready)  # committed already (an interrupt after commit): nothing to give back
    assert ring.states()[ready] == READY and ring.stats().committed == 1


def _hold_ring_lock(ring: RolloutRing, taken) -> None:
    """Child process: take the ring's lock, say so, and keep it until killed."""
    ring._lock.acquire(None)
    taken.set()
    threading.Event().wait()


def _child_holding_the_ring_lock(ring: RolloutRing):
    taken = CTX.Event()
    child = CTX.Process(target=_hold_ring_lock, args=(ring, taken), daemon=True)
    child.start()
    assert taken.wait(60.0), "the child never took the ring's lock"
    return child


def test_ring_lock_of_a_killed_holder_is_released():
    ring = _ring()
    _write(ring, 5.0, 1)
    child = _child_holding_the_ring_lock(ring)
    os.kill(child.pid, signal.SIGKILL)
    child.join(60.0)
    assert child.exitcode == -signal.SIGKILL
    taken = ring.take(max_count=1)  # the kernel dropped the dead child's lock: no wait, no TimeoutError
    assert [t.version for t in taken] == [1]
    assert ring.gather(taken)["x"][0].tolist() == [5.0] * 4


def test_ring_lock_held_by_a_stopped_process_times_out(monkeypatch):
    monkeypatch.setattr(ring_module, "_LOCK_TIMEOUT_S", 0.3)
    ring = _ring()
    _write(ring, 0.0, 0)
    child = _child_holding_the_ring_lock(ring)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        stuck = r"RolloutRing lock held for more than 0.3 s .* stopped or stuck"
        with pytest.raises(TimeoutError, match=stuck):
            ring.take(max_count=1)
        assert ring.states() == [READY, FREE, FREE]  # nothing changed
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(60.0)
    assert [t.version for t in ring.take(max_count=1)] == [0]  # usable again once the holder is gone


@pytest.mark.parametrize(("slots", "overflow"), [(1, "block"), (2, "lossy")])
def test_ring_rejects_bad_arguments(slots, overflow):
    with pytest.raises(ValueError, match="RolloutRing"):
        RolloutRing({"x": ((1,), torch.float32)}, slots, overflow, CTX)


# ---------------------------------------------------------------- weights
def test_weight_buffer_publishes_versions_and_rejects_torn_copies():
    buffer = WeightBuffer(5)
    out = torch.empty(5)
    assert buffer.version == -1
    buffer.publish(torch.arange(5.0), 3)
    assert buffer.read_into(out) == 3 and out.tolist() == [0, 1, 2, 3, 4]
    buffer._meta[0] += 1  # a writer died mid-publish: the sequence stays odd
    with pytest.raises(TimeoutError, match="no consistent weights"):
        buffer.read_into(out, timeout_s=0.05)
    with pytest.raises(ValueError, match="expects 5 values"):
        buffer.publish(torch.zeros(4), 4)
    # the next whole publish repairs it (increments kept an interrupted publish's odd count for good)
    buffer.publish(torch.arange(5.0) * 2, 4)
    assert int(buffer._meta[0]) % 2 == 0
    assert buffer.read_into(out, timeout_s=0.05) == 4 and out.tolist() == [0, 2, 4, 6, 8]


def test_pack_unpack_roundtrip_includes_normaliser():
    model, other = ActorCritic(3, 2, (8,), -0.5), ActorCritic(3, 2, (8,), 0.0)
    norm, other_norm = ObsNormalizer(3), ObsNormalizer(3)
    norm.update(torch.randn(100, 3) * 4 + 2)
    vector = pack_policy(model, norm)
    assert vector.numel() == packed_size(model, 3)
    unpack_policy(vector, other, other_norm)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert torch.allclose(other_norm.mean, norm.mean.float().double())


def test_obs_normalizer_state_loads_onto_the_cpu_in_float64():
    """A checkpoint mapped to the learner's device (cuda) must not move the statistics there: they are
    packed with CPU copies of the weights and updated with CPU batches (no GPU here: the dtype and device
    of a loaded state are what is checked)."""
    norm = ObsNormalizer(3)
    norm.load_state_dict({"mean": torch.ones(3, dtype=torch.float32), "var": torch.full((3,), 4.0),
                          "count": 5, "enabled": True})  # fmt: skip
    assert norm.mean.device.type == norm.var.device.type == "cpu"
    assert norm.mean.dtype == norm.var.dtype == torch.float64 and norm.count == 5.0
    assert torch.equal(
        pack_policy(ActorCritic(3, 2, (8,), 0.0), norm)[-6:], torch.tensor([1.0] * 3 + [4.0] * 3)
    )


def test_obs_normalizer_matches_batch_statistics():
    data = torch.randn(3000, 4, dtype=torch.float64) * 3 + 1
    norm = ObsNormalizer(4)
    for chunk in data.split(700):
        norm.update(chunk)
    assert torch.allclose(norm.mean, data.mean(0), atol=1e-3)
    assert torch.allclose(norm.var, data.var(0, unbiased=False), rtol=1e-3)


# ---------------------------------------------------------------- V-trace and loss
def _gae(rewards, values, bootstrap, discounts, lam):
    adv = np.zeros_like(rewards)
    last = np.zeros_like(bootstrap)
    next_values = np.concatenate([values[1:], bootstrap[None]], 0)
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + discounts[t] * next_values[t] - values[t]
        last = delta + discounts[t] * lam * last
        adv[t] = last
    return adv


def test_vtrace_on_policy_equals_gae_and_episode_ends_cut_the_trace():
    g = torch.Generator().manual_seed(0)
    T, B = 7, 3
    rewards, values, bootstrap = (
        torch.randn(T, B, generator=g),
        torch.randn(T, B, generator=g),
        torch.randn(B),
    )
    dones = torch.zeros(T, B)
    dones[2, 1] = 1.0
    discounts = 0.9 * (1 - dones)
    logp = torch.randn(T, B, generator=g)
    out = vtrace(logp, logp, rewards, values, bootstrap, discounts, lam=0.95)
    gae = _gae(rewards.numpy(), values.numpy(), bootstrap.numpy(), discounts.numpy(), 0.95)
    assert np.allclose((out.vs - values).numpy(), gae, atol=1e-5)
    assert float(out.rho_clip_fraction) == 0.0


def test_vtrace_truncates_importance_weights():
    T, B = 4, 2
    behaviour = torch.zeros(T, B)
    target = torch.full((T, B), 2.0)  # pi/mu = e^2 > rho_bar
    out = vtrace(behaviour, target, torch.ones(T, B), torch.zeros(T, B), torch.zeros(B), torch.ones(T, B),
                 rho_bar=1.0, c_bar=1.0)  # fmt: skip
    assert float(out.rho_clip_fraction) == 1.0
    assert torch.allclose(out.vs[-1], torch.ones(B))  # rho clipped to 1: v_T-1 = r


def _loss_on_fresh_samples(
    count: int, *, behaviour_shift: float | torch.Tensor = 0.0, entropy_coef: float = 0.0
) -> tuple[ActorCritic, PPOLoss]:
    """``ppo_loss`` of a fresh policy that is also the target, on its own samples; the behaviour
    log-probabilities are the target's plus ``behaviour_shift``."""
    model = ActorCritic(3, 2, (8,), -0.5)
    obs = torch.randn(count, 3)
    dist = model.distribution(obs)
    actions = dist.sample()
    target_logp = dist.log_prob(actions).sum(-1).detach()
    loss = ppo_loss(dist, model.value(obs), actions, target_logp + behaviour_shift, target_logp,
                    model.distribution(obs), torch.randn(count), torch.randn(count),
                    clip_ratio=0.2, value_coef=0.5, entropy_coef=entropy_coef)  # fmt: skip
    return model, loss


def test_ppo_loss_on_policy_has_unit_ratio_and_no_clipping():
    model, loss = _loss_on_fresh_samples(32, entropy_coef=0.01)
    assert float(loss.clip_fraction) == 0.0
    assert abs(float(loss.kl_target)) < 1e-6 and abs(float(loss.kl_behaviour)) < 1e-6
    loss.total.backward()
    assert model.log_std.grad is not None


def test_ppo_loss_ratio_is_anchored_at_the_target_not_the_behaviour_policy():
    """Stale data (behaviour far from target) starts every ratio at 1: the trust region is the target's."""
    # ratios pi_target/mu from e^-2 to e^2
    _, loss = _loss_on_fresh_samples(64, behaviour_shift=torch.linspace(-2.0, 2.0, 64))
    assert float(loss.clip_fraction) == 0.0
    assert float(loss.kl_behaviour) > 0.5  # the behaviour policy really is far away


def test_check_finite_names_the_tensor():
    check_finite("fine", torch.ones(2))
    with pytest.raises(
        NonFiniteError, match=r"non-finite values in 'obs': 2 of 6 entries \(first at index \(0, 1\)"
    ):
        check_finite("obs", torch.tensor([[0.0, float("nan"), 1.0], [float("inf"), 0.0, 0.0]]))
    assert issubclass(NonFiniteError, FloatingPointError)


def test_learner_nan_guard_rejects_a_poisoned_batch():
    cfg = APPOConfig(num_envs=2, steps_per_rollout=4, minibatch_size=8, hidden_sizes=(8,))
    learner = APPOLearner(cfg, 3, 1, "cpu")
    batch = {
        "obs": torch.randn(4, 2, 3), "actions": torch.randn(4, 2, 1), "logp": torch.zeros(4, 2),
        "rewards": torch.zeros(4, 2), "dones": torch.zeros(4, 2), "last_obs": torch.randn(2, 3),
    }  # fmt: skip
    metrics = learner.update(batch)
    assert np.isfinite(metrics["loss/policy"]) and learner.updates == 1
    batch["rewards"][1, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"'batch\.rewards'"):
        learner.update(batch)
    assert learner.updates == 1  # nothing changed


def test_the_step_size_follows_how_far_each_update_moved_the_policy_not_the_age_of_the_target(monkeypatch):
    """With target_update_interval > 1 the rate adapted to KL(target || current), which only grows until
    the target is refreshed: every step halved the rate, pinning it to its floor for most updates."""
    cfg = APPOConfig(
        num_envs=8, steps_per_rollout=32, minibatch_size=64, hidden_sizes=(16,), target_update_interval=3
    )
    learner = APPOLearner(cfg, 4, 2, "cpu")
    adapted: list[float] = []
    adapt = learner._adapt_learning_rate
    monkeypatch.setattr(learner, "_adapt_learning_rate", lambda kl: adapted.append(kl) or adapt(kl))
    generator = torch.Generator().manual_seed(0)
    moved, to_target = [], []
    for _ in range(3):
        obs = torch.randn(32, 8, 4, generator=generator)
        with torch.no_grad():  # on-policy: the policy that acts is the learner's
            dist = learner.model.distribution(learner.normalizer.normalize(obs))
            actions = dist.sample()
        batch = {
            "obs": obs, "actions": actions, "logp": dist.log_prob(actions).sum(-1),
            "rewards": actions[..., 0] - 0.5 * actions[..., 1], "dones": torch.zeros(32, 8),
            "last_obs": torch.randn(8, 4, generator=generator),
        }  # fmt: skip
        adapted.clear()
        metrics = learner.update(batch)
        moved.append(sum(adapted) / len(adapted))
        to_target.append(metrics["policy_kl/target_to_current"])
    assert moved[0] == pytest.approx(to_target[0], rel=1e-4)  # the first update starts at the target
    assert moved[1] < to_target[1] and moved[2] < to_target[2]  # later ones from where they started


def test_the_target_network_keeps_the_observation_statistics_it_was_trained_under(monkeypatch):
    """With target_update_interval > 1 the target is an older policy: its log-probabilities come from
    the statistics of its own time (they were taken under the current ones, a policy that never acted)."""
    cfg = APPOConfig(
        num_envs=2, steps_per_rollout=4, minibatch_size=8, hidden_sizes=(8,), target_update_interval=3
    )
    learner = APPOLearner(cfg, 3, 1, "cpu")
    generator = torch.Generator().manual_seed(0)

    def batch() -> dict[str, torch.Tensor]:
        return {
            "obs": torch.randn(4, 2, 3, generator=generator) * 5 + 2, "actions": torch.randn(4, 2, 1),
            "logp": torch.zeros(4, 2), "rewards": torch.zeros(4, 2), "dones": torch.zeros(4, 2),
            "last_obs": torch.randn(2, 3),
        }  # fmt: skip

    import simstream.rl.learner as learner_module

    seen = []
    monkeypatch.setattr(
        learner_module, "vtrace", lambda *args, **kw: seen.append(args[1]) or vtrace(*args, **kw)
    )
    initial = learner.normalizer.state_dict()
    learner.update(batch())
    second = batch()
    learner.update(second)
    assert not torch.equal(learner.normalizer.mean, initial["mean"])
    # the second update's target log-probabilities: the target (the initial policy) under the initial stats
    start = APPOLearner(cfg, 3, 1, "cpu")
    expected = start.model.distribution(start.normalizer.normalize(second["obs"])).log_prob(second["actions"])
    torch.testing.assert_close(seen[1], expected.sum(-1))
    assert torch.equal(learner.target_normalizer.mean, initial["mean"])  # the target is still the start
    obs = torch.randn(5, 3, generator=generator) * 5 + 2
    target_logp = learner.target.distribution(learner.target_normalizer.normalize(obs)).mean
    fresh = APPOLearner(cfg, 3, 1, "cpu")  # the same seed: the policy the target copies
    assert torch.equal(target_logp, fresh.model.distribution(fresh.normalizer.normalize(obs)).mean)
    learner.update(batch())  # the third update copies the policy and its statistics
    assert torch.equal(learner.target_normalizer.mean, learner.normalizer.mean)
    restored = APPOLearner(cfg, 3, 1, "cpu")
    restored.load_state_dict(learner.state_dict())
    assert torch.equal(restored.target_normalizer.var, learner.target_normalizer.var)


@pytest.mark.parametrize(
    ("start", "kl", "expected"),
    [
        (3e-4, 1.0, 2e-4),  # KL 100x the target: lowered by 1.5
        (3e-4, 1e-4, 4.5e-4),  # KL far below it: raised by 1.5
        (3e-4, 0.01, 3e-4),  # on target: kept
        (9e-3, 1e-4, 1e-2),  # raised up to the bound
        (5e-2, 1e-4, 5e-2),  # above the bound: a raise never lowers it (it made 1e-2)
        (5e-2, 1.0, 5e-2 / 1.5),  # and a lowering still lowers it
        (3e-6, 1.0, 3e-6),  # below the bound: a lowering never raises it (it made 1e-5)
        (3e-6, 1e-4, 4.5e-6),
    ],
)
def test_the_adaptive_learning_rate_moves_only_the_way_the_kl_asks(start, kl, expected):
    learner = APPOLearner(APPOConfig(learning_rate=start, desired_kl=0.01), 3, 1, "cpu")
    learner._adapt_learning_rate(kl)
    assert learner.learning_rate == pytest.approx(expected)
    assert all(group["lr"] == learner.learning_rate for group in learner.optimizer.param_groups)


def test_ring_shared_bytes_are_what_the_ring_allocates_for_its_rollouts():
    fields = {"obs": ((8, 3, 5), torch.float32), "versions": ((8,), torch.int64), "n": ((), torch.int64)}
    ring = RolloutRing(fields, 3, "block", CTX)
    try:
        allocated = sum(t.numel() * t.element_size() for t in ring.data.values())
        assert RolloutRing.shared_bytes(fields, 3) == allocated == 3 * (8 * 3 * 5 * 4 + 8 * 8 + 8)
    finally:
        ring.release()


def test_a_learner_state_with_a_shuffle_state_set_state_refuses_restores_nothing():
    """A checkpoint mapped to a cuda learner moved the shuffle generator's state onto the GPU, which
    set_state refuses after the model, target, optimiser and normalisers were already overwritten. The
    state now goes to the CPU, and is checked before anything is restored (a CPU-only machine cannot
    make a cuda tensor: a state of the wrong dtype stands for one set_state refuses)."""
    cfg = APPOConfig(num_envs=2, steps_per_rollout=4, minibatch_size=8, hidden_sizes=(8,))
    saved, learner = (
        APPOLearner(cfg, 3, 1, "cpu"),
        APPOLearner(dataclasses.replace(cfg, seed=1), 3, 1, "cpu"),
    )
    before = {name: tensor.clone() for name, tensor in learner.model.state_dict().items()}
    state = {**saved.state_dict(), "shuffle": saved.state_dict()["shuffle"].float()}
    with pytest.raises(TypeError, match=r"RNG state must be a torch\.ByteTensor"):
        learner.load_state_dict(state)
    after = learner.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    learner.load_state_dict(saved.state_dict())  # a CPU state restores everything
    assert torch.equal(learner._shuffle.get_state(), saved._shuffle.get_state())


def test_a_released_ring_holds_no_file_descriptor_or_semaphore():
    """A closed runner kept for its history (a sweep) held its ring's lock descriptor and two named
    semaphores until it was collected."""
    import gc

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def semaphores() -> int:
        return sum(name.startswith("sem.mp-") for name in os.listdir("/dev/shm"))

    def make() -> RolloutRing:
        return RolloutRing({"x": ((4,), torch.float32)}, 2, "block", mp.get_context("spawn"))

    make().release()  # what lives as long as the process (the resource tracker's pipe) is opened first
    gc.collect()
    fds, sems = open_fds(), semaphores()
    ring = make()
    assert open_fds() > fds and semaphores() == sems + 2
    ring.release()
    assert open_fds() == fds and semaphores() == sems
    assert ring.stats().committed == 0  # still answers


def test_a_truncated_step_is_stored_with_its_last_observation_and_its_raw_reward():
    """The collector added gamma * V(s_T) of its own critic, up to max_policy_lag versions old, into the
    reward: it now stores s_T and the learner bootstraps with its current critic."""
    from simstream.rl.collector import CollectorSpec, RolloutCollector, ring_fields

    from .fault_env import env_id

    spec = CollectorSpec(
        env_id=env_id("none"), num_envs=2, steps=60, seed=0, obs_dim=3, act_dim=1, hidden_sizes=(8,),
        init_log_std=0.0, gamma=0.9, reward_scale=0.5, normalize_obs=True, sync=False,
    )  # fmt: skip
    ring = RolloutRing(ring_fields(spec), 2, "block", mp.get_context("spawn"))
    model, normalizer = ActorCritic(3, 1, (8,), 0.0), ObsNormalizer(3, True)
    weights = WeightBuffer(packed_size(model, 3))
    weights.publish(pack_policy(model, normalizer), 0)
    collector = RolloutCollector(spec, ring, weights)
    try:
        assert collector.pull_weights(lambda: False, -1) and collector.collect(lambda: False)
        [taken] = ring.take(1)
        data = {key: value[0] for key, value in ring.gather([taken]).items()}
    finally:
        collector.close()
        ring.release()
        weights.release()
    # FaultEnv truncates after 50 steps: step 49 of the rollout; its state moves by 0.1 * action
    expected = torch.zeros(60, 2)
    expected[49] = 1.0
    assert torch.equal(data["truncated"], expected) and torch.equal(data["dones"], expected)
    final = data["obs"][49] + 0.1 * data["actions"][49].clamp(-1.0, 1.0)
    torch.testing.assert_close(data["final_obs"][49], final)
    torch.testing.assert_close(data["rewards"][49], -0.5 * final.abs().sum(-1))  # raw, scaled
    assert not torch.equal(data["obs"][50], final)  # the next step starts a new episode


def test_the_learner_bootstraps_a_truncated_reward_with_its_current_critic():
    cfg = APPOConfig(num_envs=2, steps_per_rollout=4, minibatch_size=8, hidden_sizes=(8,), gamma=0.9)
    learner = APPOLearner(cfg, 3, 1, "cpu")
    learner.normalizer.update(torch.randn(64, 3) * 2 + 1)
    generator = torch.Generator().manual_seed(0)
    batch = {
        "obs": torch.randn(4, 2, 3, generator=generator), "actions": torch.randn(4, 2, 1),
        "logp": torch.zeros(4, 2), "rewards": torch.ones(4, 2), "dones": torch.zeros(4, 2),
        "last_obs": torch.randn(2, 3), "truncated": torch.zeros(4, 2),
        "final_obs": torch.randn(4, 2, 3, generator=generator),
    }  # fmt: skip
    batch["truncated"][2, 1] = batch["dones"][2, 1] = 1.0
    rewards = learner._with_timeout_bootstrap(batch)
    with torch.no_grad():
        value = learner.model.value(learner.normalizer.normalize(batch["final_obs"][2, 1]))
    expected = torch.ones(4, 2)
    expected[2, 1] += 0.9 * value
    torch.testing.assert_close(rewards, expected)
    assert torch.equal(batch["rewards"], torch.ones(4, 2))  # the batch itself is left as it is
    del batch["truncated"], batch["final_obs"]
    assert torch.equal(learner._with_timeout_bootstrap(batch), torch.ones(4, 2))
