"""Lifecycle, refill and status of a real engine with real producer processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from simstream import OnlineDataEngine, OnlineDataEngineState, OnlineDataWorkerError
from simstream.sampling.gather import physical_memory
from tests.support.engines import make_cfg, stop_quietly
from tests.support.processes import wait_for_exit
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(90)


def test_start_sample_stop_and_states():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(lengths=(20, 13)), buffer_size=4))
    assert engine.state is OnlineDataEngineState.CREATED and not engine.is_init
    engine.start()
    try:
        assert engine.state is OnlineDataEngineState.READY and engine.is_init
        batch = engine.sample_batch(16, 5)
        assert batch.batch_size == torch.Size([16, 5])
        assert bool(batch["valid"].all())
        steps = batch["obs"][..., 1]
        assert bool((steps[:, 1:] - steps[:, :-1] == 1).all())
        assert torch.equal(batch["episode_step"], steps.long())
        assert torch.equal(batch["actions"][..., 0], batch["obs"][..., 0])
        stats = engine.get_stats()
        assert stats["completed_generation"] == 1 and stats["successful_episodes"] == 4
        assert stats["generated_frames"] == 20 + 13 + 20 + 13 == stats["valid_frames"]
        assert stats["sampled_chunks"] == 16
        with pytest.raises(RuntimeError, match="requires state CREATED; current state is READY"):
            engine.start()
    finally:
        engine.stop()
    assert engine.state is OnlineDataEngineState.STOPPED and not engine.is_init
    engine.stop()  # idempotent
    with pytest.raises(
        RuntimeError, match=r"sample_batch\(\) requires state READY; current state is STOPPED"
    ):
        engine.sample_batch(1, 1)


def test_stop_before_start_and_context_manager():
    engine = OnlineDataEngine(make_cfg())
    engine.stop()
    assert engine.state is OnlineDataEngineState.STOPPED
    with OnlineDataEngine(make_cfg()) as running:
        assert running.state is OnlineDataEngineState.READY
    assert running.state is OnlineDataEngineState.STOPPED


def _open_descriptors() -> list[str]:
    """What this process's descriptors point at (the listing's own descriptor left out)."""
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass
    return sorted(targets)


def test_engines_created_one_after_another_leave_no_descriptor_behind():
    import gc

    def one_engine() -> None:
        with OnlineDataEngine(make_cfg(ScriptedSpec(lengths=(20, 13)), buffer_size=4)) as engine:
            engine.sample_batch(4, 5)
        OnlineDataEngine(make_cfg())  # created only, never started

    one_engine()  # the first may open what lives as long as the process (the forkserver, imports)
    gc.collect()
    before = _open_descriptors()
    for _ in range(3):
        one_engine()
    gc.collect()
    assert _open_descriptors() == before


def test_two_workers_write_disjoint_rows_with_unique_increasing_episode_ids():
    spec = ScriptedSpec(num_envs=2, lengths=(20,))
    with OnlineDataEngine(make_cfg(spec, buffer_size=7, num_workers=2, include_provenance=True)) as engine:
        buffer = engine.shared_buffer
        workers = buffer["obs"][:, 0, 2].long().tolist()
        assert workers == [0, 0, 0, 0, 1, 1, 1]  # worker 0 owns rows 0-3, worker 1 rows 4-6
        ids = buffer["ods_episode_id"][:, 0].tolist()
        assert len(set(ids)) == 7
        generation = engine.request_refill()
        engine.wait_for_generation(generation, timeout=30)
        new_ids = buffer["ods_episode_id"][:, 0].tolist()
        assert min(new_ids) > max(ids) and len(set(new_ids)) == 7
        assert set(buffer["ods_generation"][:, 0].tolist()) == {2}
        assert engine.get_stats()["completed_generation"] == 2


def test_manual_refill_coalesces_and_wait_for_generation_validates():
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        first = engine.request_refill()
        assert first == 2
        assert engine.request_refill() in (2, 3)  # 2 while outstanding, 3 if 2 already finished
        engine.wait_for_generation(first, timeout=30)
        assert engine.get_stats()["completed_generation"] >= 2
        with pytest.raises(ValueError, match="generation must be a positive integer"):
            engine.wait_for_generation(0)
        with pytest.raises(ValueError, match="timeout must be finite and positive"):
            engine.wait_for_generation(1, timeout=float("inf"))
        with pytest.raises(ValueError, match="generation has not been requested"):
            engine.wait_for_generation(99)
        requested = engine.get_stats()["requested_generation"]
        engine.sample_batch(64, 2)  # the manual policy never requests on its own
        assert engine.get_stats()["requested_generation"] == requested


def test_sample_threshold_policy_requests_refills():
    with OnlineDataEngine(make_cfg(refill_threshold=1, buffer_size=4)) as engine:
        assert engine.get_stats()["requested_generation"] == 1
        engine.sample_batch(4, 3)  # 4 chunks >= 1 * buffer_size
        assert engine.get_stats()["requested_generation"] == 2
        engine.wait_for_generation(2, timeout=30)


def _start_in_a_thread(engine: OnlineDataEngine) -> tuple[threading.Thread, list[BaseException]]:
    """``engine.start()`` in a thread; what it raises lands in the returned list."""
    errors: list[BaseException] = []

    def run_start() -> None:
        try:
            engine.start()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run_start)
    thread.start()
    return thread, errors


def test_stop_cancels_a_running_start():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="stall")))
    thread, errors = _start_in_a_thread(engine)
    with engine._lifecycle:  # start() notifies it once STARTING
        assert engine._lifecycle.wait_for(lambda: engine.state is OnlineDataEngineState.STARTING, 30.0)
    engine.stop()
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "start() was cancelled by stop()" in str(errors[0])
    assert engine.state is OnlineDataEngineState.STOPPED


def test_a_stop_during_a_slow_launch_waits_for_it_and_leaves_no_worker_behind(monkeypatch):
    """The launch can take long (the fork server's first start imports torch): a stop() from another
    thread timed out its wait, cleaned up beside it (no workers yet) and returned STOPPED; the workers
    launched after were nobody's, their pidfds never closed."""
    import simstream.engine.lifecycle as lifecycle
    from simstream.workers.supervisor import WorkerSupervisor

    monkeypatch.setattr(lifecycle, "_START_ABORT_SLACK_S", 0.1)  # stop()'s wait ends in 3.1 s
    launching, release = threading.Event(), threading.Event()
    real_start = WorkerSupervisor.start

    def slow_start(self, specs):
        launching.set()
        assert release.wait(60), "the test never released the launch"
        return real_start(self, specs)

    monkeypatch.setattr(WorkerSupervisor, "start", slow_start)
    # time for a just-launched producer to see the stop on a loaded machine (0.5 s was not: terminated)
    engine = OnlineDataEngine(make_cfg(shutdown_timeout=3.0))
    starting, errors = _start_in_a_thread(engine)
    stopping = threading.Thread(target=engine.stop)
    try:
        assert launching.wait(60), "start() never launched"
        stopping.start()
        stopping.join(6.0)  # twice the wait that ended it
        assert stopping.is_alive(), "stop() returned while start() was still launching workers"
    finally:
        release.set()
        stopping.join(60)
        starting.join(60)
    assert not stopping.is_alive() and not starting.is_alive()
    assert len(errors) == 1 and "start() was cancelled by stop()" in str(errors[0])
    assert engine.state is OnlineDataEngineState.STOPPED and engine._supervisor is None


def test_a_stop_during_a_launch_that_outlasts_initialization_timeout_returns_and_start_ends_its_workers(
    monkeypatch,
):
    """stop() waits for a launch only up to initialization_timeout (a wedged fork server must not hang it
    too); the start thread, once its launch ends, ends the workers it launched itself."""
    import simstream.engine.lifecycle as lifecycle
    from simstream.workers.supervisor import WorkerSupervisor

    monkeypatch.setattr(lifecycle, "_START_ABORT_SLACK_S", 0.1)
    launching, release, launched = threading.Event(), threading.Event(), []
    real_start = WorkerSupervisor.start

    def wedged_start(self, specs):
        launching.set()
        assert release.wait(60), "the test never released the launch"
        real_start(self, specs)
        launched.extend((self, p.pid) for p in self.processes.values())

    monkeypatch.setattr(WorkerSupervisor, "start", wedged_start)
    engine = OnlineDataEngine(make_cfg(shutdown_timeout=3.0, initialization_timeout=1.0))
    starting, errors = _start_in_a_thread(engine)
    try:
        assert launching.wait(60), "start() never launched"
        engine.stop()  # returns: 1 s for the launch, then 3.1 s for the start's own cleanup
        assert engine.state is OnlineDataEngineState.STOPPED
    finally:
        release.set()
        starting.join(60)
    assert not starting.is_alive()
    assert len(errors) == 1 and "start() was cancelled by stop()" in str(errors[0]), errors
    assert len(launched) == 1
    supervisor, pid = launched[0]
    wait_for_exit([pid], 30, "the workers launched after the stop gave up waiting")
    assert supervisor.processes == {}, "nobody joined the workers launched after the stop gave up"
    assert engine.state is OnlineDataEngineState.STOPPED


@pytest.mark.parametrize(
    ("close_fault", "error_type", "message"),
    [
        ("raise", OSError, "flush failed while closing the source"),
        ("hang", OnlineDataWorkerError, r"required terminate\(\)/kill\(\); graceful close"),
    ],
)
def test_stop_that_cancels_a_start_raises_what_the_cleanup_found(close_fault, error_type, message):
    """A cancelled start whose cleanup fails ends FAILED, and the stop() that cancelled it says why."""
    # a hanging close is forced after the timeout; a raising one must have time to raise on a loaded
    # machine (forced first, it would be a durability failure instead of its own error)
    timeout = 0.5 if close_fault == "hang" else 10.0
    engine = OnlineDataEngine(
        make_cfg(ScriptedSpec(fault="stall", close_fault=close_fault), shutdown_timeout=timeout)
    )
    thread, errors = _start_in_a_thread(engine)
    with engine._lifecycle:
        assert engine._lifecycle.wait_for(lambda: engine.state is OnlineDataEngineState.STARTING, 30.0)
    with pytest.raises(error_type, match=message):
        engine.stop()
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and "start() was cancelled by stop()" in str(errors[0])
    assert engine.state is OnlineDataEngineState.FAILED
    assert isinstance(engine._shared.channel.error(), error_type)
    engine.stop()  # cleanup completed once: silent from now on
    assert engine.state is OnlineDataEngineState.FAILED


def test_health_checks_racing_a_clean_stop_leave_it_clean():
    """stop() joins the workers while other threads check health: those graceful exits are no deaths."""
    engine = OnlineDataEngine(make_cfg(buffer_size=4))
    engine.start()
    done = threading.Event()
    seen: list[str] = []

    def check() -> None:
        while not done.is_set():
            try:
                engine.check_health()
            except RuntimeError as error:
                seen.append(str(error))
                return

    threads = [threading.Thread(target=check) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        engine.stop()
    finally:
        done.set()
        for thread in threads:
            thread.join(30)
    assert engine.state is OnlineDataEngineState.STOPPED
    assert all("requires state READY; current state is STOPPED" in text for text in seen), seen


def test_initial_fill_timeout_fails_the_engine():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="stall"), initialization_timeout=0.5))
    with pytest.raises(TimeoutError, match=r"initial buffer fill exceeded 0.5 seconds"):
        engine.start()
    assert engine.state is OnlineDataEngineState.FAILED
    engine.stop()  # cleanup already complete: silent


