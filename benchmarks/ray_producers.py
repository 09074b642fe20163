"""Ray backend throughput (issue 17): production, ingest capacity and sampling while ingesting.

Run inside a private network namespace, where Ray binds to 127.0.0.1 only::

    unshare -n sh -c 'ip link set lo up && exec .venv/bin/python benchmarks/ray_producers.py'

(``--quick``: a smoke configuration whose figures mean nothing). Three measurements, ratios from one run:

* **production**: the built-in ``pick_place`` task (CPU-bound MuJoCo and its scripted expert), one local
  producer process against one Ray actor on the same machine, without and with a 64x64 camera.
* **ingest capacity**: a source that costs nothing (payloads the size of ``pick_place`` episodes: 53
  float32 per frame, 60-80 frames, optionally a 3x64x64 uint8 camera) in ``--actors`` actors; the engine's
  published episodes/s against a bare Ray pull loop (the same payloads returned by value from the same
  number of actors, ``ray.wait``, copied into shared tensors of the same layout, no engine). The bare
  loop runs three times, and every row prints a verdict against each: with the engine's own actors (the
  same objects cross Ray, frames and episode reports, from actors doing the same work), with actors that
  return precomputed frames and no reports (what Ray alone moves; on a small machine the engine's
  actors, which run the producer body, take CPU from the trainer's side that these do not), and with
  those actors streaming (one streaming call per actor, as the engine's ingest asks for windows). One node
  (``ray.init``) and two nodes (``ray.cluster_utils.Cluster``, actors pinned to the second node, so every
  window crosses Ray's object transfer). "Simulation cores one trainer can absorb" is the engine's
  ingest rate divided by one core's ``pick_place`` episodes/s from the production section.
* **sampling**: ``sample_batch`` calls/s while the ingest runs at full rate, against the same engine idle.

Candidates run in interleaved rounds; tables print the median of the rounds.

**Pinning** (``--pin``; off by default). On a trainer machine the ingest
process and the training loop have cores of their own and the actors run on other nodes; on one small
machine everything shares the same cores, and the engine's actors (which run the whole producer body:
rollout, checks, window copy) take CPU from the ingest that the bare loop's actors (which return a
precomputed list) do not. With ``--pin`` CPU 0 plays the trainer: the ingest process (or the bare loop's
driver) in the ingest section, the thread calling ``sample_batch`` in the sampling section; Ray's
processes, the actors and the rest of the benchmark run on the other CPUs. On 2 CPUs that leaves the
actors one CPU between them, so pinning can move the bound from the trainer's side to the actors'. Either
way the ingest table also prints the trainer-side CPU time per episode (the bare loop's driver process
against the engine's ingest process): what one trainer core absorbs wherever the actors run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import logging
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from _timing import (
    Table,
    call_rate,
    check,
    main_of,
    pin_process,
    print_header,
    process_cpu_seconds,
    ratio,
    set_single_thread,
)
from _workload import ContinuousPublication
from simstream import Episode, Field, OnlineDataEngine, OnlineDataEngineCfg, Segment
from simstream.ray import RayBackend


@dataclass(frozen=True)
class Args:
    """Ray producers benchmark (defaults: about 23 minutes on 2 vCPUs)."""

    quick: bool = False
    """Sub-second rounds: checks that everything runs, figures are meaningless."""
    rounds: int = 2
    seconds: float = 8.0
    """Measurement time per candidate per round."""
    actors: int = 2
    """Actors of the ingest-capacity section (and bare pull loop)."""
    rows: int = 64
    """Buffer rows per producer in the production and sampling sections: one generation is this many
    episodes each."""
    ingest_rows: int = 256
    """Buffer rows per producer in the ingest section. Every generation ends in a bubble (the last calls
    drain, the owner asks for the next generation, the first calls of the next one travel) that a bare
    loop, which has no generations, never pays; at 3,000-4,000 episodes/s a generation of 64 rows per
    producer lasts about 40 ms and the bubble cost about a tenth of the rate (BENCHMARKS.md, run 8)."""
    windows_per_call: tuple[int, ...] = (1, 8)
    """``RayBackend.windows_per_call`` values of the ingest section (the bare loop returns as many)."""
    calls_in_flight: int = RayBackend.calls_in_flight
    """``RayBackend.calls_in_flight`` of the ingest section; the bare loops keep as many calls (or stream
    items) outstanding per actor."""
    sections: tuple[str, ...] = ("production", "ingest", "sampling")
    pin: bool = False
    """Give the trainer's side (ingest process, bare loop driver, sampling thread) CPU 0 of its own."""

    def effective(self) -> Args:
        return replace(self, rounds=1, seconds=0.5, rows=8, ingest_rows=8) if self.quick else self


