"""``simstream stream``: start an engine, sample from it while producers refill, print throughput."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from tqdm import tqdm

from ._report import exit_code, options_checked

__all__ = ["StreamArgs", "main", "run_stream"]


@dataclass(frozen=True)
class StreamArgs:
    """Stream synthetic episodes (or a built-in task) into a sampler and report the rates."""

    task: str | None = None
    """A built-in MuJoCo task (e.g. ``pick_place``); ``None`` uses the synthetic source."""
    seconds: float = 10.0
    """How long to sample."""
    buffer_size: int = 64
    """Episode rows of the shared buffer (at least num_workers x the source's envs per rollout)."""
    num_workers: int = 2
    """Producer processes (or Ray actors with --backend ray)."""
    batch_size: int = 64
    """Chunks per sample_batch call."""
    chunk_size: int = 16
    """Frames per chunk, at most the source's shortest episode (60 frames for the synthetic source; a
    task's expert episodes vary in length, and a chunk longer than every episode published is refused
    when sampled)."""
    refill_threshold: int = 0
    """Refill after ``refill_threshold * buffer_size`` chunks; 0 keeps producers refilling continuously."""
    backend: Literal["local", "ray"] = "local"
    """Where producers run: ``local`` processes or ``ray`` actors (``docs/scale-out.md``)."""
    ray_address: str | None = None
    """With ``--backend ray``: the cluster to join (``auto``, ``host:port``); default: ``RAY_ADDRESS``,
    else a Ray instance started on this machine."""

    def __post_init__(self) -> None:
        from .._validation import require_int, require_number

        require_number("StreamArgs", "seconds", self.seconds, 0, 1e6, low_open=True)
        require_int("StreamArgs", "batch_size", self.batch_size, 1)
        require_int("StreamArgs", "chunk_size", self.chunk_size, 1)


def _check_batch_fits(args: StreamArgs, cfg) -> None:
    """One batch must fit this machine's memory: ``sample_batch`` refuses it too, but only once the
    producers have started and filled the first generation."""
    from simstream.buffer.storage import TrajectoryStorage
    from simstream.sampling.gather import require_batch_fits

    frame = TrajectoryStorage.frame_bytes(cfg.validate(), cfg.include_provenance)
    require_batch_fits(
        args.batch_size,
        args.chunk_size * frame,
        f"StreamArgs.batch_size={args.batch_size} with chunk_size={args.chunk_size}",
    )


def run_stream(args: StreamArgs) -> dict[str, float]:
    """Run the example; returns the measured rates."""
    from simstream import OnlineDataEngine, OnlineDataEngineCfg
    from simstream.ray.backend import backend_from_flags

    backend = backend_from_flags("StreamArgs", args.backend, args.ray_address)

    if args.task is None:
        from simstream.synthetic import SyntheticSpec

        source = SyntheticSpec(num_envs=4, max_episode_steps=100, min_length=60, work_us_per_step=50)
    else:
        from simstream.tasks import make_source

        source = make_source(args.task, num_envs=1)
    # known now, not after the first generation: the synthetic source's shortest episode, else a row
    shortest, what = getattr(source, "min_length", None), "shortest episode"
    if shortest is None:
        shortest, what = source.max_episode_steps, "max_episode_steps"
    if args.chunk_size > shortest:
        raise ValueError(
            f"StreamArgs.chunk_size must be <= the source's {what} {shortest}, got {args.chunk_size}"
        )
    cfg = OnlineDataEngineCfg(
        source=source,
        buffer_size=args.buffer_size,
        num_workers=args.num_workers,
        refill_threshold=args.refill_threshold,
        backend=backend,
    )
    _check_batch_fits(args, cfg)
    torch.set_num_threads(1)
    engine = OnlineDataEngine(cfg)  # checks the config: a bad option is refused before anything is said
    options_checked()  # a ValueError from here on is a producer's or a source's, not a bad option
    where = " as Ray actors" if backend is not None else ""
    print(f"starting {args.num_workers} producer(s){where} on {type(source).__name__} ...", flush=True)
    began = time.monotonic()
    with engine:
        print(f"first generation of {args.buffer_size} episodes ready in {time.monotonic() - began:.1f} s")
        first = engine.get_stats()
        batches, start, shown = 0, time.monotonic(), 0.0
        with tqdm(total=args.seconds, unit="s", bar_format="{l_bar}{bar}| {elapsed} {postfix}") as bar:
            while (elapsed := time.monotonic() - start) < args.seconds:
                engine.sample_batch(args.batch_size, args.chunk_size)
                batches += 1
                if elapsed >= shown + 0.2:  # by time: a batch may take a millisecond or a second
                    shown = elapsed
                    bar.n = round(elapsed, 1)
                    bar.set_postfix(batches_per_s=_rate(batches / elapsed))
        elapsed = time.monotonic() - start
        stats = engine.get_stats()
    rates = {
        "batches_per_s": batches / elapsed,
        "frames_per_s": batches * args.batch_size * args.chunk_size / elapsed,
        "fresh_episodes_per_s": (stats["successful_episodes"] - first["successful_episodes"]) / elapsed,
        "generations": float(stats["completed_generation"]),
    }
    print(
        f"sampled {_rate(rates['batches_per_s'])} batches/s ({rates['frames_per_s']:.0f} frames/s) while "
        f"producers published {rates['fresh_episodes_per_s']:.1f} fresh episodes/s "
        f"({stats['completed_generation']} generations)"
    )
    return rates


def _rate(per_s: float) -> str:
    """A rate with its significant digits: ``4860``, ``12``, ``0.37`` (a batch may take seconds)."""
    return f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.2g}"


def main(argv: list[str]) -> int:
    """``simstream stream``; returns the exit code (0 done, 2 bad option, 1 other failure, 130 Ctrl-C)."""

    def job() -> None:
        run_stream(tyro.cli(StreamArgs, args=argv, prog="simstream stream"))

    return exit_code("simstream stream", job, interrupted="interrupted; the producers are stopped")
