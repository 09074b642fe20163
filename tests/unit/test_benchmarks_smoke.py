"""Benchmark smoke runs (``--quick``: they must print their tables, timings are never asserted), the
``simstream bench`` command, and the output-arena recycling that the sampling fast path relies on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from simstream import Episode
from simstream.sampling.gather import ArenaPool, empty_batch
from tests.support.harness import Harness
from tests.support.processes import descendants, wait_for_exit

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
TIMEOUT_S = 240
"""Bound of each benchmark; the four run at once, and on a loaded 2-core machine one took 130 s."""
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def quick_runs() -> dict[str, subprocess.Popen]:
    """The quick benchmarks, started together (they mostly wait on engines, so they overlap well), each
    in a session of its own: a hung one is ended with everything it started (a producer that outlived it
    would hold the output pipe open), after every Python process of it printed its stacks."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONFAULTHANDLER="1")
    runs = {
        name: subprocess.Popen(
            [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for name in ("sampling", "production", "huge_pages", "recording")
    }
    yield runs
    for process in runs.values():
        if process.poll() is None:
            _end_session(process, signal.SIGKILL)
            process.communicate(timeout=30)


def _end_session(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _output(process: subprocess.Popen) -> str:
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGABRT: each process's faulthandler prints its Python stacks, then it dies
        _end_session(process, signal.SIGABRT)
        try:
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            _end_session(process, signal.SIGKILL)
            output, _ = process.communicate(timeout=30)
        pytest.fail(f"benchmark did not finish within {TIMEOUT_S} s:\n{output[-12000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


def test_sampling_quick_prints_every_table(quick_runs):
    output = _output(quick_runs["sampling"])
    for heading in (
        "### Idle sampling, low-dim",
        "### Idle sampling, with images",
        "### Sampling under continuous publication, low-dim",
        "### Sampling under continuous publication, with images",
        "### Latency of sample_batch, low-dim",
        "### Cost against buffer size",
        "### Cost against buffer size: targets",
        "### sample_batch(keys=...)",
    ):
        assert heading in output, heading
    for row in (
        "| sample_batch |",
        "| sample_batch(out=) |",
        "| one camera (keys=['obs/image']) |",
        "| raw gather (same keys) |",
        "| OnlineDataset batch mode, 0 workers |",
        "| OnlineDataset item mode, 2 workers |",
        "| OnlineDataset batch mode, 2 workers, worker_slots=0 |",
        "| OnlineDataset batch mode, 2 workers, stock multiprocessing.Queue |",
        "| 2 workers, ceiling: batches sampled, not sent |",
        "| 2 workers, same, sampled into 2 shared arenas in turn |",
        "| OnlineDataset item mode, 2 / 0 workers |",
        "| 2 processes sampling side by side, no DataLoader |",
        "| 1 process sampling alone, no DataLoader |",
        "|   2 processes sampling side by side, no DataLoader, / 1 process alone (same rounds) |",
        "| sample_batch / raw gather (same keys) |",
        "| cold cache: sample_batch growth, 16 -> 48 |",
        "| p99 under publication / idle p99 |",
    ):
        assert row in output, row
    # find_spec, not import: importing torchrl switches this process's multiprocessing start method to spawn
    if importlib.util.find_spec("torchrl") is None:
        assert "TorchRL not importable" in output
    else:
        assert "| TorchRL SliceSampler |" in output
    assert "machine: " in output and "command: `python benchmarks/sampling.py --quick`" in output


def test_production_quick_prints_its_table(quick_runs):
    output = _output(quick_runs["production"])
    assert "### Episodes per second, engine against the bare source loop" in output
    assert "| engine / bare loop, 1 worker |" in output
    assert "| engine 2 workers / 1 worker |" in output
    assert "command: `python benchmarks/production.py --quick`" in output


def test_recording_quick_prints_its_tables(quick_runs):
    output = _output(quick_runs["recording"])
    assert "| producer CPU ms/ep | recorder CPU ms/ep | CPU ceiling of the ratio |" in output
    assert "| low-dim |" in output and "| 64x64 video (h264) |" in output
    assert "| low-dim pick_place |" in output
    assert "| replay (LeRobotSpec, 2 producers) | episodes/s |" in output
    assert "command: `python benchmarks/recording.py --quick --video-codec h264`" in output


def test_huge_pages_quick_prints_both_memories(quick_runs):
    output = _output(quick_runs["huge_pages"])
    assert "| torch shared memory |" in output and "| memfd + MADV_HUGEPAGE |" in output
    assert "command: `python benchmarks/huge_pages.py --quick`" in output


def test_bench_command_lists_the_benchmarks(capsys):
    from simstream.cli import bench

    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    listing = capsys.readouterr().out
    assert "sampling" in listing and "production" in listing and "huge_pages" in listing
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["no-such-benchmark"])
    assert exit_info.value.code != 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["production", "--workers", "0"], "--workers must be one or more finite numbers > 0, got (0,)"),
        (["production", "--quick", "--workers"], "--workers must be one or more finite numbers > 0, got ()"),
        (["sampling", "--seconds", "-1"], "--seconds must be a finite number > 0, got -1.0"),
        (["sampling", "--seconds", "inf"], "--seconds must be a finite number > 0, got inf"),  # ran forever
        (["recording", "--rounds", "0"], "--rounds must be a finite number > 0, got 0"),
        (["recording", "--video-codec", "vp9"], "--video-codec"),
        (["sampling", "--sections"], "--sections must name one or more of lowdim"),
        (["sampling", "--chunk-size", "1000"], "--chunk-size must be <= --max-steps 300, got 1000"),
        # gymnasium's traceback once the candidates were starting, or (empty --modes) exit 0 having run
        # nothing and written an empty plot
        (["rl_throughput", "--env", "Nope-v1"], "--env must be a registered gymnasium environment, got"),
        (["rl_learning_curve", "--env", "Nope-v1"], "--env must be a registered gymnasium environment"),
        (["rl_learning_curve", "--seed", "-1"], "APPOConfig.seed must be"),
        (["rl_learning_curve", "--modes"], "--modes must name one or more of async, sync, got ()"),
        (
            ["rl_learning_curve", "--out", "/proc/x"],
            "Args.out cannot be written: '/proc/x'",
        ),  # a traceback after 10 s of setup
        (
            ["recording", "--writer-niceness", "0", "20"],
            "--writer-niceness takes distinct values in [0, 19], got (0, 20)",
        ),
        (
            ["recording", "--quick", "--writer-niceness"],
            "--writer-niceness takes distinct values in [0, 19], got ()",
        ),
    ],
)
def test_bench_refuses_flags_out_of_range_before_running(capsys, argv, message):
    """They crashed with tracebacks (ZeroDivisionError; IndexError after the whole run) or printed n/a."""
    from simstream.cli import bench

    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split()).replace("│ ", "")


