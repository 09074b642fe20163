"""``simstream eval CHECKPOINT``: re-evaluate a demo policy in seeded episodes; optionally save a video.

Works on the checkpoints of ``simstream demo`` and ``simstream demo --vision``; a vision policy renders its
own cameras in every step, and its video shows them beside the front camera.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from .._files import write_whole
from .._validation import (
    MAX_TORCH_THREADS,
    require,
    require_default,
    require_int,
    require_number,
    require_writable,
)
from ._report import exit_code, options_checked

__all__ = ["EvalArgs", "main", "run_eval"]


@dataclass(frozen=True)
class EvalArgs:
    """Run a checkpoint written by ``simstream demo`` closed-loop; by default on the demo's final seeds."""

    checkpoint: Annotated[Path, tyro.conf.Positional]
    """``checkpoint.pt`` of a demo run (``runs/<name>/checkpoint.pt``)."""
    episodes: int = 50
    """Seeded evaluation episodes (the demo's final evaluation uses the same first seeds)."""
    seed_offset: int = 0
    """Shift the evaluation seeds: episode ``k`` resets with seed ``1_000_000_007 + seed_offset + k``. ``0``
    repeats the demo's final evaluation; an offset at or past its ``eval_episodes`` (50) gives episodes that
    evaluation never ran (the checks during training use offsets from 10000)."""
    video: Path | None = None
    """Write rollouts of the first ``--video-episodes`` episodes to this ``.gif`` (or ``.mp4``, which needs
    the ``imageio-ffmpeg`` package): the front camera and, for a vision policy, the policy's own cameras
    beside it (what it saw, scaled up)."""
    video_episodes: int = 2
    """Episodes rendered into the video, one after the other."""
    image_size: int = 160
    """Side of the rendered video frames (front camera); a vision policy's own cameras, shown beside it, are
    scaled to the same height."""
    fps: int = 20
    """Frames per second of the video (20 = real time); a ``.gif`` takes 1, 2, 4, 5, 10, 20, 25 or 50 (the
    rates it plays exactly)."""
    execute_steps: int | None = None
    """Override the checkpoint's actions executed per predicted chunk."""
    ensemble_decay: float | None = None
    """Override: temporal ensembling with this decay instead of chunk execution."""
    gripper_threshold: float | None = None
    """Override the checkpoint's gripper threshold (in (0, 1)): the executed gripper command is fully open
    above it and closed at or below it. ``None`` (the default) keeps the checkpoint's; checkpoints written
    before the threshold existed get 0.25. No threshold at all: ``--continuous-gripper``."""
    continuous_gripper: bool = False
    """Execute the predicted gripper command as it is, without a threshold (how checkpoints written before
    the threshold existed were evaluated)."""
    json_out: Path | None = None
    """Also write the per-episode results to this JSON file."""
    num_threads: int = 1
    """Torch threads of the policy. Batches of one step's episodes are small: on 2 busy cores a vision
    policy ran 10x faster on 1 thread than on 2 (threads waiting for each other on every op)."""

    def __post_init__(self) -> None:
        for name, low in (("episodes", 1), ("video_episodes", 1), ("fps", 1)):
            require_int("EvalArgs", name, getattr(self, name), low)
        require_int("EvalArgs", "num_threads", self.num_threads, 1, MAX_TORCH_THREADS)
        require_int("EvalArgs", "image_size", self.image_size, 16, 2048)  # the renderer's range
        if self.execute_steps is not None:
            require_int("EvalArgs", "execute_steps", self.execute_steps, 1)
        require_number(
            "EvalArgs", "gripper_threshold", self.gripper_threshold, 0, 1,
            low_open=True, high_open=True, optional=True,
        )  # fmt: skip
        require(
            not (self.continuous_gripper and self.gripper_threshold is not None),
            "EvalArgs", "continuous_gripper", "False when gripper_threshold is given (they contradict)",
            self.continuous_gripper,
        )  # fmt: skip
        require_int("EvalArgs", "seed_offset", self.seed_offset, 0)
        require_number("EvalArgs", "ensemble_decay", self.ensemble_decay, 0, optional=True)
        if self.video is not None and self.video.suffix.lower() not in (".gif", ".mp4"):
            raise ValueError(f"EvalArgs.video must end in .gif or .mp4, got {str(self.video)!r}")
        self._refuse_options_that_would_be_ignored()
        if self.video is not None and self.video.suffix.lower() == ".gif":
            require(
                self.fps in _GIF_RATES, "EvalArgs", "fps",
                f"one of {', '.join(map(str, _GIF_RATES))} for a .gif (a GIF's frame delays are whole "
                "hundredths of a second, and viewers show delays under 20 ms as 100 ms)", self.fps,
                "Other rates played too fast or several times too slow; an .mp4 takes any rate",
            )  # fmt: skip
        if self.video is not None and self.video.suffix.lower() == ".mp4" and self.image_size % 2:
            raise ValueError(  # libx264 encodes even frame sizes only
                f"EvalArgs.image_size must be even for an .mp4 video, got {self.image_size}"
            )
        # known now, not after the episodes ran
        for name in ("video", "json_out"):
            _require_file_path(name, getattr(self, name))

    def _refuse_options_that_would_be_ignored(self) -> None:
        """Options with no effect in this combination were accepted, and ``--json-out`` recorded them as if
        applied."""
        if self.video is None:
            for name in ("video_episodes", "image_size", "fps"):
                require_default(
                    self, "EvalArgs", name, "without --video: it applies to the video only",
                    "Add --video PATH, or leave the option out",
                )  # fmt: skip
        require(
            self.execute_steps is None or self.ensemble_decay is None, "EvalArgs", "execute_steps",
            "None with --ensemble-decay (temporal ensembling executes one action of every chunk)",
            self.execute_steps, "Leave out one of the two",
        )  # fmt: skip


