"""Env frames/s of async PPO vs lock-step (sync) PPO vs a plain single-process PPO loop, from one run.

Run: ``python benchmarks/rl_throughput.py`` (about 3 minutes on 2 vCPUs; ``--quick``: under a minute).

All candidates step the same gymnasium task with the same network, rollout shape and PPO update
(:class:`simstream.rl.learner.APPOLearner`), one torch thread each:

* **async**: ``APPORunner`` default mode: the collector process steps rollout k+1 while the learner trains
  on rollout k, so collection and learning overlap on two cores;
* **sync**: ``APPOConfig(mode="sync")``: the same processes in lock-step (the collector waits for each
  update);
* **serial**: ``APPOConfig(mode="serial")``: collect then learn in one process, through the ring;
* **plain**: a textbook loop (no ring, no weight buffer, no subprocess): step, then update.

The rate is env frames trained on per second between the end of the warm-up iterations and the last
update (collector start-up excluded). Candidates run in interleaved rounds and the median is printed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import numpy as np
import torch

from _timing import Table, main_of, print_header, ratio, require_gym_env, require_positive
from simstream.rl import APPOConfig, APPORunner
from simstream.rl.collector import describe_env
from simstream.rl.learner import APPOLearner


@dataclass(frozen=True)
class Args:
    """Throughput of async vs sync vs plain PPO on one task."""

    env: str = "Hopper-v5"
    num_envs: int = 16
    steps_per_rollout: int = 64
    num_epochs: int = 5
    """PPO epochs per rollout (the APPOConfig default)."""
    minibatch_size: int = 512
    hidden_sizes: tuple[int, ...] = (64, 64)
    warmup_iterations: int = 3
    iterations: int = 20
    """Measured updates per candidate and round."""
    rounds: int = 3
    quick: bool = False
    """A smoke run: 1 round of 6 measured updates."""

    def __post_init__(self) -> None:
        require_positive(
            self,
            "num_envs",
            "steps_per_rollout",
            "num_epochs",
            "minibatch_size",
            "hidden_sizes",
            "warmup_iterations",
            "iterations",
            "rounds",
        )
        require_gym_env(self.env)


def _config(args: Args, mode: str = "async") -> APPOConfig:
    return APPOConfig(
        env_id=args.env,
        num_envs=args.num_envs,
        steps_per_rollout=args.steps_per_rollout,
        num_epochs=args.num_epochs,
        minibatch_size=args.minibatch_size,
        hidden_sizes=args.hidden_sizes,
        mode=mode,
    )


def runner_rate(cfg: APPOConfig, warmup: int, iterations: int) -> tuple[float, float]:
    """(frames/s after warm-up, mean policy lag) of one APPORunner run."""
    with APPORunner(cfg) as runner:
        runner.learn(warmup + iterations, log_dir=None)
        rows = runner.history
    start, end = rows[warmup - 1], rows[-1]
    frames = end["rl/trained_frames"] - start["rl/trained_frames"]
    lag = statistics.mean(r["rl/policy_lag"] for r in rows[warmup:])
    return frames / (end["rl/wall_s"] - start["rl/wall_s"]), lag


def plain_rate(cfg: APPOConfig, warmup: int, iterations: int) -> float:
    """Frames/s of a single-process PPO loop: collect a rollout with the learner's own network, update."""
    import gymnasium as gym

    obs_dim, act_dim = describe_env(cfg.env_id)
    learner = APPOLearner(cfg, obs_dim, act_dim, "cpu")
    model, norm = learner.model, learner.normalizer
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make(cfg.env_id) for _ in range(cfg.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    space = envs.single_action_space
    low, high = torch.as_tensor(space.low), torch.as_tensor(space.high)
    obs = torch.as_tensor(envs.reset(seed=cfg.seed)[0], dtype=torch.float32)
    t_steps, n = cfg.steps_per_rollout, cfg.num_envs
    began = None
    for iteration in range(warmup + iterations):
        if iteration == warmup:
            began = time.perf_counter()
        batch = {
            "obs": torch.empty(t_steps, n, obs_dim), "actions": torch.empty(t_steps, n, act_dim),
            "logp": torch.empty(t_steps, n), "rewards": torch.empty(t_steps, n),
            "dones": torch.empty(t_steps, n),
        }  # fmt: skip
        for t in range(t_steps):
            with torch.inference_mode():
                dist = model.distribution(norm.normalize(obs))
                action = dist.sample()
                logp = dist.log_prob(action).sum(-1)
            next_obs, reward, terminated, truncated, info = envs.step(action.clamp(low, high).numpy())
            rewards = torch.as_tensor(reward, dtype=torch.float32) * cfg.reward_scale
            cut = np.nonzero(truncated & ~terminated)[0]
            if cut.size:
                final = torch.as_tensor(np.stack(info["final_obs"][cut]), dtype=torch.float32)
                with torch.inference_mode():
                    rewards[cut] += cfg.gamma * model.value(norm.normalize(final))
            batch["obs"][t], batch["actions"][t], batch["logp"][t] = obs, action, logp
            batch["rewards"][t] = rewards
            batch["dones"][t] = torch.as_tensor(terminated | truncated, dtype=torch.float32)
            obs = torch.as_tensor(next_obs, dtype=torch.float32)
        batch["last_obs"] = obs
        learner.update(batch)
    envs.close()
    return iterations * t_steps * n / (time.perf_counter() - began)


def run(args: Args) -> int:
    if args.quick:
        args = replace(args, rounds=1, iterations=6, warmup_iterations=2)
    torch.set_num_threads(1)
    settings = (
        f"{args.env}, {args.num_envs} envs x {args.steps_per_rollout} steps per rollout, "
        f"MLP {args.hidden_sizes}, {args.num_epochs} epochs of minibatches of {args.minibatch_size}; "
        f"{args.warmup_iterations} warm-up + {args.iterations} measured updates, {args.rounds} round(s)"
    )
    print_header("Async RL throughput (env frames/s)", ["python", *sys.argv], settings)
    # Async overlaps collection and learning on two cores; other load on the machine eats that margin.
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rates: dict[str, list[float]] = {"async": [], "sync": [], "serial": [], "plain": []}
    lags: dict[str, list[float]] = {"async": [], "sync": [], "serial": []}
    for round_ in range(args.rounds):
        for name in lags:
            rate, lag = runner_rate(_config(args, name), args.warmup_iterations, args.iterations)
            rates[name].append(rate)
            lags[name].append(lag)
            print(f"round {round_ + 1}: {name:<6} {rate:8.0f} frames/s (policy lag {lag:.2f})", flush=True)
        rates["plain"].append(plain_rate(_config(args), args.warmup_iterations, args.iterations))
        print(f"round {round_ + 1}: plain  {rates['plain'][-1]:8.0f} frames/s", flush=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    table = Table(
        "Env frames/s (median over rounds)", ["mode", "frames/s", "vs sync", "vs plain", "policy lag"]
    )
    for name in ("async", "sync", "serial", "plain"):
        lag = statistics.mean(lags[name]) if name in lags else 0.0
        table.row(
            name, median[name], ratio(median[name], median["sync"]), ratio(median[name], median["plain"]), lag
        )
    speedup = ratio(median["async"], median["sync"])
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print(f"\nasync / sync = {speedup:.2f}x, async / plain = {ratio(median['async'], median['plain']):.2f}x")
    return 0 if speedup > 1.0 else 1


if __name__ == "__main__":
    main_of(run, Args)