# -- output arenas: a batch is never overwritten while anything of it is alive -----------------------
@pytest.fixture
def harness() -> Harness:
    harness = Harness(rows=4, steps=16)
    for row in range(4):
        harness.publish(row, Episode(length=16))
    return harness


def _sample(harness: Harness, seed: int = 0):
    return harness.sampler.sample_chunks(8, 4, "episode", torch.Generator().manual_seed(seed))


def _reused(harness: Harness, pointer: int, draws: int = 6) -> bool:
    pointers = {_sample(harness, seed)["obs"].data_ptr() for seed in range(draws)}
    return pointer in pointers


def test_a_dropped_batch_is_recycled(harness):
    if not harness.sampler.gatherer.pool.enabled:
        pytest.skip("this torch does not expose storage use counts; every batch is freshly allocated")
    pointer = _sample(harness)["obs"].data_ptr()
    assert _reused(harness, pointer)


@pytest.mark.parametrize(
    "keep",
    [
        pytest.param(lambda batch: batch, id="the-batch"),
        pytest.param(lambda batch: batch["obs"], id="one-key"),
        pytest.param(lambda batch: batch["task_index"][1:, 2], id="a-view-of-another-key"),
        pytest.param(lambda batch: batch["actions"].numpy(), id="a-numpy-array"),
        pytest.param(lambda batch: batch["valid"].untyped_storage(), id="the-storage"),
        pytest.param(lambda batch: batch["actions"].storage(), id="a-typed-storage"),
        pytest.param(lambda batch: batch.unbind(0)[3], id="an-item"),
    ],
)
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_memory_still_referenced_is_never_written_again(harness, keep):
    batch = _sample(harness)
    pointer = batch["obs"].data_ptr()
    snapshot = batch.clone()
    kept = keep(batch)
    del batch
    assert not _reused(harness, pointer)
    assert kept is not None
    if isinstance(kept, torch.Tensor) and kept.data_ptr() == pointer:
        assert torch.equal(kept, snapshot["obs"])


def test_an_arena_moved_to_shared_memory_is_never_recycled(harness):
    batch = _sample(harness)
    batch["obs"].share_memory_()  # what pickling to a trainer process does: the arena moves to shm
    pointer = batch["obs"].data_ptr()
    del batch
    assert not _reused(harness, pointer)
    assert len(harness.sampler.gatherer.pool._arenas) <= harness.sampler.gatherer.pool.max_arenas