def test_failed_attempts_are_retried_and_never_visible():
    spec = ScriptedSpec(fail_attempts=1)
    with OnlineDataEngine(make_cfg(spec, max_generation_attempts=2)) as engine:
        assert engine.get_stats()["failed_episodes"] == 4  # one failed attempt per window of 2
        batch = engine.sample_batch(64, 4)
        assert bool((batch["segment_attempt_id"] == 1).all())
        assert bool((batch["obs"][..., 0] % 10 == 1).all())  # tag encodes the attempt


def test_a_shorter_retry_leaves_no_frames_of_the_failed_attempt():
    # every window's failed attempt writes 20 frames per row, the retry that succeeds only 7
    spec = ScriptedSpec(fail_attempts=1, lengths=(20, 20, 7, 7), image=True)
    with OnlineDataEngine(make_cfg(spec, max_generation_attempts=2)) as engine:
        rows = engine.shared_buffer
        assert torch.equal(rows["valid"].sum(dim=1), torch.full((4,), 7))
        assert bool((rows["obs"][:, :7, 0] % 10 == 1).all())  # the retry's frames
        assert bool(rows["obs"][:, 7:].isnan().all())  # not the failed attempt's
        assert bool(rows["actions"][:, 7:].isnan().all())
        assert bool((rows["obs_image", "rgb"][:, :7] > 0).all())
        assert not bool(rows["obs_image", "rgb"][:, 7:].any())  # integer payload: unwritten is 0