@dataclass(frozen=True)
class ZeroCostSpec:
    """Episodes of ``pick_place``'s size that cost nothing to make: 53 float32 per frame (optionally a
    3x64x64 uint8 camera), 60-80 frames, two segments with instructions; every rollout copies the same
    precomputed frames into its rows (one memcpy) and reports the same episodes."""

    image: bool = False
    num_envs: int = 1
    max_episode_steps: int = 80

    def fields(self) -> dict[str, Field]:
        fields = {"obs/state": Field((44,)), "actions": Field((8,)), "rewards": Field(())}
        if self.image:
            fields["obs/image"] = Field((3, 64, 64), torch.uint8)
        return fields

    def build(self, worker_index: int, seed: int) -> _ZeroCostSource:
        return _ZeroCostSource(self, seed)


class _ZeroCostSource:
    def __init__(self, spec: ZeroCostSpec, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.length = int(rng.integers(60, 81))
        self.frames = {
            name: torch.from_numpy(
                rng.integers(0, 256, (spec.num_envs, self.length, *f.shape), dtype=np.uint8)
            )
            if f.dtype == torch.uint8
            else torch.from_numpy(rng.normal(size=(spec.num_envs, self.length, *f.shape)).astype(np.float32))
            for name, f in spec.fields().items()
        }
        half = self.length // 2
        segments = [
            Segment(0, half, "pick up the red block"),
            Segment(half, self.length, "place it on the pad"),
        ]
        self.episodes = [
            Episode(
                self.length, instruction="put the red block on the pad", segments=segments, terminated=True
            )
            for _ in range(spec.num_envs)
        ]

    def rollout(self, rows, *, attempt, should_stop):
        for name, frames in self.frames.items():
            rows.get(tuple(name.split("/")))[:, : self.length].copy_(frames)
        return self.episodes

    def close(self) -> None:
        pass


# -- CPU placement (--pin) ------------------------------------------------------------------------------
TRAINER_CPUS = {0}


def cluster_cpus() -> set[int]:
    """Every CPU but the trainer's."""
    return set(range(os.cpu_count() or 1)) - TRAINER_CPUS


def ingest_pid(engine: OnlineDataEngine) -> int:
    """The pid of a started Ray-backed engine's ingest process."""
    return engine._supervisor.processes["ray-ingest"].pid


def zero_cost_spec(image: bool) -> ZeroCostSpec:
    return ZeroCostSpec(image=image)


def engine_rate(
    spec, workers: int, rows: int, seconds: float, backend: RayBackend | None, pin: bool = False
) -> tuple[float, float]:
    """Published episodes/s of an engine refilling back to back, and (Ray backend) the ingest process's
    CPU microseconds per published episode; ``pin``: the ingest on the trainer CPU."""
    cfg = OnlineDataEngineCfg(
        source=spec,
        buffer_size=workers * rows,
        num_workers=workers,
        refill_policy="manual",
        backend=backend,
        initialization_timeout=600.0,
    )
    cpu_us = float("nan")
    with OnlineDataEngine(cfg) as engine:
        pids = [ingest_pid(engine)] if backend is not None else []
        if pin and pids:
            pin_process(pids[0], TRAINER_CPUS)
        with ContinuousPublication(engine) as publication:
            cpu, episodes = process_cpu_seconds(pids), engine.get_stats()["successful_episodes"]
            time.sleep(seconds)
            cpu = process_cpu_seconds(pids) - cpu
            episodes = engine.get_stats()["successful_episodes"] - episodes
        if pids:
            cpu_us = 1e6 * cpu / max(1, episodes)
    return publication.episodes_per_s, cpu_us


# -- the bare pull loop ------------------------------------------------------------------------------------
class _PayloadActor:
    """Returns the frames of the same zero-cost source on every call, as NumPy arrays: no engine at all.

    The ``count`` windows of a call are distinct arrays (copied once, then reused), as the engine's are:
    ``[frames] * count`` would pickle one window and ``count`` references to it, so the call would carry a
    ``count``-th of the bytes and, past Ray's 100 KiB limit for results returned inline, take the inline
    path where the engine's results go through the object store."""

    def __init__(self, image: bool, seed: int) -> None:
        source = _ZeroCostSource(ZeroCostSpec(image=image), seed)
        self.frames = {name: frames.numpy() for name, frames in source.frames.items()}
        self.windows: dict[int, list[dict[str, np.ndarray]]] = {}

    def generate(self, number: int, count: int) -> list[dict[str, np.ndarray]]:
        windows = self.windows.get(count)
        if windows is None:
            windows = self.windows[count] = [
                {name: array.copy() for name, array in self.frames.items()} for _ in range(count)
            ]
        return windows

    def stream(self, number: int, count: int, per_item: int) -> Iterator[list[dict[str, np.ndarray]]]:
        """:meth:`generate`'s windows as a streaming call, as the engine's actors stream theirs."""
        for _ in range(0, count, per_item):
            yield self.generate(number, per_item)


def bare_pull_rate(
    image: bool,
    actors: int,
    rows: int,
    seconds: float,
    resources: dict,
    per_call: int,
    pin: bool = False,
    producer_actors: bool = False,
    stream: bool = False,
    in_flight: int = 2,
) -> tuple[float, float]:
    """Episodes/s of ``ray.wait`` over ``actors`` x ``in_flight`` calls of ``per_call`` episodes each, copied
    into shared tensors, and this process's CPU microseconds per episode; ``pin``: this process on the
    trainer CPU meanwhile.

    ``producer_actors``: the actors are the engine's own (:class:`~simstream.ray.actor.ProducerActor`,
    built from the same spec), so the loop receives exactly what the engine's ingest receives (frames
    and episode reports, from actors doing the same work) and only copies the frames; otherwise
    :class:`_PayloadActor`, which returns precomputed frames and no reports.

    ``stream``: one streaming call per actor (``ray.wait`` on its generator, back-pressure of ``in_flight``
    items) instead of ``in_flight`` calls, the way the engine's ingest asks its actors for windows."""
    import cloudpickle
    import ray

    from simstream.ray.actor import ProducerActor

    spec = zero_cost_spec(image)
    tensors = {
        name: torch.zeros(
            (actors * rows, spec.max_episode_steps, *field.shape), dtype=field.dtype
        ).share_memory_()
        for name, field in spec.fields().items()
    }
    if producer_actors:
        remote = ray.remote(ProducerActor).options(num_cpus=1, resources=resources)
        spec_bytes = cloudpickle.dumps(spec)
        # the engine's defaults, so that these actors do exactly the work the engine's do
        attempts = OnlineDataEngineCfg.max_generation_attempts
        checked = OnlineDataEngineCfg.check_unwritten_frames
        handles = [
            remote.remote(spec_bytes, seed, seed, attempts, checked, per_call) for seed in range(actors)
        ]
        ray.get([h.build.remote() for h in handles])
    else:
        remote = ray.remote(_PayloadActor).options(num_cpus=1, resources=resources)
        handles = [remote.remote(image, seed) for seed in range(actors)]
    ray.get([h.generate.remote(0, per_call) for h in handles])  # started and warm
    calls = in_flight
    in_flight = {}
    for index, handle in enumerate(handles):
        if stream:
            call = handle.stream.options(_generator_backpressure_num_objects=calls)
            in_flight[call.remote(0, 10**12, per_call)] = index
            continue
        for _ in range(calls):
            in_flight[handle.generate.remote(0, per_call)] = index
    count, row = 0, [0] * actors
    if pin:
        pin_process(os.getpid(), TRAINER_CPUS)
    began, cpu = time.perf_counter(), process_cpu_seconds([os.getpid()])
    while time.perf_counter() - began < seconds:
        ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=1.0)
        for ref in ready:
            if stream:  # the generator stays; its next item is ready
                index, ref = in_flight[ref], next(ref)
            else:
                index = in_flight.pop(ref)
            for payload in ray.get(ref):
                frames = payload.frames if producer_actors else payload
                target = index * rows + row[index]
                row[index] = (row[index] + 1) % rows
                for name, array in frames.items():
                    np.copyto(tensors[name][target : target + 1, : array.shape[1]].numpy(), array)
                count += 1
            if not stream:
                in_flight[handles[index].generate.remote(0, per_call)] = index
    elapsed, cpu = time.perf_counter() - began, process_cpu_seconds([os.getpid()]) - cpu
    if pin:
        pin_process(os.getpid(), cluster_cpus())
    in_flight.clear()  # a generator dropped releases its actor from back-pressure
    for handle in handles:
        ray.kill(handle)
    return count / elapsed, 1e6 * cpu / max(1, count)


