"""The training loop: sample contexts from the live stream, fit the chunk policy, check it closed-loop.

The loop reads the engine while its producers keep refilling the buffer, so every metric that says how
fresh the data is (episodes published, generations, sampled contexts) is read from ``engine.get_stats()``
as training goes and kept in :class:`TrainingLog` for the report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.swa_utils import AveragedModel
from tqdm import tqdm

from .config import DURING_TRAINING_SEED_OFFSET, DemoConfig
from .data import InstructionTable, context_batch
from .evaluate import eval_seeds, evaluate_policy
from .policy import ChunkPolicy, masked_chunk_loss
from .prefetch import BatchPrefetcher
from .text import HashedTextEmbedding
from .vision import VisionPolicy, policy_keys, vision_context_batch

NORMALIZER_CONTEXTS = 8192
"""Contexts the normalisation is fitted on (one batch of the low-dimensional keys, no camera frames)."""
NORMALIZER_KEYS = ("obs/state", "obs/objects", "actions")
"""The payload fields that batch holds at most (with ``task_index``, ``valid`` and ``loss_mask``)."""

if TYPE_CHECKING:
    from simstream import OnlineDataEngine

__all__ = [
    "DURING_TRAINING_SEED_OFFSET",
    "TrainingLog",
    "batch_sampler",
    "fit_normalizer",
    "learning_rate",
    "train_policy",
    "weight_average",
]

_STREAM_EVERY_S = 2.0
_BATCH_TIMEOUT_S = 300.0
"""Bound of one wait for a training batch (the sampler's own bounded waits and producer checks run inside)."""


@dataclass
class TrainingLog:
    """Time series of one run (``time_s`` counts from the start of training)."""

    loss: list[tuple[int, float, float]] = field(default_factory=list)
    """``(step, time_s, loss)`` per step."""
    evals: list[dict[str, float]] = field(default_factory=list)
    """``{step, time_s, success_rate, episodes}`` per closed-loop check."""
    stream: list[dict[str, float]] = field(default_factory=list)
    """``{time_s, step, samples_per_s, fresh_episodes_per_s, successful_episodes, completed_generation,
    sampled_chunks}`` every ~2 s."""
    steps_done: int = 0
    train_time_s: float = 0.0
    stopped_early: bool = False
    """Whether ``time_limit_s`` ended training before ``steps``."""
    batch_wait_s: float = 0.0
    """Seconds the trainer spent blocked waiting for a batch (the prefetch thread samples ahead)."""
    step_time_s: float = 0.0
    """Seconds spent in gradient steps, waits included (closed-loop checks excluded)."""
    idle_thread_steps: int = 0
    """Gradient steps taken with ``DemoConfig.idle_threads`` threads, while the producers were idle."""
    episodes_at_start: int = 0
    """The engine's ``successful_episodes`` when training started (the base of the fresh-episode rate)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return {
            "loss": [list(item) for item in self.loss],
            "evals": list(self.evals),
            "stream": list(self.stream),
            "steps_done": self.steps_done,
            "train_time_s": self.train_time_s,
            "stopped_early": self.stopped_early,
            "batch_wait_s": self.batch_wait_s,
            "step_time_s": self.step_time_s,
            "idle_thread_steps": self.idle_thread_steps,
        }

    @property
    def batch_wait_share(self) -> float:
        """Share of each gradient step spent waiting for a batch (target: under 10%)."""
        return self.batch_wait_s / max(self.step_time_s, 1e-9)


def batch_sampler(
    engine: OnlineDataEngine,
    policy: ChunkPolicy | VisionPolicy,
    instructions: InstructionTable,
    batch_size: int,
    generator: torch.Generator,
    *,
    images: bool = True,
) -> Callable[[], Any]:
    """A function that samples one context batch and converts it to the policy's tensors.

    It asks the engine for the keys the policy reads only (``keys=``): a vision policy's batch holds the
    camera frames, ``obs/state``, ``actions`` and ``task_index``, and ``obs/objects`` only when the policy
    has the auxiliary cube-position head (then as that head's target, never as an input). ``images=False``
    leaves the frames out (fitting the normalisation needs the low-dimensional keys only).
    """
    config = policy.config
    if isinstance(policy, VisionPolicy):
        cameras = config.cameras if images else ()
        objects = bool(config.object_dim)
        keys = policy_keys(cameras) + (["obs/objects"] if objects else [])

        def convert(batch):
            return vision_context_batch(batch, config.history, instructions, cameras, objects=objects)
    else:
        keys = ["obs/state", "obs/objects", "actions", "task_index"]

        def convert(batch):
            return context_batch(batch, config.history, instructions)

    def sample() -> Any:
        batch = engine.sample_batch_with_context(
            batch_size, config.history, config.horizon, generator=generator, keys=keys
        )
        return convert(batch)

    return sample


def fit_normalizer(
    engine: OnlineDataEngine,
    policy: ChunkPolicy | VisionPolicy,
    instructions: InstructionTable,
    generator: torch.Generator,
) -> int:
    """Fit the policy's normalisation on :data:`NORMALIZER_CONTEXTS` contexts sampled from the buffer now
    (the first generation, and whatever the producers refilled meanwhile); returns the count."""
    data = batch_sampler(engine, policy, instructions, NORMALIZER_CONTEXTS, generator, images=False)()
    if isinstance(policy, VisionPolicy):
        objects = data.object_targets
        policy.fit_normalizer(data.proprio, data.history_mask, data.targets, data.loss_mask, objects)
    else:
        policy.fit_normalizer(data.features, data.history_mask, data.targets, data.loss_mask)
    return len(data)


def learning_rate(peak: float, progress: float) -> float:
    """Linear warm-up over the first 5% of training, then cosine decay to 0 at ``progress = 1``.

    ``progress`` is the larger of the step fraction and the time fraction of the training budget, so a run
    cut short by ``time_limit_s`` still ends annealed instead of at a high learning rate.
    """
    progress = min(max(progress, 0.0), 1.0)
    if progress < 0.05:
        return peak * (progress + 0.002) / 0.052
    return peak * 0.5 * (1.0 + math.cos(math.pi * (progress - 0.05) / 0.95))


class _StreamMeter:
    """Samples/s and fresh episodes/s over the last window, read from the engine's counters."""

    def __init__(self, engine: OnlineDataEngine, batch_size: int) -> None:
        self.engine, self.batch_size = engine, batch_size
        self.began = self.last_time = time.monotonic()
        self.last_step, self.last_episodes = 0, engine.get_stats()["successful_episodes"]

    def read(self, step: int) -> dict[str, float]:
        now, stats = time.monotonic(), self.engine.get_stats()
        elapsed = max(now - self.last_time, 1e-9)
        record = {
            "time_s": now - self.began,
            "step": step,
            "samples_per_s": (step - self.last_step) * self.batch_size / elapsed,
            "fresh_episodes_per_s": (stats["successful_episodes"] - self.last_episodes) / elapsed,
            "successful_episodes": stats["successful_episodes"],
            "completed_generation": stats["completed_generation"],
            "sampled_chunks": stats["sampled_chunks"],
        }
        self.last_time, self.last_step, self.last_episodes = now, step, stats["successful_episodes"]
        return record


class _TrainerThreads:
    """Torch threads of the trainer: ``idle`` while the producers are idle, ``busy`` while they produce.

    A generation is being produced while the engine's requested generation is ahead of its completed one.
    Between generations the producers sleep, so the trainer can use their cores too; while they run,
    threads beyond the free cores would wait for one at every parallel region (measured on 2 cores: 2.7
    steps/s against 34.5). ``idle=0`` keeps ``busy`` throughout.
    """

    def __init__(self, engine: OnlineDataEngine, busy: int, idle: int) -> None:
        self.engine, self.busy, self.idle = engine, busy, idle
        self.current = busy
        torch.set_num_threads(busy)

    def update(self) -> bool:
        """Set the thread count for the next step; ``True`` when it is ``idle``'s."""
        if not self.idle:
            return False
        status = self.engine.get_flow_status()
        producers_idle = status["completed_generation"] >= status["requested_generation"]
        wanted = self.idle if producers_idle else self.busy
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
        return producers_idle


def train_policy(
    engine: OnlineDataEngine,
    policy: ChunkPolicy | VisionPolicy,
    embedding: HashedTextEmbedding,
    cfg: DemoConfig,
    *,
    deadline: float,
    writer: Any = None,
) -> TrainingLog:
    """Train ``policy`` (normalisation already fitted) on contexts sampled from the running ``engine``.

    With ``cfg.ema_decay > 0`` the checks during training evaluate the moving average of the weights, and
    ``policy`` ends holding it (what the final evaluation and the checkpoint then use).

    Args:
        engine: A READY engine streaming ``cfg.task``.
        policy: The policy to train in place.
        embedding: Instruction embedding (shared with evaluation and the checkpoint).
        cfg: Steps, batch size, learning rate, evaluation schedule.
        deadline: ``time.monotonic()`` after which training stops early (``log.stopped_early``).
        writer: Optional TensorBoard ``SummaryWriter``.

    Returns:
        The loss, stream and closed-loop success time series.
    """
    instructions = InstructionTable(engine.language_registry, embedding)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    device = torch.device(cfg.device)
    sample = batch_sampler(engine, policy, instructions, cfg.batch_size, generator)
    if device.type == "cuda":  # pinned host memory lets the copy to the GPU run asynchronously

        def sample_pinned() -> Any:
            return sample().apply(torch.Tensor.pin_memory)

        fetch = sample_pinned
    else:
        fetch = sample
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    averaged = weight_average(policy, cfg.ema_decay)
    evaluated = policy if averaged is None else averaged.module
    dtype = cfg.training_dtype
    precision = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    log, meter = TrainingLog(), _StreamMeter(engine, cfg.batch_size)
    log.episodes_at_start = meter.last_episodes
    threads = _TrainerThreads(engine, cfg.num_threads, cfg.idle_threads)
    began, ema, next_stream = time.monotonic(), math.nan, time.monotonic() + _STREAM_EVERY_S
    budget_s = max(deadline - began, 1e-3)
    rates: dict[str, float] | None = None  # none measured until the first window ends
    bar = tqdm(total=cfg.steps, desc="training", unit="step", dynamic_ncols=True)
    # its thread starts sampling at once: created last, right before the try that closes it
    prefetcher = BatchPrefetcher(fetch)
    try:
        for step in range(1, cfg.steps + 1):
            policy.train()
            progress = max((step - 1) / cfg.steps, (time.monotonic() - began) / budget_s)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(cfg.lr, progress)
            log.idle_thread_steps += threads.update()
            step_began = time.monotonic()
            data, waited = prefetcher.get(_BATCH_TIMEOUT_S)
            log.batch_wait_s += waited
            if device.type != "cpu":
                data = data.apply(lambda tensor: tensor.to(device, non_blocking=True))
            loss = _loss(policy, data, cfg.object_aux_weight, precision)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            if averaged is not None:
                averaged.update_parameters(policy)
            value = loss.item()
            ema = value if math.isnan(ema) else 0.98 * ema + 0.02 * value
            now = time.monotonic()
            log.step_time_s += now - step_began
            log.loss.append((step, now - began, value))
            log.steps_done = step
            if writer is not None and step % 10 == 0:
                writer.add_scalar("train/loss", value, step)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], step)
            if now >= next_stream:
                record = meter.read(step)
                record["time_s"] = now - began
                log.stream.append(record)
                rates = record
                next_stream = now + _STREAM_EVERY_S
                if writer is not None:
                    for key in ("samples_per_s", "fresh_episodes_per_s", "completed_generation"):
                        writer.add_scalar(f"stream/{key}", record[key], step)
            bar.update(1)
            if step % 10 == 0:
                measured = {}
                if rates is not None:  # 0 before the first window would read as a stalled stream
                    measured = {
                        "samples_s": f"{rates['samples_per_s']:.0f}",
                        "fresh_eps_s": f"{rates['fresh_episodes_per_s']:.1f}",
                    }
                bar.set_postfix(loss=f"{ema:.4f}", **measured, refresh=False)
            if cfg.eval_episodes_during and (step % cfg.eval_every == 0 or step == cfg.steps):
                _check(evaluated, embedding, cfg, log, step, time.monotonic() - began, writer)
            if time.monotonic() >= deadline and step < cfg.steps:
                log.stopped_early = True
                if cfg.eval_episodes_during and step % cfg.eval_every != 0:
                    _check(evaluated, embedding, cfg, log, step, time.monotonic() - began, writer)
                break
    finally:
        torch.set_num_threads(cfg.num_threads)
        prefetcher.close()
        bar.close()
        log.train_time_s = time.monotonic() - began
    if averaged is not None:
        policy.load_state_dict(averaged.module.state_dict())
    return log


