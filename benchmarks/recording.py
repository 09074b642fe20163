"""LeRobot recording and replay (issue 18): what recording costs the producers and the trainer.

Run: ``python benchmarks/recording.py`` (about 6 minutes on 2 vCPUs); ``--quick`` checks that it runs.

1. ``simstream record``'s loop, 2 producers on ``pick_place``, low-dim and with a 64x64 camera as video
   (``--video-codec h264``, the record command's default, or ``av1``): episodes/s the producers publish
   while the owner requests generations back to back, without and with a ``LeRobotRecorder`` (which
   producers wait for); bytes per episode. Target: with / without >= 0.95. Also the CPU per episode of the
   producers and of the recorder (the owner's CPU with the recorder minus without), and the ceiling they
   put on the ratio when the producers fill every core: producer / (producer + recorder).
2. ``sample_batch(256, 16)`` in the trainer while the producers refill continuously (the demo's setting,
   with ``demo --record``'s groups of 8 episodes), without and with the recorder: batches/s. Target: >= 0.90.
   The trainer process (sampler and recorder threads) is pinned to one core, the producers to the rest;
   the rates count the sampling loop's own time.
3. Replay: episodes/s that ``LeRobotSpec`` streams into an engine (2 producers) from the datasets of 1.

**Phases, not separate runs.** Each measurement runs one engine and alternates phases of ``--seconds``
(``--sampling-seconds`` in 2) without and with a recorder on it (a new recorder per phase, appending to
one dataset; in 1 its ``close()``, the last group's flush, belongs to its phase), in the order
without-with, then with-without, and so on.
On a shared 2-vCPU VM the host's speed drifts by tens of percent over a minute; separate 20-second runs
of each candidate put that drift into the ratio, adjacent short phases of one engine mostly cancel it.
Each ratio is the median over pairs of adjacent phases (every pair's ratio is printed too); the rates are
medians over phases. ``--writer-niceness 0 10`` compares recorders whose writer thread runs at the
process's priority and 10 nice steps below it (the default): each round then has three phases, in an
order that rotates from round to round.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from _timing import main_of, pin_process, process_cpu_seconds, quick_preset, require_positive


@dataclass(frozen=True)
class Args:
    """What recording a LeRobot dataset costs the producers and the trainer, and replay rates."""

    quick: bool = False
    """Short rounds: checks that everything runs; the figures mean nothing."""
    seconds: float = 5.0
    """Seconds per phase (and the replay measures ``seconds * rounds``)."""
    rounds: int = 8
    """Pairs of phases (without, with) per measurement; tables print the median."""
    workers: int = 2
    video_codec: Literal["h264", "av1"] = "h264"
    """Codec of the camera video (``h264``: the record command's default; ``av1``: LeRobot's)."""
    sampling_seconds: float = 1.0
    """Seconds per phase of the sampling section (with the trainer pinned, short phases vary little)."""
    sampling_rounds: int = 40
    """Pairs of phases of the sampling section."""
    flush_every: int | None = None
    """The recorder's episodes per group of files; default: what each command uses (``simstream record``:
    the recorder's default, 32; ``demo --record``, the sampling section: ``TRAINING_FLUSH_EVERY``, 8)."""
    writer_niceness: tuple[int, ...] = (10,)
    """The recorder's ``writer_niceness`` (default 10); several values (``--writer-niceness 0 10``) add a
    recording phase per value to each round, in rotating order, and a row per value to each table."""

    def __post_init__(self) -> None:
        require_positive(
            self, "seconds", "rounds", "workers", "sampling_seconds", "sampling_rounds", "flush_every"
        )
        niceness = self.writer_niceness
        if not niceness or any(not 0 <= n <= 19 for n in niceness) or len(set(niceness)) < len(niceness):
            raise ValueError(f"--writer-niceness takes distinct values in [0, 19], got {niceness}")


def _engine(source, workers: int, buffer_size: int, manual: bool):
    from simstream import OnlineDataEngine, OnlineDataEngineCfg

    policy = {"refill_policy": "manual"} if manual else {"refill_threshold": 0}
    cfg = OnlineDataEngineCfg(source=source, buffer_size=buffer_size, num_workers=workers, **policy)
    return OnlineDataEngine(cfg)