# -- sections ------------------------------------------------------------------------------------------
def production(args: Args) -> dict[bool, float]:
    """One core's ``pick_place`` episodes/s (local process), without (False) and with (True) the camera."""
    from simstream.tasks import make_source

    table = Table(
        "Production: pick_place, 1 local producer vs 1 Ray actor (episodes/s)",
        ["camera", "local process", "Ray actor", "ratio", "target", "verdict"],
    )
    one_core = {}
    for image_size, target in ((None, 0.90), (64, 0.80)):
        spec = make_source("pick_place", num_envs=1, image_size=image_size)
        local, actor = [], []
        for _ in range(args.rounds):
            local.append(engine_rate(spec, 1, args.rows, args.seconds, None)[0])
            actor.append(engine_rate(spec, 1, args.rows, args.seconds, RayBackend())[0])
        local_rate, actor_rate = statistics.median(local), statistics.median(actor)
        value = ratio(actor_rate, local_rate)
        table.row(
            "64x64" if image_size else "none", local_rate, actor_rate, value, target, check(value, target)
        )
        one_core[image_size is not None] = local_rate
    return one_core


def ingest(args: Args, one_core: dict[bool, float], nodes: str, resources: dict) -> None:
    table = Table(
        f"Ingest capacity, {nodes}: zero-cost source in {args.actors} actors (episodes/s; trainer-side CPU "
        "per episode: the bare loop's driver, the engine's ingest process)",
        ["payload", "windows per call", "bare loop, engine's actors", "engine", "ratio", "target", "verdict",
         "bare loop, frames only", "ratio to it", "verdict to it", "bare streaming loop, frames only",
         "ratio to it", "verdict to it", "MiB/s", "sim cores absorbed",
         "CPU us/ep bare (engine's actors / frames only / streaming)", "CPU us/ep engine",
         "CPU ratio (to each)",
         "sim cores per trainer core"],
    )  # fmt: skip
    for image, per_call in [(image, k) for image in (False, True) for k in args.windows_per_call]:
        backend = RayBackend(
            resources=resources, windows_per_call=per_call, calls_in_flight=args.calls_in_flight
        )
        spec = zero_cost_spec(image)
        bare, frames_only, streamed, engine = [], [], [], []
        for _ in range(args.rounds):
            pull = partial(
                bare_pull_rate,
                image,
                args.actors,
                args.ingest_rows,
                args.seconds,
                resources,
                per_call,
                in_flight=args.calls_in_flight,
            )
            bare.append(pull(args.pin, producer_actors=True))
            frames_only.append(pull(args.pin))
            streamed.append(pull(args.pin, stream=True))
            engine.append(engine_rate(spec, args.actors, args.ingest_rows, args.seconds, backend, args.pin))
        bare_rate, frames_rate, stream_rate, engine_eps = (
            statistics.median(r[0] for r in rates) for rates in (bare, frames_only, streamed, engine)
        )
        bare_cpu, frames_cpu, stream_cpu, engine_cpu = (
            statistics.median(r[1] for r in rates) for rates in (bare, frames_only, streamed, engine)
        )
        value = ratio(engine_eps, bare_rate)
        frame_bytes = 53 * 4 + (3 * 64 * 64 if image else 0)  # about 70 frames per episode
        mib_s = engine_eps * 70 * frame_bytes / 2**20
        one = one_core.get(image, float("nan"))  # with the camera: a camera core
        payload = "53 floats + 64x64 camera" if image else "53 floats"
        cpu_ratios = " / ".join(f"{ratio(cpu, engine_cpu):.2f}" for cpu in (bare_cpu, frames_cpu, stream_cpu))
        table.row(
            payload, per_call, bare_rate, engine_eps, value, 0.80, check(value, 0.80), frames_rate,
            ratio(engine_eps, frames_rate), check(ratio(engine_eps, frames_rate), 0.80), stream_rate,
            ratio(engine_eps, stream_rate), check(ratio(engine_eps, stream_rate), 0.80), mib_s,
            ratio(engine_eps, one),
            f"{bare_cpu:.0f} / {frames_cpu:.0f} / {stream_cpu:.0f}", engine_cpu, cpu_ratios,
            ratio(ratio(1e6, engine_cpu), one),
        )  # fmt: skip


