"""Sampling throughput and latency of the engine against TorchRL and the raw gather, in one run.

Run: ``python benchmarks/sampling.py`` (or ``simstream bench sampling``); ``--quick`` is a seconds-long
smoke configuration whose figures mean nothing. Every ratio printed compares candidates measured in the
same run, on the same shared memory, in interleaved rounds (median of rounds).

Sections: idle throughput without and with images (``sample_batch``, ``OnlineDataset`` item and batch
mode with 0 and 2 ``DataLoader`` workers, TorchRL ``SliceSampler``, raw gather); the same while producers
publish back to back; latency percentiles idle and under publication; per-batch cost against buffer size;
``sample_batch(keys=...)`` with one camera of three against every key (bytes and batches/s).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from _timing import (
    Rates,
    Table,
    call_rate,
    check,
    interleaved_rates,
    last_level_cache_bytes,
    latency_ms,
    main_of,
    percentile,
    print_header,
    process_cpu_seconds,
    quick_preset,
    ratio,
    require_positive,
)
from _timing import set_single_thread as _set_single_thread
from _workload import (
    ContinuousPublication,
    RawGather,
    Workload,
    make_engine,
    make_torchrl_sampler,
    payload_keys,
)
from simstream.data import OnlineDataset, loader_context
from simstream.sampling.gather import BatchLayout

Section = Literal["lowdim", "images", "publication", "latency", "scaling", "keys"]
ALL_SECTIONS: tuple[Section, ...] = ("lowdim", "images", "publication", "latency", "scaling", "keys")


@dataclass(frozen=True)
class Args:
    """sample_batch against TorchRL and the raw gather (defaults: about 6 minutes on 2 vCPUs)."""

    sections: tuple[Section, ...] = ALL_SECTIONS
    """Which sections to run."""
    quick: bool = False
    """Tiny buffers and sub-second timings: checks that every section runs, figures are meaningless."""
    buffer_size: int = 512
    """Episodes in the buffer (low-dim, image and publication sections)."""
    max_steps: int = 300
    batch_size: int = 256
    chunk_size: int = 32
    image_size: int = 64
    rounds: int = 5
    """Interleaved rounds per measurement; tables print the median."""
    seconds: float = 0.6
    """Time per candidate per round (image candidates get twice as long)."""
    scaling_sizes: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    """Buffer sizes of the scaling section (low-dim)."""
    loader_workers: int = 2
    """``DataLoader`` workers of the multi-worker rows."""
    keys_buffer_size: int = 32
    """Episodes in the buffer of the ``keys`` section (three 64x64 cameras: 36 KiB per frame)."""
    keys_batch_size: int = 64
    """Chunks per batch in the ``keys`` section."""

    def __post_init__(self) -> None:
        require_positive(
            self,
            "buffer_size",
            "max_steps",
            "batch_size",
            "chunk_size",
            "image_size",
            "rounds",
            "seconds",
            "scaling_sizes",
            "loader_workers",
            "keys_buffer_size",
            "keys_batch_size",
        )
        if not self.sections:  # ran nothing and exited 0
            raise ValueError(f"--sections must name one or more of {', '.join(ALL_SECTIONS)}, got ()")
        if self.chunk_size > self.max_steps:  # failed with a traceback once the engines had started
            raise ValueError(f"--chunk-size must be <= --max-steps {self.max_steps}, got {self.chunk_size}")

    def round_seconds(self, workload: Workload) -> float:
        """Time per candidate per round: image batches are ~30x slower, so they get twice as long."""
        return self.seconds * (2 if workload.image_size else 1)

    def effective(self) -> Args:
        if not self.quick:
            return self
        return quick_preset(
            self,
            buffer_size=32,
            max_steps=40,
            batch_size=16,
            chunk_size=8,
            image_size=8,
            rounds=1,
            seconds=0.03,
            scaling_sizes=(16, 48),
            keys_buffer_size=8,
            keys_batch_size=8,
        )


# -- candidates ------------------------------------------------------------------------------------
def _engine_candidates(engine, workload: Workload) -> dict[str, Callable[[], object]]:
    b, c = workload.batch_size, workload.chunk_size
    generator = torch.Generator().manual_seed(0)
    reusable = engine.sample_batch(b, c, generator=generator)

    def fresh() -> None:
        engine.sample_batch(b, c, generator=generator)

    def into_out() -> None:
        engine.sample_batch(b, c, generator=generator, out=reusable)

    return {"sample_batch": fresh, "sample_batch(out=)": into_out}


def _loader(
    engine,
    workload: Workload,
    item_mode: bool,
    workers: int,
    worker_slots: int = 6,
    stock_queues: bool = False,
) -> DataLoader:
    """``OnlineDataset.loader`` (direct queues), or ``multiprocessing.Queue`` with ``stock_queues``."""
    batch_size = None if item_mode else workload.batch_size
    dataset = OnlineDataset(engine, workload.chunk_size, batch_size, seed=0, worker_slots=worker_slots)
    context = mp.get_context(mp.get_start_method()) if stock_queues and workers else None
    return dataset.loader(
        workers, workload.batch_size if item_mode else None, multiprocessing_context=context
    )


class _SampleWithoutSending(IterableDataset):
    """Workers that sample batches like ``OnlineDataset`` but send the trainer only a counter.

    The ceiling of any hand-off design: what ``DataLoader`` workers deliver on this machine when moving a
    batch to the trainer costs nothing. With ``arenas > 1`` the worker writes its batches into that many
    shared output arenas in turn, as a worker cycling through output slots does (a worker cannot write
    into the slot it sent last, and mostly gets the one before back): the cost of writing into an arena
    that has partly left the cache.
    """

    def __init__(self, engine, workload: Workload, arenas: int = 1) -> None:
        self.engine, self.workload, self.arenas = engine, workload, arenas

    def __iter__(self):
        b, c = self.workload.batch_size, self.workload.chunk_size
        generator = torch.Generator().manual_seed(get_worker_info().id)
        layout = BatchLayout.of(self.engine.shared_buffer, (b, c))
        outs = [layout.empty(shared=self.arenas > 1) for _ in range(self.arenas)]
        count = 0
        while True:
            self.engine.sample_batch(b, c, generator=generator, out=outs[count % self.arenas])
            count += 1
            yield count


LOADER_WARMUP_BATCHES = 24
"""Batches a fresh ``DataLoader`` iterator delivers before its round is timed: enough for every worker to
fill its prefetch queue and hand each output slot over once, so rounds measure the steady state a
training run lives in rather than worker start-up."""


def _loader_rounds(
    engine, loaders: dict[str, DataLoader], workload: Workload, args: Args, rates: Rates
) -> None:
    """Interleaved rounds of every loader (round 1 of each, then round 2, ...) and of the plain processes.

    Each round iterates a fresh ``DataLoader`` iterator (workers started anew, then stopped), timed after
    ``LOADER_WARMUP_BATCHES``. Interleaving pairs the rows' measurements in time, so the ratios between
    them do not carry the VM's drift.
    """
    seconds = args.round_seconds(workload)
    warmup = 3 if args.quick else LOADER_WARMUP_BATCHES
    for _ in range(args.rounds):
        for name, loader in loaders.items():
            iterator = iter(loader)
            for _ in range(warmup):
                next(iterator)
            workers = [worker.pid for worker in getattr(iterator, "_workers", ())]
            began, workers_cpu = time.perf_counter(), process_cpu_seconds(workers)
            rate, cpu_ms = call_rate(lambda it=iterator: next(it), seconds)
            batches = rate * (time.perf_counter() - began)
            workers_ms = (
                (process_cpu_seconds(workers) - workers_cpu) * 1e3 / batches if workers else float("nan")
            )
            rates.add(name, rate, cpu_ms, workers_ms)
            del iterator
        _parallel_processes_round(engine, workload, args, rates)


def _sample_in_process(engine, workload: Workload, seed: int, ready, seconds: float, results) -> None:
    """One sampler of ``_parallel_processes_round``: ``sample_batch`` in a loop, its rate to ``results``."""
    _set_single_thread()
    b, c = workload.batch_size, workload.chunk_size
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):  # warm-up, as every in-process candidate gets
        engine.sample_batch(b, c, generator=generator)
    ready.wait(timeout=60.0)  # every sampler starts timing at the same moment
    rate, _ = call_rate(lambda: engine.sample_batch(b, c, generator=generator), seconds)
    results.put(rate)


def _parallel_processes_round(engine, workload: Workload, args: Args, rates: Rates) -> None:
    """One process, then ``loader_workers`` plain processes sampling side by side, no ``DataLoader``.

    What the machine itself allows: no queues, no hand-off, no trainer process competing for the cores.
    Both counts run in the same round, so their ratio compares like with like.
    """
    context = mp.get_context("fork")
    seconds = args.round_seconds(workload)
    for count in sorted({1, args.loader_workers}):
        ready, results = context.Barrier(count + 1), context.Queue()
        processes = [
            context.Process(target=_sample_in_process, args=(engine, workload, i, ready, seconds, results))
            for i in range(count)
        ]
        for process in processes:
            process.start()
        try:
            ready.wait(timeout=60.0)
            total = sum(results.get(timeout=60.0 + seconds) for _ in processes)
        finally:
            for process in processes:
                process.join(timeout=30.0)
                if process.is_alive():
                    process.kill()
                    process.join()
        rates.add(_processes_name(count), total)


def _loaders(engine, workload: Workload, workers: int) -> dict[str, DataLoader]:
    """The DataLoader rows: both modes with 0 and ``workers`` workers, batch mode with stock queues and
    without slots, and the no-hand-off ceiling."""
    return {
        _loader_name(False, 0): _loader(engine, workload, False, 0),
        _loader_name(True, 0): _loader(engine, workload, True, 0),
        _loader_name(False, workers): _loader(engine, workload, False, workers),
        _loader_name(True, workers): _loader(engine, workload, True, workers),
        _loader_name(False, workers, STOCK): _loader(engine, workload, False, workers, stock_queues=True),
        _loader_name(False, workers, NO_SLOTS): _loader(engine, workload, False, workers, worker_slots=0),
        _loader_name(False, workers, CEILING): _ceiling_loader(engine, workload, workers, arenas=1),
        _loader_name(False, workers, ROTATING): _ceiling_loader(engine, workload, workers, ROTATING_ARENAS),
    }


def _ceiling_loader(engine, workload: Workload, workers: int, arenas: int) -> DataLoader:
    """Workers sampling like ``OnlineDataset`` into ``arenas`` outputs, sending counters (direct queues)."""
    dataset = _SampleWithoutSending(engine, workload, arenas)
    context = loader_context()  # the queues OnlineDataset.loader uses
    return DataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context=context)


NO_SLOTS = "worker_slots=0"
STOCK = "stock multiprocessing.Queue"
CEILING = "ceiling: batches sampled, not sent"
ROTATING_ARENAS = 2
ROTATING = f"same, sampled into {ROTATING_ARENAS} shared arenas in turn"


def _processes_name(count: int) -> str:
    """Row of ``count`` plain processes calling ``sample_batch`` in a loop (no ``DataLoader``)."""
    return (
        "1 process sampling alone, no DataLoader"
        if count == 1
        else (f"{count} processes sampling side by side, no DataLoader")
    )


def _loader_name(item_mode: bool, workers: int, variant: str = "") -> str:
    name = f"OnlineDataset {'item' if item_mode else 'batch'} mode, {workers} workers"
    if variant in (CEILING, ROTATING):
        return f"{workers} workers, {variant}"
    return f"{name}, {variant}" if variant else name


# -- sections --------------------------------------------------------------------------------------
def throughput_section(args: Args, engine, workload: Workload, title: str) -> None:
    raw = RawGather(engine, workload)
    candidates = {"raw gather (same keys)": raw, **_engine_candidates(engine, workload)}
    candidates["raw gather, whole-slice copies (same keys)"] = RawGather(engine, workload, windowed=True)
    payload_only = RawGather(engine, workload, payload_keys(engine))
    candidates["raw gather (payload keys only)"] = payload_only
    torchrl = make_torchrl_sampler(engine, workload)
    if (
        torchrl is not None
    ):  # in the same rounds as sample_batch: the x TorchRL targets compare like with like
        candidates["TorchRL SliceSampler"] = torchrl
    seconds = args.round_seconds(workload)
    rates = interleaved_rates(candidates, args.rounds, seconds)
    _loader_rounds(engine, _loaders(engine, workload, args.loader_workers), workload, args, rates)
    # every row copies the same keys as the raw gather, but the payload-only one
    nbytes = {name: raw.bytes_per_batch for name in rates.rounds}
    nbytes["raw gather (payload keys only)"] = payload_only.bytes_per_batch
    _print_throughput(title, workload, rates, nbytes, torchrl is not None, args.loader_workers)


def _print_throughput(
    title: str, workload: Workload, rates: Rates, nbytes: dict[str, int], has_torchrl: bool, workers: int
) -> None:
    images = workload.image_size is not None
    table = Table(
        f"{title}: {workload.describe()}, {nbytes['raw gather (same keys)'] / 2**20:.1f} MiB per batch",
        [
            "candidate",
            "batches/s",
            "ms/batch",
            "CPU ms/batch",
            "workers' CPU ms/batch",
            "GB/s",
            "x TorchRL",
            "x raw gather",
        ],
    )
    raw = rates.median("raw gather (same keys)")
    torchrl = rates.median("TorchRL SliceSampler")
    for name in rates.rounds:
        rate = rates.median(name)
        cpu, workers_cpu = rates.median_cpu_ms(name), rates.median_helper_cpu_ms(name)
        gb_s = rate * nbytes[name] / 1e9
        table.row(name, rate, 1e3 / rate, cpu, workers_cpu, gb_s, ratio(rate, torchrl), ratio(rate, raw))
    print(
        "\nCPU ms/batch: CPU time of the calling thread per batch (DataLoader rows with workers: the "
        "trainer's share only). Workers' CPU ms/batch: all DataLoader workers together, from /proc "
        "(10 ms ticks). Wall-clock rates include whatever else the machine runs."
    )
    if not has_torchrl:
        print("\nTorchRL not importable: `pip install torchrl` to add the TorchRL rows.")
    engine = rates.median("sample_batch")
    loader0 = rates.median(_loader_name(False, 0))
    loader2 = rates.median(_loader_name(False, workers))
    targets = Table(f"{title}: targets", ["check", "measured", "target", "verdict"])
    target_trl = 15.0 if images else 5.0
    for label, value, target in (
        ("sample_batch / TorchRL SliceSampler", ratio(engine, torchrl), target_trl),
        ("sample_batch / raw gather (same keys)", ratio(engine, raw), 0.70),
        ("sample_batch(out=) / raw gather (same keys)", ratio(rates.median("sample_batch(out=)"), raw), 0.70),
    ):
        targets.row(label, value, f">= {target:g}", check(value, target))
    _loader_target(
        targets, f"OnlineDataset batch mode, {workers} / 0 workers", ratio(loader2, loader0), images
    )
    stock = rates.median(_loader_name(False, workers, STOCK))
    targets.row(f"  same, {STOCK} (DataLoader's default)", ratio(stock, loader0), "report", "-")
    without = rates.median(_loader_name(False, workers, NO_SLOTS))
    ceiling = rates.median(_loader_name(False, workers, CEILING))
    label = f"  same, {NO_SLOTS} (a new shared segment per batch)"
    targets.row(label, ratio(without, loader0), "report", "-")
    targets.row(f"  {workers} workers, {CEILING} / 0 workers", ratio(ceiling, loader0), "report", "-")
    targets.row("  OnlineDataset batch mode / that ceiling", ratio(loader2, ceiling), "report", "-")
    rotating = rates.median(_loader_name(False, workers, ROTATING))
    targets.row(f"  {workers} workers, {ROTATING} / 0 workers", ratio(rotating, loader0), "report", "-")
    processes = rates.median(_processes_name(workers))
    label = f"  {_processes_name(workers)}, / 1 process alone (same rounds)"
    targets.row(label, ratio(processes, rates.median(_processes_name(1))), "report", "-")
    items0, items2 = rates.median(_loader_name(True, 0)), rates.median(_loader_name(True, workers))
    _loader_target(targets, f"OnlineDataset item mode, {workers} / 0 workers", ratio(items2, items0), images)


def _loader_target(targets: Table, label: str, value: float, images: bool) -> None:
    """The issue's 2 / 0 workers target (>= 1.5 for low-dim batches; image batches are reported)."""
    if images:
        targets.row(label, value, "report (memory bus)", "-")
    else:
        targets.row(label, value, ">= 1.5", check(value, 1.5))


