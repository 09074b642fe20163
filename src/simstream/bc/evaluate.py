"""Closed-loop evaluation: run a chunk policy in fresh seeded episodes of a built-in task.

The episodes of one evaluation run in lockstep, one ``TaskEnv`` each, so the policy runs once per control
step on a batch instead of once per episode; more than :data:`MAX_PARALLEL_EPISODES` seeds run in
consecutive groups, so memory stays bounded. The policy predicts a chunk of ``horizon`` actions. By default
the executor replans every step and blends every chunk's prediction for the current step (temporal
ensembling, as in ACT); with ``ensemble_decay=None`` it plays the first ``execute_steps`` of each chunk and
then replans (receding horizon). With ``n`` chunks covering step ``t``, the oldest first (``i = 0``):

    a_t = sum_i w_i * chunk_i[t] / sum_i w_i,   w_i = exp(-ensemble_decay * i)

so ``ensemble_decay = 0`` is the plain average and a larger value trusts older chunks more. Measured on
pick_place (one policy, 50 seeded episodes, before the gripper threshold): averaging 90%, executing 8
steps per chunk 82%, 4 steps 62%.

The gripper is then executed as the expert commands it, fully open or closed: above ``gripper_threshold``
the command is 1, else 0. A regressed command between the two (the blend of "keep holding" and "open")
leaves the fingers half open, a state the expert never shows; vision policies stalled there with the cube
in the bin (``docs/demo.md``).
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
from .vision import PROPRIO_DIM, VisionPolicy, proprio_features

__all__ = [
    "EVAL_SEED_BASE",
    "MAX_PARALLEL_EPISODES",
    "STRIP_EVERY",
    "EvalResult",
    "RolloutConfig",
    "eval_seeds",
    "evaluate_policy",
]

EVAL_SEED_BASE = 1_000_000_007
"""First evaluation seed. Producers draw 64-bit hashed seeds, so evaluation episodes are fresh."""
STRIP_EVERY = 4
"""Steps between the policy frames kept for the report's strips."""


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
    gripper_threshold: float | None = 0.25
    """The executed gripper command (the action's last entry, 1 = open) is 1 above this and 0 at or below
    it, as the expert's; ``None`` executes the predicted value as it is. In (0, 1). Below 0.5 because
    opening is the safe side: a policy unsure whether to let go hovers at 0.3-0.6 with the cube in the bin,
    while a carried cube is held at values near 0 (chosen on seeds apart from the reported ones:
    ``docs/demo.md``)."""

    def __post_init__(self) -> None:
        require_int("RolloutConfig", "execute_steps", self.execute_steps, 1)
        require_number("RolloutConfig", "ensemble_decay", self.ensemble_decay, 0, optional=True)
        require_number(
            "RolloutConfig", "gripper_threshold", self.gripper_threshold, 0, 1,
            low_open=True, high_open=True, optional=True,
        )  # fmt: skip
        require_int("RolloutConfig", "max_episode_steps", self.max_episode_steps, 1)


@dataclass
class EvalResult:
    """Outcome of one evaluation: per-episode success and length, in seed order."""

    seeds: list[int]
    successes: list[bool]
    lengths: list[int]
    instructions: list[str]
    frames: list[list[np.ndarray]] = field(default_factory=list)
    """Rendered ``[H, W, 3]`` frames per recorded episode (only with ``record``), ``length + 1`` of them (the
    state before each action, then the one it ended in): the front camera, and for a vision policy its own
    cameras beside it (scaled up to the same height)."""
    strips: dict[str, tuple[int, list[np.ndarray]]] = field(default_factory=dict)
    """Vision policies with ``keep_strips``: ``"success"`` / ``"failure"`` -> ``(seed, frames)`` of the
    first such episode, what the policy saw every :data:`STRIP_EVERY` steps (``[S, S * cameras, 3]``)."""

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
        action = self._next(env)
        if self.rollout.gripper_threshold is not None:
            action[-1] = 1.0 if action[-1] > self.rollout.gripper_threshold else 0.0
        return action

    def _next(self, env: int) -> np.ndarray:
        if self.rollout.ensemble_decay is None:
            return self.pending[env].pop(0).copy()
        chunks = self.chunks[env]
        # the chunk planned `age` steps ago predicts the current step at its index `age`
        predictions = np.stack([chunk[age] for age, chunk in enumerate(chunks)])
        ages = np.arange(len(chunks))
        weights = np.exp(self.rollout.ensemble_decay * (ages - ages[-1]))  # the oldest weighs 1
        return weights @ predictions / weights.sum()