def sampling(args: Args) -> None:
    table = Table(
        "sample_batch(256, 16, keys=['obs/state', 'actions']) while the ingest runs at full rate (calls/s; "
        "the camera row ingests camera episodes and samples the same low-dim keys)",
        ["payload", "idle", "ingesting", "ratio", "target", "verdict", "episodes/s ingested meanwhile"],
    )
    for image in (False, True):
        cfg = OnlineDataEngineCfg(
            source=zero_cost_spec(image),
            buffer_size=args.actors * args.rows,
            num_workers=args.actors,
            refill_policy="manual",
            backend=RayBackend(),
            initialization_timeout=600.0,
        )
        idle, busy, ingested = [], [], []
        with OnlineDataEngine(cfg) as engine:
            draw = partial(engine.sample_batch, 256, 16, keys=["obs/state", "actions"])
            if args.pin:  # this thread samples on the trainer CPU; the ingest stays with the cluster
                os.sched_setaffinity(0, TRAINER_CPUS)
            for _ in range(args.rounds):
                idle.append(call_rate(draw, args.seconds)[0])
                with ContinuousPublication(engine) as publication:
                    busy.append(call_rate(draw, args.seconds)[0])
                ingested.append(publication.episodes_per_s)
        if args.pin:
            os.sched_setaffinity(0, cluster_cpus())
        idle_rate, busy_rate = statistics.median(idle), statistics.median(busy)
        value = ratio(busy_rate, idle_rate)
        table.row(
            "camera episodes ingested" if image else "low-dim", idle_rate, busy_rate, value, 0.80,
            check(value, 0.80),
            statistics.median(ingested),
        )  # fmt: skip


