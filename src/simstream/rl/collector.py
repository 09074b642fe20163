"""The APPO collector: steps a vector of gymnasium environments with the latest policy into the ring.

Runs in the spawned collector process (:func:`run_appo_collector`) or, in serial mode, inside the learner
(:class:`RolloutCollector` used directly). A newly published policy is applied at the next step
(``weight_refresh="step"``, the default) or only between rollouts (``"rollout"``); every step records the
version that chose its action, and the ring stamps the rollout with its oldest version.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..workers.supervisor import ctrl_c_deferred, owner_watch
from .appo import check_finite
from .model import ActorCritic, ObsNormalizer, unpack_policy
from .ring import RolloutRing
from .weights import WeightBuffer

__all__ = [
    "TIMING_KEYS",
    "CollectorSpec",
    "RolloutCollector",
    "describe_env",
    "ring_fields",
    "run_appo_collector",
]

TIMING_KEYS = ("collector/rollout_s", "collector/env_step_s", "collector/wait_s")
"""Per rollout: seconds producing it, of which stepping environments, and seconds blocked before it."""


@dataclass(frozen=True)
class CollectorSpec:
    """Everything the collector needs besides shared memory (plain data, pickled into the child)."""

    env_id: str
    num_envs: int
    steps: int
    seed: int
    obs_dim: int
    act_dim: int
    hidden_sizes: tuple[int, ...]
    init_log_std: float
    gamma: float
    reward_scale: float
    normalize_obs: bool
    sync: bool
    refresh_each_step: bool = True


def describe_env(env_id: str) -> tuple[int, int]:
    """``(obs_dim, act_dim)`` of a gymnasium task with flat ``Box`` spaces (builds and closes one env)."""
    import gymnasium as gym

    env = gym.make(env_id)
    try:
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        raise ValueError(f"APPOConfig.env_id must name a task with a flat Box observation, got {env_id!r}")
    if not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) != 1:
        raise ValueError(f"APPOConfig.env_id must name a task with a flat Box action, got {env_id!r}")
    return int(obs_space.shape[0]), int(act_space.shape[0])


def ring_fields(spec: CollectorSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-slot layout of one rollout, time-major ``[T, N, ...]``."""
    t, n, f32 = spec.steps, spec.num_envs, torch.float32
    return {
        "obs": ((t, n, spec.obs_dim), f32),
        "actions": ((t, n, spec.act_dim), f32),
        "logp": ((t, n), f32),
        "versions": ((t,), torch.int64),
        "rewards": ((t, n), f32),
        "dones": ((t, n), f32),
        "truncated": ((t, n), f32),
        "final_obs": ((t, n, spec.obs_dim), f32),
        "last_obs": ((n, spec.obs_dim), f32),
        "episode_returns": ((t * n,), f32),
        "episode_lengths": ((t * n,), f32),
        "num_episodes": ((), torch.int64),
        "timing_s": ((len(TIMING_KEYS),), f32),
    }


