"""Hopper-v5 learning curve (mean episode return against wall-clock seconds) of async and sync PPO.

Run: ``python benchmarks/rl_learning_curve.py`` (default: 2 x 10 minutes on the local cores);
``--quick`` is a one-minute smoke run. Writes ``learning_curve.png`` and ``summary.json`` to ``--out``.

Both modes use the same config and seed; wall-clock time counts from the start of ``learn()``, collector
start-up included, so the curves show what a user waits for.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, replace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import torch

from _timing import Table, main_of, print_header, require_gym_env, require_positive
from simstream.rl import APPOConfig, APPORunner
from simstream.rl.config import Mode


@dataclass(frozen=True)
class Args:
    """Return vs wall-clock of async and sync PPO on Hopper-v5."""

    env: str = "Hopper-v5"
    seconds: float = 600.0
    """Wall-clock budget per mode."""
    modes: tuple[Mode, ...] = ("async", "sync")
    seed: int = 0
    out: str = "runs/bench-hopper"
    quick: bool = False
    """A smoke run: 30 s per mode."""

    def __post_init__(self) -> None:
        from simstream._validation import require_writable

        require_positive(self, "seconds")
        if not self.modes:
            raise ValueError("--modes must name one or more of async, sync, got ()")
        require_gym_env(self.env)
        for mode in self.modes:  # the runner's own checks (seed, ...), before the first run
            APPOConfig(env_id=self.env, seed=self.seed, mode=mode)
        require_writable("Args", "out", self.out, folder=True)


def _run(args: Args, mode: str) -> tuple[list[dict[str, float]], dict]:
    cfg = APPOConfig(env_id=args.env, seed=args.seed, mode=mode)
    with APPORunner(cfg) as runner:
        summary = runner.learn(1_000_000, log_dir=None, max_wall_s=args.seconds, max_env_frames=None)
        return runner.history, summary


def _plot(curves: dict[str, list[dict[str, float]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_frames) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for mode, rows in curves.items():
        rows = [r for r in rows if not math.isnan(r["rl/return"])]
        by_time.plot([r["rl/wall_s"] for r in rows], [r["rl/return"] for r in rows], label=mode)
        by_frames.plot([r["rl/env_frames"] for r in rows], [r["rl/return"] for r in rows], label=mode)
    by_time.set_xlabel("wall-clock seconds")
    by_frames.set_xlabel("environment frames")
    for axis in (by_time, by_frames):
        axis.set_ylabel("mean episode return (last 20 episodes)")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _return_at(rows: list[dict[str, float]], seconds: float) -> float:
    before = [r["rl/return"] for r in rows if r["rl/wall_s"] <= seconds and not math.isnan(r["rl/return"])]
    return before[-1] if before else float("nan")


def run(args: Args) -> int:
    if args.quick:
        args = replace(args, seconds=30.0)
    torch.set_num_threads(1)
    print_header(
        f"{args.env} learning curve",
        ["python", *sys.argv],
        f"APPOConfig defaults, seed {args.seed}, {args.seconds:g} s per mode, modes {', '.join(args.modes)}",
    )
    os.makedirs(args.out, exist_ok=True)
    curves, summaries = {}, {}
    for mode in args.modes:
        print(f"running {mode} for {args.seconds:g} s ...", flush=True)
        curves[mode], summaries[mode] = _run(args, mode)
    marks = [args.seconds * f for f in (0.25, 0.5, 0.75, 1.0)]
    table = Table(
        "Mean return of the last 20 episodes at wall-clock time",
        ["mode", *[f"{m:.0f} s" for m in marks], "env frames", "frames/s", "best"],
    )
    for mode, rows in curves.items():
        s = summaries[mode]
        table.row(mode, *[_return_at(rows, m) for m in marks], float(s["env_frames"]),
                  float(s["env_frames_per_s"]), float(s["best_return"] or math.nan))  # fmt: skip
    png = os.path.join(args.out, "learning_curve.png")
    _plot(curves, png, f"PPO on {args.env}, {os.cpu_count()} CPU cores")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"args": vars(args) | {"modes": list(args.modes)}, "summaries": summaries}, f, indent=2)
    print(f"\nwrote {png} and summary.json")
    return 0


if __name__ == "__main__":
    main_of(run, Args)
