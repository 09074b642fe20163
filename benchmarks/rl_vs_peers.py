"""Return against wall-clock time of simstream's async and lock-step PPO and Stable-Baselines3 PPO (issue 20).

Run: ``.venv/bin/python benchmarks/rl_vs_peers.py`` (2 tasks x 2 seeds x 3 contenders x 300 s, about one
hour on a quiet machine); ``--budget-s 20 --tasks Hopper-v5 --seeds 0`` is a smoke run (about 2 minutes;
its targets are meaningless). ``--analyse-only`` re-prints the tables, the targets and the plot from an
existing ``<out>/curves.json`` without running anything. Needs ``stable-baselines3`` (the ``bench``
extra); without it the SB3 contender is skipped and the targets that need it print ``n/a``.

Contenders, each with its library's default settings, one at a time in a fresh interpreter, for the same
wall-clock budget, interleaved (for each task and seed: async, sync, sb3):

* **async**: ``APPOConfig(env_id=task, seed=seed)``: the collector process steps while the learner trains;
* **sync**: the same with ``mode="sync"`` (lock-step: the collector waits for each update);
* **sb3**: ``PPO("MlpPolicy", task, seed=seed, device="cpu")``, one environment (SB3's own ``Monitor`` +
  ``DummyVecEnv``), one torch thread, stopped by a callback once the budget is spent.

Each clock starts when the library's training call begins (``learn``), so simstream's collector start-up
counts against it. The return is the mean of the last 20 completed training episodes (of however many
exist, up to 20: simstream's ``stats_window``); SB3's is computed the same way from every episode its
``Monitor`` reports. A curve is a list of ``(wall_s, env_frames, return)`` points from the first completed
episode on.

Figures, per task, median over seeds:

* ``return @ x%``: the return at x% of the budget (the last point at or before that time; 100% is the
  run's final return);
* ``frames/s``: env frames stepped per wall-clock second over the whole run;
* ``time to SB3 final``: when the run first reaches the final return of SB3 on the same task and seed,
  in seconds and as a fraction of the budget ("not reached" if never).

Targets:

* per frame: async's return at the env frames lock-step reached in its budget is >= 0.90 x lock-step's
  final return (median over seeds of the per-seed ratio; n/a where lock-step's final return is <= 0);
* per second: async and sync each reach SB3's final return within 0.5 of the budget, and async needs at
  most 0.85 of the time sync needs (median over seeds of the per-seed ratio), on every task.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import importlib.metadata
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import tyro

# Torch, gymnasium, simstream and SB3 are imported where they are used, so the pure analysis functions
# below load quickly (tests/unit/test_rl_vs_peers_analysis.py imports this file).

Point = tuple[float, float, float]
"""One curve point: (wall-clock seconds since learn began, env frames so far, mean return)."""
CONTENDERS = ("async", "sync", "sb3")
FRACTIONS = (0.25, 0.5, 1.0)
STATS_WINDOW = 20
PER_FRAME_TARGET = 0.90
BUDGET_FRACTION_TARGET = 0.5
ASYNC_OVER_SYNC_TARGET = 0.85
COLOURS = {"async": "tab:blue", "sync": "tab:orange", "sb3": "tab:green"}


@dataclass(frozen=True)
class Args:
    """Return vs wall-clock of simstream async / sync PPO and Stable-Baselines3 PPO (issue 20)."""

    tasks: tuple[str, ...] = ("Hopper-v5", "HalfCheetah-v5")
    """Gymnasium task ids."""
    seeds: tuple[int, ...] = (0, 1)
    """Seeds; every contender runs each (task, seed) once."""
    budget_s: float = 300.0
    """Wall-clock budget of every run."""
    out: str = "runs/rl-vs-peers"
    """Folder for curves.json and return_vs_wall_clock.png."""
    analyse_only: bool = False
    """Re-analyse ``<out>/curves.json`` without running anything."""


@dataclass(frozen=True)
class ChildArgs:
    """One run in a fresh interpreter (``rl_vs_peers.py --child ...``); writes its result as JSON."""

    contender: str
    task: str
    seed: int
    budget_s: float
    result_path: str


# ---------------------------------------------------------------------------------------- pure analysis
def return_at_time(curve: Sequence[Point], seconds: float) -> float:
    """Return of the last point at or before ``seconds`` (NaN if none).

    >>> return_at_time([(1.0, 10, 5.0), (2.0, 20, 7.0)], 1.5)
    5.0
    """
    before = [ret for wall, _, ret in curve if wall <= seconds]
    return before[-1] if before else math.nan


def return_at_frames(curve: Sequence[Point], frames: float) -> float:
    """Return of the last point with at most ``frames`` env frames (NaN if none).

    >>> return_at_frames([(1.0, 10, 5.0), (2.0, 20, 7.0)], 20)
    7.0
    """
    before = [ret for _, done, ret in curve if done <= frames]
    return before[-1] if before else math.nan


def time_to_reach(curve: Sequence[Point], threshold: float) -> float:
    """Wall-clock seconds of the first point whose return is >= ``threshold``; inf if never, NaN if no
    threshold (NaN).

    >>> time_to_reach([(1.0, 10, 5.0), (2.0, 20, 7.0)], 6.0), time_to_reach([(1.0, 10, 5.0)], 6.0)
    (2.0, inf)
    """
    if math.isnan(threshold):
        return math.nan
    return next((wall for wall, _, ret in curve if ret >= threshold), math.inf)


def final_return(curve: Sequence[Point]) -> float:
    """Return of the last point (NaN for an empty curve)."""
    return curve[-1][2] if curve else math.nan


def final_frames(curve: Sequence[Point]) -> float:
    """Env frames of the last point (NaN for an empty curve)."""
    return curve[-1][1] if curve else math.nan


def time_ratio(numerator_s: float, denominator_s: float) -> float:
    """``numerator_s / denominator_s`` for times that may be inf (never reached).

    Both never reached: inf; only the denominator never: 0 (the numerator got there first).

    >>> time_ratio(10.0, 20.0), time_ratio(10.0, math.inf), time_ratio(math.inf, math.inf)
    (0.5, 0.0, inf)
    """
    if math.isnan(numerator_s) or math.isnan(denominator_s):
        return math.nan
    if math.isinf(numerator_s):
        return math.inf
    if math.isinf(denominator_s):
        return 0.0
    return numerator_s / denominator_s if denominator_s > 0 else math.nan


def per_frame_ratio(async_curve: Sequence[Point], sync_curve: Sequence[Point]) -> float:
    """Async's return at the frames sync reached over sync's final return (NaN if that is <= 0).

    >>> per_frame_ratio([(1.0, 50, 80.0), (2.0, 120, 95.0)], [(3.0, 100, 100.0)])
    0.8
    """
    sync_final = final_return(sync_curve)
    if not sync_final > 0:
        return math.nan
    return return_at_frames(async_curve, final_frames(sync_curve)) / sync_final


def median(values: Sequence[float]) -> float:
    """Median; NaN if empty or if any value is NaN (a missing run is never hidden)."""
    if not values or any(math.isnan(v) for v in values):
        return math.nan
    return statistics.median(values)


def verdict(value: float, target: float, higher_is_better: bool = False) -> str:
    """``met`` / ``SHORT`` of ``value`` against ``target`` (inf counts as a value), ``n/a`` for NaN.

    >>> verdict(0.4, 0.5), verdict(math.inf, 0.5), verdict(0.95, 0.9, higher_is_better=True)
    ('met', 'SHORT', 'met')
    """
    if math.isnan(value):
        return "n/a"
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "SHORT"


# ---------------------------------------------------------------------------------------- child runs
def run_simstream(task: str, seed: int, mode: str, budget_s: float) -> dict:
    """One APPORunner run with default settings; its curve from ``runner.history``."""
    import torch

    from simstream.rl import APPOConfig, APPORunner

    torch.set_num_threads(1)
    with APPORunner(APPOConfig(env_id=task, seed=seed, mode=mode)) as runner:
        summary = runner.learn(10**9, log_dir=None, max_wall_s=budget_s)
        rows = runner.history
    curve = [
        (row["rl/wall_s"], row["rl/env_frames"], row["rl/return"])
        for row in rows
        if not math.isnan(row["rl/return"])
    ]
    return {
        "curve": curve,
        "env_frames": summary["env_frames"],
        "wall_s": summary["wall_time_s"],
        "frames_per_s": summary["env_frames_per_s"],
    }


def run_sb3(task: str, seed: int, budget_s: float) -> dict:
    """Stable-Baselines3 PPO with default settings until ``budget_s``; one point per completed episode."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    class BudgetCurve(BaseCallback):
        """Stops training once the budget is spent; records (wall_s, frames, mean of last 20 returns)."""

        def __init__(self) -> None:
            super().__init__()
            self.began = math.nan
            self.returns: deque[float] = deque(maxlen=STATS_WINDOW)
            self.curve: list[Point] = []

        def _on_training_start(self) -> None:
            self.began = time.monotonic()

        def _on_step(self) -> bool:
            wall = time.monotonic() - self.began
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.returns.append(float(info["episode"]["r"]))
                    mean = sum(self.returns) / len(self.returns)
                    self.curve.append((wall, float(self.num_timesteps), mean))
            return wall < budget_s

    torch.set_num_threads(1)
    model = PPO("MlpPolicy", task, seed=seed, device="cpu", verbose=0)
    callback = BudgetCurve()
    model.learn(total_timesteps=10**12, callback=callback)
    wall = time.monotonic() - callback.began
    frames = int(model.num_timesteps)
    return {"curve": callback.curve, "env_frames": frames, "wall_s": wall, "frames_per_s": frames / wall}