_GIF_RATES = (1, 2, 4, 5, 10, 20, 25, 50)
"""Frame rates a GIF plays exactly: 100 / fps hundredths of a second per frame, at least 2."""


def _require_file_path(name: str, path: Path | None) -> None:
    """``path`` can be written (see :func:`~simstream._validation.require_writable`)."""
    if path is not None:
        require_writable("EvalArgs", name, path)


def write_video(path: Path, episodes: list[list], fps: int) -> Path:
    """Write the frames (``[H, W, 3]`` uint8) of the episodes one after the other as a GIF or MP4."""
    import imageio.v3 as iio
    import numpy as np

    frames = [frame for episode in episodes for frame in episode]
    if not frames:
        raise ValueError("no frames were recorded")
    path.parent.mkdir(parents=True, exist_ok=True)

    def encode(partial: Path) -> None:
        if path.suffix.lower() == ".gif":
            iio.imwrite(partial, np.stack(frames), duration=1000 / fps, loop=0)
            return
        try:
            iio.imwrite(partial, np.stack(frames), fps=fps, codec="libx264")
        except Exception as error:
            raise RuntimeError(
                f"cannot write {str(path)!r}: {error}. MP4 needs `pip install imageio-ffmpeg`; "
                "a .gif needs nothing"
            ) from error

    return write_whole(path, encode)


def run_eval(args: EvalArgs) -> dict:
    """Evaluate; returns the summary that is printed (and written with ``--json-out``)."""
    import torch
    from tqdm import tqdm

    from simstream.bc import eval_seeds, evaluate_policy, load_checkpoint
    from simstream.bc.vision import VisionPolicy
    from simstream.sampling.gather import require_batch_fits

    torch.set_num_threads(args.num_threads)
    checkpoint = load_checkpoint(args.checkpoint)
    rollout = checkpoint.rollout
    if args.execute_steps is not None or args.ensemble_decay is not None:
        rollout = dataclasses.replace(
            rollout,
            execute_steps=rollout.execute_steps if args.execute_steps is None else args.execute_steps,
            # an explicit --execute-steps means chunk execution unless --ensemble-decay is given too
            ensemble_decay=args.ensemble_decay,
        )
    if args.continuous_gripper or args.gripper_threshold is not None:
        rollout = dataclasses.replace(rollout, gripper_threshold=args.gripper_threshold)
    horizon = checkpoint.policy.config.horizon
    if args.execute_steps is not None and rollout.ensemble_decay is None and args.execute_steps > horizon:
        raise ValueError(  # a chunk holds only `horizon` actions (a checkpoint's own setting is trusted)
            f"EvalArgs.execute_steps must be <= the policy's horizon {horizon}, got {args.execute_steps}"
        )
    seeds = eval_seeds(args.episodes, offset=args.seed_offset)
    record = 0 if args.video is None else min(args.video_episodes, args.episodes)
    if args.video is not None and record < args.video_episodes:
        print(f"the video shows {record} episode(s): --episodes is {args.episodes}", flush=True)
    if record:
        # the frames are kept until the episodes end, then stacked for the encoder: twice their size
        views = len(checkpoint.policy.config.cameras) if isinstance(checkpoint.policy, VisionPolicy) else 0
        frame_bytes = 3 * args.image_size * args.image_size * (1 + views)
        require_batch_fits(
            record, 2 * (rollout.max_episode_steps + 1) * frame_bytes,
            f"EvalArgs.video: {record} episode(s) of up to {rollout.max_episode_steps} frames of "
            f"{args.image_size} x {args.image_size * (1 + views)} pixels", batch="video",
            limit="--video-episodes", hint=" (or lower --image-size)",
        )  # fmt: skip
    options_checked()  # a ValueError from here on is the evaluation's, not a bad option
    began = time.monotonic()
    with tqdm(total=len(seeds), desc=f"evaluating {checkpoint.task}", unit="ep", dynamic_ncols=True) as bar:
        result = evaluate_policy(
            checkpoint.policy, checkpoint.embedding, checkpoint.task, seeds, rollout,
            record=record, image_size=args.image_size, on_step=bar.update,
        )  # fmt: skip
    summary = {
        "checkpoint": str(args.checkpoint),
        "task": checkpoint.task,
        "policy": "vision" if isinstance(checkpoint.policy, VisionPolicy) else "state",
        "success_rate": result.success_rate,
        "successes": int(sum(result.successes)),
        "episodes": len(seeds),
        "seeds": seeds,
        "episode_success": result.successes,
        "episode_length": result.lengths,
        "rollout": dataclasses.asdict(rollout),
        "eval_time_s": time.monotonic() - began,
    }
    if args.video is not None:
        summary["video"] = str(write_video(args.video, result.frames, args.fps))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        write_whole(args.json_out, lambda partial: partial.write_text(json.dumps(summary, indent=2)))
    return summary


def main(argv: list[str]) -> int:
    """``simstream eval``; returns the exit code (0 done, 2 bad option or checkpoint, 1 other failure)."""

    def job() -> None:
        summary = run_eval(tyro.cli(EvalArgs, args=argv, prog="simstream eval"))
        mean_length = sum(summary["episode_length"]) / len(summary["episode_length"])
        print(
            f"{summary['task']}: success {summary['success_rate']:.0%} "
            f"({summary['successes']}/{summary['episodes']} seeded episodes, mean length {mean_length:.0f} "
            f"steps) in {summary['eval_time_s']:.0f} s"
        )
        if "video" in summary:
            print(f"video: {summary['video']}")

    return exit_code("simstream eval", job, bad_options=(ValueError, FileNotFoundError))