def test_flow_status_and_budget_snapshot_without_quotas():
    with OnlineDataEngine(make_cfg()) as engine:
        status = engine.get_flow_status()
        assert status == {
            "requested_generation": 1,
            "completed_generation": 1,
            "successful_episodes": 4,
            "unlocked_remaining_chunks": None,
            "total_delivered_chunks": None,
        }
        snapshot = engine.get_sampling_budget_snapshot()
        assert snapshot["enabled"] is False and snapshot["rows"] == []
        assert engine.drain_lifecycle_events() == []
        engine.check_health()


def test_sampling_argument_errors():
    with OnlineDataEngine(make_cfg(ScriptedSpec(max_episode_steps=20))) as engine:
        with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
            engine.sample_batch(0, 2)
        with pytest.raises(ValueError, match=r"chunk_size \(21\) exceeds max_episode_steps \(20\)"):
            engine.sample_batch(1, 21)
        with pytest.raises(ValueError, match="chunk_size must be at least 1, got 0"):
            engine.sample_batch(1, 0)
        with pytest.raises(ValueError, match=r"chunk_size must be an int >= 1, got 2\.0"):
            engine.sample_batch(4, 2.0)
        with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 2\.5"):
            engine.sample_batch(2.5, 2)
        with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got True"):
            engine.sample_batch_with_context(True, 2, 2)
        assert engine.sample_batch(np.int64(3), np.int32(2)).batch_size == torch.Size([3, 2])
        for bad in ("seed", 0, np.random.default_rng(0)):
            with pytest.raises(
                ValueError, match=r"generator must be a torch.Generator on the CPU or None, got "
            ):
                engine.sample_batch(2, 2, generator=bad)
            with pytest.raises(ValueError, match=r"generator must be a torch.Generator on the CPU or None"):
                engine.sample_batch_with_context(2, 2, 1, generator=bad)
        # a batch larger than the machine's memory is refused before anything is drawn
        memory, per_frame = physical_memory(), engine._sampler.gatherer._all_frame_bytes
        generator = torch.Generator().manual_seed(5)
        state = generator.get_state()
        too_big = (
            r"batch_size=10{12} with 4 frames per item needs .* GiB for one batch, more than this machine's "
            rf".* GiB of memory: batch_size can be at most {memory // (4 * per_frame)} here"
        )
        with pytest.raises(ValueError, match=too_big):
            engine.sample_batch(10**12, 4, generator=generator)
        assert torch.equal(generator.get_state(), state)
        fits = memory // (5 * (2 * 4 + 1))  # actions: 2 float32, plus valid: 1 bool (loss_mask is derived)
        with pytest.raises(ValueError, match=rf"with 5 frames per item .* at most {fits} here"):
            engine.sample_batch_with_context(10**12, 3, 3, keys="actions")
        with pytest.raises(ValueError, match="sampling_mode must be 'episode', 'segment', or 'boundary'"):
            engine.sample_batch(1, 2, "frames")
        with pytest.raises(ValueError, match="boundary sampling requires chunk_size >= 2"):
            engine.sample_batch(1, 1, "boundary")
        with pytest.raises(Exception, match="No unlocked valid chunk satisfies sampling_mode='boundary'"):
            engine.sample_batch(1, 2, "boundary")  # one segment per episode: no boundary
        with pytest.raises(ValueError, match="Context lengths must be positive integers"):
            engine.sample_batch_with_context(1, 0, 2)
        with pytest.raises(ValueError, match="Context sampling_mode must be episode or segment"):
            engine.sample_batch_with_context(1, 2, 2, sampling_mode="boundary")
        with pytest.raises(ValueError, match="generations must be a nonempty tuple of positive integers"):
            engine.sample_batch_with_context(1, 2, 2, generations=[1])
        with pytest.raises(ValueError, match="Source has no generation metadata"):
            engine.sample_batch_with_context(1, 2, 2, generations=(1,))