class _History:
    """The last ``history`` policy inputs of every episode, shifted by one frame per step."""

    def __init__(self, policy: ChunkPolicy | VisionPolicy, num_envs: int) -> None:
        config, history = policy.config, policy.config.history
        self.mask = torch.zeros(num_envs, history, dtype=torch.bool)
        if isinstance(policy, VisionPolicy):
            size = config.image_size
            self.tensors = {"proprio": torch.zeros(num_envs, history, PROPRIO_DIM)}
            for camera in config.cameras:
                self.tensors[camera] = torch.zeros(num_envs, history, 3, size, size, dtype=torch.uint8)
        else:
            self.tensors = {"features": torch.zeros(num_envs, history, policy.feature_mean.shape[0])}

    def push(self, frames: dict[str, torch.Tensor], active: list[int]) -> None:
        index = torch.tensor(active)
        for name, tensor in self.tensors.items():
            tensor[index] = torch.cat([tensor[index, 1:], frames[name][:, None]], dim=1)
        self.mask[index] = torch.cat([self.mask[index, 1:], torch.ones(len(active), 1, dtype=torch.bool)], 1)

    def act(self, policy: ChunkPolicy | VisionPolicy, rows: list[int], text: torch.Tensor) -> np.ndarray:
        device = policy.target_mean.device
        index = torch.tensor(rows)
        mask, text = self.mask[index].to(device), text[index].to(device)
        if isinstance(policy, VisionPolicy):
            images = {camera: self.tensors[camera][index].to(device) for camera in policy.config.cameras}
            chunks = policy.act(images, self.tensors["proprio"][index].to(device), mask, text)
        else:
            chunks = policy.act(self.tensors["features"][index].to(device), mask, text)
        return chunks.cpu().numpy()


def _frame_inputs(policy, envs, observations, active) -> dict[str, torch.Tensor]:
    """The policy's per-frame inputs of the active episodes; a vision policy's cameras are rendered here."""
    state = torch.from_numpy(np.stack([observations[i]["state"] for i in active]))
    if not isinstance(policy, VisionPolicy):
        objects = torch.from_numpy(np.stack([observations[i]["objects"] for i in active]))
        return {"features": observation_features(state, objects)}
    size = (policy.config.image_size,) * 2
    frames = {"proprio": proprio_features(state)}
    for camera in policy.config.cameras:
        frames[camera] = torch.from_numpy(np.stack([envs[i].scene.render(camera, size) for i in active]))
    return frames


def _side_by_side(front: np.ndarray, views: list[np.ndarray]) -> np.ndarray:
    """``[H, W, 3]`` front frame with the policy's ``[3, S, S]`` views beside it, scaled to height ``H``."""
    height = front.shape[0]
    scaled = []
    for view in views:
        pick = np.arange(height) * view.shape[1] // height
        scaled.append(view[:, pick][:, :, pick].transpose(1, 2, 0))
    return np.concatenate([front, *scaled], axis=1)


MAX_PARALLEL_EPISODES = 64
"""Episodes one evaluation steps in lockstep at most; more seeds run in consecutive groups of this size, so
memory (one simulator, its renderers and a history per episode) stays bounded whatever ``--episodes`` is."""


def evaluate_policy(
    policy: ChunkPolicy | VisionPolicy,
    embedding: HashedTextEmbedding,
    task: str,
    seeds: Sequence[int],
    rollout: RolloutConfig | None = None,
    *,
    record: int = 0,
    image_size: int = 128,
    keep_strips: bool = False,
    on_step: Callable[[int], None] | None = None,
    max_parallel: int = MAX_PARALLEL_EPISODES,
) -> EvalResult:
    """Run ``policy`` closed-loop in one episode per seed of ``task``; up to ``max_parallel`` in lockstep.

    Args:
        policy: A fitted :class:`ChunkPolicy` or :class:`VisionPolicy` (in eval mode while it runs, then
            back in the mode it had; it runs on the device its weights are on).
        embedding: The text embedding the policy was trained with.
        task: A built-in task name.
        seeds: ``TaskEnv.reset`` seeds, one episode each.
        rollout: Chunk execution settings (default :class:`RolloutConfig`).
        record: Render the first ``record`` episodes from the front camera (for a video): the state
            before every action and the state the episode ended in (``length + 1`` frames); a vision
            policy's own camera frames are shown beside it.
        image_size: Side of the rendered front frames.
        keep_strips: Keep what a vision policy saw in its first successful and first failed episode.
        on_step: Called with the number of episodes that finished, after each control step where some did.
        max_parallel: Episodes run in lockstep at most (the seeds in order, in groups of this size).
            An episode's actions can differ in their last bits with the number of episodes stepped beside
            it (a matrix product over one row takes another path than over several), so a rerun is exact
            with the same seeds and ``max_parallel``, not necessarily with other groupings.

    Returns:
        Per-episode success, length and instruction, in seed order; the recorded frames and the strips.
    """
    from simstream.tasks import get_task

    rollout = rollout or RolloutConfig()
    require_int("evaluate_policy", "max_parallel", max_parallel, 1)
    require_int("evaluate_policy", "record", record, 0)
    get_task(task)  # an unknown name fails before a simulator is built
    # the caller's mode comes back: a training loop that evaluates lost a vision policy's random shift
    training = policy.training
    policy.eval()
    try:
        result = EvalResult(seeds=list(seeds), successes=[], lengths=[], instructions=[])
        for start in range(0, len(result.seeds), max_parallel):
            group = result.seeds[start : start + max_parallel]
            part = _evaluate_group(
                policy, embedding, task, group, rollout,
                record=max(0, min(record - start, len(group))), image_size=image_size,
                keep_strips=keep_strips and len(result.strips) < 2, on_step=on_step,
            )  # fmt: skip
            result.successes += part.successes
            result.lengths += part.lengths
            result.instructions += part.instructions
            result.frames += part.frames
            for outcome, strip in part.strips.items():
                result.strips.setdefault(outcome, strip)
    finally:
        policy.train(training)
    return result


