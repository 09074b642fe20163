"""Timing, tables and the machine description shared by the benchmark scripts.

Rates are measured in interleaved rounds (every candidate once per round, then the next round) and
reported as the median over rounds, so slow drift of a shared VM hits every candidate alike and the ratios
printed by one run compare like with like.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Rates",
    "Table",
    "call_rate",
    "describe_machine",
    "interleaved_rates",
    "latency_ms",
    "pin_process",
    "process_cpu_seconds",
    "ratio",
    "set_single_thread",
]


def main_of(run: Callable[[Any], int | None], args_type: type) -> None:
    """Parse ``args_type``'s flags, run the benchmark and exit with its code. A Ctrl-C (or SIGTERM, handled
    as one) ends it with one line and exit code 130 (143) once its engines have stopped, as the
    ``simstream`` commands end; any other failure keeps its traceback (a benchmark is a developer's tool)."""
    import sys
    from pathlib import Path

    import tyro

    from simstream.cli._report import EXIT_INTERRUPTED, EXIT_TERMINATED, sigterm_as_ctrl_c

    terminated: list[int] = []
    try:
        with sigterm_as_ctrl_c(terminated):
            code = run(tyro.cli(args_type))
    except KeyboardInterrupt:
        what = "terminated (SIGTERM)" if terminated else "interrupted"
        print(f"\n{Path(sys.argv[0]).name}: {what}", file=sys.stderr)
        sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)
    sys.exit(code or 0)


def set_single_thread() -> None:
    """One intra-op thread: samplers get their parallelism from processes (see BENCHMARKS.md)."""
    torch.set_num_threads(1)


def call_rate(fn: Callable[[], object], seconds: float, min_calls: int = 3) -> tuple[float, float]:
    """Calls per second of ``fn`` (wall clock) and this thread's CPU milliseconds per call.

    Runs for at least ``seconds`` and ``min_calls`` calls. On a shared or oversubscribed machine the CPU
    time shows what a call costs when it does run; the wall-clock rate is what a trainer gets.
    """
    calls = 0
    began, cpu = time.perf_counter(), time.thread_time()
    deadline = began + seconds
    while calls < min_calls or time.perf_counter() < deadline:
        fn()
        calls += 1
    return calls / (time.perf_counter() - began), (time.thread_time() - cpu) * 1e3 / calls


@dataclass
class Rates:
    """Per-round rates (and CPU ms per call) of each candidate; tables print medians."""

    rounds: dict[str, list[float]] = field(default_factory=dict)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    helper_cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    """CPU milliseconds per call spent in helper processes (``DataLoader`` workers), where measured."""

    def add(
        self, name: str, rate: float, cpu_ms: float = float("nan"), helper_cpu_ms: float = float("nan")
    ) -> None:
        self.rounds.setdefault(name, []).append(rate)
        self.cpu_ms.setdefault(name, []).append(cpu_ms)
        self.helper_cpu_ms.setdefault(name, []).append(helper_cpu_ms)

    def median(self, name: str) -> float:
        values = self.rounds.get(name)
        return statistics.median(values) if values else float("nan")

    def median_cpu_ms(self, name: str) -> float:
        values = self.cpu_ms.get(name)
        return statistics.median(values) if values else float("nan")

    def median_helper_cpu_ms(self, name: str) -> float:
        values = self.helper_cpu_ms.get(name)
        return statistics.median(values) if values else float("nan")

    def __contains__(self, name: str) -> bool:
        return name in self.rounds


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus`` (``os.sched_setaffinity(pid)`` alone moves one
    thread; threads started later inherit their creator's affinity)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def process_cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (Linux ``/proc``; else NaN)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def interleaved_rates(
    candidates: dict[str, Callable[[], object]],
    rounds: int,
    seconds: float,
    *,
    warmup_calls: int = 2,
    min_calls: int = 3,
    rates: Rates | None = None,
) -> Rates:
    """Rates of every candidate, measured once per round in turn."""
    rates = rates or Rates()
    for fn in candidates.values():
        for _ in range(warmup_calls):
            fn()
    for _ in range(rounds):
        for name, fn in candidates.items():
            rates.add(name, *call_rate(fn, seconds, min_calls))
    return rates