def test_sample_batch_out_is_checked_before_any_write():
    with OnlineDataEngine(make_cfg(ScriptedSpec(max_episode_steps=20))) as engine:
        generator = torch.Generator().manual_seed(0)
        out = engine.sample_batch(3, 4, generator=generator)
        expected = engine.sample_batch(3, 4, generator=torch.Generator().manual_seed(1))
        assert engine.sample_batch(3, 4, generator=torch.Generator().manual_seed(1), out=out) is out
        assert (out == expected).all()
        before = out.clone()
        first_key = "/".join(engine._sampler.gatherer._paths[0])
        with pytest.raises(KeyError, match=f"out has no tensor at '{first_key}'"):
            engine.sample_batch(3, 4, out=out.exclude(engine._sampler.gatherer._paths[0]))
        with pytest.raises(
            ValueError, match=r"out must be a TensorDict of batch size \[3, 5\] .* got \[3, 4\]"
        ):
            engine.sample_batch(3, 5, out=out)
        flat = out.clone()
        flat.batch_size = [3]  # leaves of the right shapes: its torn-item redraws read the window length
        with pytest.raises(ValueError, match=r"out must be a TensorDict of batch size \[3, 4\] .* got \[3\]"):
            engine.sample_batch(3, 4, out=flat)
        # refused before anything is drawn: the generator gives the windows it would have given
        drawn = torch.Generator().manual_seed(5)
        with pytest.raises(ValueError):
            engine.sample_batch(3, 5, generator=drawn, out=out)
        fresh = engine.sample_batch(3, 4, generator=torch.Generator().manual_seed(5))
        assert (engine.sample_batch(3, 4, generator=drawn) == fresh).all()
        wrong_dtype = out.clone()
        wrong_dtype.set("valid", wrong_dtype.get("valid").to(torch.int64))
        with pytest.raises(ValueError, match=r"out\['valid'\] must be a contiguous torch.bool tensor"):
            engine.sample_batch(3, 4, out=wrong_dtype)
        strided = engine.sample_batch(4, 3).transpose(0, 1)
        with pytest.raises(ValueError, match=rf"out\['{first_key}'\] .* got .* \(not contiguous\)\."):
            engine.sample_batch(3, 4, out=strided)
        not_a_tensor = out.clone()
        not_a_tensor.set_non_tensor("valid", "yes")
        with pytest.raises(KeyError, match="out has no tensor at 'valid'"):
            engine.sample_batch(3, 4, out=not_a_tensor)
        assert (out == before).all()


