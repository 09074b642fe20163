"""Fault injection through a real spawned collector: every failure is raised, diagnosed, and cleaned up.

Each case asserts the exception type, the report text, the time from the fault (stamped by the collector
with the system-wide monotonic clock) to the raise, and that close() left no process behind (the autouse
``no_leaks`` fixture also checks /dev/shm and threads).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time

import pytest

from simstream.rl import APPOConfig, APPORunner, CollectorDiedError, CollectorHangError, RunnerConfig
from tests.rl.collectors import LockDeathRunner, StoppedInTheRingLock, ToyRunner
from tests.rl.fault_env import HUGE_HEAD, HUGE_TAIL, env_id

pytestmark = pytest.mark.timeout(90)

# A death must be seen through the process itself (exit code, error channel), never by waiting out a
# watchdog. The hang timeout is set far above this bound, so a detection under it cannot have come from
# the heartbeat watchdog; the bound itself is generous so that a loaded 2-core machine stays green.
HANG_TIMEOUT_S = 60.0
DETECTION_BOUND_S = 20.0


def _config(fault: str, **runner) -> APPOConfig:
    return APPOConfig(
        env_id=env_id(fault),
        num_envs=2,
        steps_per_rollout=16,
        minibatch_size=32,
        num_epochs=1,
        hidden_sizes=(16,),
        stats_window=2,
        runner=RunnerConfig(**{"shutdown_timeout_s": 5.0, "hang_timeout_s": HANG_TIMEOUT_S, **runner}),
    )


@pytest.fixture
def stamp(tmp_path, monkeypatch):
    path = tmp_path / "fault_stamp"
    monkeypatch.setenv("SIMSTREAM_RL_FAULT_STAMP", str(path))
    return path


def _learn_until_death(runner, stamp) -> tuple[CollectorDiedError, float]:
    with runner:
        try:
            runner.learn(10_000, log_dir=None)
        except CollectorDiedError as error:
            raised_at = time.monotonic()
            caught = error
        else:  # pragma: no cover - the fault must fire
            pytest.fail("learn() returned although the collector failed")
    assert stamp.exists(), "the injected fault did not run"
    return caught, raised_at - float(stamp.read_text())


def _assert_cleaned_up(runner) -> None:
    report = runner.last_close_report
    assert report is not None and not report.still_alive
    assert report.failure is not None
    assert mp.active_children() == []


@pytest.mark.parametrize(
    ("fault", "exitcode", "fragments"),
    [
        pytest.param(
            "create", None,
            ["Collector process crashed.", "RuntimeError: FaultEnv could not be created (injected)",
             "fault_env.py"],
            id="env-creation",
        ),
        pytest.param(
            "raise", None,
            ["Collector process crashed.", "ValueError: injected failure in the middle of a rollout",
             "in step"],
            id="mid-rollout",
        ),
        pytest.param(
            "unpicklable", None,
            ["Collector process crashed.", "UnpicklableFaultError: an exception that cannot travel"],
            id="unpicklable",
        ),
        pytest.param(
            "nan", None, ["NonFiniteError: non-finite values in 'rewards'"], id="nan-guard",
        ),
        pytest.param(
            "sigkill", -9, ["killed by signal 9 (SIGKILL)", "OOM killer", "dmesg"], id="sigkill",
        ),
        pytest.param(
            "segfault", -11,
            ["killed by signal 11 (SIGSEGV)", "segmentation fault", "faulthandler",
             "Fatal Python error: Segmentation fault", "_maybe_fault"],
            id="segfault",
        ),
        pytest.param(
            "abort", -6, ["killed by signal 6 (SIGABRT)", "abort()", "Fatal Python error: Aborted"],
            id="abort",
        ),
        pytest.param(
            "exit135", 135,
            ["exited with code 135 (shell-style signal 7, SIGBUS)", "shared memory", "/dev/shm"],
            id="exit-135",
        ),
    ],
)  # fmt: skip
def test_collector_failure_is_raised_with_a_diagnosis(fault, exitcode, fragments, stamp):
    runner = APPORunner(_config(fault))
    error, latency = _learn_until_death(runner, stamp)
    assert type(error) is CollectorDiedError
    for fragment in fragments:
        assert fragment in error.report, f"{fragment!r} missing from:\n{error.report}"
    assert str(error) == error.report
    if exitcode is not None:
        assert error.exitcode == exitcode
        assert error.traceback_text is None
    else:
        assert error.traceback_text and "Traceback (most recent call last)" in error.traceback_text
    assert latency < DETECTION_BOUND_S, f"detected {latency:.2f} s after the fault"
    assert runner.last_run_summary["status"] == "collector_died"
    assert runner.last_run_summary["failure"] == error.report
    _assert_cleaned_up(runner)
    assert runner.last_close_report.released >= 2  # ring and weight buffer


def test_traceback_over_64_kib_arrives_capped_head_and_tail(stamp):
    runner = APPORunner(_config("huge"))
    error, latency = _learn_until_death(runner, stamp)
    report = error.report
    assert "Traceback (most recent call last)" in report
    assert HUGE_TAIL in report  # the end of a traceback holds the cause: kept
    assert "characters cut" in report
    assert HUGE_HEAD not in report or len(report) < 64 * 1024
    assert len(report) < 64 * 1024
    assert latency < DETECTION_BOUND_S  # no pipe to block on, unlike the reference (defect 7)
    _assert_cleaned_up(runner)


def test_hang_is_raised_after_the_heartbeat_timeout_with_the_stack(stamp):
    hang_timeout_s = 3.0  # well above any heartbeat gap of a loaded machine (110 ms measured at load 12)
    runner = APPORunner(_config("hang", hang_timeout_s=hang_timeout_s))
    error, latency = _learn_until_death(runner, stamp)
    assert isinstance(error, CollectorHangError)
    assert isinstance(error, CollectorDiedError) and isinstance(error, TimeoutError)
    assert "hung: no heartbeat" in error.report
    assert "time.sleep" in error.report or "_maybe_fault" in error.report  # faulthandler stack of the child
    # the watchdog, not the pytest timeout; it counts from the last heartbeat, a moment before the stamp
    assert hang_timeout_s - 0.25 <= latency < DETECTION_BOUND_S
    report = runner.last_close_report
    assert report.forced and not report.still_alive  # a hung collector must be terminated
    assert mp.active_children() == []


def test_a_hang_after_learn_returned_is_diagnosed_by_close_not_blamed_on_a_kill(stamp):
    """The collector keeps filling the ring after learn() returns; a hang then is found by the watchdog
    alone. close() must report it as a hang with the stack, not as the SIGTERM it sends."""
    cfg = _config("hang", hang_timeout_s=3.0)
    runner = APPORunner(
        dataclasses.replace(cfg, num_envs=1, steps_per_rollout=8, num_slots=8, minibatch_size=8)
    )
    runner.learn(1, log_dir=None)  # the collector hangs at its 40th step, in a later rollout
    assert runner._channel.wait_published(DETECTION_BOUND_S), "the watchdog never published the hang"
    report = runner.close()
    assert report.failure.startswith("Collector process hung: no heartbeat")
    assert "time.sleep" in report.failure or "_maybe_fault" in report.failure  # its stack, dumped alive
    assert "signal" not in report.failure.splitlines()[0]
    assert report.forced and not report.still_alive
    assert mp.active_children() == []


def test_exception_while_importing_the_collector_module(stamp):
    runner = ToyRunner(target="tests.rl.broken_import:collect")
    error, latency = _learn_until_death(runner, stamp)
    assert type(error) is CollectorDiedError
    assert "ImportError: tests.rl.broken_import fails at import time (injected)" in error.report
    assert "resolve_target" in error.report  # raised inside the guarded entry, not before it
    assert latency < DETECTION_BOUND_S
    _assert_cleaned_up(runner)
    assert runner.resource.released == 1


def test_collector_returning_without_being_asked_is_a_death():
    runner = ToyRunner(mode="return_early")
    with runner, pytest.raises(CollectorDiedError, match="exited with code 0") as info:
        runner.learn(10_000)
    assert info.value.exitcode == 0
    assert mp.active_children() == []


def test_a_collector_killed_holding_the_ring_lock_is_reported_as_dead():
    """The kernel releases the lock of a killed holder: the learner takes it, then finds the dead
    collector."""
    runner = LockDeathRunner()
    try:
        with pytest.raises(CollectorDiedError, match=r"killed by signal 9 \(SIGKILL\)") as caught:
            runner.learn()
        assert caught.value.exitcode == -9
    finally:
        runner.close()
    assert mp.active_children() == []


def test_a_collector_stopped_holding_the_ring_lock_is_a_hang_that_says_it_is_stopped():
    """The learner waited out the ring lock's own 5 s before it looked at the collector, and the report
    blamed a deadlocked native call after a second spent asking a stopped process for its stacks. The
    lock wait now checks the collector, and the report says the process is stopped."""
    import os
    import signal

    runner = StoppedInTheRingLock(_config("none", hang_timeout_s=1.0, shutdown_timeout_s=2.0))
    try:
        with pytest.raises(CollectorHangError) as raised:
            runner.learn(50, log_dir=None)
        assert "The process is stopped (SIGSTOP, Ctrl-Z or a debugger)" in raised.value.report
        assert "faulthandler" not in raised.value.report
    finally:
        report = runner.close()
        if runner.collector_pid is not None and report.still_alive:
            os.kill(runner.collector_pid, signal.SIGKILL)
    assert report.forced and not report.still_alive
    assert mp.active_children() == []


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_collector_killed_or_stopped_while_it_waits_on_the_stop_signal_never_wedges_close(signal_name):
    """The collector sleeps in ``stop_event.wait()`` between steps. A ``multiprocessing.Event`` there made
    ``close()``'s ``set()`` wait forever for the dead (or stopped) sleeper to confirm its wake-up."""
    import os
    import signal
    import threading

    runner = ToyRunner(config=RunnerConfig(shutdown_timeout_s=1.0, hang_timeout_s=HANG_TIMEOUT_S))
    closed = threading.Event()
    try:
        runner.learn(3)
        os.kill(runner.collector_pid, getattr(signal, signal_name))
        if signal_name == "SIGKILL":
            with pytest.raises(CollectorDiedError, match=r"killed by signal 9 \(SIGKILL\)"):
                runner.learn(10**9)
        closer = threading.Thread(target=lambda: (runner.close(), closed.set()), daemon=True)
        closer.start()
        assert closed.wait(DETECTION_BOUND_S), "close() did not return"
        report = runner.last_close_report
        assert report.exitcode == -9 and not report.still_alive
        assert report.forced == (signal_name == "SIGSTOP")  # a stopped collector is killed past its grace
    finally:
        if not closed.is_set() and runner.collector_pid is not None:
            os.kill(runner.collector_pid, signal.SIGKILL)
    assert mp.active_children() == []
