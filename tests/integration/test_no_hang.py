"""No process's death or stop, at any moment, wedges another; a script that exits leaves nothing behind.

Each test kills or stops a real process at the moment named and bounds every wait on the outcome: a hang
shows as a failed bounded join, never as a stuck suite.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from simstream import OnlineDataEngine, OnlineDataEngineState
from simstream.data import OnlineDataset
from tests.support.engines import make_cfg, stop_quietly
from tests.support.processes import wait_for_exit
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(120)

_BOUND_S = 30.0
_REPO = Path(__file__).resolve().parents[2]


def _two_producers(**overrides) -> OnlineDataEngine:
    values = {"num_workers": 2, "shutdown_timeout": 2.0}
    values.update(overrides)
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(), **values))
    engine.start()
    return engine


def _producer_pid(engine: OnlineDataEngine, index: int) -> int:
    return engine._supervisor.processes[f"producer-{index}"].pid


def _in_thread(function) -> tuple[threading.Thread, list]:
    """Run ``function`` in a daemon thread; the list receives its result or exception."""
    outcome: list = []

    def body() -> None:
        try:
            outcome.append(function())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def test_stop_after_an_idle_producer_was_killed_returns_with_its_death():
    """A dead sleeper used to wedge the wake-up that stop() sends every producer (Event.set)."""
    engine = _two_producers(refill_policy="manual")
    pid = _producer_pid(engine, 0)
    os.kill(pid, signal.SIGKILL)
    wait_for_exit([pid], _BOUND_S, "the killed producer")
    assert engine._shared.channel.wait_published(_BOUND_S)
    thread, outcome = _in_thread(engine.stop)
    thread.join(_BOUND_S)
    assert not thread.is_alive(), "stop() hung after an idle producer was killed"
    assert isinstance(outcome[0], RuntimeError)
    assert "exited unexpectedly (exit code -9, signal SIGKILL)" in str(outcome[0])
    assert engine.state is OnlineDataEngineState.FAILED


def test_the_with_block_ends_after_an_idle_producer_was_killed():
    def run() -> None:
        with OnlineDataEngine(make_cfg(ScriptedSpec(), num_workers=2, refill_policy="manual")) as engine:
            pid = _producer_pid(engine, 1)
            os.kill(pid, signal.SIGKILL)
            wait_for_exit([pid], _BOUND_S, "the killed producer")
            assert engine._shared.channel.wait_published(_BOUND_S)

    thread, outcome = _in_thread(run)
    thread.join(_BOUND_S)
    assert not thread.is_alive(), "leaving the with block hung"
    assert isinstance(outcome[0], RuntimeError) and "exited unexpectedly" in str(outcome[0])


def test_a_producer_killed_while_dataloader_workers_iterate_ends_the_loop_with_its_death():
    engine = _two_producers(buffer_size=8, refill_threshold=1)
    try:
        loader = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=0).loader(num_workers=2)
        killed = threading.Event()

        def iterate() -> int:
            batches, iterator = 0, iter(loader)
            try:
                while batches < 100_000:
                    next(iterator)
                    batches += 1
                    if batches == 20:
                        os.kill(_producer_pid(engine, 0), signal.SIGKILL)
                        killed.set()
                raise AssertionError("the loop never saw the producer's death")
            except BaseException as error:  # its traceback holds the iterator: drop it, so workers stop
                error.__context__ = None
                raise error.with_traceback(None) from None
            finally:
                del iterator

        thread, outcome = _in_thread(iterate)
        thread.join(_BOUND_S * 2)
        assert not thread.is_alive(), "the training loop hung after a producer was killed"
        assert killed.is_set()
        assert isinstance(outcome[0], RuntimeError), outcome
        assert "exited unexpectedly (exit code -9, signal SIGKILL)" in str(outcome[0])
    finally:
        stop_quietly(engine)


def test_sampling_never_waits_for_a_stopped_producer():
    """A SIGSTOPped producer sleeping on its wake-up used to hold every refill request (and so every
    sample_batch that made one) until it was continued."""
    engine = _two_producers(buffer_size=8, refill_threshold=1)
    pid = _producer_pid(engine, 0)
    try:
        os.kill(pid, signal.SIGSTOP)

        def sample_many() -> int:
            # every second call passes the refill threshold (8 chunks) and asks for a refill
            for _ in range(200):
                batch = engine.sample_batch(4, 3)
                assert bool(batch["valid"].all())
            return 200

        thread, outcome = _in_thread(sample_many)
        thread.join(_BOUND_S)
        assert not thread.is_alive(), "sample_batch waited for a stopped producer"
        assert outcome == [200]
        assert engine.get_stats()["sampled_chunks"] == 800
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.stop()
    assert engine.state is OnlineDataEngineState.STOPPED


def _take_and_die(lock, taken) -> None:
    lock.acquire(None)
    taken.set()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("which", ["quota", "lifecycle log", "refill request", "language"])
def test_a_consumer_killed_holding_a_shared_lock_wedges_no_producer_and_no_owner(which):
    engine = _two_producers(
        refill_policy="manual",
        episode_sample_budget=1000,
        episode_sample_hard_limit=1000,
        lifecycle_event_capacity=64,
        buffer_size=8,
    )
    try:
        lock = {
            "quota": lambda: engine._shared.quota.lock,
            "lifecycle log": lambda: engine._shared.events._lock,
            "refill request": lambda: engine._shared.progress._request_lock,
            "language": lambda: engine._shared.language._append_lock,
        }[which]()
        ctx = mp.get_context("fork")
        taken = ctx.Event()
        holder = ctx.Process(target=_take_and_die, args=(lock, taken))
        holder.start()
        assert taken.wait(_BOUND_S)
        holder.join(_BOUND_S)
        assert holder.exitcode == -signal.SIGKILL

        def refill_twice() -> int:
            for _ in range(2):
                engine.drain_lifecycle_events()
                engine.wait_for_generation(engine.request_refill(), timeout=_BOUND_S)
            engine.language_registry.intern(f"after the {which} holder died")
            return engine.get_stats()["completed_generation"]

        thread, outcome = _in_thread(refill_twice)
        thread.join(_BOUND_S * 2)
        assert not thread.is_alive(), f"a consumer killed holding the {which} lock wedged the engine"
        assert outcome == [3]
        assert engine.sample_batch(4, 2)["valid"].all()
        assert engine.get_sampling_budget_snapshot()["enabled"]
    finally:
        engine.stop()


def _take_and_stop(lock, taken) -> None:
    lock.acquire(None)
    taken.set()
    os.kill(os.getpid(), signal.SIGSTOP)


@pytest.mark.parametrize("which", ["quota", "refill request", "lifecycle log"])
def test_a_consumer_stopped_holding_a_shared_lock_ends_the_owners_waits_after_the_timeout(which):
    """A stopped holder never releases (the kernel frees a lock only on death) and publishes nothing: the
    owner's calls that take the lock end with TimeoutError after sample_wait_timeout, naming it."""
    engine = _two_producers(
        refill_policy="manual", episode_sample_budget=1000, episode_sample_hard_limit=1000, buffer_size=8,
        sample_wait_timeout=1.0, lifecycle_event_capacity=16,
    )  # fmt: skip
    holder = None
    try:
        lock = {
            "quota": engine._shared.quota.lock,
            "refill request": engine._shared.progress._request_lock,
            "lifecycle log": engine._shared.events.lock,  # drain waited for it without a bound
        }[which]
        ctx = mp.get_context("fork")
        taken = ctx.Event()
        holder = ctx.Process(target=_take_and_stop, args=(lock, taken))
        holder.start()
        assert taken.wait(_BOUND_S)
        calls = {
            "quota": [
                engine.get_flow_status,
                engine.get_sampling_budget_snapshot,
                lambda: engine.sample_batch(4, 2),
            ],
            "refill request": [engine.request_refill],
            "lifecycle log": [engine.drain_lifecycle_events],
        }[which]
        name = {"quota": "The quota lock", "refill request": "The refill-request lock"}.get(
            which, "The lifecycle log lock"
        )
        for call in calls:
            thread, outcome = _in_thread(call)
            thread.join(_BOUND_S)
            assert not thread.is_alive(), f"{call} waited on a stopped holder of the {which} lock"
            assert isinstance(outcome[0], TimeoutError), outcome
            assert str(outcome[0]) == (
                f"{name} was held for more than 1 s by process {holder.pid}, which is stopped (SIGSTOP or a "
                "debugger?) and cannot release it"
            )
    finally:
        if holder is not None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(_BOUND_S)
        engine.stop()
    assert engine.state is OnlineDataEngineState.STOPPED


