"""Every way a producer can fail reaches the owner and consumers, as the spec names it."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from simstream import OnlineDataEngine, OnlineDataEngineState, OnlineDataWorkerError
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(90)


def _started(spec: ScriptedSpec, **overrides) -> OnlineDataEngine:
    engine = OnlineDataEngine(make_cfg(spec, **overrides))
    engine.start()
    return engine


def _wait_failed(engine: OnlineDataEngine, timeout_s: float = 30.0) -> None:
    """Wait (bounded) for the failure record that makes the engine FAILED in every process."""
    assert engine._shared.channel.wait_published(timeout_s), f"no failure published within {timeout_s} s"
    assert engine.state is OnlineDataEngineState.FAILED


def test_worker_exception_arrives_as_the_original_type_everywhere():
    engine = _started(ScriptedSpec(fault="raise", fault_after=2), refill_policy="manual")
    engine.request_refill()
    _wait_failed(engine)
    with pytest.raises(KeyError, match="scripted failure in rollout") as first:
        engine.sample_batch(1, 1)
    with pytest.raises(KeyError) as second:
        engine.check_health()
    assert first.value is second.value  # decoded once, the same object every time
    with pytest.raises(KeyError):
        engine.request_refill()
    with pytest.raises(KeyError):
        engine.stop()  # the first stop reports the failure...
    engine.stop()  # ...then is a no-op
    assert engine.state is OnlineDataEngineState.FAILED


def test_raising_the_failure_again_and_again_does_not_grow_its_traceback():
    """The same object is raised by every call: each raise added its frames (and their locals) to the last
    one's, so a retry loop leaked memory and printed tracebacks thousands of frames long."""

    def depth(error: BaseException) -> int:
        count, tb = 0, error.__traceback__
        while tb is not None:
            count, tb = count + 1, tb.tb_next
        return count

    engine = _started(ScriptedSpec(fault="raise", fault_after=2), refill_policy="manual")
    engine.request_refill()
    _wait_failed(engine)
    depths = []
    for _ in range(50):
        with pytest.raises(KeyError) as caught:
            engine.sample_batch(1, 1)
        depths.append(depth(caught.value))
    assert len(set(depths)) == 1 and depths[0] < 10, depths
    with pytest.raises(KeyError):
        engine.stop()


def test_error_during_start_is_raised_by_start():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="raise")))
    with pytest.raises(KeyError, match="scripted failure"):
        engine.start()
    assert engine.state is OnlineDataEngineState.FAILED


def test_source_build_failure_is_raised_by_start():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="build_raise")))
    with pytest.raises(ValueError, match="source could not be built"):
        engine.start()


@pytest.mark.parametrize(
    ("fault", "fragment"),
    [
        ("unpicklable", "Worker raised tests.support.sources.UnpicklableError: cannot travel as a pickle"),
        ("oddinit", "Worker raised tests.support.sources.OddInitError: 7: odd constructor"),
    ],
    ids=["unpicklable", "cannot-rebuild"],
)
def test_exception_that_cannot_be_rebuilt_becomes_worker_error(fault, fragment):
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault=fault)))
    with pytest.raises(OnlineDataWorkerError, match=fragment):
        engine.start()


@pytest.mark.parametrize(
    ("fault", "status"),
    [
        ("sigkill", "exit code -9, signal SIGKILL"),
        ("segfault", "exit code -11, signal SIGSEGV"),
        ("exit", "exit code 3"),
    ],
    ids=["sigkill", "segfault", "os-exit"],
)
def test_hard_death_is_detected_without_sampling(fault, status):
    engine = _started(ScriptedSpec(fault=fault, fault_after=2), refill_policy="manual")
    engine.request_refill()
    _wait_failed(engine)
    with pytest.raises(RuntimeError, match=rf"simulation worker exited unexpectedly \({status}\)"):
        engine.check_health()
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        engine.stop()


def test_a_silent_death_ends_a_long_wait_for_generation():
    engine = _started(ScriptedSpec(fault="sigkill", fault_after=2), refill_policy="manual")
    with pytest.raises(RuntimeError, match=r"exited unexpectedly \(exit code -9, signal SIGKILL\)"):
        engine.wait_for_generation(engine.request_refill(), timeout=600)
    assert engine.state is OnlineDataEngineState.FAILED
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        engine.stop()