def _make_vector_env(env_id: str, num_envs: int):
    import gymnasium as gym

    return gym.vector.SyncVectorEnv(
        [partial(gym.make, env_id) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )


class RolloutCollector:
    """Owns the vector env, a CPU copy of the policy and the running episode statistics.

    Invariant: ``self.version`` is the version of the weights the next step will use; ``versions[t]`` in the
    ring is the version that produced step ``t``'s action and log-probability.
    """

    def __init__(
        self,
        spec: CollectorSpec,
        ring: RolloutRing,
        weights: WeightBuffer,
        beat: Callable[[], None] = lambda: None,
        *,
        in_learner: bool = False,
    ) -> None:
        self.spec, self.ring, self.weights, self.beat = spec, ring, weights, beat
        # In the learner's own thread (serial mode) a Ctrl-C waits for the step it lands in: inside
        # envs.step it left the envs a step ahead of the observation and the episode counters kept here
        # (a later learn() then joined two episodes into one, without a done between them).
        self._whole_step = ctrl_c_deferred if in_learner else contextlib.nullcontext
        self.envs = _make_vector_env(spec.env_id, spec.num_envs)
        obs_shape, act_shape = self.envs.single_observation_space.shape, self.envs.single_action_space.shape
        if obs_shape != (spec.obs_dim,) or act_shape != (spec.act_dim,):
            raise ValueError(
                f"{spec.env_id} built in the collector has spaces {obs_shape}/{act_shape}, "
                f"the learner expected ({spec.obs_dim},)/({spec.act_dim},)"
            )
        self.low = torch.as_tensor(self.envs.single_action_space.low, dtype=torch.float32)
        self.high = torch.as_tensor(self.envs.single_action_space.high, dtype=torch.float32)
        self.model = ActorCritic(spec.obs_dim, spec.act_dim, spec.hidden_sizes, spec.init_log_std)
        self.normalizer = ObsNormalizer(spec.obs_dim, spec.normalize_obs)
        self.version = -1
        self._vector = torch.empty(weights.size)
        self._noise = torch.Generator().manual_seed(spec.seed + 7919)
        # a seed of its own per environment: gymnasium's default (seed + i) gave runs with seeds 0 and 1
        # 15 of their 16 environments' starts in common
        env_seeds = np.random.SeedSequence(spec.seed).generate_state(spec.num_envs, dtype=np.uint32)
        obs, _ = self.envs.reset(seed=[int(s) for s in env_seeds])
        self.obs = torch.as_tensor(obs, dtype=torch.float32)
        self.ep_return = np.zeros(spec.num_envs)
        self.ep_length = np.zeros(spec.num_envs)
        self._waited_s = self._env_s = 0.0

    def pull_weights(self, should_stop: Callable[[], bool], newer_than: int) -> bool:
        """Apply the newest weights, first waiting until their version exceeds ``newer_than``.

        Returns:
            ``False`` if asked to stop while waiting.
        """
        began = time.perf_counter()
        while self.weights.version <= newer_than:
            if should_stop():
                return False
            self.beat()
            time.sleep(0.0005)
        self._waited_s += time.perf_counter() - began
        self._apply_newest_weights()
        return True

    def _apply_newest_weights(self) -> None:
        """Load the published weights when they are newer than the ones in use (a no-op otherwise)."""
        if self.weights.version != self.version:
            version = self.weights.read_into(self._vector, on_retry=self.beat)
            # the version last: a Ctrl-C inside the copy (serial mode, the learner's thread) left a model
            # half old, half new, stamped as the new version, and never read again until the next publish
            unpack_policy(self._vector, self.model, self.normalizer)
            self.version = version

    def collect(self, should_stop: Callable[[], bool]) -> bool:
        """Write one rollout into a ring slot and commit it; ``False`` if stopped first."""
        began = time.perf_counter()
        slot = self.ring.acquire(should_stop=should_stop, on_wait=self.beat)
        if slot is None:
            return False
        committed = False
        try:
            committed = self._fill(slot, should_stop, began)
        finally:
            if not committed:
                # stopped, failed or interrupted (a serial runner's Ctrl-C lands here): the slot goes
                # back, or every cut rollout would keep one until none is left and learn() waits forever
                self.ring.abandon(slot)
        return committed

    def _fill(self, slot: int, should_stop: Callable[[], bool], began: float) -> bool:
        started = time.perf_counter()
        view = {name: tensor[slot] for name, tensor in self.ring.data.items()}
        episodes = 0
        self._env_s = 0.0
        for t in range(self.spec.steps):
            if should_stop():
                return False
            self.beat()
            # A policy published mid-rollout is used from the next step on: each step records the
            # version whose log-probability it stored, so the learner's data is as fresh as it can be.
            if self.spec.refresh_each_step:
                self._apply_newest_weights()
            view["versions"][t] = self.version
            with self._whole_step():
                episodes = self._step(view, t, episodes)
        view["last_obs"].copy_(self.obs)
        view["num_episodes"].fill_(episodes)
        waited, self._waited_s = self._waited_s + started - began, 0.0
        view["timing_s"].copy_(torch.tensor([time.perf_counter() - started, self._env_s, waited]))
        # the oldest version any step used (the lag cap sees the worst step); read after the steps, since
        # the first step may already act with weights newer than those held while waiting for the slot
        self.ring.commit(slot, int(view["versions"].min()))
        return True

    def _step(self, view: dict[str, torch.Tensor], t: int, episodes: int) -> int:
        obs = self.obs
        with torch.inference_mode():
            dist = self.model.distribution(self.normalizer.normalize(obs))
            action = torch.normal(dist.mean, dist.stddev, generator=self._noise)
            logp = dist.log_prob(action).sum(-1)
        check_finite("actions", action)
        stepped = time.perf_counter()
        next_obs, reward, terminated, truncated, info = self.envs.step(
            torch.maximum(torch.minimum(action, self.high), self.low).numpy()
        )
        self._env_s += time.perf_counter() - stepped
        rewards = torch.as_tensor(reward, dtype=torch.float32)
        check_finite("rewards", rewards)
        # Timeout bootstrapping: a truncated episode did not end, and its last reward gets gamma * V(s_T)
        # from the learner's critic at its update (this copy of the critic may be several versions old)
        cut = np.nonzero(truncated & ~terminated)[0]
        view["truncated"][t] = 0.0
        if cut.size:
            final = torch.as_tensor(np.stack(info["final_obs"][cut]), dtype=torch.float32)
            check_finite("final_obs", final)
            view["final_obs"][t, cut] = final
            view["truncated"][t, cut] = 1.0
        done = terminated | truncated
        view["obs"][t] = obs
        view["actions"][t] = action
        view["logp"][t] = logp
        view["rewards"][t] = rewards * self.spec.reward_scale
        view["dones"][t] = torch.as_tensor(done, dtype=torch.float32)
        self.ep_return += reward
        self.ep_length += 1
        for i in np.nonzero(done)[0]:
            view["episode_returns"][episodes] = float(self.ep_return[i])
            view["episode_lengths"][episodes] = float(self.ep_length[i])
            episodes += 1
            self.ep_return[i] = 0.0
            self.ep_length[i] = 0
        self.obs = torch.as_tensor(next_obs, dtype=torch.float32)
        check_finite("observations", self.obs)
        return episodes

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Collect until ``should_stop()``; in sync mode wait for a newer policy before each rollout."""
        newer_than = -1
        while not should_stop():
            if not self.pull_weights(should_stop, newer_than):
                return
            if not self.collect(should_stop):
                return
            if self.spec.sync:
                newer_than = self.version

    def close(self) -> None:
        self.envs.close()


def run_appo_collector(
    stop_event,
    heartbeat: Callable[[], None],
    spec: CollectorSpec,
    ring: RolloutRing,
    weights: WeightBuffer,
) -> None:
    """Collector process body (``APPORunner._collector_fn``): build, then collect until stopped.

    Also stops when the learner process is gone (killed without ``close()``), so no collector outlives it.
    """
    torch.set_num_threads(1)
    owner_gone = owner_watch()
    collector = RolloutCollector(spec, ring, weights, beat=heartbeat)

    def should_stop() -> bool:
        return stop_event.is_set() or owner_gone()

    try:
        collector.run(should_stop)
    finally:
        collector.close()