def child_main(args: ChildArgs) -> int:
    """Body of ``--child``: run one contender and write its result JSON."""
    if args.contender == "sb3":
        result = run_sb3(args.task, args.seed, args.budget_s)
    else:
        result = run_simstream(args.task, args.seed, args.contender, args.budget_s)
    with open(args.result_path, "w") as handle:
        json.dump(result, handle)
    return 0


def run_child(contender: str, task: str, seed: int, budget_s: float, out: str) -> dict | None:
    """Runs one contender in a fresh interpreter; its result, or None (with the output tail) on failure."""
    path = os.path.join(out, f"run-{task}-{seed}-{contender}.json")
    flags = {"contender": contender, "task": task, "seed": seed, "budget-s": budget_s, "result-path": path}
    command = [sys.executable, os.path.abspath(__file__), "--child"]
    command += [part for flag, value in flags.items() for part in (f"--{flag}", str(value))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=budget_s + 600)
    except subprocess.TimeoutExpired:
        print(f"  {contender} {task} seed {seed}: no result {budget_s + 600:g} s after its start", flush=True)
        return None
    if done.returncode != 0:
        print(f"  {contender} {task} seed {seed} failed (exit {done.returncode}):", flush=True)
        print((done.stdout + done.stderr)[-3000:], flush=True)
        return None
    with open(path) as handle:
        result = json.load(handle)
    os.remove(path)
    return result