def publication_section(args: Args, engine, workload: Workload, title: str) -> None:
    """Idle and busy rounds alternate, so the busy/idle ratios pair measurements taken close in time."""
    candidates = {
        "raw gather (same keys)": RawGather(engine, workload),
        **_engine_candidates(engine, workload),
    }
    idle, busy = Rates(), Rates()
    published = []
    seconds = args.round_seconds(workload)
    for _ in range(args.rounds):
        interleaved_rates(candidates, 1, seconds, rates=idle)
        with ContinuousPublication(engine) as publication:
            interleaved_rates(candidates, 1, seconds, rates=busy)
        published.append(publication.episodes_per_s)
    producer_alone = _producer_rate(engine, seconds)
    table = Table(
        f"{title}: {workload.describe()}",
        ["candidate", "idle batches/s", "under publication", "busy / idle"],
    )
    for name in candidates:
        table.row(name, idle.median(name), busy.median(name), ratio(busy.median(name), idle.median(name)))
    fresh = sorted(published)[len(published) // 2]
    print(
        f"\nproducers published {fresh:,.0f} episodes/s while sampling "
        f"({producer_alone:,.0f} episodes/s with nobody sampling)"
    )
    raw_share = ratio(busy.median("raw gather (same keys)"), idle.median("raw gather (same keys)"))
    engine_share = ratio(busy.median("sample_batch"), idle.median("sample_batch"))
    targets = Table(f"{title}: targets", ["check", "measured", "target", "verdict"])
    targets.row("sample_batch under publication / idle", engine_share, ">= 0.8", check(engine_share, 0.8))
    targets.row("same for the raw gather (the machine's share)", raw_share, "report", "-")
    relative = ratio(engine_share, raw_share)
    targets.row("sample_batch's busy/idle relative to the raw gather's", relative, "report", "-")


def _producer_rate(engine, seconds: float) -> float:
    with ContinuousPublication(engine) as publication:
        time.sleep(max(seconds, 0.2) * 2)
    return publication.episodes_per_s


def latency_section(args: Args, engine, workload: Workload, title: str) -> None:
    b, c = workload.batch_size, workload.chunk_size
    generator = torch.Generator().manual_seed(0)
    seconds = args.seconds * 2 * (2 if workload.image_size else 1)
    idle: list[float] = []
    busy: list[float] = []
    for _ in range(args.rounds):
        idle += latency_ms(lambda: engine.sample_batch(b, c, generator=generator), seconds)
        with ContinuousPublication(engine):
            busy += latency_ms(lambda: engine.sample_batch(b, c, generator=generator), seconds)
    table = Table(f"{title}: {workload.describe()}", ["sample_batch", "calls", "p50 ms", "p99 ms", "max ms"])
    for name, values in (("idle", idle), ("under publication", busy)):
        table.row(name, len(values), percentile(values, 50), percentile(values, 99), max(values))
    value = ratio(percentile(busy, 99), percentile(idle, 99))
    targets = Table(f"{title}: targets", ["check", "measured", "target", "verdict"])
    targets.row("p99 under publication / idle p99", value, "<= 3", check(value, 3.0, higher_is_better=False))


def _cold_cache_ms(
    candidates: dict[str, Callable[[], object]], calls: int, evict_bytes: int
) -> dict[str, float]:
    """Median time of each candidate with the last-level cache flushed before every call.

    A training step between two batches does the same to the cache. Candidates take turns call by call,
    so drift of a shared machine hits them alike.
    """
    scratch = torch.ones(evict_bytes // 4)
    sink = torch.empty_like(scratch)
    durations: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(calls):
        for name, fn in candidates.items():
            sink.copy_(scratch)
            began = time.perf_counter()
            fn()
            durations[name].append(time.perf_counter() - began)
    return {name: percentile(values, 50) * 1e3 for name, values in durations.items()}


def _shmem_huge_pages() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    text = path.read_text().strip() if path.exists() else "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else text


class _SizeTimes(NamedTuple):
    """Per-batch milliseconds of one buffer size, cache warm (back-to-back calls) and flushed."""

    size: int
    nbytes: int
    engine_ms: float
    quota_ms: float
    raw_ms: float
    cold_engine_ms: float
    cold_raw_ms: float


def scaling_section(args: Args, workload: Workload) -> None:
    """Every buffer size lives at once, so all sizes are measured in the same interleaved rounds."""
    cache = last_level_cache_bytes()
    evict = 2 * (cache or 32 * 2**20)
    calls = 30 if args.quick else 300
    engines = {}
    try:
        candidates: dict[str, Callable[[], object]] = {}
        nbytes: dict[int, int] = {}
        for size in args.scaling_sizes:
            sized = replace(workload, buffer_size=size, image_size=None)
            engine = engines[size] = make_engine(sized, num_envs=64)
            candidates[f"{size} engine"] = _engine_candidates(engine, sized)["sample_batch"]
            # per-episode quotas (never exhausted here): selection, copy and debit under the quota lock
            budgeted = engines[-size] = make_engine(
                sized, num_envs=64, episode_sample_budget=2**62, episode_sample_hard_limit=2**62
            )
            candidates[f"{size} quotas"] = _engine_candidates(budgeted, sized)["sample_batch"]
            candidates[f"{size} raw"] = RawGather(engine, sized)
            nbytes[size] = sum(t.numel() * t.element_size() for t in engine.shared_buffer.values(True, True))
        rates = interleaved_rates(candidates, args.rounds, args.seconds)
        cold = _cold_cache_ms(candidates, calls, evict)
    finally:
        for engine in engines.values():
            engine.stop()
    table = Table(
        f"Cost against buffer size (low-dim, batch {workload.batch_size} x {workload.chunk_size})",
        [
            "episodes",
            "buffer MiB",
            "sample_batch ms",
            "with quotas ms",
            "raw gather ms",
            "raw / sample_batch",
            "cold cache: sample_batch ms",
            "cold cache: raw ms",
        ],
    )
    measured = [
        _SizeTimes(
            size,
            nbytes[size],
            1e3 / rates.median(f"{size} engine"),
            1e3 / rates.median(f"{size} quotas"),
            1e3 / rates.median(f"{size} raw"),
            cold[f"{size} engine"],
            cold[f"{size} raw"],
        )
        for size in args.scaling_sizes
    ]
    for m in measured:
        table.row(
            m.size,
            m.nbytes / 2**20,
            m.engine_ms,
            m.quota_ms,
            m.raw_ms,
            m.raw_ms / m.engine_ms,
            m.cold_engine_ms,
            m.cold_raw_ms,
        )
    print(
        "\nAll sizes were measured in the same interleaved rounds. Cold cache: "
        f"{evict // 2**20} MiB streamed through the cache before each timed call (median of {calls} "
        "per size, sizes taking turns). "
        f"Transparent huge pages for shared memory: {_shmem_huge_pages()}."
    )
    first, last = measured[0], measured[-1]
    sizes = f"{first.size} -> {last.size}"
    targets = Table("Cost against buffer size: targets", ["check", "measured", "target", "verdict"])
    for engine_label, raw_label, engine_ms, raw_ms in (
        ("sample_batch per-batch time growth", "raw gather per-batch time growth", "engine_ms", "raw_ms"),
        ("cold cache: sample_batch growth", "cold cache: raw gather growth", "cold_engine_ms", "cold_raw_ms"),
    ):
        growth = ratio(getattr(last, engine_ms), getattr(first, engine_ms)) - 1
        raw_growth = ratio(getattr(last, raw_ms), getattr(first, raw_ms)) - 1
        verdict = check(growth, 0.2, higher_is_better=False)
        targets.row(f"{engine_label}, {sizes}", f"{growth:+.0%}", "< +20%", verdict)
        targets.row(f"{raw_label}, {sizes}", f"{raw_growth:+.0%}", "report", "-")
    quota_growth = ratio(last.quota_ms, first.quota_ms) - 1
    targets.row(
        f"sample_batch with quotas per-batch time growth, {sizes}",
        f"{quota_growth:+.0%}",
        "< +20%",
        check(quota_growth, 0.2, higher_is_better=False),
    )
    beyond = [m for m in measured if cache is not None and m.nbytes > 2 * cache]
    if len(beyond) >= 2 and beyond[0] is not first:
        low, high = beyond[0], beyond[-1]
        targets.row(
            f"sample_batch growth {low.size} -> {high.size} (buffers over 2x the {cache // 2**20} MiB cache)",
            f"{ratio(high.engine_ms, low.engine_ms) - 1:+.0%}",
            "report",
            "-",
        )


KEY_SETS: dict[str, list[str] | None] = {
    "every key (keys=None)": None,
    "one camera + obs/state + actions": ["obs/image", "obs/state", "actions"],
    "one camera (keys=['obs/image'])": ["obs/image"],
}
"""``keys=`` of the ``keys`` section's candidates; ``valid`` is always copied too."""


def keys_section(args: Args, base: Workload) -> None:
    """``sample_batch(keys=...)``: bytes and batches/s with every key and with one camera of three."""
    workload = replace(
        base, buffer_size=args.keys_buffer_size, batch_size=args.keys_batch_size, image_size=args.image_size
    )
    engine = make_engine(workload, extra_cameras=("wrist_image", "side_image"))
    try:
        b, c = workload.batch_size, workload.chunk_size
        generator = torch.Generator().manual_seed(0)
        candidates, nbytes = {}, {}
        for label, keys in KEY_SETS.items():
            batch = engine.sample_batch(b, c, generator=generator, keys=keys)
            nbytes[label] = sum(leaf.nbytes for leaf in batch.values(include_nested=True, leaves_only=True))
            del batch  # the batch's arena goes back to the pool

            def sample(keys=keys) -> None:
                engine.sample_batch(b, c, generator=generator, keys=keys)

            candidates[label] = sample
        rates = interleaved_rates(candidates, args.rounds, args.round_seconds(workload))
    finally:
        engine.stop()
    table = Table(
        f"sample_batch(keys=...): {workload.describe()}, cameras obs/image, obs/wrist_image, obs/side_image",
        ["keys", "MiB/batch", "batches/s", "ms/batch", "GB/s", "x every key (batches/s)"],
    )
    every = rates.median("every key (keys=None)")
    for label in KEY_SETS:
        rate = rates.median(label)
        table.row(
            label, nbytes[label] / 2**20, rate, 1e3 / rate, rate * nbytes[label] / 1e9, ratio(rate, every)
        )
    one = "one camera (keys=['obs/image'])"
    print(
        f"\nOne camera of three copies {nbytes[one] / nbytes['every key (keys=None)']:.0%} of the bytes of "
        f"every key and runs {ratio(rates.median(one), every):.2f}x as many batches per second."
    )


def run(args: Args) -> int:
    _set_single_thread()
    args = args.effective()
    base = Workload(args.buffer_size, args.max_steps, args.batch_size, args.chunk_size)
    images = replace(base, image_size=args.image_size)
    print_header(
        "simstream sampling benchmark",
        ["python", "benchmarks/sampling.py", *sys.argv[1:]],
        f"{args.rounds} interleaved rounds x {args.seconds:g} s per candidate, median shown"
        + (" (QUICK: figures meaningless)" if args.quick else ""),
    )
    for workload, label in ((base, "low-dim"), (images, "with images")):
        wanted = [s for s in ("publication", "latency") if s in args.sections]
        if ("lowdim" if workload is base else "images") in args.sections:
            wanted.insert(0, "throughput")
        if not wanted:
            continue
        engine = make_engine(workload)
        try:
            if "throughput" in wanted:
                throughput_section(args, engine, workload, f"Idle sampling, {label}")
            if "publication" in wanted:
                publication_section(args, engine, workload, f"Sampling under continuous publication, {label}")
            if "latency" in wanted:
                latency_section(args, engine, workload, f"Latency of sample_batch, {label}")
        finally:
            engine.stop()
    if "scaling" in args.sections:
        scaling_section(args, base)
    if "keys" in args.sections:
        keys_section(args, base)
    return 0


if __name__ == "__main__":
    main_of(run, Args)