def test_sample_batch_refuses_the_shared_buffer_itself_as_out():
    """Its rows have the right shape, dtypes and contiguity: a batch was written into published rows,
    behind their seqlock, leaving run tables that no longer describe the frames."""
    with OnlineDataEngine(make_cfg(ScriptedSpec(max_episode_steps=20))) as engine:
        rows = engine.shared_buffer[0:2]
        before = rows.clone()
        with pytest.raises(ValueError, match=r"out\['\w+'\] is memory of the shared buffer itself"):
            engine.sample_batch(2, 20, out=rows)
        assert (engine.shared_buffer[0:2] == before).all()


def test_del_of_an_unstopped_owner_engine_stops_its_workers():
    engine = OnlineDataEngine(make_cfg())
    engine.start()
    pids = [p.pid for p in engine._supervisor.processes.values()]
    engine.__del__()
    assert engine.state is OnlineDataEngineState.STOPPED
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


_ORPHAN_SCRIPT = """
import os, select, signal, sys
from simstream import OnlineDataEngine
from tests.support.engines import make_cfg, stop_quietly

if __name__ == "__main__":
    from multiprocessing import forkserver, util

    engine = OnlineDataEngine(make_cfg(num_workers=2))
    engine.start()
    print(" ".join(str(p.pid) for p in engine._supervisor.processes.values()), flush=True)
    print(forkserver._forkserver._forkserver_pid, util.get_temp_dir(), flush=True)
    if sys.argv[1:] == ["helper"]:  # a process the owner forks (a Pool's worker) outlives it
        helper = os.fork()
        if helper == 0:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)  # the test reads the script's output to its end: not this process's
            os.dup2(null, 2)
            select.select([], [], [], 120)  # until the test kills it, at most 120 s
            os._exit(0)
        print(helper, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


_SCRIPT_S = 180.0
"""Bound of a script run in a subprocess (spawned producers import torch and the script again; on a loaded
2-core machine one took 66 s)."""


def _run_script(path, text: str, timeout: float, args: tuple[str, ...] | list[str] = ()):
    """Run ``text`` as the main module of a fresh interpreter (with ``args``), the repository importable."""
    import subprocess
    import sys
    from pathlib import Path

    path.write_text(text)
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_producers_exit_when_the_owner_is_killed(tmp_path):
    """...and the forkserver removes the owner's ``pymp-*`` directory, which the SIGKILL left behind."""
    result = _run_script(tmp_path / "owner.py", _ORPHAN_SCRIPT, timeout=_SCRIPT_S)
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stderr[-2000:]
    pids = [int(p) for p in lines[0].split()]
    assert len(pids) == 2, result.stderr[-2000:]
    forkserver_pid, temp_dir = lines[1].split()

    wait_for_exit([*pids, int(forkserver_pid)], 10, "orphaned producers and forkserver")
    assert os.path.basename(temp_dir).startswith("pymp-")
    assert not os.path.exists(temp_dir), "the forkserver left its killed owner's multiprocessing directory"


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_producers_exit_when_the_owner_is_killed_while_a_process_it_forked_lives_on(tmp_path):
    """The forked process inherited the pipe the producers watched for their owner's exit: they ran on
    for as long as it lived (a Pool's workers, whose parent died, wait for ever)."""
    import subprocess
    import sys
    from pathlib import Path

    script, output = tmp_path / "owner.py", tmp_path / "output"
    script.write_text(_ORPHAN_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    with open(output, "w") as handle:  # not a pipe: its reader would wait for every process holding it
        subprocess.run(
            [sys.executable, str(script), "helper"], stdout=handle, stderr=subprocess.STDOUT,
            timeout=_SCRIPT_S, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, check=False,
        )  # fmt: skip
    lines = [line for line in output.read_text().splitlines() if line and line[0].isdigit()]
    assert len(lines) == 3, output.read_text()[-2000:]
    producers, helper = [int(p) for p in lines[0].split()], int(lines[2])
    try:
        wait_for_exit(producers, 10, "producers of an owner killed while its forked helper lives")
        os.kill(helper, 0)  # still there: it was no help to the producers
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)
        wait_for_exit([helper, int(lines[1].split()[0])], 30, "the helper and the fork server")


