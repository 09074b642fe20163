"""``run_demo``: stream expert episodes, train a policy on them live, evaluate it, write the run folder.

The engine's producers are separate processes: call :func:`run_demo` from a CLI entry point or under
``if __name__ == "__main__":``. Stages, each with a progress bar: fill the first generation, fit the
normalisation on it, train (producers keep refilling), evaluate ``eval_episodes`` seeded episodes, write
``checkpoint.pt``, ``summary.json``, the PNG plots, ``report.md`` and TensorBoard logs into
``runs/<name>/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .._runs import claim_run_folder
from .._validation import require, require_writable
from ..engine.lifecycle import start_forkserver, stop_then_close
from .camera_source import CameraSourceSpec, measure_bare_rate
from .checkpoint import PolicyCheckpoint, save_checkpoint
from .config import DemoConfig
from .data import InstructionTable
from .evaluate import EvalResult, eval_seeds, evaluate_policy
from .policy import ChunkPolicy
from .recording import check_dataset_task, check_record_target, demo_recorder, demo_source
from .report import write_plots, write_report, write_strips
from .text import HashedTextEmbedding
from .train import NORMALIZER_CONTEXTS, NORMALIZER_KEYS, TrainingLog, fit_normalizer, train_policy
from .vision import VisionPolicy, VisionPolicyConfig

__all__ = ["check_demo_setup", "run_demo", "start_with_progress"]


def start_with_progress(engine: Any, total: int, timeout_s: float) -> float:
    """``engine.start()`` behind a progress bar of the first generation's episodes; returns seconds taken.

    ``start`` runs in a helper thread while this thread polls ``get_stats()``, so Ctrl-C still reaches the
    caller at once; the caller's ``engine.stop()`` (context manager exit) then cancels the start.

    Raises:
        TimeoutError: the first generation was not ready after ``timeout_s`` (the caller stops the engine).
        Exception: whatever ``engine.start()`` raised (a producer's original exception).
    """
    errors: list[BaseException] = []

    def start() -> None:
        try:
            engine.start()
        except BaseException as error:  # handed to the main thread
            errors.append(error)

    began = time.monotonic()
    start_forkserver()  # here, on the main thread: it ignores a Ctrl-C during its preload only from here
    thread = threading.Thread(target=start, name="simstream-demo-start", daemon=True)
    thread.start()
    with tqdm(total=total, desc="first generation", unit="ep", dynamic_ncols=True) as bar:
        while thread.is_alive():
            thread.join(0.25)
            bar.n = min(total, int(engine.get_stats()["successful_episodes"]))
            bar.refresh()
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"the first generation was not ready after {timeout_s:.0f} s")
        if not errors:
            bar.n = total
    if errors:
        raise errors[0]
    return time.monotonic() - began


def _machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    return f"{platform.machine()}, {cores} CPU cores, torch {torch.__version__} ({threads} trainer thread)"


NOISY_EXPERT_ATTEMPTS = 10
"""Attempts per window with ``action_noise``: ten failures in a row at 13% each is about 1e-9."""


def _final_eval(checkpoint: PolicyCheckpoint, episodes: int) -> tuple[EvalResult, float]:
    began = time.monotonic()
    seeds = eval_seeds(episodes)
    with tqdm(total=episodes, desc="final evaluation", unit="ep", dynamic_ncols=True) as bar:
        result = evaluate_policy(
            checkpoint.policy, checkpoint.embedding, checkpoint.task, seeds, checkpoint.rollout,
            keep_strips=True, on_step=bar.update,
        )  # fmt: skip
    return result, time.monotonic() - began


def _stream_summary(log: TrainingLog, stats: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """The stream's totals, and its rates over the whole of training (from its first step, so a run
    shorter than the meter's 2-s window still has them)."""
    span = max(log.train_time_s, 1e-9)
    return {
        "successful_episodes": int(stats["successful_episodes"]),
        "completed_generation": int(stats["completed_generation"]),
        "sampled_chunks": int(stats["sampled_chunks"]),
        "trained_contexts": log.steps_done * batch_size,
        "generated_frames": int(stats["generated_frames"]),
        "mean_samples_per_s": log.steps_done * batch_size / span,
        "mean_fresh_episodes_per_s": (stats["successful_episodes"] - log.episodes_at_start) / span,
    }


def engine_config(cfg: DemoConfig):
    """The ``OnlineDataEngineCfg`` the demo streams with: the task's expert (with ``--vision``, rendering
    its cameras), or a LeRobot dataset with ``--dataset``."""
    from simstream import OnlineDataEngineCfg
    from simstream.tasks import make_source

    if cfg.vision:
        source = CameraSourceSpec(
            cfg.task,
            cfg.cameras,
            cfg.image_size,
            max_episode_steps=cfg.max_episode_steps,
            action_noise=cfg.action_noise,
        )
    else:
        source = make_source(cfg.task, num_envs=1, max_episode_steps=cfg.max_episode_steps)
    source = demo_source(cfg, source)  # --dataset: a LeRobot dataset replayed instead
    return OnlineDataEngineCfg(
        source=source, buffer_size=cfg.buffer_size, num_workers=cfg.num_workers,
        refill_threshold=cfg.refill_threshold, seed=cfg.seed, backend=cfg.engine_backend,
        # a perturbed expert fails now and then (about 13% of episodes at 0.03 rad); a window is published
        # only when its episode succeeds, so give each window more attempts than the default 3
        max_generation_attempts=NOISY_EXPERT_ATTEMPTS if cfg.vision and cfg.action_noise > 0
        else OnlineDataEngineCfg.max_generation_attempts,
    )  # fmt: skip


def check_demo_setup(cfg: DemoConfig) -> Any:
    """The engine's config for ``cfg``, checked as far as it can be before anything starts or is written:
    every engine field, the source (``--dataset``: the dataset's files and fields), and that the buffer's
    shared memory fits ``/dev/shm``.

    ``simstream demo`` calls it while parsing its flags, so such a problem exits with 2 (a bad option)
    and creates no run folder; :func:`run_demo` calls it again for library users.

    Raises:
        ValueError: naming the setting and its accepted range, or the bytes needed against those free.
    """
    from simstream.engine.sizing import check_shared_memory

    _check_run_folder(cfg)
    engine_cfg = engine_config(cfg)
    layout = engine_cfg.validate()
    if cfg.dataset is not None:  # its rows are as long as its longest episode, not max_episode_steps
        for name in ("history", "horizon"):
            require(
                getattr(cfg, name) <= layout.max_episode_steps, "DemoConfig", name,
                f"at most {layout.max_episode_steps}, the frames of the longest episode of the dataset",
                getattr(cfg, name),
            )  # fmt: skip
    check_shared_memory(engine_cfg, layout)
    _check_batch_fits(cfg, engine_cfg, layout)
    if cfg.dataset is not None:
        check_dataset_task(engine_cfg.source, cfg.task)
    if cfg.record is not None:
        require_writable("DemoConfig", "record", cfg.record, folder=True)
        check_record_target(engine_cfg.source, cfg.record)
    return engine_cfg


def _check_batch_fits(cfg: DemoConfig, engine_cfg: Any, layout: Any) -> None:
    """One batch of contexts must fit this machine's memory (``sample_batch_with_context`` refuses it too,
    but only once the producers run and training has begun)."""
    from simstream.buffer.storage import TrajectoryStorage
    from simstream.sampling.gather import require_batch_fits

    frame = TrajectoryStorage.frame_bytes(layout, engine_cfg.include_provenance)
    context = cfg.history + cfg.horizon - 1
    require_batch_fits(
        cfg.batch_size, context * frame, f"DemoConfig.batch_size={cfg.batch_size}", batch="batch of contexts"
    )
    # the normalisation's one big batch: low-dimensional keys, task_index (8 bytes), valid and loss_mask
    low_dim = sum(
        math.prod(field.shape) * field.dtype.itemsize
        for name, field in layout.fields.items()
        if name in NORMALIZER_KEYS
    )
    require_batch_fits(  # frames of a context, each frame as many bytes as all the contexts' frames
        context,
        NORMALIZER_CONTEXTS * (low_dim + 10),
        f"DemoConfig.history={cfg.history} with horizon={cfg.horizon}",
        batch=f"batch of the {NORMALIZER_CONTEXTS} contexts the normalisation is fitted on",
        limit="history + horizon - 1",
    )


def _check_run_folder(cfg: DemoConfig) -> None:
    """``runs_dir`` must be a folder, and a named run's folder new or empty: a second run in it would mix
    its TensorBoard events and files with the first's."""
    runs = Path(cfg.runs_dir)
    if runs.exists() and not runs.is_dir():
        raise ValueError(f"DemoConfig.runs_dir must be a folder, got the file {str(runs)!r}")
    require_writable("DemoConfig", "runs_dir", runs, folder=True)
    if cfg.name is not None:
        run_dir = runs / cfg.name
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise ValueError(
                f"DemoConfig.name: {str(run_dir)!r} already holds a run; choose another --name or remove it"
            )


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the whole demo; returns the summary also written to ``summary.json``.

    Raises:
        KeyboardInterrupt: after stopping the producers (nothing is left running).
        Exception: a producer's original exception, after the engine stopped.
    """
    from torch.utils.tensorboard import SummaryWriter

    from simstream import OnlineDataEngine

    began = time.monotonic()
    engine_cfg = check_demo_setup(cfg)  # a bad setting fails here, before anything is written
    source = engine_cfg.source
    # an unnamed run claims (creates) its folder: two started in the same second get two
    name = cfg.name if cfg.name is not None else claim_run_folder(cfg.runs_dir, "demo")
    run_dir = Path(cfg.runs_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)  # claimed, or a named run's: new or empty (check_demo_setup)
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    policy_config = cfg.policy_config
    vision = isinstance(policy_config, VisionPolicyConfig)
    policy = VisionPolicy(policy_config) if vision else ChunkPolicy(policy_config)
    policy.to(cfg.device)
    embedding = HashedTextEmbedding(cfg.text_dim)
    where = " (Ray actors)" if cfg.backend == "ray" else ""
    print(f"simstream demo: {cfg.task}, {cfg.num_workers} producers{where}, buffer {cfg.buffer_size} "
          f"episodes -> {run_dir}", flush=True)  # fmt: skip
    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    try:
        engine = OnlineDataEngine(engine_cfg)
        recorder, in_flight = None, None
        try:
            recorder = demo_recorder(engine, cfg)  # --record: the live stream into a LeRobot dataset
            startup_s = start_with_progress(
                engine, cfg.buffer_size, timeout_s=engine_cfg.initialization_timeout
            )
            fit_normalizer(
                engine,
                policy,
                InstructionTable(engine.language_registry, embedding),
                torch.Generator().manual_seed(cfg.seed),
            )
            print(f"training started: {cfg.steps} steps of {cfg.batch_size} contexts "
                  f"(history {cfg.history}, chunk {cfg.horizon})", flush=True)  # fmt: skip
            log = train_policy(
                engine, policy, embedding, cfg, deadline=began + cfg.time_limit_s, writer=writer
            )
        except BaseException as error:
            in_flight = error
            raise
        finally:
            # raises a producer's failure, after stopping; --record flushes every episode published before
            stop_then_close(engine, recorder, in_flight)
        # after the stop: a producer may publish between the last step and stop(), and --record keeps it
        stats = engine.get_stats()
        checkpoint = PolicyCheckpoint(policy, embedding, cfg.task, cfg.rollout_config)
        checkpoint.info = {"steps": log.steps_done, "success_rate": None, "run": name}
        # saved before the final evaluation (minutes with cameras): interrupting it keeps the training
        checkpoint_path = save_checkpoint(run_dir / "checkpoint.pt", checkpoint)
        # the source alone, now that nothing else runs: the reference for the stream's episodes/s
        bare = measure_bare_rate(source) if isinstance(source, CameraSourceSpec) else None
        result, eval_s = _final_eval(checkpoint, cfg.eval_episodes)
        writer.add_scalar("eval/final_success_rate", result.success_rate, log.steps_done)
    finally:
        writer.close()
    checkpoint.info["success_rate"] = result.success_rate
    checkpoint_path = save_checkpoint(run_dir / "checkpoint.pt", checkpoint)
    summary = _summary(cfg, name, run_dir, result, log, stats)
    if bare is not None:
        summary["stream"]["bare_source"] = bare
        summary["stream"]["bare_episodes_per_s_all_workers"] = bare["episodes_per_s"] * cfg.num_workers
    if cfg.vision:  # what the policy saw in evaluation, whether it trained live or from a dataset
        summary["strips"] = [str(path) for path in write_strips(run_dir, result.strips)]
    summary.update(startup_time_s=startup_s, eval_time_s=eval_s, checkpoint=str(checkpoint_path))
    final = summary["final_eval"]
    plots = write_plots(run_dir, log.as_dict(), final)
    summary["plots"] = [str(path) for path in plots]
    summary["report"] = str(run_dir / "report.md")
    summary["total_time_s"] = time.monotonic() - began
    write_report(run_dir, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "training_log.json").write_text(json.dumps(log.as_dict()))
    return summary


def _summary(
    cfg: DemoConfig, name: str, run_dir: Path, result: EvalResult, log: TrainingLog, stats: dict[str, Any]
) -> dict[str, Any]:
    """The numbers of ``summary.json`` that the run's stages produced."""
    final = {
        "success_rate": result.success_rate,
        "successes": int(sum(result.successes)),
        "episodes": len(result.seeds),
        "mean_length": sum(result.lengths) / max(1, len(result.lengths)),
        "seeds": [result.seeds[0], result.seeds[-1]],
    }
    losses = [item[2] for item in log.loss[-200:]]
    return {
        "name": name,
        "task": cfg.task,
        "quick": cfg.quick,
        "success_rate": result.success_rate,
        "final_eval": final,
        "steps_done": log.steps_done,
        "stopped_early": log.stopped_early,
        "final_loss": sum(losses) / max(1, len(losses)),
        "train_time_s": log.train_time_s,
        "batch_wait_share": log.batch_wait_share,
        "idle_thread_steps": log.idle_thread_steps,
        "training_dtype": str(cfg.training_dtype).removeprefix("torch."),
        "vision": cfg.vision,
        "stream": _stream_summary(log, stats, cfg.batch_size),
        "evals_during_training": log.evals,
        "tensorboard": str(run_dir / "tensorboard"),
        "machine": _machine(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
    }
