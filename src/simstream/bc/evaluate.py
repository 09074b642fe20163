"""Closed-loop evaluation: run a chunk policy in fresh seeded episodes of a built-in task.

All episodes of one evaluation run in lockstep, one ``TaskEnv`` each, so the policy runs once per control
step on a batch instead of once per episode. The policy predicts a chunk of ``horizon`` actions. By default
the executor replans every step and blends every chunk's prediction for the current step (temporal
ensembling, as in ACT); with ``ensemble_decay=None`` it plays the first ``execute_steps`` of each chunk and
then replans (receding horizon). With ``n`` chunks covering step ``t``, the oldest first (``i = 0``):

    a_t = sum_i w_i * chunk_i[t] / sum_i w_i,   w_i = exp(-ensemble_decay * i)

so ``ensemble_decay = 0`` is the plain average and a larger value trusts older chunks more. Measured on
pick_place (one policy, 50 seeded episodes): averaging 90%, executing 8 steps per chunk 82%, 4 steps 62%.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .._validation import require_int, require_number
from .policy import ChunkPolicy, observation_features
from .text import HashedTextEmbedding

__all__ = ["EVAL_SEED_BASE", "EvalResult", "RolloutConfig", "eval_seeds", "evaluate_policy"]

EVAL_SEED_BASE = 1_000_000_007
"""First evaluation seed. Producers draw 64-bit hashed seeds, so evaluation episodes are fresh."""


def eval_seeds(num_episodes: int, offset: int = 0) -> list[int]:
    """The reset seeds of an evaluation: ``EVAL_SEED_BASE + offset + i``."""
    return [EVAL_SEED_BASE + offset + i for i in range(num_episodes)]


@dataclass(frozen=True)
class RolloutConfig:
    """How the policy's action chunks are executed."""

    ensemble_decay: float | None = 0.0
    """Temporal ensembling weight decay ``m`` (>= 0; 0 averages); ``None`` executes chunks instead."""
    execute_steps: int = 8
    """Actions played from each chunk before replanning (with ``ensemble_decay=None`` only)."""
    max_episode_steps: int = 200
    """Truncation limit of an evaluation episode (20 Hz steps)."""

    def __post_init__(self) -> None:
        require_int("RolloutConfig", "execute_steps", self.execute_steps, 1)
        require_number("RolloutConfig", "ensemble_decay", self.ensemble_decay, 0, optional=True)
        require_int("RolloutConfig", "max_episode_steps", self.max_episode_steps, 1)


@dataclass
class EvalResult:
    """Outcome of one evaluation: per-episode success and length, in seed order."""

    seeds: list[int]
    successes: list[bool]
    lengths: list[int]
    instructions: list[str]
    frames: list[list[np.ndarray]] = field(default_factory=list)
    """Rendered ``[H, W, 3]`` frames per recorded episode (only with ``record``)."""

    @property
    def success_rate(self) -> float:
        """Fraction of successful episodes."""
        return float(np.mean(self.successes)) if self.successes else 0.0


class _ChunkExecutor:
    """Per-episode action source: temporal ensembling or receding-horizon execution of the chunks."""

    def __init__(self, num_envs: int, horizon: int, rollout: RolloutConfig) -> None:
        self.rollout = rollout
        self.pending: list[list[np.ndarray]] = [[] for _ in range(num_envs)]
        # ensembling: the chunks that still cover the coming step, newest first
        self.chunks: list[deque[np.ndarray]] = [deque(maxlen=horizon) for _ in range(num_envs)]

    def needs_plan(self, env: int) -> bool:
        return self.rollout.ensemble_decay is not None or not self.pending[env]

    def add_plan(self, env: int, chunk: np.ndarray) -> None:
        if self.rollout.ensemble_decay is None:
            self.pending[env] = list(chunk[: self.rollout.execute_steps])
        else:
            self.chunks[env].appendleft(chunk)

    def pop(self, env: int) -> np.ndarray:
        if self.rollout.ensemble_decay is None:
            return self.pending[env].pop(0)
        chunks = self.chunks[env]
        # the chunk planned `age` steps ago predicts the current step at its index `age`
        predictions = np.stack([chunk[age] for age, chunk in enumerate(chunks)])
        ages = np.arange(len(chunks))
        weights = np.exp(self.rollout.ensemble_decay * (ages - ages[-1]))  # the oldest weighs 1
        return weights @ predictions / weights.sum()


