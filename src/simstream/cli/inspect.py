"""``simstream inspect``: look at what a built-in task's source streams.

Builds the task's episode source in this process (as a producer worker would), records a few episodes
into buffer rows, prints their instructions and segments, renders a strip of camera frames to PNG and
reports the expert's success rate and episodes per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from .._validation import require_int, require_writable
from ._report import exit_code, options_checked

__all__ = ["InspectArgs", "main", "run_inspect"]


@dataclass(frozen=True)
class InspectArgs:
    """Record expert episodes of a built-in task; print segments and language; save a frame strip."""

    task: str = "pick_place"
    """Built-in task (``simstream.tasks.list_tasks()``)."""
    episodes: int = 12
    """Expert episodes to record (success rate and episodes/s are measured over them)."""
    show: int = 3
    """Episodes whose segments are printed and drawn in the strip."""
    frames: int = 8
    """Camera frames per episode in the strip, evenly spaced."""
    image_size: int = 128
    """Side of the recorded camera images."""
    camera: str = "front"
    """Camera of the images: ``front``, ``wrist`` or ``top``."""
    seed: int = 0
    """Seed of the source (episode seeds derive from it)."""
    out: Path | None = None
    """PNG of the frame strip. Default: ``runs/inspect-<task>.png``."""

    def __post_init__(self) -> None:
        for name, low in (("episodes", 1), ("show", 1), ("frames", 1)):
            require_int("InspectArgs", name, getattr(self, name), low)
        require_int("InspectArgs", "image_size", self.image_size, 16, 2048)  # as simstream eval
        require_int("InspectArgs", "seed", self.seed, 0)
        from simstream.tasks import CAMERAS, get_task

        get_task(self.task)
        if self.camera not in CAMERAS:
            raise ValueError(f"InspectArgs.camera must be one of {CAMERAS}, got {self.camera!r}")
        if self.out is not None and Path(self.out).suffix.lower() not in (".png", ".jpg", ".jpeg"):
            # matplotlib would add .png to another name and the report would name a file it did not write
            raise ValueError(f"InspectArgs.out must be a .png or .jpg file, got {str(self.out)!r}")
        require_writable("InspectArgs", "out", self.out_path)  # known now, not after the episodes ran

    @property
    def out_path(self) -> Path:
        """Where the strip goes: ``out``, or ``runs/inspect-<task>.png``."""
        return Path(self.out) if self.out is not None else Path("runs") / f"inspect-{self.task}.png"


def _allocate_rows(spec):
    import torch
    from tensordict import TensorDict

    rows = TensorDict({}, batch_size=[spec.num_envs, spec.max_episode_steps])
    for name, field in spec.fields().items():
        shape = (spec.num_envs, spec.max_episode_steps, *field.shape)
        rows.set(tuple(name.split("/")), torch.zeros(shape, dtype=field.dtype))
    return rows


def _segment_at(episode, t: int) -> str:
    for segment in episode.segments:
        if segment.start <= t < segment.end:
            return segment.instruction or episode.instruction or ""
    return ""


def save_strip(path: Path, shown: list[tuple[object, object]], frames: int) -> Path:
    """Draw ``frames`` evenly spaced images of each ``(episode, images [T, 3, H, W])`` as one PNG row.

    Each row is one episode, titled with its instruction; each frame is labelled with its step and the
    phase of the segment it belongs to.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    import torch

    height, width = shown[0][1].shape[-2:]
    # an episode shows at most its length in distinct frames, however many were asked for
    columns = min(frames, max(episode.length for episode, _ in shown))
    fig, axes = plt.subplots(len(shown), 1, figsize=(1.6 * columns, 2.1 * len(shown)), squeeze=False)
    for ax, (episode, images) in zip(axes[:, 0], shown):
        count = min(frames, episode.length)  # a huge --frames costs no more than the episode's length
        steps = sorted({round(i * (episode.length - 1) / max(count - 1, 1)) for i in range(count)})
        gap = torch.full((3, height, 4), 255, dtype=torch.uint8)
        tiles = [tile for t in steps for tile in (images[t], gap)][:-1]
        ax.imshow(torch.cat(tiles, dim=2).permute(1, 2, 0).numpy())
        ax.set_xticks([(width + 4) * i + width / 2 for i in range(len(steps))])
        ax.set_xticklabels([f"t={t}\n{_segment_at(episode, t).split(' the ')[0]}" for t in steps], fontsize=8)
        ax.set_yticks([])
        ax.set_title(f"{episode.instruction} ({episode.length} steps)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_inspect(args: InspectArgs) -> dict:
    """Record, print and draw; returns the measured numbers and the PNG path."""
    from tqdm import tqdm

    from simstream.tasks import make_source

    spec = make_source(args.task, num_envs=1, image_size=args.image_size, camera=args.camera)
    source = spec.build(worker_index=0, seed=args.seed)
    rows = _allocate_rows(spec)
    shown, successes, lengths = [], 0, []
    options_checked()  # a ValueError from here on is the simulation's, not a bad option
    began = time.monotonic()
    try:
        for _ in tqdm(range(args.episodes), desc=f"recording {args.task}", unit="ep", dynamic_ncols=True):
            (episode,) = source.rollout(rows, attempt=0, should_stop=lambda: False)
            successes += bool(episode.success)
            lengths.append(episode.length)
            if len(shown) < args.show:
                shown.append((episode, rows["obs", "image"][0, : episode.length].clone()))
    finally:
        source.close()
    elapsed = time.monotonic() - began
    for index, (episode, _) in enumerate(shown):
        status = "success" if episode.success else "failed"
        print(f"episode {index}: {episode.instruction!r} - {episode.length} steps, {status}")
        for segment in episode.segments:
            print(f"    [{segment.start:3d}, {segment.end:3d})  {segment.instruction}")
    out = args.out_path
    save_strip(out, shown, args.frames)
    summary = {
        "task": args.task,
        "episodes": args.episodes,
        "expert_success_rate": successes / args.episodes,
        "episodes_per_s": args.episodes / elapsed,
        "steps_per_s": sum(lengths) / elapsed,
        "mean_length": sum(lengths) / len(lengths),
        "strip": str(out),
    }
    print(
        f"expert: {successes}/{args.episodes} successful ({summary['expert_success_rate']:.0%}), "
        f"{summary['episodes_per_s']:.1f} episodes/s ({summary['steps_per_s']:.0f} control steps/s with "
        f"{args.image_size}x{args.image_size} {args.camera} images, one process), "
        f"mean length {summary['mean_length']:.0f} steps"
    )
    print(f"frame strip: {out}")
    return summary


def main(argv: list[str]) -> int:
    """``simstream inspect``; returns the exit code (0 done, 2 bad option, 1 other failure)."""

    def job() -> None:
        run_inspect(tyro.cli(InspectArgs, args=argv, prog="simstream inspect"))

    return exit_code("simstream inspect", job)