def _producer_pids(engine) -> list[int]:
    processes = engine._supervisor.processes
    return [process.pid for name, process in processes.items() if name.startswith("producer-")]


def _recorder(engine, record: Path, args: Args, flush_every: int | None, niceness: int):
    """A started ``LeRobotRecorder`` appending to ``record``; ``flush_every=None``: its default."""
    from simstream.lerobot import LeRobotRecorder

    groups = {} if flush_every is None else {"flush_every": flush_every}
    return LeRobotRecorder(
        engine, record, video_codec=args.video_codec, writer_niceness=niceness, **groups
    ).start()


_NOTHING_PUBLISHED_S = 120.0
"""How much longer than its seconds a phase waits for its first published episode (a short ``--quick``
phase on a loaded machine may see none, and its rate would be 0)."""


def _refill_back_to_back(engine, seconds: float) -> None:
    """Request generations back to back with ``simstream record``'s own loop for ``seconds``, and until at
    least one episode was published (at most ``_NOTHING_PUBLISHED_S`` longer)."""
    from simstream.cli.record import refill_until

    began, first = time.monotonic(), engine.get_stats()["successful_episodes"]

    def done() -> bool:
        elapsed = time.monotonic() - began
        return elapsed >= seconds and (
            engine.get_stats()["successful_episodes"] > first or elapsed >= seconds + _NOTHING_PUBLISHED_S
        )

    refill_until(engine, done, lambda: None)


def _alternate(
    engine, args: Args, record: Path, flush_every: int | None, measure
) -> tuple[list, dict[int, list]]:
    """``measure(engine)`` in rounds of phases, one without a recorder and one with a recorder per
    ``args.writer_niceness`` value, ``args.rounds`` times, after one phase of warm-up. Round ``k`` starts
    ``k`` places further along the list of phases (with one niceness: without-with, then with-without),
    so a steady drift of the machine's speed cancels. Returns the results without, and with per
    niceness, in round order. ``measure`` runs a phase and returns the callback that closes it with the
    phase's rates."""
    measure(engine)()  # warm-up, not counted: the producers' first episodes after start are slower
    phases: list[int | None] = [None, *args.writer_niceness]
    plain: list[dict] = []
    recorded: dict[int, list[dict]] = {niceness: [] for niceness in args.writer_niceness}
    for k in range(args.rounds):
        shift = k % len(phases)
        for niceness in phases[shift:] + phases[:shift]:
            recorder = None
            if niceness is not None:
                # What the buffer holds from the phase before counts as recorded: ``simstream record``
                # starts its recorder before the engine, so it never begins with a backlog to copy.
                shared = engine._shared
                shared.record_gate.recorded.copy_(shared.index.episode_id)
                recorder = _recorder(engine, record, args, flush_every, niceness)
            finish = measure(engine)
            if recorder is not None:
                recorder.close()  # the last group's flush is part of the phase
                result = finish()
                result["bytes_per_episode"] = recorder.bytes_written / max(1, recorder.episodes_flushed)
                result["skipped"] = recorder.episodes_skipped
                result["producer_wait_s"] = recorder.producer_wait_s
                recorded[niceness].append(result)
            else:
                plain.append(finish())
    return plain, recorded


def production(source, args: Args, record: Path) -> tuple[list[dict], dict[int, list[dict]]]:
    """Episodes/s the producers publish with generations requested back to back (``simstream record``),
    and the CPU seconds per episode of the producers and of this process (the recorder's threads run
    here), per phase without and with the recorder."""

    def measure(engine):
        first, began = engine.get_stats()["successful_episodes"], time.monotonic()
        owner_cpu, producers_cpu = time.process_time(), process_cpu_seconds(_producer_pids(engine))
        _refill_back_to_back(engine, args.seconds)

        def finish() -> dict[str, float]:
            elapsed = time.monotonic() - began
            episodes = engine.get_stats()["successful_episodes"] - first
            return {
                "episodes_per_s": episodes / elapsed,
                "owner_cpu_per_episode_s": (time.process_time() - owner_cpu) / max(1, episodes),
                "producer_cpu_per_episode_s": (process_cpu_seconds(_producer_pids(engine)) - producers_cpu)
                / max(1, episodes),
            }

        return finish

    with _engine(source, args.workers, 8 * args.workers, manual=True) as engine:
        engine.request_refill()  # the producers run from here to the end of the last phase
        return _alternate(engine, args, record, args.flush_every, measure)


