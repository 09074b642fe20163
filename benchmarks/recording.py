"""LeRobot recording and replay (issue 18): what recording costs the producers and the trainer.

Run: ``python benchmarks/recording.py`` (about 6 minutes on 2 vCPUs); ``--quick`` checks that it runs.

1. ``simstream record``'s loop, 2 producers on ``pick_place``, low-dim and with a 64x64 camera as video
   (``--video-codec h264``, the record command's default, or ``av1``): episodes/s the producers publish
   while the owner requests generations back to back, without
   and with a ``LeRobotRecorder`` (which producers wait for), in interleaved rounds; bytes per episode.
   Target: with / without >= 0.95.
2. ``sample_batch(256, 16)`` in the trainer while the producers refill continuously (the demo's setting),
   without and with the recorder: batches/s. Target: >= 0.90.
3. Replay: episodes/s that ``LeRobotSpec`` streams into an engine (2 producers) from the datasets of 1.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro


@dataclass(frozen=True)
class Args:
    quick: bool = False
    """Short rounds: checks that everything runs; the figures mean nothing."""
    seconds: float = 20.0
    """Measured seconds per round (after the first generation)."""
    rounds: int = 2
    """Interleaved rounds per candidate; tables print the median."""
    workers: int = 2
    video_codec: str = "h264"
    """Codec of the camera video (``h264``: the record command's default; ``av1``: LeRobot's)."""


def _engine(source, workers: int, buffer_size: int, manual: bool):
    from simstream import OnlineDataEngine, OnlineDataEngineCfg

    policy = {"refill_policy": "manual"} if manual else {"refill_threshold": 0}
    cfg = OnlineDataEngineCfg(source=source, buffer_size=buffer_size, num_workers=workers, **policy)
    return OnlineDataEngine(cfg)


def production(source, args: Args, record: Path | None) -> dict[str, float]:
    """Episodes/s the producers publish with generations requested back to back (``simstream record``)."""
    from simstream.lerobot import LeRobotRecorder

    engine = _engine(source, args.workers, 8 * args.workers, manual=True)
    recorder = LeRobotRecorder(engine, record, video_codec=args.video_codec) if record is not None else None
    if recorder is not None:
        recorder.start()
    with engine:
        first, began = engine.get_stats()["successful_episodes"], time.monotonic()
        while time.monotonic() - began < args.seconds:
            engine.request_refill()
            time.sleep(0.01)  # the record command polls its progress the same way
        elapsed = time.monotonic() - began
        episodes = engine.get_stats()["successful_episodes"] - first
    out = {"episodes_per_s": episodes / elapsed}
    if recorder is not None:
        recorder.close()
        out["bytes_per_episode"] = recorder.bytes_written / max(1, recorder.episodes_flushed)
        out["recorded"] = recorder.episodes_flushed
        out["skipped"] = recorder.episodes_skipped
    return out


def sampling(source, args: Args, record: Path | None) -> float:
    """Batches/s of ``sample_batch(256, 16)`` while producers refill continuously."""
    from simstream.lerobot import LeRobotRecorder

    engine = _engine(source, args.workers, 64, manual=False)
    recorder = (
        LeRobotRecorder(engine, record, video_codec=args.video_codec).start() if record is not None else None
    )
    with engine:
        first, batches, began = engine.get_stats()["successful_episodes"], 0, time.monotonic()
        while time.monotonic() - began < args.seconds:
            engine.sample_batch(256, 16)
            batches += 1
        elapsed = time.monotonic() - began
        episodes = engine.get_stats()["successful_episodes"] - first
    if recorder is not None:
        recorder.close()
    return batches / elapsed, episodes / elapsed


def replay(root: Path, args: Args) -> float:
    from simstream.lerobot import LeRobotSpec

    return production(LeRobotSpec(root), args, None)["episodes_per_s"]


def run(args: Args) -> int:
    """Run every measurement and print its table (``simstream bench recording``)."""
    from simstream.tasks import make_source

    torch.set_num_threads(1)
    if args.quick:
        args = Args(quick=True, seconds=2.0, rounds=1, workers=args.workers, video_codec=args.video_codec)
    scratch = Path(tempfile.mkdtemp(prefix="simstream-recording-"))
    video = f"64x64 video ({args.video_codec})"
    sources = {"low-dim": make_source("pick_place"), video: make_source("pick_place", image_size=64)}
    flags = " --quick" if args.quick else f" --seconds {args.seconds:g} --rounds {args.rounds}"
    flags += f" --video-codec {args.video_codec}"
    print(f"command: `python benchmarks/recording.py{flags}`; machine: {os.cpu_count()} CPUs")
    rows = []
    try:
        for name, source in sources.items():
            plain, recorded, sizes = [], [], []
            for k in range(args.rounds):  # interleaved: without, with, without, with
                plain.append(production(source, args, None)["episodes_per_s"])
                result = production(source, args, scratch / f"{name}-{k}".replace(" ", "_"))
                assert result["skipped"] == 0
                recorded.append(result["episodes_per_s"])
                sizes.append(result["bytes_per_episode"])
            a, b = statistics.median(plain), statistics.median(recorded)
            rows.append((name, a, b, b / a, statistics.median(sizes)))
        print(
            "\n| record (2 producers, pick_place) | without eps/s | with eps/s | ratio (>= 0.95) | bytes/ep |"
        )
        print("|---|---:|---:|---:|---:|")
        for name, a, b, r, size in rows:
            print(f"| {name} | {a:.2f} | {b:.2f} | {r:.3f} | {size:,.0f} |")

        plain, recorded = [], []
        for k in range(args.rounds):
            plain.append(sampling(sources["low-dim"], args, None))
            recorded.append(sampling(sources["low-dim"], args, scratch / f"sampling-{k}"))
        a, b = (statistics.median(r[0] for r in rates) for rates in (plain, recorded))
        ea, eb = (statistics.median(r[1] for r in rates) for rates in (plain, recorded))
        print("\n| sample_batch(256, 16), refilling | batches/s without | with recorder | ratio (>= 0.90) |")
        print("|---|---:|---:|---:|")
        print(f"| low-dim pick_place | {a:.1f} | {b:.1f} | {b / a:.3f} |")
        print(f"| (fresh episodes/s meanwhile) | {ea:.2f} | {eb:.2f} | {eb / ea:.3f} |")

        print("\n| replay (LeRobotSpec, 2 producers) | episodes/s |")
        print("|---|---:|")
        for name in sources:
            rate = replay(scratch / f"{name}-0".replace(" ", "_"), args)
            print(f"| {name} | {rate:.1f} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(tyro.cli(Args)))