_CONSUMER_OF_A_KILLED_OWNER_SCRIPT = """
import multiprocessing as mp, os, signal
from simstream import OnlineDataEngine
from tests.support.consumers import sample_until_it_fails
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec


def own(ready):
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(lengths=(20, 9)), buffer_size=6, refill_threshold=1))
    engine.start()
    consumer = mp.get_context("spawn").Process(target=sample_until_it_fails, args=(engine, ready))
    consumer.start()
    ready.wait(120)
    os.kill(os.getpid(), signal.SIGKILL)  # no stop(), no exit handlers


if __name__ == "__main__":
    context = mp.get_context("spawn")
    ready = context.Event()
    owner = context.Process(target=own, args=(ready,))
    owner.start()
    owner.join(180)
    # the consumer, the owner's child, is an orphan now: it prints once it has its answer
"""


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_a_consumer_of_an_owner_killed_without_stop_gets_an_error_not_a_frozen_buffer(tmp_path):
    """Producers leave with their owner; they now say why, and the consumers it started raise it instead
    of sampling a buffer that never changes again (state READY, refills never served)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "consumer.py"
    script.write_text(_CONSUMER_OF_A_KILLED_OWNER_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    out_path = tmp_path / "out.txt"
    # a file, not a pipe: the orphaned consumer holds it open after the script's own process has ended
    with open(out_path, "w") as out:
        subprocess.run(
            [sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, timeout=_SCRIPT_S, cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
        )  # fmt: skip
    deadline = time.monotonic() + 90
    while "consumer:" not in out_path.read_text():
        assert time.monotonic() < deadline, out_path.read_text()[-3000:]
        threading.Event().wait(0.05)
    line = next(line for line in out_path.read_text().splitlines() if line.startswith("consumer:"))
    assert line.startswith("consumer: FAILED OnlineDataWorkerError OnlineDataEngine owner process "), line
    assert "exited without stop(): the producers stopped with it" in line


_UNGUARDED_SCRIPT = """
import sys
from simstream import OnlineDataEngine
from tests.support.engines import make_cfg, stop_quietly

# No `if __name__ == "__main__":` guard: every forkserver producer re-runs this module (as
# "__mp_main__"), and the engine it builds there must refuse to start.
engine = OnlineDataEngine(make_cfg())
try:
    engine.start()
except RuntimeError as error:
    if __name__ == "__main__":
        print("owner", engine.state.value, str(error).replace("\\n", " "), flush=True)
    elif sys.argv[1] == "raise":
        raise  # the producer's preparation fails, as in a script that does not catch it
    else:
        print("child", engine.state.value, str(error), flush=True)
else:
    engine.stop()
    print("owner", engine.state.value, flush=True)
"""

_CHILD_REFUSAL = (
    "OnlineDataEngine.start() was called while Python was preparing a worker process, which imports the "
    'main module again: start the engine under `if __name__ == "__main__":`.'
)


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_an_engine_started_while_a_producer_imports_the_main_module_refuses_to_start(tmp_path):
    """The child's engine raises before it allocates or starts anything; the owner's producer then runs."""
    result = _run_script(tmp_path / "unguarded.py", _UNGUARDED_SCRIPT, timeout=_SCRIPT_S, args=["catch"])
    lines = sorted(result.stdout.splitlines())
    assert lines == [f"child CREATED {_CHILD_REFUSAL}", "owner STOPPED"], (
        result.stdout + result.stderr[-3000:]
    )


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_a_script_without_a_main_guard_gets_start_error_naming_the_guard(tmp_path):
    """A producer that dies while Python prepares it cannot publish anything: the owner's error says why."""
    result = _run_script(tmp_path / "unguarded.py", _UNGUARDED_SCRIPT, timeout=_SCRIPT_S, args=["raise"])
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, report
    (line,) = result.stdout.splitlines()
    assert line.startswith(
        "owner FAILED OnlineDataEngine simulation worker exited unexpectedly (exit code 1)."
    ), report
    assert "It exited before any of its own code ran" in line, report
    assert "Under the 'forkserver' start method" in line and '`if __name__ == "__main__":`' in line, report
    assert _CHILD_REFUSAL in result.stderr, report  # the producer's own stderr says it too
    assert "terminate called" not in result.stderr and "leaked" not in result.stderr, report


def test_ctrl_c_reaching_the_producers_is_left_to_the_owner():
    """A terminal's Ctrl-C goes to the whole process group; producers ignore it, the owner decides."""
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        pid = engine._supervisor.processes["producer-0"].pid
        os.kill(pid, signal.SIGINT)
        generation = engine.request_refill()
        engine.wait_for_generation(generation, timeout=30)  # the producer kept working
        assert engine.state is OnlineDataEngineState.READY
        assert engine.sample_batch(4, 2).batch_size == torch.Size([4, 2])
    assert engine.state is OnlineDataEngineState.STOPPED