def _take_and_hold(lock, taken, release) -> None:
    lock.acquire(None)
    taken.set()
    release.wait(_BOUND_S)
    lock.release()


def test_a_live_process_holding_the_quota_lock_past_the_timeout_is_waited_for():
    """A live holder (another consumer's long batch copy) is no stopped one: the owner's quota waits
    outlast sample_wait_timeout and go on once it releases (they failed with TimeoutError after it)."""
    engine = _two_producers(
        refill_policy="manual", episode_sample_budget=1000, episode_sample_hard_limit=1000, buffer_size=8,
        sample_wait_timeout=0.5,
    )  # fmt: skip
    ctx = mp.get_context("fork")
    taken, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_take_and_hold, args=(engine._shared.quota.lock, taken, release))
    holder.start()
    try:
        assert taken.wait(_BOUND_S)
        threads = [_in_thread(call) for call in (engine.get_flow_status, lambda: engine.sample_batch(4, 2))]
        threads[0][0].join(4 * engine.cfg.sample_wait_timeout)  # the old deadline, long past
        assert all(thread.is_alive() for thread, _ in threads) and not any(o for _, o in threads)
        release.set()
        for thread, outcome in threads:
            thread.join(_BOUND_S)
            assert not thread.is_alive() and not isinstance(outcome[0], BaseException), outcome
        assert threads[0][1][0]["successful_episodes"] == 8
        assert threads[1][1][0].batch_size == torch.Size([4, 2])
    finally:
        release.set()
        holder.join(_BOUND_S)
        engine.stop()
    assert holder.exitcode == 0