def test_an_arena_moved_to_shared_memory_is_let_go_even_while_another_is_free(harness):
    """It was forgotten only when no free arena of the layout was found: with one always free, the shared
    one stayed in the pool, mapped, with its file descriptor, for the life of the sampler."""
    pool = harness.sampler.gatherer.pool
    shared = _sample(harness)
    spare = _sample(harness)  # a second arena of the same layout
    storage = shared["obs"].untyped_storage()
    shared["obs"].share_memory_()
    del shared, spare  # the spare arena is free from now on
    for seed in range(3):
        batch = _sample(harness, seed)
        del batch
    assert all(arena.storage.data_ptr() != storage.data_ptr() for arena in pool._arenas)
    assert not any(arena.storage.is_shared() for arena in pool._arenas)


def test_out_batches_and_pickled_pools_start_empty(harness):
    out = _sample(harness)
    again = harness.sampler.sample_chunks(8, 4, "episode", None, out=out)
    assert again is out
    pool = pickle.loads(pickle.dumps(harness.sampler.gatherer.pool))
    assert isinstance(pool, ArenaPool) and pool._arenas == []


def test_empty_batch_is_one_arena_with_the_template_layout(harness):
    template = harness.storage.rows_view()
    batch = empty_batch(template, (3, 5), shared=True)
    assert batch.batch_size == torch.Size([3, 5])
    assert set(batch.keys(True, True)) == set(template.keys(True, True))
    storages = {batch.get(k).untyped_storage().data_ptr() for k in batch.keys(True, True)}
    assert len(storages) == 1 and batch["obs"].is_shared()
    assert batch["obs"].shape == (3, 5, 2) and batch["valid"].dtype == torch.bool


def test_latency_percentiles_are_nearest_rank():
    spec = importlib.util.spec_from_file_location("_bench_timing", BENCHMARKS / "_timing.py")
    timing = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = timing  # its dataclasses look their module up
    spec.loader.exec_module(timing)
    hundred = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose
    assert timing.percentile(hundred, 99) == 99.0  # not the maximum
    assert timing.percentile(hundred, 50) == 50.0
    assert timing.percentile(hundred, 100) == 100.0
    assert timing.percentile([float(v) for v in range(1, 11)], 50) == 5.0
    assert timing.percentile([7.0], 99) == 7.0


def test_flags_given_beside_quick_win_over_its_preset():
    """--quick replaced every field of its preset: --seconds 2 --rounds 4 beside it were dropped silently."""
    from dataclasses import dataclass

    spec = importlib.util.spec_from_file_location("_bench_timing", BENCHMARKS / "_timing.py")
    timing = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = timing
    spec.loader.exec_module(timing)

    @dataclass(frozen=True)
    class Args:
        seconds: float = 5.0
        rounds: int = 8
        buffer_size: int = 512

    quick = timing.quick_preset(Args(seconds=2.0, rounds=4), seconds=0.03, rounds=1, buffer_size=32)
    assert quick == Args(seconds=2.0, rounds=4, buffer_size=32)
    assert timing.quick_preset(Args(), seconds=0.03, rounds=1) == Args(seconds=0.03, rounds=1)


@pytest.mark.parametrize(
    ("signal_number", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
)
def test_a_benchmark_stopped_with_ctrl_c_or_sigterm_says_so_in_one_line_and_leaves_nothing_running(
    signal_number, code, said
):
    """It printed a traceback and an exit code of 1 (Ctrl-C) or died without stopping its producers
    (SIGTERM); it now ends as the simstream commands do, after its engines stopped."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job ignores Ctrl-C
    try:
        process = subprocess.Popen(
            [sys.executable, str(BENCHMARKS / "production.py"), "--workers", "2", "--rounds", "50",
             "--seconds", "5"],
            cwd=ROOT, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert process.stdout.readline().startswith("## simstream production benchmark")
        deadline = time.monotonic() + 120
        # the resource tracker, the forkserver and both producer processes run (with 2, the signal landed
        # while the forkserver imported, before any producer: a start-up a test of its own covers)
        while len(producers := descendants(process.pid)) < 4:
            assert time.monotonic() < deadline and process.poll() is None, (
                "the benchmark's producers never started"
            )
            threading.Event().wait(0.05)
        process.send_signal(signal_number)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert process.returncode == code, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == f"production.py: {said}"
    assert "Traceback" not in stderr
    wait_for_exit(producers, 15, "producer processes left running")