_CTRL_C_SCRIPT = """
from simstream import OnlineDataEngine
from tests.support.engines import make_cfg, stop_quietly
from tests.support.sources import ScriptedSpec

if __name__ == "__main__":
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(rollout_s=0.5), num_workers=2))
    print("starting", flush=True)
    try:
        engine.start()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    else:
        print("started", flush=True)
        engine.stop()
"""


def _children(pid: int) -> set[int]:
    children = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                children |= {int(child) for child in handle.read().split()}
        except OSError:
            continue
    return children


def _forkserver_and_its_children(owner: int) -> tuple[int | None, set[int]]:
    for child in _children(owner):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as handle:
                if b"multiprocessing.forkserver" in handle.read():
                    return child, _children(child)
        except OSError:
            continue
    return None, set()


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_ctrl_c_while_a_script_starts_its_engine_prints_no_worker_traceback(tmp_path, ctrl_c_raises):
    """Ctrl-C reaches the whole process group, the forkserver importing its preload (torch, for a couple
    of seconds) included: only the owner may react (the forkserver printed a KeyboardInterrupt traceback)."""
    import subprocess
    import sys

    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    owner = subprocess.Popen(
        [sys.executable, str(script)], cwd=root, env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert owner.stdout.readline().strip() == "starting"
        deadline = time.monotonic() + _SCRIPT_S
        while time.monotonic() < deadline:  # a bounded poll: nothing tells when the forkserver forks
            forkserver, _ = _forkserver_and_its_children(owner.pid)
            if forkserver is not None:
                break
            threading.Event().wait(0.001)
        os.killpg(owner.pid, signal.SIGINT)
        out, err = owner.communicate(timeout=_SCRIPT_S)
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.communicate(timeout=30)
    assert "Traceback" not in err, err[-3000:]
    assert owner.returncode == 0 and out.strip() in ("interrupted", "started"), (out, err[-3000:])


_USER_PROCESS_SCRIPT = """
import multiprocessing as mp
import signal

from simstream import OnlineDataEngine
from tests.support.engines import make_cfg


def report(pipe):
    pipe.send(signal.getsignal(signal.SIGINT) is signal.default_int_handler)


if __name__ == "__main__":
    with OnlineDataEngine(make_cfg()):
        pass
    ctx = mp.get_context("forkserver")  # the engine's forkserver
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=report, args=(writer,))
    process.start()
    print("default handler:", reader.recv(), flush=True)
    process.join()
"""


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_the_users_own_forkserver_processes_keep_python_s_ctrl_c_handler(tmp_path):
    """The forkserver imports its preload with SIGINT ignored, then restores Python's handler: the
    processes it starts for the user get KeyboardInterrupt on Ctrl-C as usual."""
    result = _run_script(tmp_path / "user.py", _USER_PROCESS_SCRIPT, timeout=_SCRIPT_S)
    assert result.stdout.strip() == "default handler: True", result.stderr[-3000:]


def test_a_ctrl_c_during_a_workers_start_is_delivered_once_the_worker_is_registered(
    monkeypatch, ctrl_c_raises
):
    """A real SIGINT while Process.start() runs: the supervisor registers the started worker before the
    KeyboardInterrupt surfaces, so its shutdown joins it (it was left to itself before)."""
    from simstream.workers.channel import ErrorChannel
    from simstream.workers.supervisor import WorkerSpec, WorkerSupervisor

    ctx = mp.get_context("forkserver")
    channel, stop = ErrorChannel(ctx), ctx.Event()
    supervisor = WorkerSupervisor(
        ctx, channel, is_closing=lambda: True, died_message=lambda label, code: "died"
    )
    start = mp.process.BaseProcess.start

    def start_while_interrupted(process):
        signal.raise_signal(signal.SIGINT)
        start(process)

    monkeypatch.setattr(mp.process.BaseProcess, "start", start_while_interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            supervisor.start([WorkerSpec("worker", "tests.support.workers:wait_for", (stop,))])
        monkeypatch.undo()
        assert list(supervisor.processes) == ["worker"]
    finally:
        stop.set()
        report = supervisor.shutdown(30.0)
    assert report.exitcodes == {"worker": 0} and not report.still_alive


def _interrupt_first_shutdown(engine: OnlineDataEngine, monkeypatch) -> list:
    """The engine's first worker shutdown raises KeyboardInterrupt at once, later ones run; returns the
    list that counts the calls."""
    shutdown, calls = engine._shutdown_workers, []

    def interrupted_once():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return shutdown()

    monkeypatch.setattr(engine, "_shutdown_workers", interrupted_once)
    return calls


@pytest.mark.parametrize("during", ["stop", "start"])
def test_ctrl_c_in_the_owners_cleanup_is_raised_not_kept_as_the_engines_failure(during, monkeypatch):
    """A KeyboardInterrupt landing in stop()'s (or a failing start()'s) cleanup reaches the caller once;
    it is not published, so a later stop() (the context manager's, the exit hook's) ends STOPPED instead
    of raising that old Ctrl-C again, and no consumer reads it as the engine's failure."""
    engine = OnlineDataEngine(make_cfg())
    calls = _interrupt_first_shutdown(engine, monkeypatch)
    if during == "start":
        monkeypatch.setattr(
            engine, "_wait_for_initial_fill", lambda: (_ for _ in ()).throw(KeyboardInterrupt)
        )
        with pytest.raises(KeyboardInterrupt):
            engine.start()  # its cleanup is interrupted too
    else:
        engine.start()
        with pytest.raises(KeyboardInterrupt):
            engine.stop()
    assert engine._shared.channel.read() is None
    if during == "stop":  # a start whose cleanup was cut short reads FAILED until stop() finishes it
        assert engine.state is OnlineDataEngineState.READY
    engine.stop()  # finishes the cleanup
    assert engine.state is OnlineDataEngineState.STOPPED and len(calls) == 2
    assert engine._supervisor is None or not engine._supervisor.processes


def test_ctrl_c_after_stop_signalled_the_producers_leaves_their_exits_to_the_next_stop(monkeypatch):
    """The Ctrl-C lands once stop() told the producers to close and they did (exit code 0): the next
    stop() must not read those exits as deaths (it made the engine FAILED with "exited unexpectedly")."""
    engine = OnlineDataEngine(make_cfg())
    engine.start()
    shutdown, supervisor = engine._shutdown_workers, engine._supervisor
    calls = []

    def interrupted_after_the_close():
        calls.append(1)
        if len(calls) > 1:
            return shutdown()
        engine._shared.close_flag.set()
        engine._shared.wake_all()
        # the producers exit on their own now; read through the supervisor, which the monitor shares
        assert [supervisor.wait_exited(label, 60.0) for label in supervisor.processes] == [0]
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_shutdown_workers", interrupted_after_the_close)
    with pytest.raises(KeyboardInterrupt):
        engine.stop()
    assert engine.state is OnlineDataEngineState.READY and engine._shared.channel.read() is None
    engine.stop()
    assert engine.state is OnlineDataEngineState.STOPPED and len(calls) == 2


def test_ctrl_c_during_the_cleanup_of_a_failed_start_reaches_the_caller(monkeypatch):
    """start() failed (its initial fill timed out) and a Ctrl-C landed in its cleanup: the caller gets the
    KeyboardInterrupt, the start's error as its context, instead of the error with the Ctrl-C as a note."""
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="stall"), initialization_timeout=0.5))
    calls = _interrupt_first_shutdown(engine, monkeypatch)
    with pytest.raises(KeyboardInterrupt) as raised:
        engine.start()
    assert isinstance(raised.value.__context__, TimeoutError)
    assert "Worker cleanup also failed: KeyboardInterrupt" in "".join(raised.value.__context__.__notes__)
    assert engine.state is OnlineDataEngineState.FAILED
    stop_quietly(engine)
    assert len(calls) == 2


