"""``simstream record``: record a built-in task's expert episodes into a LeRobot v3.0 dataset.

The producers run at full speed; the recorder copies every published episode beside them (it never
samples) and flushes small groups of closed files. Exit codes: 0 done, 2 a bad option, 130 interrupted
(what was flushed stays a valid dataset), 1 any other failure.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._validation import require_int, require_writable
from ._report import exit_code, options_checked

__all__ = ["PROGRESS_EVERY_S", "RecordArgs", "main", "refill_until", "run_record"]


@dataclass(frozen=True)
class RecordArgs:
    """Record expert episodes of a built-in task into a LeRobot v3.0 dataset (appends to an existing one)."""

    task: str = "pick_place"
    """Built-in task (``simstream.tasks.list_tasks()``)."""
    episodes: int = 100
    """Episodes to record."""
    out: Path | None = None
    """Dataset folder: created, or appended to when it holds a dataset (repaired first if interrupted).
    Default: ``datasets/<task>``."""
    image_size: int | None = None
    """Record the camera as ``observation.image`` at this size (square); default: low-dimensional only."""
    num_workers: int = 2
    """Producer processes."""
    only_success: bool = False
    """Leave out episodes that ended truncated (they are counted). The engine publishes a built-in task's
    window only when its expert succeeded, so with the built-in tasks every episode is kept either way;
    the flag guards recordings whose episodes may end truncated."""
    no_video: bool = False
    """Store cameras as PNG images inside the parquet files (lossless) instead of video."""
    video_codec: Literal["h264", "av1"] = "h264"
    """Codec of camera videos: ``h264`` (a fifth or less of AV1's encoding CPU, so recording keeps up with
    the producers) or ``av1`` (LeRobot's default; on 64x64 frames about the same bytes). Appending keeps
    the dataset's."""
    key_map: list[str] = field(default_factory=list)
    """``LEROBOT_KEY=FIELD`` overrides of the naming rule, e.g. ``observation.images.front=obs/image``."""
    skip_when_behind: bool = False
    """Let producers overwrite episodes the recorder has not copied yet (counted) instead of waiting."""
    seed: int = 0
    """Seed of the producers."""
    max_episode_steps: int = 200
    """Row capacity at 20 Hz."""
    buffer_size: int | None = None
    """Episodes in the shared buffer; default ``8 * num_workers``."""
    backend: Literal["local", "ray"] = "local"
    """Where producers run: ``local`` processes or ``ray`` actors (``docs/scale-out.md``); the recorder
    runs here either way, beside the shared buffer."""
    ray_address: str | None = None
    """With ``--backend ray``: the cluster to join (``auto``, ``host:port``); default: ``RAY_ADDRESS``,
    else a Ray instance started on this machine."""

    def __post_init__(self) -> None:
        require_int("RecordArgs", "episodes", self.episodes, 1)
        require_int("RecordArgs", "num_workers", self.num_workers, 1, 256)
        if self.buffer_size is not None:
            require_int("RecordArgs", "buffer_size", self.buffer_size, self.num_workers)
        # the scripted experts take up to ~80 steps: shorter rows could never hold a success
        require_int("RecordArgs", "max_episode_steps", self.max_episode_steps, 100)
        require_int("RecordArgs", "seed", self.seed, 0, 2**63 - 1)
        if self.image_size is not None:
            require_int("RecordArgs", "image_size", self.image_size, 8, 2048)
        require_writable("RecordArgs", "out", self.out_path, folder=True)
        from simstream.ray.backend import backend_from_flags  # no ray import: the flags' rules only

        backend_from_flags("RecordArgs", self.backend, self.ray_address)

    @property
    def out_path(self) -> Path:
        """Where the dataset goes: ``out``, or ``datasets/<task>`` (one task's episodes per dataset)."""
        return Path(self.out) if self.out is not None else Path("datasets") / self.task


PROGRESS_EVERY_S = 0.25
"""Longest wait between two looks at the recording's progress (the bar, a recorder failure, the end)."""


def refill_until(
    engine: Any, done: Callable[[], bool], tick: Callable[[], None], every_s: float = PROGRESS_EVERY_S
) -> None:
    """Keep ``engine``'s producers busy until ``done()``: each generation is requested the moment the one
    before completes (a request coalesces with an outstanding one), and ``tick()`` runs at least every
    ``every_s`` seconds.

    Waiting for the completion itself, not for the next look at the progress, is what keeps producers from
    idling between generations: a request once per look left them idle for up to ``every_s`` after each.

    Raises:
        Exception: a producer's failure (from the engine), or whatever ``tick`` raises.
    """
    generation = engine.request_refill()
    next_tick = time.monotonic()
    while not done():
        now = time.monotonic()
        if now >= next_tick:
            tick()
            next_tick = now + every_s
        try:
            engine.wait_for_generation(generation, timeout=max(1e-3, next_tick - now))
        except TimeoutError:
            # the wait ran out, or a producer raised a TimeoutError of its own: then the engine failed
            engine.check_health()
            continue
        generation = engine.request_refill()


def run_record(args: RecordArgs, progress: bool = True) -> dict[str, float]:
    """Record ``args.episodes`` episodes; returns counts and rates."""
    import torch
    from tqdm import tqdm

    from simstream import OnlineDataEngine, OnlineDataEngineCfg
    from simstream.engine.lifecycle import stop_then_close
    from simstream.lerobot import KeyMap, LeRobotRecorder
    from simstream.lerobot.writer import check_dataset_folder
    from simstream.ray.backend import backend_from_flags
    from simstream.tasks import make_source

    out = args.out_path
    check_dataset_folder(out, "--out")
    key_map = KeyMap.parse(args.key_map).overrides
    source = make_source(
        args.task, num_envs=1, image_size=args.image_size, max_episode_steps=args.max_episode_steps
    )
    cfg = OnlineDataEngineCfg(
        source=source,
        buffer_size=8 * args.num_workers if args.buffer_size is None else args.buffer_size,
        num_workers=args.num_workers,
        refill_policy="manual",
        seed=args.seed,
        backend=backend_from_flags("RecordArgs", args.backend, args.ray_address),
    )
    cfg.validate()
    torch.set_num_threads(1)
    engine = OnlineDataEngine(cfg)
    recorder = LeRobotRecorder(
        engine,
        out,
        video=not args.no_video,
        video_codec=args.video_codec,
        key_map=key_map,
        max_episodes=args.episodes,
        only_success=args.only_success,
        on_full="skip" if args.skip_when_behind else "wait",
    )
    began = time.monotonic()
    bar = tqdm(total=args.episodes, unit="ep", disable=not progress, desc=f"recording {args.task}")

    def tick() -> None:
        recorder.check()
        bar.n = recorder.episodes_flushed
        rate = recorder.episodes_flushed / (time.monotonic() - began)
        megabytes = recorder.bytes_written / 1e6
        bar.set_postfix_str(f"{rate:.1f} eps/s, {megabytes:.1f} MB written", refresh=True)

    in_flight: BaseException | None = None
    options_checked()  # a ValueError from here on is a producer's or the writer's, not a bad option
    try:
        recorder.start()
        engine.start()
        refill_until(engine, lambda: recorder.episodes_flushed >= args.episodes, tick)
        tick()  # the bar's last count
    except BaseException as error:
        in_flight = error
        raise
    finally:
        bar.close()
        try:
            stop_then_close(engine, recorder, in_flight)  # raises a producer's failure, after stopping
        finally:
            if isinstance(in_flight, KeyboardInterrupt):  # what the interruption kept, and where
                print(
                    f"\nsimstream record: {recorder.episodes_flushed} episodes of this run were flushed; "
                    f"the dataset {out.resolve()} holds {recorder.writer.episodes_flushed} episodes, "
                    "LeRobot v3.0",
                    file=sys.stderr,
                )
    elapsed = time.monotonic() - began
    return {
        "episodes": recorder.episodes_flushed,
        "episodes_per_s": recorder.episodes_flushed / elapsed,
        "bytes": recorder.bytes_written,
        "skipped": recorder.episodes_skipped,
        "producer_wait_s": recorder.producer_wait_s,
        "filtered": recorder.episodes_filtered,
        "seconds": elapsed,
        "total_episodes": recorder.writer.episodes_flushed,
        "path": str(out.resolve()),
    }


def main(argv: list[str]) -> int:
    """Parse :class:`RecordArgs` and record; returns the exit code."""
    import tyro

    parsed: list[RecordArgs] = []
    code = exit_code(
        "simstream record",
        # one flag per switch (--no-video, not --no-video/--no-no-video)
        lambda: parsed.append(
            tyro.cli(RecordArgs, args=argv, prog="simstream record", config=(tyro.conf.FlagCreatePairsOff,))
        ),
    )
    if code or not parsed:
        return code

    def job() -> None:
        result = run_record(parsed[0])
        extra = ""
        if result["skipped"] or result["filtered"]:
            extra = (
                f"; {result['skipped']} skipped while behind, {result['filtered']} left out (not successful)"
            )
        if result["producer_wait_s"] >= 0.05:  # the recorder fell behind: say what it cost the producers
            extra += f"; producers waited {result['producer_wait_s']:.1f} s for the recorder"
        print(
            f"recorded {result['episodes']} episodes in {result['seconds']:.1f} s "
            f"({result['episodes_per_s']:.1f} eps/s, {result['bytes'] / 1e6:.1f} MB){extra}\n"
            f"dataset: {result['path']} ({result['total_episodes']} episodes, LeRobot v3.0)",
            flush=True,
        )

    return exit_code("simstream record", job, interrupted="interrupted; what was flushed is a valid dataset")