def _give_the_trainer_a_core(engine, cpus: list[int]) -> None:
    """Pin this process (the trainer: sampler and recorder threads) to the first of ``cpus`` and the
    producers to the others; nothing on a machine with one core."""
    if len(cpus) < 2:
        return
    pin_process(os.getpid(), {cpus[0]})
    for pid in _producer_pids(engine):
        pin_process(pid, set(cpus[1:]))


def sampling(source, args: Args, record: Path) -> tuple[list[dict], dict[int, list[dict]]]:
    """Batches/s of ``sample_batch(256, 16)`` while producers refill continuously, and the fresh
    episodes/s they published meanwhile, per phase without and with the recorder.

    The trainer process has a core of its own and the producers the others, as on a training machine.
    Unpinned, three busy threads on two cores put the sampler on a core of its own for a while, then on
    a core it shares, as the kernel balances them: single phases varied from 0.6 to 1.5 times their
    neighbour's rate, which swamped the recorder's few percent."""
    from simstream.bc.recording import TRAINING_FLUSH_EVERY

    def measure(engine):
        first, batches, began = engine.get_stats()["successful_episodes"], 0, time.monotonic()
        while True:
            elapsed = time.monotonic() - began
            if elapsed >= args.seconds and (  # and at least one fresh episode, as in production phases
                engine.get_stats()["successful_episodes"] > first
                or elapsed >= args.seconds + _NOTHING_PUBLISHED_S
            ):
                break
            engine.sample_batch(256, 16)
            batches += 1
        # The rates are over the sampling loop alone: a trainer samples while its recorder runs, not
        # while the phase's recorder closes (its last flush would count as time without batches).
        elapsed = time.monotonic() - began
        episodes = engine.get_stats()["successful_episodes"] - first

        def finish() -> dict[str, float]:
            return {"batches_per_s": batches / elapsed, "episodes_per_s": episodes / elapsed}

        return finish

    args = dataclasses.replace(args, seconds=args.sampling_seconds, rounds=args.sampling_rounds)
    everywhere = os.sched_getaffinity(0)
    with _engine(source, args.workers, 64, manual=False) as engine:
        try:
            _give_the_trainer_a_core(engine, sorted(everywhere))
            return _alternate(engine, args, record, args.flush_every or TRAINING_FLUSH_EVERY, measure)
        finally:
            pin_process(os.getpid(), everywhere)


def replay(root: Path, args: Args) -> float:
    """Episodes/s ``LeRobotSpec`` streams from ``root`` into an engine (generations back to back)."""
    from simstream.lerobot import LeRobotSpec

    with _engine(LeRobotSpec(root), args.workers, 8 * args.workers, manual=True) as engine:
        first, began = engine.get_stats()["successful_episodes"], time.monotonic()
        _refill_back_to_back(engine, args.seconds * args.rounds)
        return (engine.get_stats()["successful_episodes"] - first) / (time.monotonic() - began)


def _pair_ratios(plain: list[dict], recorded: list[dict], key: str) -> list[float]:
    """with / without per round (its phases are adjacent: they share the machine's state, so their ratio
    is steadier than the ratio of medians taken over the whole run)."""
    return [
        with_[key] / without[key] if without[key] else math.nan for without, with_ in zip(plain, recorded)
    ]


def _spread(ratios: list[float]) -> str:
    return ", ".join(f"{r:.3f}" for r in sorted(ratios))