def _loss(
    policy: ChunkPolicy | VisionPolicy, data: Any, object_aux_weight: float, precision: torch.autocast
) -> torch.Tensor:
    """The chunk loss, plus ``object_aux_weight`` times the auxiliary cube-position loss if there is one.

    The network runs inside ``precision`` (an autocast context, possibly disabled); the losses are
    computed in float32 from its outputs.
    """
    if isinstance(policy, VisionPolicy) and policy.config.object_dim:
        with precision:
            prediction, objects = policy.forward_with_objects(*data.inputs())
        chunk = masked_chunk_loss(prediction.float(), policy.normalize_targets(data.targets), data.loss_mask)
        return chunk + object_aux_weight * policy.object_loss(objects.float(), data.object_targets)
    with precision:
        prediction = policy(*data.inputs())
    return masked_chunk_loss(prediction.float(), policy.normalize_targets(data.targets), data.loss_mask)


def _check(
    policy: ChunkPolicy | VisionPolicy,
    embedding: HashedTextEmbedding,
    cfg: DemoConfig,
    log: TrainingLog,
    step: int,
    time_s: float,
    writer: Any,
) -> None:
    """One closed-loop check during training, with its own transient progress bar."""
    seeds = eval_seeds(cfg.eval_episodes_during, offset=DURING_TRAINING_SEED_OFFSET)
    with tqdm(total=len(seeds), desc=f"  check @ step {step}", unit="ep", leave=False) as bar:
        result = evaluate_policy(policy, embedding, cfg.task, seeds, cfg.rollout_config, on_step=bar.update)
    log.evals.append(
        {"step": step, "time_s": time_s, "success_rate": result.success_rate, "episodes": len(seeds)}
    )
    tqdm.write(f"step {step}: closed-loop success {result.success_rate:.0%} over {len(seeds)} episodes")
    if writer is not None:
        writer.add_scalar("eval/success_rate", result.success_rate, step)


def weight_average(policy: torch.nn.Module, decay: float) -> AveragedModel | None:
    """An exponential moving average of ``policy``'s weights and buffers, or ``None`` for ``decay == 0``.

    ``update_parameters(policy)`` after each optimiser step folds the new weights in: the first call copies
    them, the ``n``-th one after it blends with ``min(decay, (1 + n) / (10 + n))``, so the average of a short
    run (``--quick``) is not dominated by the initial weights. ``.module`` is a policy with the averaged
    weights.
    """
    if decay == 0:
        return None

    @torch.no_grad()
    def blend(averages: list[torch.Tensor], currents: list[torch.Tensor], _count: torch.Tensor) -> None:
        # the count handed in is a copy on the weights' device (reading it would wait for a GPU); the
        # model's own counter stays on the CPU, where AveragedModel creates it
        done = float(averaged.n_averaged)
        weight = 1.0 - min(decay, (1.0 + done) / (10.0 + done))
        for average, current in zip(averages, currents, strict=True):
            average.lerp_(current, weight)

    averaged = AveragedModel(policy, multi_avg_fn=blend, use_buffers=True)
    return averaged