# ---------------------------------------------------------------------------------------- parent
def sb3_available() -> bool:
    """Whether Stable-Baselines3 can be imported (without importing it)."""
    return importlib.util.find_spec("stable_baselines3") is not None


def versions() -> str:
    """Installed versions of the libraries the contenders use."""
    found = []
    for name in ("torch", "gymnasium", "mujoco", "stable_baselines3"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def run_all(args: Args, contenders: Sequence[str], path: str, settings: str) -> dict:
    """Every (task, seed, contender) run, interleaved; ``curves.json`` is rewritten after each run."""
    data = {"budget_s": args.budget_s, "tasks": list(args.tasks), "seeds": list(args.seeds), "runs": {}}
    data["settings"] = f"{settings}; command: {' '.join([sys.executable, *sys.argv])}"
    for task in args.tasks:
        for seed in args.seeds:
            for contender in contenders:
                print(f"running {contender} on {task}, seed {seed}, for {args.budget_s:g} s ...", flush=True)
                result = run_child(contender, task, seed, args.budget_s, args.out)
                if result is not None:
                    data["runs"].setdefault(task, {}).setdefault(contender, {})[str(seed)] = result
                    print(f"  {_run_line(result)}", flush=True)
                with open(path, "w") as handle:
                    json.dump(data, handle)
    return data


def _run_line(result: dict) -> str:
    """One progress line: final return, frames, rate and the load average the next run starts under."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"final return {final_return(result['curve']):.1f}, {result['env_frames']:,} frames, "
        f"{result['frames_per_s']:,.0f} frames/s; load average now {load}"
    )


def _curve(data: dict, task: str, contender: str, seed: int) -> list[Point]:
    run = data["runs"].get(task, {}).get(contender, {}).get(str(seed))
    return [tuple(point) for point in run["curve"]] if run else []


def _run_value(data: dict, task: str, contender: str, seed: int, key: str) -> float:
    run = data["runs"].get(task, {}).get(contender, {}).get(str(seed))
    return float(run[key]) if run and run.get(key) is not None else math.nan


def _time_text(seconds: float) -> str:
    return "not reached" if math.isinf(seconds) else seconds


def print_task_table(data: dict, task: str) -> None:
    """Per contender, median over seeds: returns at fractions of the budget, frames/s, time to SB3 final."""
    from _timing import Table

    budget, seeds = data["budget_s"], data["seeds"]
    columns = [f"return @ {f:.0%}" for f in FRACTIONS]
    table = Table(
        f"{task}: median over seeds {', '.join(map(str, seeds))} ({budget:g} s budget)",
        ["contender", *columns, "frames/s", "time to SB3 final (s)", "... / budget"],
    )
    for contender in CONTENDERS:
        if contender not in data["runs"].get(task, {}):
            table.row(contender, *["n/a"] * (len(columns) + 3))
            continue
        curves = {s: _curve(data, task, contender, s) for s in seeds}
        returns = [
            median([final_return(c) if f == 1.0 else return_at_time(c, f * budget) for c in curves.values()])
            for f in FRACTIONS
        ]
        rate = median([_run_value(data, task, contender, s, "frames_per_s") for s in seeds])
        reach = median([time_to_reach(curves[s], final_return(_curve(data, task, "sb3", s))) for s in seeds])
        table.row(contender, *returns, rate, _time_text(reach), _time_text(reach / budget))


def per_second_ratios(data: dict, task: str) -> dict[str, float]:
    """Median over seeds: each simstream mode's time to SB3's final return / budget, and async / sync."""
    budget, seeds = data["budget_s"], data["seeds"]
    reach = {
        mode: [
            time_to_reach(_curve(data, task, mode, s), final_return(_curve(data, task, "sb3", s)))
            for s in seeds
        ]
        for mode in ("async", "sync")
    }
    return {
        "async": median([t / budget for t in reach["async"]]),
        "sync": median([t / budget for t in reach["sync"]]),
        "async/sync": median([time_ratio(a, s) for a, s in zip(reach["async"], reach["sync"])]),
    }


def print_targets(data: dict) -> None:
    """Each target with its verdict and the numbers behind it."""
    print("\n### Targets\n")
    for task in data["tasks"]:
        per_seed = []
        for seed in data["seeds"]:
            sync = _curve(data, task, "sync", seed)
            frames, sync_final = final_frames(sync), final_return(sync)
            async_at = return_at_frames(_curve(data, task, "async", seed), frames)
            per_seed.append(per_frame_ratio(_curve(data, task, "async", seed), sync))
            print(
                f"- {task} seed {seed}: sync reached {frames:,.0f} frames, final return {sync_final:.1f}; "
                f"async's return at those frames {async_at:.1f}"
            )
        value = median(per_seed)
        print(
            f"- per frame, {task}: async at sync's frames / sync final = {_fraction(value)} "
            f"(target >= {PER_FRAME_TARGET}): {verdict(value, PER_FRAME_TARGET, higher_is_better=True)}"
        )
    for task in data["tasks"]:
        for seed in data["seeds"]:
            threshold = final_return(_curve(data, task, "sb3", seed))
            times = [time_to_reach(_curve(data, task, mode, seed), threshold) for mode in ("async", "sync")]
            seconds = ["never" if math.isinf(t) else f"{t:.1f} s" for t in times]
            print(
                f"- {task} seed {seed}: SB3 ended at {threshold:.1f}; async reaches it at {seconds[0]}, "
                f"sync at {seconds[1]} (async / sync {_fraction(time_ratio(*times))}; 0: only sync never did)"
            )
        ratios = per_second_ratios(data, task)
        for mode in ("async", "sync"):
            print(
                f"- per second, {task}: {mode} reaches SB3's final return at {_fraction(ratios[mode])} "
                f"of the budget (target <= {BUDGET_FRACTION_TARGET}): "
                f"{verdict(ratios[mode], BUDGET_FRACTION_TARGET)}"
            )
        print(
            f"- per second, {task}: async's time / sync's time to SB3's final return = "
            f"{_fraction(ratios['async/sync'])} (target <= {ASYNC_OVER_SYNC_TARGET}): "
            f"{verdict(ratios['async/sync'], ASYNC_OVER_SYNC_TARGET)}"
        )


def _fraction(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return "never (not reached)" if math.isinf(value) else f"{value:.2f}"


def plot(data: dict, path: str) -> None:
    """One subplot per task: return against wall-clock seconds, one line per contender and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = data["tasks"]
    fig, axes = plt.subplots(
        1, len(tasks), figsize=(5.5 * len(tasks), 4), constrained_layout=True, squeeze=False
    )
    for axis, task in zip(axes[0], tasks):
        for contender in CONTENDERS:
            for i, seed in enumerate(data["seeds"]):
                curve = _curve(data, task, contender, seed)
                if curve:
                    axis.plot(
                        [p[0] for p in curve],
                        [p[2] for p in curve],
                        color=COLOURS[contender],
                        alpha=0.8,
                        label=contender if i == 0 else None,
                    )
        axis.set_title(task)
        axis.set_xlabel("wall-clock seconds")
        axis.set_ylabel(f"mean return (last {STATS_WINDOW} episodes)")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(
        f"PPO, default settings, {data['budget_s']:g} s per run, seeds {', '.join(map(str, data['seeds']))}"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: Args) -> int:
    """Runs (unless ``--analyse-only``), then prints the tables and targets and writes the plot."""
    from _timing import print_header

    path = os.path.join(args.out, "curves.json")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    settings = (
        f"load average {load}; {os.cpu_count()} CPUs; {versions()}; budget {args.budget_s:g} s per run, "
        f"tasks {', '.join(args.tasks)}, seeds {', '.join(map(str, args.seeds))}"
    )
    if args.analyse_only:
        with open(path) as handle:
            data = json.load(handle)
        settings = f"re-analysing {path}; its run: {data.get('settings', '(not recorded)')}"
    print_header("RL vs peers: return against wall-clock time", [sys.executable, *sys.argv], settings)
    if not args.analyse_only:
        os.makedirs(args.out, exist_ok=True)
        contenders = CONTENDERS if sb3_available() else CONTENDERS[:2]
        if not sb3_available():
            print(
                "stable_baselines3 is not importable (pip install stable-baselines3, or the bench extra): "
                "the sb3 contender is skipped and the targets that need it print n/a.",
                flush=True,
            )
        data = run_all(args, contenders, path, settings)
    for task in data["tasks"]:
        print_task_table(data, task)
    print_targets(data)
    png = os.path.join(args.out, "return_vs_wall_clock.png")
    plot(data, png)
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child_main(tyro.cli(ChildArgs, args=sys.argv[2:])))
    from _timing import main_of

    main_of(main, Args)