def main(args: Args) -> None:
    args = args.effective()
    for per_call in args.windows_per_call:  # the ingest section's settings, checked before anything runs
        RayBackend(windows_per_call=per_call, calls_in_flight=args.calls_in_flight)
    set_single_thread()
    if args.pin:  # Ray's processes (started below) and the engines' ingest processes inherit this
        pin_process(os.getpid(), cluster_cpus())
    import ray
    from ray.cluster_utils import Cluster

    print_header(
        "Ray producers",
        [sys.executable, *sys.argv],
        f"rounds={args.rounds}, seconds={args.seconds}, actors={args.actors}, rows per producer={args.rows} "
        f"({args.ingest_rows} in the ingest section), "
        f"pin={'trainer on CPU 0, cluster on the rest' if args.pin else 'off'}",
    )
    ray.init(
        num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False
    )
    try:
        if args.pin:  # one producer each side: the local one may use any CPU (the actor has the cluster's)
            pin_process(os.getpid(), TRAINER_CPUS | cluster_cpus())
        one_core = production(args) if "production" in args.sections else {}
        if args.pin:
            pin_process(os.getpid(), cluster_cpus())
        if "ingest" in args.sections:
            ingest(args, one_core, "one node", {})
        if "sampling" in args.sections:
            sampling(args)
    finally:
        ray.shutdown()
    if "ingest" in args.sections:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=args.actors, resources={"sim": args.actors})
            ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
            ingest(args, one_core, "two nodes (cluster_utils)", {"sim": 1})
        finally:
            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":
    main_of(main, Args)
