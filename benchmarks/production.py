"""Production throughput: episodes/s of the engine against the bare source loop, 1 and N workers.

Run: ``python benchmarks/production.py`` (or ``simstream bench production``); ``--quick`` is a seconds-long
smoke configuration whose figures mean nothing.

The source is the synthetic one with a CPU-bound cost per step (``--work-us-per-step``, a stand-in for a
physics step), the reference layout and lengths drawn in ``[200, 300]``. The bare loop is the same source
calling ``rollout`` into a private ``TensorDict`` in as many processes as the engine has workers, with no
engine at all: claiming rows, deriving metadata and run tables, and publishing are the engine's overhead.
Engine rates count episodes published while the owner requests generations back to back. Candidates run
in interleaved rounds; tables print the median.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import math
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from _timing import (
    Rates,
    Table,
    check,
    main_of,
    print_header,
    quick_preset,
    ratio,
    require_positive,
    set_single_thread,
)
from _workload import ContinuousPublication, Workload, make_engine, synthetic_spec


@dataclass(frozen=True)
class Args:
    """Episodes/s of the engine against the bare source loop (defaults: about 2 minutes on 2 vCPUs)."""

    quick: bool = False
    """Tiny episodes and sub-second rounds: checks that everything runs, figures are meaningless."""
    work_us_per_step: float = 50.0
    """CPU time the source burns per step (a stand-in for simulation)."""
    max_steps: int = 300
    num_envs: int = 4
    """Episodes per rollout (rows per write window)."""
    rows_per_worker: int = 128
    """Buffer rows each producer owns (one generation = this many episodes per worker)."""
    workers: tuple[int, ...] = (1, 2)
    """Worker counts to measure; ratios compare each with the first."""
    rounds: int = 3
    seconds: float = 4.0
    """Measurement time per candidate per round."""
    nan_check: bool = False
    """Also run the first worker count with ``check_unwritten_frames=False``: the check's cost."""

    def __post_init__(self) -> None:
        if isinstance(self.work_us_per_step, bool) or not 0 <= self.work_us_per_step < math.inf:
            # 0: a source that costs nothing per step, the engine's own overhead alone (BENCHMARKS.md)
            raise ValueError(
                f"--work-us-per-step must be a finite number >= 0, got {self.work_us_per_step!r}"
            )
        require_positive(
            self,
            "max_steps",
            "num_envs",
            "rows_per_worker",
            "workers",
            "rounds",
            "seconds",
        )

    def effective(self) -> Args:
        if not self.quick:
            return self
        return quick_preset(
            self, max_steps=30, rows_per_worker=8, rounds=1, seconds=0.15, work_us_per_step=20.0
        )


def _bare_worker(spec_args: tuple, worker: int, seconds: float, barrier, results) -> None:
    set_single_thread()
    workload, num_envs = spec_args
    spec = synthetic_spec(workload, num_envs, fixed_length=False)
    source = spec.build(worker, 1000 + worker)
    fields = spec.fields()
    rows = TensorDict(
        {
            tuple(name.split("/")): torch.zeros(num_envs, spec.max_episode_steps, *f.shape, dtype=f.dtype)
            for name, f in fields.items()
        },
        batch_size=[num_envs, spec.max_episode_steps],
    )
    source.rollout(rows, attempt=0, should_stop=lambda: False)  # warm-up
    barrier.wait(timeout=120)
    episodes, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        episodes += len(source.rollout(rows, attempt=0, should_stop=lambda: False))
    results.put(episodes / (time.perf_counter() - began))
    source.close()


def bare_rate(workload: Workload, num_envs: int, processes: int, seconds: float) -> float:
    """Aggregate episodes/s of ``processes`` bare source loops running at the same time."""
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [
        ctx.Process(target=_bare_worker, args=((workload, num_envs), k, seconds, barrier, results))
        for k in range(processes)
    ]
    for process in workers:
        process.start()
    total = sum(results.get(timeout=seconds + 120) for _ in workers)
    for process in workers:
        process.join(timeout=30)
    return total


def engine_rate(engine, seconds: float) -> float:
    with ContinuousPublication(engine) as publication:
        time.sleep(seconds)
    return publication.episodes_per_s


def run(args: Args) -> int:
    set_single_thread()
    args = args.effective()
    print_header(
        "simstream production benchmark",
        ["python", "benchmarks/production.py", *sys.argv[1:]],
        f"synthetic source, {args.work_us_per_step:g} us CPU per step, episodes of "
        f"{2 * args.max_steps // 3}-{args.max_steps} steps, {args.num_envs} per rollout; "
        f"{args.rounds} interleaved rounds x {args.seconds:g} s, median shown"
        + (" (QUICK: figures meaningless)" if args.quick else ""),
    )
    engines, unchecked = {}, None
    try:
        for count in args.workers:
            workload = Workload(
                buffer_size=args.rows_per_worker * count,
                max_steps=args.max_steps,
                num_workers=count,
                work_us_per_step=args.work_us_per_step,
            )
            engines[count] = (workload, make_engine(workload, num_envs=args.num_envs, fixed_length=False))
        if args.nan_check:
            workload = engines[args.workers[0]][0]
            unchecked = make_engine(
                workload, num_envs=args.num_envs, fixed_length=False, check_unwritten_frames=False
            )
        rates = Rates()
        for _ in range(args.rounds):
            for count, (workload, engine) in engines.items():
                rates.add(f"bare {count}", bare_rate(workload, args.num_envs, count, args.seconds))
                rates.add(f"engine {count}", engine_rate(engine, args.seconds))
            if unchecked is not None:
                rates.add("engine unchecked", engine_rate(unchecked, args.seconds))
    finally:
        for engine in [engine for _, engine in engines.values()] + [unchecked]:
            if engine is not None:
                engine.stop()
    _print(args, rates)
    return 0


def _print(args: Args, rates: Rates) -> None:
    first = args.workers[0]
    table = Table(
        "Episodes per second, engine against the bare source loop",
        ["workers", "bare loop eps/s", "engine eps/s", "engine / bare", f"engine / engine({first})"],
    )
    for count in args.workers:
        bare, engine = rates.median(f"bare {count}"), rates.median(f"engine {count}")
        table.row(count, bare, engine, ratio(engine, bare), ratio(engine, rates.median(f"engine {first}")))
    targets = Table("Production: targets", ["check", "measured", "target", "verdict"])
    overhead = ratio(rates.median(f"engine {first}"), rates.median(f"bare {first}"))
    targets.row(f"engine / bare loop, {first} worker", overhead, ">= 0.95", check(overhead, 0.95))
    for count in args.workers[1:]:
        scaling = ratio(rates.median(f"engine {count}"), rates.median(f"engine {first}"))
        machine = ratio(rates.median(f"bare {count}"), rates.median(f"bare {first}"))
        targets.row(f"engine {count} workers / {first} worker", scaling, ">= 1.7", check(scaling, 1.7))
        targets.row(f"bare loop {count} processes / 1 (what the machine allows)", machine, "report", "-")
    if args.nan_check:
        checked = Table(
            f"check_unwritten_frames, {first} worker",
            ["check", "engine eps/s", "engine / bare loop", "with / without the check"],
        )
        with_check, without = rates.median(f"engine {first}"), rates.median("engine unchecked")
        bare = rates.median(f"bare {first}")
        checked.row("on (default)", with_check, ratio(with_check, bare), ratio(with_check, without))
        checked.row("off", without, ratio(without, bare), "-")


if __name__ == "__main__":
    main_of(run, Args)
