"""A worker that dies before its own code runs, and starting workers from a child that is still being
prepared: the supervisor explains the first, engines and runners refuse the second."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from simstream import OnlineDataEngine, OnlineDataEngineState, OnlineDataWorkerError
from simstream.workers.channel import ErrorChannel
from simstream.workers.supervisor import (
    WorkerSpec,
    WorkerSupervisor,
    bootstrap_note,
    preparing_worker_process,
)
from tests.rl.collectors import ToyRunner
from tests.support.engines import make_cfg

pytestmark = pytest.mark.timeout(90)

_BOUND_S = 30.0
_GUARD = '`if __name__ == "__main__":`'


def _refuse_to_be_rebuilt() -> None:
    raise RuntimeError("this argument cannot be rebuilt in the child")


class _FailsToUnpickle:
    """A process argument whose unpickling raises: the child dies while Python prepares it."""

    def __reduce__(self):
        return (_refuse_to_be_rebuilt, ())


@pytest.mark.parametrize(
    ("method", "exitcode", "expected"),
    [
        (
            "spawn",
            1,
            ["Python failed while preparing the new process", "Under the 'spawn' start method", _GUARD],
        ),
        ("forkserver", 1, ["Under the 'forkserver' start method", _GUARD]),
        ("fork", 1, ["Python failed while preparing the new process"]),
        ("spawn", -9, []),  # a signal names itself
        ("spawn", None, []),
    ],
)
def test_bootstrap_note_names_the_guard_where_the_main_module_is_imported_again(method, exitcode, expected):
    note = bootstrap_note(method, exitcode)
    assert all(fragment in note for fragment in expected), note
    assert (note == "") == (not expected)
    if method == "fork":
        assert _GUARD not in note  # fork does not import the main module again


def _supervisor(ctx) -> tuple[WorkerSupervisor, ErrorChannel]:
    channel = ErrorChannel(ctx)
    supervisor = WorkerSupervisor(
        ctx, channel, is_closing=lambda: False, died_message=lambda label, code: f"{label} died ({code})."
    )
    return supervisor, channel


def test_a_worker_that_dies_before_its_entry_gets_the_diagnosis_and_one_that_ran_does_not():
    ctx = mp.get_context("spawn")
    supervisor, channel = _supervisor(ctx)
    supervisor.start([WorkerSpec(label="unbuildable", target="builtins:len", args=(_FailsToUnpickle(),))])
    try:
        assert channel.wait_published(_BOUND_S), "the death was not published"
        message = str(channel.error())
        assert message.startswith("unbuildable died (1). It exited before any of its own code ran"), message
        assert "Under the 'spawn' start method" in message and _GUARD in message
    finally:
        assert not supervisor.shutdown(_BOUND_S).still_alive

    supervisor, channel = _supervisor(ctx)
    supervisor.start([WorkerSpec(label="ran", target="sys:exit", args=(3,))])
    try:
        assert channel.wait_published(_BOUND_S)
        error = channel.error()  # its own code ran and reported why it ended
        assert isinstance(error, OnlineDataWorkerError) and isinstance(error.__cause__, SystemExit)
        assert str(error) == "Worker ran raised SystemExit: 3 (it ended that process)"
        # its exit status through the supervisor, which joins under the lock its monitor thread takes
        report = supervisor.shutdown(_BOUND_S)
        assert report.exitcodes == {"ran": 3} and not report.forced
        assert supervisor.exit_note("ran", 3) == ""  # so there is nothing to add about preparing it
    finally:
        assert not supervisor.shutdown(_BOUND_S).still_alive


@pytest.fixture
def preparing():
    """This process looks like a child that Python is still preparing (the flag multiprocessing sets)."""
    process = mp.process.current_process()
    process._inheriting = True
    try:
        assert preparing_worker_process()
        yield
    finally:
        del process._inheriting
    assert not preparing_worker_process()


def test_an_engine_started_while_its_process_is_being_prepared_refuses_before_starting_anything(preparing):
    engine = OnlineDataEngine(make_cfg())
    try:
        with pytest.raises(RuntimeError, match=r"start\(\) was called while Python was preparing a worker"):
            engine.start()
        assert engine.state is OnlineDataEngineState.CREATED
        assert engine._supervisor is None
    finally:
        engine.stop()


def test_a_runner_started_while_its_process_is_being_prepared_refuses_before_spawning(preparing):
    runner = ToyRunner()
    try:
        with pytest.raises(RuntimeError, match="ToyRunner started its collector while Python was preparing"):
            runner.learn(1)
        assert runner.collector_pid is None
    finally:
        runner.close()
