"""Frozen, validated configuration of the async runner and of async PPO.

Every field has an attribute docstring (tyro prints it as ``--help``). A bad value raises ``ValueError``
at construction, naming the field and the accepted range, before any memory or process exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, get_args

from .._validation import require, require_choice, require_int, require_number
from ..config import INT64_MAX, MAX_TIMEOUT_S

__all__ = [
    "MAX_NUM_ENVS",
    "MAX_STATS_WINDOW",
    "MODES",
    "APPOConfig",
    "Mode",
    "RunnerConfig",
    "max_learner_threads",
]

MAX_NUM_ENVS = 4096
"""Environments one collector steps one after another (``SyncVectorEnv``): more would take minutes to
build and to step once, and fail the collector's start-up as a hang instead of being refused here."""
MAX_STATS_WINDOW = 1_000_000
"""Most completed episodes the reported return averages (the window is a ``deque`` of that length)."""


def max_learner_threads() -> int:
    """The most torch threads the learner may ask for: 256, or this machine's CPUs when it has more (torch
    and its OpenMP runtime crash when thread creation fails)."""
    return max(256, os.cpu_count() or 1)


Mode = Literal["async", "sync", "serial"]
"""How collection and learning interleave (see :attr:`APPOConfig.mode`)."""
MODES: tuple[str, ...] = get_args(Mode)


@dataclass(frozen=True)
class RunnerConfig:
    """Supervision of the collector process (every bound the learner waits under)."""

    hang_timeout_s: float = 30.0
    """A collector that sends no heartbeat for this long is reported as hung and stopped."""
    startup_timeout_s: float = 120.0
    """Grace from spawning the collector until its first heartbeat (imports, building environments)."""
    shutdown_timeout_s: float = 10.0
    """close() waits this long for a graceful exit before terminate(), then kill()."""
    poll_interval_s: float = 0.1
    """Every wait is sliced into pieces this long, each followed by a liveness check."""
    data_timeout_s: float = 300.0
    """The longest the learner waits for one rollout from a live, beating collector."""

    def __post_init__(self) -> None:
        # process joins poll(2) in int32 milliseconds: longer waits would overflow
        for name in ("hang_timeout_s", "startup_timeout_s", "data_timeout_s"):
            require_number("RunnerConfig", name, getattr(self, name), 0, MAX_TIMEOUT_S, low_open=True)
        require_number("RunnerConfig", "shutdown_timeout_s", self.shutdown_timeout_s, 0, MAX_TIMEOUT_S)
        require_number(
            "RunnerConfig",
            "poll_interval_s",
            self.poll_interval_s,
            0,
            0.5,
            low_open=True,
            consequence="Longer slices would let a collector death go unnoticed for more than a second.",
        )