def run(args: Args) -> int:
    """Run every measurement and print its table (``simstream bench recording``)."""
    from simstream.tasks import make_source

    torch.set_num_threads(1)
    if args.quick:
        args = quick_preset(args, seconds=1.0, rounds=1, sampling_seconds=1.0, sampling_rounds=1)
    scratch = Path(tempfile.mkdtemp(prefix="simstream-recording-"))
    video = f"64x64 video ({args.video_codec})"
    sources = {"low-dim": make_source("pick_place"), video: make_source("pick_place", image_size=64)}
    flags = (
        " --quick"
        if args.quick
        else f" --seconds {args.seconds:g} --rounds {args.rounds}"
        f" --sampling-seconds {args.sampling_seconds:g} --sampling-rounds {args.sampling_rounds}"
    )
    flags += f" --video-codec {args.video_codec}" + (
        f" --flush-every {args.flush_every}" if args.flush_every else ""
    )
    if args.writer_niceness != (10,):
        flags += " --writer-niceness " + " ".join(map(str, args.writer_niceness))
    print(f"command: `python benchmarks/recording.py{flags}`; machine: {os.cpu_count()} CPUs")

    def median(results, key):
        return statistics.median(result[key] for result in results)

    def label(name: str, niceness: int) -> str:
        return name if len(args.writer_niceness) == 1 else f"{name}, writer nice {niceness}"

    rows, rounds = [], []
    try:
        for name, source in sources.items():
            plain, by_niceness = production(source, args, scratch / name.replace(" ", "_"))
            for niceness, recorded in by_niceness.items():
                assert all(result["skipped"] == 0 for result in recorded)
                a, b = median(plain, "episodes_per_s"), median(recorded, "episodes_per_s")
                pairs = _pair_ratios(plain, recorded, "episodes_per_s")
                producer_ms = 1e3 * median(plain, "producer_cpu_per_episode_s")
                recorder_ms = 1e3 * (
                    median(recorded, "owner_cpu_per_episode_s") - median(plain, "owner_cpu_per_episode_s")
                )
                # with every core busy producing, each CPU second the recorder takes is one the producers
                # lose (unless it runs where they leave a core idle: the ratio may pass this ceiling)
                ceiling = min(1.0, producer_ms / (producer_ms + max(recorder_ms, 0.0)))
                size = median(recorded, "bytes_per_episode")
                # seconds of producer time per second of recording spent waiting for the recorder's copies
                waited = median(recorded, "producer_wait_s") / args.seconds
                rows.append(
                    (label(name, niceness), a, b, pairs, size, producer_ms, recorder_ms, ceiling, waited)
                )
                rounds.append(
                    f"{label(name, niceness)}, episodes/s without -> with, by round: "
                    + ", ".join(
                        f"{p['episodes_per_s']:.2f} -> {r['episodes_per_s']:.2f}"
                        for p, r in zip(plain, recorded)
                    )
                )
        print(
            "\n| record (2 producers, pick_place) | without eps/s | with eps/s | ratio (>= 0.95) "
            "| pairs' ratios | bytes/ep | producer CPU ms/ep | recorder CPU ms/ep "
            "| CPU ceiling of the ratio | producers' wait for the recorder (s per s) |"
        )
        print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
        for name, a, b, pairs, size, producer_ms, recorder_ms, ceiling, waited in rows:
            print(
                f"| {name} | {a:.2f} | {b:.2f} | {statistics.median(pairs):.3f} | {_spread(pairs)} "
                f"| {size:,.0f} | {producer_ms:.1f} | {recorder_ms:.2f} | {ceiling:.3f} | {waited:.4f} |"
            )
        print("\n" + "\n".join(f"* {line}" for line in rounds))

        plain, by_niceness = sampling(sources["low-dim"], args, scratch / "sampling")
        print(
            "\n| sample_batch(256, 16), refilling (trainer on a core of its own) | batches/s without "
            "| with recorder | ratio (>= 0.90) "
            "| pairs' ratios |"
        )
        print("|---|---:|---:|---:|---|")
        for niceness, recorded in by_niceness.items():
            a, b = median(plain, "batches_per_s"), median(recorded, "batches_per_s")
            ea, eb = median(plain, "episodes_per_s"), median(recorded, "episodes_per_s")
            pairs = _pair_ratios(plain, recorded, "batches_per_s")
            fresh = _pair_ratios(plain, recorded, "episodes_per_s")
            ratio = statistics.median(pairs)
            row = label("low-dim pick_place", niceness)
            print(f"| {row} | {a:.1f} | {b:.1f} | {ratio:.3f} | {_spread(pairs)} |")
            print(
                f"| (fresh episodes/s meanwhile) | {ea:.2f} | {eb:.2f} | {statistics.median(fresh):.3f} "
                f"| {_spread(fresh)} |"
            )

        print("\n| replay (LeRobotSpec, 2 producers) | episodes/s |")
        print("|---|---:|")
        for name in sources:
            rate = replay(scratch / name.replace(" ", "_"), args)
            print(f"| {name} | {rate:.1f} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    main_of(run, Args)