def evaluate_policy(
    policy: ChunkPolicy,
    embedding: HashedTextEmbedding,
    task: str,
    seeds: Sequence[int],
    rollout: RolloutConfig | None = None,
    *,
    record: int = 0,
    image_size: int = 128,
    on_step: Callable[[int], None] | None = None,
) -> EvalResult:
    """Run ``policy`` closed-loop in one episode per seed of ``task``; the episodes run in lockstep.

    Args:
        policy: A fitted :class:`ChunkPolicy` (set to eval mode here).
        embedding: The text embedding the policy was trained with.
        task: A built-in task name.
        seeds: ``TaskEnv.reset`` seeds, one episode each.
        rollout: Chunk execution settings (default :class:`RolloutConfig`).
        record: Render the first ``record`` episodes from the front camera (for a video).
        image_size: Side of the rendered frames.
        on_step: Called with the number of episodes that finished, after each control step where some did.

    Returns:
        Per-episode success, length and instruction, and the recorded frames.
    """
    from simstream.tasks import make_env  # imports MuJoCo: only when evaluating

    rollout = rollout or RolloutConfig()
    policy.eval()
    history, horizon = policy.config.history, policy.config.horizon
    envs = [make_env(task, max_episode_steps=rollout.max_episode_steps) for _ in seeds]
    try:
        observations = [env.reset(seed) for env, seed in zip(envs, seeds)]
        texts = embedding([env.instruction for env in envs])
        n = len(envs)
        feats = torch.zeros(n, history, policy.feature_mean.shape[0])
        mask = torch.zeros(n, history, dtype=torch.bool)
        executor = _ChunkExecutor(n, horizon, rollout)
        done = [False] * n
        successes, lengths = [False] * n, [0] * n
        frames: list[list[np.ndarray]] = [[] for _ in range(min(record, n))]
        for _ in range(rollout.max_episode_steps):
            active = [i for i in range(n) if not done[i]]
            if not active:
                break
            _push(feats, mask, observations, active)
            replan = [i for i in active if executor.needs_plan(i)]
            if replan:
                chunks = policy.act(feats[replan], mask[replan], texts[replan]).numpy()
                for i, chunk in zip(replan, chunks):
                    executor.add_plan(i, chunk)
            finished = 0
            for i in active:
                if i < len(frames):
                    frames[i].append(
                        envs[i].scene.render("front", (image_size, image_size)).transpose(1, 2, 0)
                    )
                obs, _, terminated, truncated, info = envs[i].step(executor.pop(i).astype(np.float32))
                observations[i], lengths[i] = obs, lengths[i] + 1
                if terminated or truncated:
                    done[i], successes[i] = True, bool(info["success"])
                    finished += 1
            if on_step is not None and finished:
                on_step(finished)
        return EvalResult(
            seeds=list(seeds),
            successes=successes,
            lengths=lengths,
            instructions=[env.instruction for env in envs],
            frames=frames,
        )
    finally:
        for env in envs:
            env.close()


def _push(feats: torch.Tensor, mask: torch.Tensor, observations: list[dict], active: list[int]) -> None:
    """Shift each active episode's history by one frame and append its newest observation."""
    index = torch.tensor(active)
    state = torch.from_numpy(np.stack([observations[i]["state"] for i in active]))
    objects = torch.from_numpy(np.stack([observations[i]["objects"] for i in active]))
    feats[index] = torch.cat([feats[index, 1:], observation_features(state, objects)[:, None]], dim=1)
    mask[index] = torch.cat([mask[index, 1:], torch.ones(len(active), 1, dtype=torch.bool)], dim=1)