def test_a_producer_sys_exit_is_raised_as_a_worker_error_naming_it(capfd):
    engine = _started(ScriptedSpec(fault="sys_exit", fault_after=2), refill_policy="manual")
    engine.request_refill()
    _wait_failed(engine)
    with pytest.raises(OnlineDataWorkerError) as raised:
        engine.sample_batch(1, 1)
    assert (
        str(raised.value)
        == "Worker producer-0 raised SystemExit: the simulator gave up (it ended that process)"
    )
    assert (
        isinstance(raised.value.__cause__, SystemExit)
        and raised.value.__cause__.code == "the simulator gave up"
    )
    with pytest.raises(OnlineDataWorkerError, match="raised SystemExit"):
        engine.stop()
    # the message reaches the trainer inside the error; the producer itself printed nothing
    assert "the simulator gave up" not in capfd.readouterr().err


def test_a_rollout_that_returns_none_unasked_fails_with_the_reason():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="none", fault_after=1), refill_policy="manual"))
    with pytest.raises(
        ValueError,
        match=r"EpisodeSource.rollout returned None for rollout 2 although should_stop\(\) is False: None "
        r"means 'interrupted by should_stop'",
    ):
        engine.start()  # the first generation's second window; before, the producer exited 0, unexplained
    assert engine.state is OnlineDataEngineState.FAILED


def test_a_failing_cleanup_publishes_its_error_before_the_state_says_failed(monkeypatch):
    """A consumer reads the state, then the channel: FAILED must always find the error that explains it."""
    engine = _started(ScriptedSpec(), refill_policy="manual")
    seen = []
    set_state = engine._set_state

    def record(state):
        if state is OnlineDataEngineState.FAILED:
            seen.append(engine._shared.channel.error())
        set_state(state)

    shutdown = engine._shutdown_workers

    def failing_shutdown():
        shutdown()  # the workers are really stopped; then the cleanup reports a failure
        raise OSError("cleanup failed")

    monkeypatch.setattr(engine, "_set_state", record)
    monkeypatch.setattr(engine, "_shutdown_workers", failing_shutdown)
    with pytest.raises(OSError, match="cleanup failed"):
        engine.stop()
    assert len(seen) == 1 and isinstance(seen[0], OSError)
    assert engine.state is OnlineDataEngineState.FAILED


def test_bad_episode_report_fails_with_the_row_and_publishes_nothing():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="bad_report", max_episode_steps=20)))
    with pytest.raises(ValueError, match=r"Episode.length of row 1 must be an int in \[0, 20\], got 21"):
        engine.start()
    assert int(engine._shared.index.stable_rows()[:2].sum()) == 0 or engine.get_stats()["valid_frames"] == 0


def test_exhausted_attempts_fail_the_engine():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fail_attempts=5), max_generation_attempts=2))
    with pytest.raises(RuntimeError, match=r"Failed to generate rollout 1 after 2 attempts\."):
        engine.start()
    assert engine.get_stats()["failed_episodes"] == 4


def test_error_in_source_close_makes_stop_raise_it():
    engine = _started(ScriptedSpec(close_fault="raise"))
    with pytest.raises(OSError, match="flush failed while closing the source"):
        engine.stop()
    assert engine.state is OnlineDataEngineState.FAILED


def test_hanging_close_is_forced_and_reported_as_durability_failure():
    engine = _started(ScriptedSpec(close_fault="hang"), shutdown_timeout=0.5)
    with pytest.raises(OnlineDataWorkerError, match=r"required terminate\(\)/kill\(\); graceful close"):
        engine.stop()
    assert engine.state is OnlineDataEngineState.FAILED
    engine.stop()


def test_context_manager_keeps_the_body_exception_primary():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(close_fault="raise")))
    with pytest.raises(ZeroDivisionError) as info, engine:
        1 / 0  # noqa: B018
    notes = getattr(info.value, "__notes__", [])
    assert any("OnlineDataEngine cleanup also failed: OSError: flush failed" in n for n in notes)