@dataclass(frozen=True)
class APPOConfig:
    """Asynchronous PPO (IMPACT-style V-trace with a target network) on a gymnasium task."""

    env_id: str = "Hopper-v5"
    """Gymnasium environment id (``module:Name-v0`` imports ``module`` first)."""
    num_envs: int = 16
    """Environments stepped together (``SyncVectorEnv``) inside the collector."""
    steps_per_rollout: int = 64
    """Steps per environment in one rollout; a rollout holds ``num_envs * steps_per_rollout`` frames."""
    num_slots: int = 4
    """Rollouts the shared-memory ring holds."""
    overflow: Literal["block", "drop_oldest"] = "block"
    """Full ring: ``block`` makes the collector wait (back-pressure); ``drop_oldest`` overwrites (counted)."""
    weight_refresh: Literal["step", "rollout"] = "step"
    """When the collector applies a newly published policy (async mode): ``step`` at the next environment
    step, so a rollout may hold several versions, each step stamped with its own (fresher data, lower
    policy lag); ``rollout`` only between rollouts (one version per rollout)."""
    max_policy_lag: int | None = 8
    """Async mode: rollouts whose policy is more than this many versions behind the learner are dropped
    (counted). Sync and serial modes train on every rollout: the collector makes the next one only after
    it (their lag is 0, except for a rollout that straddled a ``load_checkpoint``)."""
    mode: Mode = "async"
    """``async``: the collector steps the next rollouts while the learner trains (policy lag >= 0);
    ``sync``: the collector waits for each update before its next rollout (lock-step, policy lag 0, for A/B
    comparison); ``serial``: collect, then learn, in this one process (no subprocess; for debugging)."""
    seed: int = 0
    """Seeds the networks, the environments and the action noise."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor and of the critic (separate networks)."""
    init_log_std: float = -0.5
    """Initial log standard deviation of the Gaussian policy."""
    learning_rate: float = 3e-4
    """Adam step size (the start value when ``desired_kl`` adapts it)."""
    desired_kl: float | None = 0.01
    """Adapt the step size to keep KL(policy at the update's start || current) near this (the target's KL
    with ``target_update_interval`` 1); ``None`` keeps it constant."""
    num_epochs: int = 5
    """Passes over each batch."""
    minibatch_size: int = 512
    """Frames per gradient step, at least 2 (advantages are normalised per minibatch, and one frame's
    normalised advantage is 0: no policy gradient)."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """Trace decay: V-trace ``c_t = lambda * min(c_bar, rho_t)``; on-policy the value targets are GAE(lambda)
    returns (the policy advantage is IMPALA's ``rho_t (r_t + gamma v_{t+1} - V(x_t))``, ``v`` the V-trace
    targets)."""
    clip_ratio: float = 0.2
    """PPO clipping range of the policy ratio."""
    value_coef: float = 0.5
    """Weight of the value loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = 1.0
    """Global gradient norm clip."""
    rho_bar: float = 1.0
    """V-trace truncation of the importance weight in the value targets."""
    c_bar: float = 1.0
    """V-trace truncation of the trace coefficients."""
    target_update_interval: int = 1
    """Copy the learner's policy into the target network every this many updates."""
    normalize_obs: bool = True
    """Normalise observations with running statistics (shared with the collector through the weights)."""
    reward_scale: float = 0.1
    """Rewards are multiplied by this before learning (returns in episode metrics stay unscaled)."""
    learner_num_threads: int = 1
    """torch threads of the learner during ``learn()`` (0 keeps torch's setting); the collector uses 1."""
    stats_window: int = 20
    """Completed episodes averaged into the reported return."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Collector supervision."""

    def __post_init__(self) -> None:
        owner = "APPOConfig"
        require(isinstance(self.env_id, str) and bool(self.env_id), owner, "env_id", "a gym id", self.env_id)
        for name, low, high in (
            ("num_envs", 1, MAX_NUM_ENVS),
            ("steps_per_rollout", 1, None),
            ("num_slots", 2, None),
            ("num_epochs", 1, None),
            ("minibatch_size", 2, None),  # advantages are normalised per minibatch: one frame's is 0
            ("target_update_interval", 1, None),
            ("learner_num_threads", 0, max_learner_threads()),
            ("stats_window", 1, MAX_STATS_WINDOW),
            ("seed", 0, INT64_MAX),
        ):
            require_int(owner, name, getattr(self, name), low, high)
        require_choice(owner, "overflow", self.overflow, ("block", "drop_oldest"))
        require_choice(owner, "weight_refresh", self.weight_refresh, ("step", "rollout"))
        require_choice(owner, "mode", self.mode, MODES)
        if self.max_policy_lag is not None:
            require_int(owner, "max_policy_lag", self.max_policy_lag, 0)
        require(
            isinstance(self.hidden_sizes, tuple)
            and len(self.hidden_sizes) >= 1
            and all(type(h) is int and h >= 1 for h in self.hidden_sizes),
            owner,
            "hidden_sizes",
            "a non-empty tuple of ints >= 1",
            self.hidden_sizes,
        )
        require(type(self.normalize_obs) is bool, owner, "normalize_obs", "True or False", self.normalize_obs)
        for name in ("learning_rate", "clip_ratio", "max_grad_norm", "rho_bar", "c_bar", "reward_scale"):
            require_number(owner, name, getattr(self, name), 0, low_open=True)
        require_number(owner, "desired_kl", self.desired_kl, 0, low_open=True, optional=True)
        require_number(owner, "gamma", self.gamma, 0, 1)
        require_number(owner, "gae_lambda", self.gae_lambda, 0, 1)
        for name in ("value_coef", "entropy_coef"):
            require_number(owner, name, getattr(self, name), 0)
        require_number(owner, "init_log_std", self.init_log_std, -5, 2)
        require(
            self.minibatch_size <= self.frames_per_rollout,
            owner,
            "minibatch_size",
            f"<= num_envs * steps_per_rollout = {self.frames_per_rollout}",
            self.minibatch_size,
        )
        require(isinstance(self.runner, RunnerConfig), owner, "runner", "a RunnerConfig", self.runner)

    @property
    def frames_per_rollout(self) -> int:
        """Environment frames in one rollout."""
        return self.num_envs * self.steps_per_rollout