def _run_script(body: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    script = textwrap.dedent(
        """
        import json, os, sys
        from simstream import OnlineDataEngine, OnlineDataEngineCfg
        from tests.support.sources import ScriptedSpec

        def producer_pids(engine):
            return [p.pid for p in engine._supervisor.processes.values()]

        if __name__ == "__main__":
        """
    ) + textwrap.indent(textwrap.dedent(body), "    ")
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=_REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": str(_REPO)},
    )


def _pids_from(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("{"))
    return json.loads(line)


@pytest.mark.parametrize("ending", ["raises", "returns"])
def test_a_script_that_never_stops_its_engine_exits_and_leaves_no_process(ending):
    last_line = 'raise RuntimeError("the training script crashed")' if ending == "raises" else "pass"
    result = _run_script(
        f"""
        engine = OnlineDataEngine(OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4, num_workers=2))
        engine.start()
        engine.sample_batch(2, 2)
        print(json.dumps({{"producers": producer_pids(engine)}}), flush=True)
        {last_line}
        """
    )
    pids = _pids_from(result.stdout)["producers"]
    assert len(pids) == 2
    if ending == "raises":
        assert result.returncode == 1
        assert "RuntimeError: the training script crashed" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
    wait_for_exit(pids, _BOUND_S, "producers of a script that exited without stop()")


_OWNER_HEAD = """
import json, sys, threading, multiprocessing.resource_tracker as tracker
from simstream import OnlineDataEngine, OnlineDataEngineCfg
from tests.support.sources import ScriptedSpec


def report(engine):
    producers = [p.pid for p in engine._supervisor.processes.values()]
    print(json.dumps({"producers": producers, "tracker": tracker._resource_tracker._pid}), flush=True)
"""