def test_owner_only_operations_refuse_consumers(tmp_path):

    with OnlineDataEngine(make_cfg()) as engine:
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_try_owner_calls, args=(engine, queue))
        child.start()
        messages = queue.get(timeout=30)
        child.join(30)
        assert child.exitcode == 0
        for op in ("stop", "request_refill", "drain_lifecycle_events", "start"):
            assert f"OnlineDataEngine.{op}() may only be called by owner process" in messages[op]
        assert engine.state is OnlineDataEngineState.READY


def _try_owner_calls(engine, queue) -> None:
    messages = {}
    for op in ("stop", "request_refill", "drain_lifecycle_events", "start"):
        try:
            getattr(engine, op)()
            messages[op] = "no error"
        except RuntimeError as error:
            messages[op] = str(error)
    queue.put(messages)


_FAILING_SCRIPT = """
import traceback

from simstream import OnlineDataEngine
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec

if __name__ == "__main__":
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="raise")))
    try:
        try:
            raise ValueError("the trainer's own bug")
        finally:
            engine.start()  # the producer's failure interrupts the handling of the trainer's bug
    except KeyError as error:
        assert isinstance(error.__context__, ValueError), error.__context__
        print("CAUGHT", "".join(traceback.format_exception(error)), flush=True)
"""


def test_a_producer_failure_is_printed_once_by_the_owner_with_the_producers_traceback(tmp_path):
    """The producer prints nothing (a terminal showed every worker's traceback before the CLI's message);
    the exception the owner raises carries the producer's traceback as a note, under its own, and the
    trainer's own exception that it interrupted is still shown (a cause would have hidden it)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "failing.py"
    script.write_text(_FAILING_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Process producer" not in result.stderr, result.stderr
    printed = result.stdout.split("CAUGHT", 1)[1]
    own, _, raised = printed.partition("During handling of the above exception, another exception occurred")
    assert "ValueError: the trainer's own bug" in own
    message, _, note = raised.partition("KeyError: 'scripted failure in rollout'\n")
    assert "in engine.start()" in message or "engine.start()" in message
    assert note.startswith("Traceback in producer-0:\nTraceback (most recent call last):"), note
    assert 'in _fault\n    raise KeyError("scripted failure in rollout")' in note


class _Recorder:
    """What ``stop_then_close`` closes after the stop (a recorder): counts its closes, or fails one."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.closed = error, 0

    def close(self) -> None:
        self.closed += 1
        if self.error is not None:
            raise self.error


def test_a_run_ended_by_a_signal_stays_interrupted_when_its_producers_died_of_it_too():
    """``simstream record`` and the demo stopped their engine in a finally: a SIGTERM to the whole
    process group also killed the producers, the stop's RuntimeError replaced the interruption, and the
    command exited 1 ("worker exited unexpectedly") instead of 143."""
    from simstream.engine.lifecycle import stop_then_close

    engine = _started(ScriptedSpec(fault="sigkill", fault_after=2), refill_policy="manual")
    engine.request_refill()
    _wait_failed(engine)
    recorder, interruption = _Recorder(), KeyboardInterrupt()
    stop_then_close(engine, recorder, interruption)  # returns: the caller's raise goes on
    assert recorder.closed == 1 and engine.state is OnlineDataEngineState.FAILED
    [note] = interruption.__notes__
    assert note.startswith("Stopping after it also failed: RuntimeError: ") and "exited unexpectedly" in note

    engine = _started(ScriptedSpec(fault="sigkill", fault_after=2), refill_policy="manual")
    engine.request_refill()
    _wait_failed(engine)
    recorder = _Recorder(OSError(28, "No space left on device"))
    with pytest.raises(RuntimeError, match="exited unexpectedly") as caught:  # no interruption: raised
        stop_then_close(engine, recorder, None)
    assert recorder.closed == 1
    assert caught.value.__notes__[-1] == "Stopping also failed: OSError: [Errno 28] No space left on device"


def test_a_ctrl_c_while_a_failed_run_stops_is_raised_after_both_steps():
    from simstream.engine.lifecycle import stop_then_close

    engine = _started(ScriptedSpec(), refill_policy="manual")
    recorder, failure = _Recorder(KeyboardInterrupt()), ValueError("the run's own failure")
    with pytest.raises(KeyboardInterrupt):
        stop_then_close(engine, recorder, failure)
    assert engine.state is OnlineDataEngineState.STOPPED and recorder.closed == 1
    stop_then_close(engine, None, None)  # stopped already: nothing to do, nothing raised