def _evaluate_group(
    policy: ChunkPolicy | VisionPolicy,
    embedding: HashedTextEmbedding,
    task: str,
    seeds: Sequence[int],
    rollout: RolloutConfig,
    *,
    record: int,
    image_size: int,
    keep_strips: bool,
    on_step: Callable[[int], None] | None,
) -> EvalResult:
    """One group of :func:`evaluate_policy`: every episode of ``seeds`` in lockstep."""
    from simstream.tasks import make_env  # imports MuJoCo: only when evaluating

    vision = isinstance(policy, VisionPolicy)
    keep_strips = keep_strips and vision
    envs: list = []
    video: list = []
    try:  # built inside: what was built before a failure (a GL context refused) is closed too
        for _ in seeds:
            envs.append(make_env(task, max_episode_steps=rollout.max_episode_steps))
        # video frames get their own renderers: one renderer switching between the policy's and the
        # video's image sizes would rebuild its GL context on every frame
        for env in envs[: min(record, len(envs))]:
            video.append(env.scene._make_renderer((image_size, image_size)))
        observations = [env.reset(seed) for env, seed in zip(envs, seeds)]
        texts = embedding([env.instruction for env in envs])
        n = len(envs)
        history = _History(policy, n)
        executor = _ChunkExecutor(n, policy.config.horizon, rollout)
        done = [False] * n
        successes, lengths = [False] * n, [0] * n
        frames: list[list[np.ndarray]] = [[] for _ in range(min(record, n))]
        seen: list[list[np.ndarray]] = [[] for _ in range(n)]
        strips: dict[str, tuple[int, list[np.ndarray]]] = {}

        def video_frame(i: int, views: list[np.ndarray] | None) -> np.ndarray:
            video[i].update_scene(envs[i].scene.data, camera="front")
            front = video[i].render().copy()
            return _side_by_side(front, views) if views is not None else front

        def final_views(i: int) -> list[np.ndarray]:
            final = _frame_inputs(policy, envs, observations, [i])
            return [final[camera][0].numpy() for camera in policy.config.cameras]

        for step in range(rollout.max_episode_steps):
            active = [i for i in range(n) if not done[i]]
            if not active:
                break
            inputs = _frame_inputs(policy, envs, observations, active)
            history.push(inputs, active)
            replan = [i for i in active if executor.needs_plan(i)]
            if replan:
                for i, chunk in zip(replan, history.act(policy, replan, texts)):
                    executor.add_plan(i, chunk)
            views = {i: [inputs[c][k].numpy() for c in policy.config.cameras] for k, i in enumerate(active)} \
                if vision else {}  # fmt: skip
            finished = 0
            for i in active:
                if i < len(frames):
                    frames[i].append(video_frame(i, views.get(i)))
                if keep_strips and step % STRIP_EVERY == 0:
                    seen[i].append(np.concatenate(views[i], axis=2).transpose(1, 2, 0))
                obs, _, terminated, truncated, info = envs[i].step(executor.pop(i).astype(np.float32))
                observations[i], lengths[i] = obs, lengths[i] + 1
                if terminated or truncated:
                    done[i], successes[i] = True, bool(info["success"])
                    finished += 1
                    if i < len(frames):  # the state it ended in: the cube placed, or where the limit left it
                        frames[i].append(video_frame(i, final_views(i) if vision else None))
                    if keep_strips:
                        strips.setdefault("success" if successes[i] else "failure", (seeds[i], seen[i]))
                        seen[i] = []
            if on_step is not None and finished:
                on_step(finished)
        return EvalResult(
            seeds=list(seeds),
            successes=successes,
            lengths=lengths,
            instructions=[env.instruction for env in envs],
            frames=frames,
            strips=strips,
        )
    finally:
        for renderer in video:
            renderer.close()
        for env in envs:
            env.close()