def _start_owner(main: str, **environment: str) -> tuple[subprocess.Popen, dict]:
    """Start an owner script: ``_OWNER_HEAD`` then ``main``, whose engine calls ``report(engine)`` once.
    Returns the process and the pids it reported (its producers and its resource tracker)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER_HEAD + textwrap.dedent(main)], cwd=_REPO, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(_REPO), **environment},
    )  # fmt: skip
    ready = select.poll()
    ready.register(owner.stdout, select.POLLIN)
    if not ready.poll(_BOUND_S * 1000):
        owner.kill()
        owner.wait(_BOUND_S)
        owner.stdout.close()
        raise AssertionError("the owner script printed nothing")
    return owner, json.loads(owner.stdout.readline())


def _kill_owner_and_wait_for_the_rest(owner: subprocess.Popen, pids: dict, what: str) -> None:
    """SIGKILL the owner, then wait (bounded) until its producers, fork server and tracker have exited."""
    forkserver = {_parent_of(pid) for pid in pids["producers"]}
    owner.kill()
    owner.wait(_BOUND_S)
    wait_for_exit([*pids["producers"], *forkserver, pids["tracker"]], _BOUND_S, what)


def test_an_owner_killed_in_wait_for_generation_leaves_no_process_behind():
    """The producer that completed the generation used to hang in its wake-up of the dead owner."""
    owner, pids = _start_owner(
        """
        if __name__ == "__main__":
            cfg = OnlineDataEngineCfg(
                source=ScriptedSpec(), buffer_size=4, num_workers=2, refill_policy="manual"
            )
            engine = OnlineDataEngine(cfg)
            engine.start()
            report(engine)
            while True:
                engine.wait_for_generation(engine.request_refill(), timeout=60)
        """
    )
    try:
        _kill_owner_and_wait_for_the_rest(
            owner, pids, "producers, forkserver and resource tracker of a killed owner"
        )
    finally:
        owner.kill()
        owner.stdout.close()


def test_an_owner_killed_while_a_source_hangs_in_its_rollout_leaves_no_process_behind(tmp_path):
    """The producer notices its owner's death between control steps; a source hung inside ``rollout()``
    never returns to one, and without an owner nobody would terminate it: it ran forever, keeping the
    fork server and the resource tracker alive too. It now exits ``shutdown_timeout`` after the owner."""
    stamp = tmp_path / "hanging"
    owner, pids = _start_owner(
        """
        if __name__ == "__main__":
            cfg = OnlineDataEngineCfg(
                source=ScriptedSpec(fault="hang", fault_after=1), buffer_size=2, num_workers=1,
                refill_policy="manual", shutdown_timeout=1.0,
            )
            engine = OnlineDataEngine(cfg)
            engine.start()
            engine.request_refill()  # its rollout hangs
            report(engine)
            threading.Event().wait(600)
        """,
        SIMSTREAM_TEST_HANG_STAMP=str(stamp),
    )
    try:
        deadline = time.monotonic() + _BOUND_S
        while not stamp.exists():  # the source is inside its hang
            assert time.monotonic() < deadline and owner.poll() is None, "the source never hung"
            threading.Event().wait(0.02)
        _kill_owner_and_wait_for_the_rest(
            owner, pids, "the hung producer, forkserver and resource tracker of a killed owner"
        )
    finally:
        owner.kill()
        owner.stdout.close()
        for pid in pids["producers"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_a_close_failure_during_a_timed_out_start_is_a_note_and_stays_visible():
    engine = OnlineDataEngine(
        make_cfg(ScriptedSpec(fault="stall", close_fault="raise"), initialization_timeout=1.0)
    )
    with pytest.raises(TimeoutError, match=r"initial buffer fill exceeded 1\.0 seconds") as raised:
        engine.start()
    note = "producer-0: source close() also failed: OSError: flush failed while closing the source"
    assert note in getattr(raised.value, "__notes__", [])
    assert engine.state is OnlineDataEngineState.FAILED
    with pytest.raises(TimeoutError) as checked:
        engine.check_health()
    assert note in checked.value.__notes__


def _stats_in_child(engine, results) -> None:
    results.send(engine.get_stats()["producers"])


def test_get_stats_lists_every_producer_in_the_owner_and_in_consumers():
    engine = _two_producers(refill_policy="manual", buffer_size=8)
    try:
        engine.wait_for_generation(engine.request_refill(), timeout=_BOUND_S)
        producers = engine.get_stats()["producers"]
        assert [p["index"] for p in producers] == [0, 1]
        assert [p["pid"] for p in producers] == [_producer_pid(engine, 0), _producer_pid(engine, 1)]
        # 8 rows in two ranges of 4, two generations: each producer published 4 rows twice
        assert [(p["episodes"], p["frames"], p["completed_generation"]) for p in producers] == [
            (8, 160, 2)
        ] * 2
        assert all(p["alive"] and p["restarts"] == 0 and p["node_id"] is None for p in producers)
        assert sum(p["episodes"] for p in producers) == engine.get_stats()["successful_episodes"]
        ctx = mp.get_context("forkserver")
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_stats_in_child, args=(engine, writer))
        child.start()
        assert reader.poll(_BOUND_S)
        assert reader.recv() == producers  # a consumer sees the same rows
        child.join(_BOUND_S)
        os.kill(producers[1]["pid"], signal.SIGKILL)
        wait_for_exit([producers[1]["pid"]], _BOUND_S, "the killed producer")
        assert [p["alive"] for p in engine.get_stats()["producers"]] == [True, False]
    finally:
        stop_quietly(engine)


def _take_and_stop(lock, taken) -> None:
    lock.acquire(None)
    taken.set()
    os.kill(os.getpid(), signal.SIGSTOP)


def test_a_consumer_stopped_holding_the_refill_request_lock_does_not_hold_up_sampling():
    engine = _two_producers(buffer_size=8, refill_threshold=1)
    ctx = mp.get_context("fork")
    taken = ctx.Event()
    holder = ctx.Process(target=_take_and_stop, args=(engine._shared.progress._request_lock, taken))
    holder.start()
    try:
        assert taken.wait(_BOUND_S)

        def sample_many() -> int:
            for _ in range(100):  # every second call is due a refill: the busy lock is skipped, not awaited
                assert bool(engine.sample_batch(4, 3)["valid"].all())
            return 100

        thread, outcome = _in_thread(sample_many)
        thread.join(_BOUND_S)
        assert not thread.is_alive(), "sample_batch waited for a stopped consumer's request lock"
        assert outcome == [100]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(_BOUND_S)
        engine.stop()
