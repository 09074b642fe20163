"""``WorkerSupervisor``: exits seen by ``dead_workers`` and the ``on_exit`` hook, per start method."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from simstream.workers.channel import ErrorChannel
from simstream.workers.supervisor import WorkerSpec, WorkerSupervisor

pytestmark = pytest.mark.timeout(120)

_EXIT = "tests.support.workers:exit_when_told"
_WAIT = "tests.support.workers:wait_for"


def _tell_when_waited(supervisor: WorkerSupervisor) -> threading.Event:
    """An event set once something (a shutdown) starts to wait for a worker of ``supervisor`` to exit."""
    waiting, wait_exited = threading.Event(), supervisor.wait_exited

    def wait_and_tell(label, timeout_s):
        waiting.set()
        return wait_exited(label, timeout_s)

    supervisor.wait_exited = wait_and_tell
    return waiting


def _supervisor(ctx, channel, on_exit) -> WorkerSupervisor:
    return WorkerSupervisor(
        ctx,
        channel,
        is_closing=lambda: False,
        died_message=lambda label, code: f"{label} died with exit code {code}",
        on_exit=on_exit,
    )


@pytest.mark.parametrize("method", mp.get_all_start_methods())
def test_a_silent_death_is_published_before_the_hook_and_stays_visible(method):
    ctx = mp.get_context(method)
    channel, go, stop = ErrorChannel(ctx), ctx.Event(), ctx.Event()
    called, records = threading.Event(), []

    def on_exit() -> None:
        records.append(channel.read())
        called.set()

    supervisor = _supervisor(ctx, channel, on_exit)
    supervisor.start([WorkerSpec("dies", _EXIT, (go, 3)), WorkerSpec("lives", _WAIT, (stop,))])
    try:
        assert supervisor.dead_workers() == []
        go.set()
        assert called.wait(60.0), "the monitor never called on_exit"
        assert records[0] is not None and records[0].worker == "dies"
        assert "dies died with exit code 3" in str(channel.error())
        # the exit status was read by the monitor; the sentinel still reports the death
        assert supervisor.dead_workers() == [("dies", 3)]
        assert supervisor.dead_workers() == [("dies", 3)]
    finally:
        stop.set()
        report = supervisor.shutdown(30.0)
    assert report.exitcodes == {"dies": 3, "lives": 0}
    assert not report.forced
    assert supervisor.dead_workers() == []


def test_a_failing_hook_does_not_stop_the_monitor():
    ctx = mp.get_context("fork")
    channel, first, second = ErrorChannel(ctx), ctx.Event(), ctx.Event()
    calls = []
    both = threading.Event()

    def on_exit() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            both.set()
        raise RuntimeError("hook failed")

    supervisor = _supervisor(ctx, channel, on_exit)
    supervisor.start([WorkerSpec("first", _EXIT, (first, 4)), WorkerSpec("second", _EXIT, (second, 5))])
    try:
        first.set()
        second.set()
        assert both.wait(60.0), f"on_exit was called {len(calls)} time(s), expected 2"
        assert sorted(supervisor.dead_workers()) == [("first", 4), ("second", 5)]
        assert channel.read().worker in ("first", "second")  # first failure wins
    finally:
        first.set()
        second.set()
        supervisor.shutdown(30.0)


def test_a_monitor_that_does_not_stop_keeps_the_processes_open_until_it_does():
    ctx = mp.get_context("fork")
    channel, stop = ErrorChannel(ctx), ctx.Event()
    in_hook, release = threading.Event(), threading.Event()

    def on_exit() -> None:  # holds the monitor thread, as a stuck hook would
        in_hook.set()
        release.wait(60.0)

    supervisor = _supervisor(ctx, channel, on_exit)
    supervisor.start([WorkerSpec("worker", _WAIT, (stop,))])
    try:
        stop.set()
        assert in_hook.wait(60.0), "the monitor never saw the exit"
        report = supervisor.shutdown(30.0)
        assert not report.monitor_stopped and report.still_alive == []
        assert report.exitcodes == {"worker": 0}
        assert list(supervisor.processes) == ["worker"]  # not closed: the monitor may still read them
    finally:
        release.set()
    report = supervisor.shutdown(30.0)
    assert report.monitor_stopped and supervisor.processes == {}


@pytest.mark.parametrize("method", mp.get_all_start_methods())
def test_exit_statuses_stay_readable_while_a_shutdown_waits_for_its_workers(method):
    """``get_stats()`` and the sampling liveness check call ``dead_workers()`` while ``stop()`` waits for
    slow workers: they must get an answer, not wait out the whole shutdown."""
    ctx = mp.get_context(method)
    channel, stop = ErrorChannel(ctx), ctx.Event()
    supervisor = _supervisor(ctx, channel, None)
    supervisor.start([WorkerSpec("slow", _WAIT, (stop,))])
    joining = _tell_when_waited(supervisor)
    reports = []
    shutdown = threading.Thread(target=lambda: reports.append(supervisor.shutdown(60.0)))
    shutdown.start()
    try:
        assert joining.wait(30.0), "shutdown() never began to wait for the worker"
        answers = []
        reader = threading.Thread(target=lambda: answers.append(supervisor.dead_workers()))
        reader.start()
        reader.join(20.0)
        assert not reader.is_alive(), "dead_workers() waited for the shutdown"
        assert answers == [[]] and shutdown.is_alive()
    finally:
        stop.set()
        shutdown.join(60.0)
    assert reports[0].exitcodes == {"slow": 0} and not reports[0].forced


def test_two_shutdowns_at_once_run_one_after_the_other():
    """A stop() racing a failed start's cleanup: the second shutdown waits for the first, then finds the
    workers gone (interleaved, one closed the processes the other still joined)."""
    ctx = mp.get_context("fork")
    channel, stop = ErrorChannel(ctx), ctx.Event()
    supervisor = _supervisor(ctx, channel, None)
    supervisor.start([WorkerSpec("slow", _WAIT, (stop,))])
    joining = _tell_when_waited(supervisor)
    reports, errors = [], []

    def shutdown() -> None:
        try:
            reports.append(supervisor.shutdown(60.0))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=shutdown) for _ in range(2)]
    threads[0].start()
    try:
        assert joining.wait(30.0), "the first shutdown never began to wait for the worker"
        threads[1].start()
    finally:
        stop.set()
        for thread in threads:
            thread.join(90.0)
    assert not any(thread.is_alive() for thread in threads) and errors == []
    assert reports[0].exitcodes == {"slow": 0} and reports[1].exitcodes == {}
    assert supervisor.processes == {}


def test_a_ctrl_c_between_two_closes_of_a_shutdown_leaves_a_later_shutdown_clean():
    """The shutdown closed the workers one by one, then forgot them: interrupted in between, it left closed
    processes registered, and the next shutdown (the stop() after the Ctrl-C) failed joining them."""
    ctx = mp.get_context("fork")
    channel, stop = ErrorChannel(ctx), ctx.Event()
    supervisor = _supervisor(ctx, channel, None)
    supervisor.start([WorkerSpec(f"w{i}", _WAIT, (stop,)) for i in range(2)])
    second = supervisor.processes["w1"]
    close = second.close

    def interrupted_close() -> None:
        close()
        raise KeyboardInterrupt

    second.close = interrupted_close
    stop.set()
    with pytest.raises(KeyboardInterrupt):
        supervisor.shutdown(60.0)
    report = supervisor.shutdown(60.0)
    assert report.exitcodes == {} and report.still_alive == [] and supervisor.processes == {}


def test_a_ctrl_c_while_a_spawn_worker_is_prepared_is_ignored_as_in_its_body():
    """The owner decides on Ctrl-C; a worker's first act ignores it. Before that act, a ``spawn`` worker
    unpickles its arguments and re-imports the main module for seconds: a Ctrl-C then killed it with a
    ``KeyboardInterrupt`` traceback on the terminal. Workers now start with SIGINT blocked."""
    from tests.support.workers import InterruptsItsUnpickling

    ctx = mp.get_context("spawn")
    channel, ran = ErrorChannel(ctx), ctx.Event()
    supervisor = _supervisor(ctx, channel, None)
    spec = WorkerSpec(
        "interrupted", "tests.support.workers:expect_unpickled", (InterruptsItsUnpickling(), ran)
    )
    supervisor.start([spec])
    try:
        assert ran.wait(60.0), f"the worker did not run its body: {channel.error()!r}"
        # the monitor's report of the exit, before the shutdown stops the monitor
        assert channel.wait_published(60.0)
    finally:
        report = supervisor.shutdown(30.0)
    assert report.exitcodes == {"interrupted": 0}
    # its return, unasked for, is all the monitor saw: no KeyboardInterrupt
    assert str(channel.error()) == "interrupted died with exit code 0"


def test_a_forkserver_exit_status_read_by_many_threads_at_once_is_the_same_for_each():
    """A forkserver worker's status arrives once, over a pipe. Python's reader is not thread-safe: two
    threads joining the process raced for it, and the loser read 255 (a test that joined while the monitor
    thread read failed one run in four; every ``Process.start()`` in the owner reads it too). Readers now
    take turns, whether they join the process, call ``wait_exited`` or are the monitor."""
    import signal

    ctx = mp.get_context("forkserver")
    channel, started = ErrorChannel(ctx), ctx.RawValue("i", 0)
    supervisor = _supervisor(ctx, channel, None)
    supervisor.start([WorkerSpec("dies", "tests.support.workers:start_a_child_and_die", (started,), True)])
    process, codes = supervisor.processes["dies"], []

    def join_it() -> None:
        process.join(60.0)
        codes.append(process.exitcode)

    readers = [threading.Thread(target=join_it) for _ in range(4)]
    readers += [
        threading.Thread(target=lambda: codes.append(supervisor.wait_exited("dies", 60.0))) for _ in range(4)
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(90.0)
    assert channel.wait_published(60.0)
    report = supervisor.shutdown(5.0)  # kills the child the worker left in its group
    assert codes == [-signal.SIGKILL] * 8
    assert report.exitcodes == {"dies": -signal.SIGKILL}
    assert str(channel.error()) == "dies died with exit code -9"


@pytest.mark.parametrize("own_process_group", [True, False])
def test_what_a_group_leading_worker_left_running_is_killed_at_shutdown(own_process_group):
    """A worker with ``own_process_group`` leads a group; the processes it started stay in it, and once
    the worker has died the shutdown kills them. Without it they are left alone (the owner's group)."""
    import os
    import signal

    ctx = mp.get_context("forkserver")
    channel, started = ErrorChannel(ctx), ctx.RawValue("i", 0)
    supervisor = _supervisor(ctx, channel, None)
    spec = WorkerSpec("leader", "tests.support.workers:start_a_child_and_die", (started,), own_process_group)
    supervisor.start([spec])
    leader = supervisor.processes["leader"].pid
    # not the process's own join(): that raced the monitor thread for the one forkserver status (255)
    assert supervisor.wait_exited("leader", 60.0) == -signal.SIGKILL
    child = started.value
    assert child > 0
    try:
        assert os.getpgid(child) == (leader if own_process_group else os.getpgid(0))
        report = supervisor.shutdown(5.0)
        assert report.exitcodes == {"leader": -signal.SIGKILL}
        if own_process_group:
            assert _gone_within(child, 20.0)
        else:
            assert not _gone_within(child, 0.0)  # the owner's to stop (here: the finally below)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _gone_within(pid: int, bound_s: float) -> bool:
    """Whether ``pid`` ended (or is a zombie) within ``bound_s``; polls /proc in 10-ms steps."""
    import time

    deadline = time.monotonic() + bound_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rsplit(") ", 1)[1][0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        threading.Event().wait(0.01)


def test_workers_that_outlive_a_killed_fork_server_are_killed_at_shutdown():
    """A forkserver worker's exit status comes from the fork server: with the server killed, a live worker
    read as exited with code 255, and the shutdown left it running."""
    import os
    import signal
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    channel, stop = ErrorChannel(ctx), ctx.Event()
    supervisor = _supervisor(ctx, channel, None)
    supervisor.start([WorkerSpec("lives", _WAIT, (stop,))])
    worker = supervisor.processes["lives"].pid
    try:
        os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)  # a new one starts on next use
        report = supervisor.shutdown(0.5)
        assert report.exitcodes == {"lives": 255} and report.forced and report.still_alive == []
        assert _gone_within(worker, 20.0)
    finally:  # not stop.set(): an Event's set() waits for a killed sleeper to confirm its wake-up, forever
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("method", mp.get_all_start_methods())
def test_a_death_is_seen_while_a_child_the_worker_forked_holds_its_sentinel(method):
    """A fork/spawn worker's sentinel is a pipe it holds, and a child it forks keeps it open: the worker's
    death was seen only once that child ended (here: never, until the test killed it)."""
    import os
    import signal

    ctx = mp.get_context(method)
    channel, started = ErrorChannel(ctx), ctx.RawValue("i", 0)
    supervisor = _supervisor(ctx, channel, None)
    supervisor.start([WorkerSpec("forks", "tests.support.workers:fork_a_child_and_exit", (started, 3), True)])
    try:
        assert channel.wait_published(20.0)
        assert str(channel.error()) == "forks died with exit code 3"
        assert supervisor.dead_workers() == [("forks", 3)]
        assert started.value > 0 and not _gone_within(started.value, 0.0)  # the child still holds it
        report = supervisor.shutdown(5.0)  # kills what is left of the worker's group: the child
        assert report.exitcodes == {"forks": 3} and not report.forced
        assert _gone_within(started.value, 20.0)
        assert supervisor.wait_exited("forks", 0.0) == 3  # after the shutdown: the code it recorded
    finally:
        if started.value:
            try:
                os.kill(started.value, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("method", mp.get_all_start_methods())
def test_an_exit_status_read_again_inside_its_own_read_returns_instead_of_waiting_for_itself(
    method, monkeypatch
):
    """A signal handler or a finalizer (an engine's __del__ stopping it) that ran in the middle of a read
    and read the same status again waited for the read's lock, held by its own thread, forever."""
    from multiprocessing import popen_fork, popen_forkserver

    inner, asking = [], threading.Event()
    for popen_class in (popen_fork.Popen, popen_forkserver.Popen):  # spawn's reads are fork's

        def read_and_ask_again(self, flag=0, read=popen_class.poll):
            if asking.is_set():
                asking.clear()
                inner.append(self.poll())  # what a handler running here does: the outer read is under way
            return read(self, flag)

        monkeypatch.setattr(popen_class, "poll", read_and_ask_again)
    ctx = mp.get_context(method)
    channel, go = ErrorChannel(ctx), ctx.Event()
    supervisor = _supervisor(ctx, channel, None)
    supervisor.start([WorkerSpec("w", _EXIT, (go, 5))])
    try:
        popen = supervisor.processes["w"]._popen
        asking.set()
        assert popen.poll() is None and inner == [None]
        go.set()
        assert supervisor.wait_exited("w", 20.0) == 5
    finally:
        go.set()
        supervisor.shutdown(5.0)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_status_reaped_by_one_thread_is_seen_by_another_that_asked_at_the_same_time(method, monkeypatch):
    """Two threads reaping one fork/spawn worker with waitpid(): the loser got ECHILD and read the exited
    worker as alive (the monitor then published a clean exit during close as a death, code unknown)."""
    from multiprocessing import popen_fork
    from multiprocessing.connection import wait

    from simstream.workers.supervisor import _read_exit_status_once

    real_waitpid, codes, threads = os.waitpid, {}, []
    other_done = threading.Event()

    def reap_while_another_asks(pid, options):
        if pid == process.pid and not threads:  # the first reader, past its "no code yet" check
            threads.append(
                threading.Thread(target=lambda: (codes.update(other=process._popen.poll()), other_done.set()))
            )
            threads[0].start()
            other_done.wait(0.5)  # it reaped first when nothing made the reads take turns
        return real_waitpid(pid, options)

    ctx = mp.get_context(method)
    process = ctx.Process(target=os._exit, args=(4,))
    process.start()
    monkeypatch.setattr(popen_fork.os, "waitpid", reap_while_another_asks)
    _read_exit_status_once(process)  # what the supervisor does to every worker it starts
    try:
        assert wait([process.sentinel], 20.0)
        codes["first"] = process.exitcode
        threads[0].join(20.0)  # it waited for the first read
        assert codes == {"first": 4, "other": 4}
    finally:
        process.join(20.0)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_join_of_a_worker_reaped_elsewhere_returns_in_its_bound(method):
    """Someone else took the status (os.wait(), SIGCHLD ignored): the blocking read looped forever at
    full CPU, since the sentinel reads as ended and waitpid() has nothing to give any more."""
    from multiprocessing.connection import wait

    from simstream.workers.supervisor import _read_exit_status_once

    process = mp.get_context(method).Process(target=os._exit, args=(3,))
    process.start()
    _read_exit_status_once(process)
    assert wait([process.sentinel], 20.0)
    os.waitpid(process.pid, 0)  # a stray reaper
    joiner = threading.Thread(target=process.join, args=(1.0,))
    joiner.start()
    joiner.join(10.0)
    try:
        assert not joiner.is_alive() and process.exitcode is None  # CPython's answer: the status is gone
    finally:  # a child without a status stays among multiprocessing's children for good
        mp.process._children.discard(process)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_supervisor_stopped_inside_a_read_made_outside_its_status_lock_does_not_deadlock(
    method, monkeypatch
):
    """A finalizer or signal handler stopping the supervisor in the middle of a read made outside its status
    lock (another Process.start(), active_children(), is_alive()): the read held its own lock and waited for
    the status lock, which the monitor held while it waited for the read's lock."""
    from multiprocessing import popen_fork

    real_read, stopped, asking = popen_fork.Popen.poll, [], threading.Event()

    def read_then_stop(self, flag=os.WNOHANG):
        if asking.is_set() and threading.current_thread().name == "reader":
            asking.clear()
            go.set()  # the worker exits; the monitor sees it and wants to read its status
            channel.wait_published(1.0)  # it cannot: this read holds the status
            stopped.append(supervisor.shutdown(0.2, terminate_join_s=0.2))  # an engine's __del__ would
        return real_read(self, flag)

    monkeypatch.setattr(popen_fork.Popen, "poll", read_then_stop)  # before start: the wrapper reads with it
    ctx = mp.get_context(method)
    channel, go = ErrorChannel(ctx), ctx.Event()
    supervisor = _supervisor(ctx, channel, None)
    supervisor.start([WorkerSpec("w", _EXIT, (go, 3))])
    process = supervisor.processes["w"]
    asking.set()
    reader = threading.Thread(target=process.is_alive, name="reader")
    reader.start()
    reader.join(60.0)
    try:
        assert not reader.is_alive() and len(stopped) == 1
        assert stopped[0].still_alive == ["w"]  # its status was being read: not known inside that read
        assert not process.is_alive() and process.exitcode == 3  # the read went on once the stop returned
    finally:
        go.set()
        report = supervisor.shutdown(5.0)
    assert report.exitcodes == {"w": 3} and report.still_alive == []