def latency_ms(fn: Callable[[], object], seconds: float, min_calls: int = 50) -> list[float]:
    """Duration of every call of ``fn`` (milliseconds) over ``seconds``."""
    durations = []
    deadline = time.perf_counter() + seconds
    while len(durations) < min_calls or time.perf_counter() < deadline:
        began = time.perf_counter_ns()
        fn()
        durations.append((time.perf_counter_ns() - began) / 1e6)
    return durations


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), nearest-rank."""
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))  # the smallest value with at least q% of values at or below it
    return ordered[max(0, min(len(ordered), rank) - 1)]


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and denominator == denominator else float("nan")


class Table:
    """A Markdown table printed as it is built, so partial results survive an interrupted run."""

    def __init__(self, title: str, columns: Sequence[str]) -> None:
        self.columns = list(columns)
        print(f"\n### {title}\n", flush=True)
        print("| " + " | ".join(self.columns) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|", flush=True)

    def row(self, *cells: object) -> None:
        print("| " + " | ".join(_format(cell) for cell in cells) + " |", flush=True)


def _format(cell: object) -> str:
    if isinstance(cell, float):
        if cell != cell:
            return "n/a"
        if abs(cell) >= 100:
            return f"{cell:,.0f}"
        if abs(cell) >= 10:
            return f"{cell:.1f}"
        return f"{cell:.2f}"
    return str(cell)


def check(value: float, target: float, higher_is_better: bool = True) -> str:
    """``met`` / ``SHORT`` verdict of a measured ratio against its target."""
    if value != value:
        return "n/a"
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "SHORT"


def describe_machine() -> str:
    """One line: CPU model, cores, memory, Python, torch, threads and the OpenMP wait policy."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as handle:
            total_kb = int(handle.readline().split()[1])
        memory = f", {total_kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"{model}, {os.cpu_count()} logical CPUs{memory}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
    )


def print_header(title: str, command: Iterable[str], settings: str) -> None:
    print(f"## {title}\n")
    print(f"command: `{' '.join(command)}`  ")
    print(f"machine: {describe_machine()}  ")
    print(f"settings: {settings}", flush=True)


def quick_preset(args: Any, **preset: Any) -> Any:
    """``args`` with ``--quick``'s ``preset`` applied to the fields that still hold their defaults: a flag
    given beside ``--quick`` wins, as in ``simstream demo --quick`` (they were overridden silently)."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    return dataclasses.replace(
        args, **{name: value for name, value in preset.items() if getattr(args, name) == defaults[name]}
    )


def require_gym_env(env: str) -> None:
    """Refuse an ``--env`` gymnasium does not know before anything runs (it failed with gymnasium's
    traceback once the candidates were starting)."""
    import gymnasium

    try:
        gymnasium.spec(env)
    except Exception as error:
        raise ValueError(f"--env must be a registered gymnasium environment, got {env!r}: {error}") from None


def require_positive(args: object, *names: str) -> None:
    """Refuse flags that must be positive and finite (each number of a list, and a list must hold one)
    before anything runs: a ``ValueError`` naming the flag, as the ``simstream`` commands do (``inf``
    seconds ran forever)."""
    for name in names:
        value = getattr(args, name)
        if value is None:
            continue
        values = value if isinstance(value, tuple) else (value,)
        if not values or any(isinstance(v, bool) or not 0 < v < math.inf for v in values):
            flag = "--" + name.replace("_", "-")
            kind = "one or more finite numbers" if isinstance(value, tuple) else "a finite number"
            raise ValueError(f"{flag} must be {kind} > 0, got {value!r}")


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache (Linux sysfs), or ``None`` when unknown."""
    sizes = []
    for entry in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        if text.endswith("K"):
            sizes.append(int(text[:-1]) * 1024)
        elif text.endswith("M"):
            sizes.append(int(text[:-1]) * 2**20)
    return max(sizes) if sizes else None