def test_a_stop_inside_this_threads_own_stop_or_start_asks_and_returns(monkeypatch):
    """A signal handler runs in the thread it interrupts: its stop() inside stop() ran a second shutdown
    within the first (the engine ended FAILED), and inside start() it waited for the start it had
    interrupted (shutdown_timeout + 10 s). Now it asks them to stop and returns; they finish cleanly."""
    engine = OnlineDataEngine(make_cfg(shutdown_timeout=5.0))
    engine.start()
    shutdown, nested = engine._shutdown_workers, []

    def shutdown_with_a_handlers_stop():
        engine.stop()  # as a SIGALRM/SIGTERM handler calling stop() would
        nested.append(engine.state)
        return shutdown()

    monkeypatch.setattr(engine, "_shutdown_workers", shutdown_with_a_handlers_stop)
    engine.stop()
    assert nested == [OnlineDataEngineState.READY] and engine.state is OnlineDataEngineState.STOPPED

    starting = OnlineDataEngine(make_cfg(shutdown_timeout=5.0))
    fill = starting._wait_for_initial_fill

    def fill_with_a_handlers_stop():
        starting.stop()  # returns at once, leaving the shutdown to the start it interrupted
        nested.append((starting.state, starting._supervisor is not None))
        return fill()

    monkeypatch.setattr(starting, "_wait_for_initial_fill", fill_with_a_handlers_stop)
    with pytest.raises(RuntimeError, match=r"OnlineDataEngine.start\(\) was cancelled by stop\(\)"):
        starting.start()
    assert nested[1] == (OnlineDataEngineState.STARTING, True)
    assert starting.state is OnlineDataEngineState.STOPPED
