"""Start, watch and stop worker processes; shared by the data engine and the RL runner.

The supervisor owns the process handles of one group of workers and nothing else: it starts each worker
through :func:`worker_entry` (so every exception a worker raises, from unpickling its arguments to its last
line, is published on the :class:`~simstream.workers.channel.ErrorChannel`), runs a monitor thread that
turns a silent death (SIGKILL, segfault, ``os._exit``) into a published record within milliseconds (then
calls the owner's ``on_exit`` hook, so a waiting owner wakes at once), keeps an optional heartbeat per
worker for hang detection, and stops the group with a bounded escalation: graceful join, then
``terminate()``, then ``kill()``.

A worker that dies before :func:`worker_entry` runs cannot publish anything: under ``spawn`` and
``forkserver`` that is Python failing to prepare the child (it imports the main module again, so a script
that starts workers at import time fails there). Each worker marks a shared flag as its first act, and
:meth:`WorkerSupervisor.exit_note` turns a missing flag into a diagnosis for the death's message.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_sentinels

from .channel import ErrorChannel

__all__ = [
    "EntryFlags",
    "Heartbeat",
    "ShutdownReport",
    "WorkerSpec",
    "WorkerSupervisor",
    "bootstrap_note",
    "ctrl_c_deferred",
    "exit_with_owner",
    "owner_watch",
    "preparing_worker_process",
    "refuse_in_preparing_child",
    "sigint_blocked",
    "sigint_handled",
    "worker_entry",
]

logger = logging.getLogger(__name__)
_MONITOR_STOP_S = 1.0
"""How long a shutdown waits for the monitor thread to stop."""
_JOIN_SLICE_S = 0.05
"""Longest single wait of a stop for a worker's exit, between two reads of its status (see
``WorkerSupervisor.wait_exited``)."""


def worker_entry(
    target: str,
    args: tuple,
    channel: ErrorChannel,
    label: str,
    heartbeat: Heartbeat | None,
    index: int,
    entered: EntryFlags | None = None,
    own_process_group: bool = False,
) -> None:
    """Top-level body of every worker process.

    ``target`` is ``"module:function"``, imported *inside* the guard, so an import error in the child is
    reported like any other failure. User objects that may fail to unpickle in the child should travel as
    pickled bytes in ``args`` and be loaded by the target. The process exits with code 1; its traceback
    travels with the published exception (every reader adds it as a note) and is
    printed here only when an earlier failure was published instead.
    """
    # Ctrl-C reaches the whole process group: the owner decides, and its stop() ends the workers cleanly.
    # The worker began with SIGINT blocked (see WorkerSupervisor.start); once ignored, a pending one is void.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if own_process_group:  # before it starts anything: all of that joins the group (WorkerSpec)
        os.setpgid(0, 0)
    if entered is not None:
        entered.mark(index)
    try:
        if heartbeat is not None:
            heartbeat.beat(index)
        module_name, _, function_name = target.partition(":")
        function = getattr(importlib.import_module(module_name), function_name)
        function(*args)
    except BaseException as error:
        channel.publish(error, label)
        if channel.holds(error):
            # its traceback (or a sys.exit's message) is printed by whoever raises it, not on the terminal of
            # every worker too; a sys.exit keeps its exit code
            code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1
            raise SystemExit(code) from None
        raise


def exit_with_owner(grace_s: float = 0.0, last_words: Callable[[], None] | None = None) -> None:
    """In a worker: a daemon thread that ends this process ``grace_s`` seconds after the process that
    started it has exited (running ``last_words`` first), whatever the main thread is doing then.

    For code that may be stuck where it never polls :func:`owner_watch` (a source inside a simulator
    call), or whose parent-pid check cannot see the owner (a ``forkserver`` worker's parent is the fork
    server). Does nothing in a process nobody started.
    """
    gone = _owner_exit_fd()
    if gone is None:
        return

    def watch() -> None:
        wait_for_sentinels([gone])
        if grace_s > 0:
            threading.Event().wait(grace_s)
        if last_words is not None:
            last_words()
        os._exit(1)

    threading.Thread(target=watch, name="simstream-owner-watch", daemon=True).start()


def owner_watch() -> Callable[[], bool]:
    """In a worker: a check that is true once the process that started this one has exited.

    Workers poll it as often as their stop event (sources poll before every control step), so it is one
    ``poll(2)`` on :func:`_owner_exit_fd`, registered once: ``parent_process().is_alive()`` builds a
    selector per call and costs ten times as much. Always false in a process nobody started.
    """
    gone = _owner_exit_fd()
    if gone is None:
        return lambda: False
    poller = select.poll()
    poller.register(gone, select.POLLIN)
    return lambda: bool(poller.poll(0))


_owner_exit: tuple[int, int] | None = None
"""``(pid, fd)``: :func:`_owner_exit_fd` of process ``pid`` (a forked child opens its own)."""


def _owner_exit_fd() -> int | None:
    """A descriptor that becomes readable once the process that started this one has exited (``None`` in
    a process nobody started): a pidfd of it.

    Not ``parent_process().sentinel``: that is a pipe whose write end the owner keeps, and every process
    the owner forks afterwards (a ``multiprocessing.Pool``, a fork-context helper) inherits a copy. While
    one of those lived, an owner's SIGKILL went unseen and the producers ran on. The sentinel serves
    where pidfds do not exist (Linux < 5.3).
    """
    global _owner_exit
    owner = mp.parent_process()
    if owner is None:
        return None
    if _owner_exit is not None and _owner_exit[0] == os.getpid():
        return _owner_exit[1]
    if not hasattr(os, "pidfd_open"):
        return owner.sentinel
    try:
        fd = os.pidfd_open(owner.pid)
    except ProcessLookupError:
        fd = None
    except OSError:
        return owner.sentinel
    gone = select.poll()  # not select(): a descriptor number past 1023 is out of its range
    gone.register(owner.sentinel, select.POLLIN)
    if fd is not None and gone.poll(0):  # gone before the pidfd, its pid maybe reused
        os.close(fd)
        fd = None
    if fd is None:  # gone already: a pipe whose write end is closed reads as EOF for ever
        fd, write = os.pipe()
        os.close(write)
    _owner_exit = (os.getpid(), fd)
    return fd


class EntryFlags:
    """One shared byte per worker, set by :func:`worker_entry` before anything else: a worker whose flag
    is unset when it exits died while Python was still preparing the process."""

    def __init__(self, num_workers: int, ctx: mp.context.BaseContext) -> None:
        self._flags = ctx.Array("b", num_workers, lock=False)

    def mark(self, index: int) -> None:
        self._flags[index] = 1

    def entered(self, index: int) -> bool:
        return bool(self._flags[index])


def preparing_worker_process() -> bool:
    """True while Python prepares a ``spawn`` or ``forkserver`` child, that is, while it imports the main
    module again there: starting workers then is the mistake :func:`bootstrap_note` explains (the flag is
    the one multiprocessing itself checks before refusing to start a process)."""
    return bool(getattr(mp.process.current_process(), "_inheriting", False))


def refuse_in_preparing_child(action: str, remedy: str) -> None:
    """Raise ``RuntimeError`` when called while Python prepares a worker process (see
    :func:`preparing_worker_process`): starting workers there would start them again in every child.

    Args:
        action: What was attempted, as the message's subject (``"OnlineDataEngine.start() was called"``).
        remedy: What to put under the main guard (``"start the engine"``).
    """
    if preparing_worker_process():
        raise RuntimeError(
            f"{action} while Python was preparing a worker process, which imports the main module again: "
            f'{remedy} under `if __name__ == "__main__":`.'
        )


def bootstrap_note(start_method: str, exitcode: int | None) -> str:
    """Why a worker that never reached its own code exited, as a sentence to append to its death's message
    (empty where there is nothing to add: a signal names itself)."""
    if exitcode is None or exitcode <= 0:
        return ""
    note = " It exited before any of its own code ran: Python failed while preparing the new process."
    if start_method in ("spawn", "forkserver"):
        note += (
            f" Under the {start_method!r} start method each worker imports the main module again, so a "
            "script that starts workers when it is imported must do so under "
            "`if __name__ == \"__main__\":`. The worker's stderr shows Python's own error."
        )
    return note


class Heartbeat:
    """One shared monotonic timestamp per worker; a worker calls :meth:`beat` from its loop."""

    def __init__(self, num_workers: int, ctx: mp.context.BaseContext) -> None:
        self._stamps = ctx.Array("d", [time.monotonic()] * num_workers, lock=False)

    def beat(self, index: int) -> None:
        self._stamps[index] = time.monotonic()

    def age_s(self, index: int) -> float:
        """Seconds since worker ``index`` last beat (``CLOCK_MONOTONIC`` is system-wide on Linux)."""
        return time.monotonic() - self._stamps[index]

    def hold(self, index: int, seconds: float) -> None:
        """Count worker ``index`` as alive for the next ``seconds`` (a start-up grace before its first beat).

        The next :meth:`beat` ends the grace; hang detection then uses the normal timeout again.
        """
        self._stamps[index] = time.monotonic() + seconds

    def reset(self) -> None:
        now = time.monotonic()
        for i in range(len(self._stamps)):
            self._stamps[i] = now


@dataclass(frozen=True)
class WorkerSpec:
    """What to run in one worker: ``target(*args)`` where ``target`` is ``"module:function"``.

    ``args`` travel as process arguments, so shared-memory objects and multiprocessing primitives may be
    among them.
    """

    label: str
    target: str
    args: tuple = ()
    own_process_group: bool = False
    """The worker leads a process group of its own, which the processes it starts join (unless they move
    to another), and the supervisor SIGKILLs what is left of that group once the worker has exited: what
    the worker started and could not stop itself because it was killed (the Ray ingest's local cluster).
    The group gets no Ctrl-C from the terminal either; the owner stops the worker."""


@dataclass
class ShutdownReport:
    """How a group was stopped."""

    forced: bool = False
    """``terminate()`` or ``kill()`` was needed for at least one worker."""
    exitcodes: dict[str, int | None] = field(default_factory=dict)
    still_alive: list[str] = field(default_factory=list)
    monitor_stopped: bool = True
    """The monitor thread ended; if not, the processes stay open (the monitor may still read them)."""


class WorkerSupervisor:
    """Owns a group of worker processes, their monitor thread and their shutdown.

    Args:
        ctx: Multiprocessing context (``forkserver`` for the engine, ``spawn`` for the RL collector).
        channel: Where failures are published.
        is_closing: Returns ``True`` once the owner asked the workers to stop; a worker exiting then is
            not a failure (a non-zero exit code still is).
        died_message: Builds the message of the ``RuntimeError`` published for a silent death.
        heartbeat: Optional per-worker heartbeat the workers update.
        hang_timeout_s: With a heartbeat, a worker silent for this long is reported as hung.
        on_exit: Called in the monitor thread after a worker exited (its failure, if any, already
            published) or a hang was published: wakes an owner that sleeps on its own event. Exceptions
            it raises are logged, never propagated.
    """

    def __init__(
        self,
        ctx: mp.context.BaseContext,
        channel: ErrorChannel,
        *,
        is_closing: Callable[[], bool],
        died_message: Callable[[str, int | None], str],
        heartbeat: Heartbeat | None = None,
        hang_timeout_s: float | None = None,
        daemon: bool = False,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self._ctx = ctx
        self._channel = channel
        self._is_closing = is_closing
        self._died_message = died_message
        self._heartbeat = heartbeat
        self._hang_timeout_s = hang_timeout_s
        self._daemon = daemon
        self._on_exit = on_exit
        self._processes: dict[str, mp.process.BaseProcess] = {}
        self._indices: dict[str, int] = {}
        self._exit_signals: dict[str, int] = {}
        """label -> the descriptor that becomes readable when the worker has exited (see _exit_signal)."""
        self._final_exitcodes: dict[str, int | None] = {}
        """label -> exit code, of the workers a shutdown closed (for :meth:`wait_exited`)."""
        self._pidfds: dict[str, int] = {}
        """label -> a pidfd of the worker: its real liveness, whatever a dead fork server reported."""
        self._group_leaders: dict[str, int] = {}
        """label -> pid of the workers that lead a process group (``WorkerSpec.own_process_group``)."""
        self._entered: EntryFlags | None = None
        self._exits = select.poll()
        """Every worker's sentinel: one ``poll(2)`` tells whether any exited (see :meth:`dead_workers`)."""
        self._exit_read = threading.Event()
        """Set by whoever reads an exit status first: a forkserver sentinel may read as idle once it was."""
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()
        self._forcing = threading.Event()
        self._status_lock = threading.RLock()
        self._shutdown_lock = threading.Lock()
        """One shutdown at a time: two (a stop() racing a failed start's cleanup) would close the
        processes one of them still joins."""

    @property
    def processes(self) -> dict[str, mp.process.BaseProcess]:
        """The workers by label, until a shutdown closes them. Their exit statuses are read in turn by every
        thread (see :func:`_read_exit_status_once`); :meth:`wait_exited` and :meth:`dead_workers` read them
        without racing a shutdown that closes the processes (a closed one raises ``ValueError``)."""
        return dict(self._processes)

    def wait_exited(self, label: str, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for worker ``label`` to exit; its exit code, or ``None`` if it lives.

        Safe beside a shutdown: after one, the code it recorded.

        Raises:
            KeyError: no worker ``label`` was started.
        """
        deadline = time.monotonic() + timeout_s
        signalled = False
        while True:
            began = time.monotonic()
            with self._status_lock:  # a shutdown closes the processes under it
                process = self._processes.get(label)
                if process is None:
                    return self._final_exitcodes[label]
                code = process.exitcode  # a non-blocking waitpid
                if code is not None or began >= deadline:
                    return code
                # waited on outside the lock, through a copy a shutdown cannot close: joining under it,
                # this thread took it back at once after every slice, and dead_workers() (get_stats(), a
                # sampler's liveness check) waited for the whole stop
                exit_signal = os.dup(self._exit_signal(label, process))
            try:
                up = bool(
                    wait_for_sentinels([exit_signal], timeout=max(0.0, min(_JOIN_SLICE_S, deadline - began)))
                )
            finally:
                os.close(exit_signal)
            if up and signalled:
                # up twice, and no status between: reaped elsewhere (SIGCHLD ignored, ``os.wait()``); the
                # rest of the slice keeps this loop from spinning (once up, the status is read at once)
                _wait_out_slice(began, deadline)
            signalled = up

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Start every worker, then the monitor thread."""
        self._entered = entered = EntryFlags(len(specs), self._ctx)
        # a spawn start launches Python's resource tracker if it is not running, and its launch unblocks
        # SIGINT in this thread on its way out: launched now, it cannot undo the block below
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        for index, spec in enumerate(specs):
            process = self._ctx.Process(
                target=worker_entry,
                args=(
                    spec.target,
                    spec.args,
                    self._channel,
                    spec.label,
                    self._heartbeat,
                    index,
                    entered,
                    spec.own_process_group,
                ),
                name=spec.label,
                daemon=self._daemon,
            )
            # a child started but not registered would be left to itself; and a child begins with SIGINT
            # blocked: a Ctrl-C while spawn re-imports the main module (seconds) printed its traceback
            with ctrl_c_deferred(), sigint_blocked():
                process.start()  # registered only once started: shutdown() joins what it holds
                _read_exit_status_once(process, self._status_lock)
                self._processes[spec.label] = process
                self._indices[spec.label] = index
                if spec.own_process_group:
                    self._group_leaders[spec.label] = process.pid
                with contextlib.suppress(OSError):  # gone already, or no pidfds (Linux < 5.3)
                    self._pidfds[spec.label] = os.pidfd_open(process.pid)
                self._exit_signals[spec.label] = exit_signal = self._exit_signal(spec.label, process)
                self._exits.register(exit_signal, select.POLLIN)
        self._monitor = threading.Thread(
            target=_monitor_workers,
            args=(
                dict(self._processes),
                self._channel,
                self._monitor_stop,
                self._forcing,
                self._status_lock,
                self._is_closing,
                self.died_message,
                self._heartbeat,
                self._hang_timeout_s,
                self._on_exit,
                self._exit_read,
                dict(self._exit_signals),
            ),
            name="simstream-worker-monitor",
            daemon=True,
        )
        self._monitor.start()

    def _exit_signal(self, label: str, process: mp.process.BaseProcess) -> int:
        """What becomes readable when worker ``label`` has exited and its status can be read.

        A fork/spawn worker's sentinel is a pipe it holds: a child it forked (and did not close the pipe
        in) keeps it open after the worker died, which hid the death for as long as that child lived. Its
        pidfd tells instead (the status is then ``waitpid()``'s to take). A forkserver worker's sentinel
        is the fork server's status pipe, readable once the status is there: kept.
        """
        fd = self._pidfds.get(label)
        if fd is None or getattr(process._popen, "method", None) == "forkserver":
            return process.sentinel
        return fd

    def exit_note(self, label: str, exitcode: int | None) -> str:
        """A sentence to append to the message of ``label``'s death: why it died if it never reached
        :func:`worker_entry` (see :func:`bootstrap_note`), else empty."""
        index, entered = self._indices.get(label), self._entered
        if index is None or entered is None or entered.entered(index):
            return ""
        return bootstrap_note(self._ctx.get_start_method(), exitcode)

    def died_message(self, label: str, exitcode: int | None) -> str:
        """The owner's message for a silent death of ``label``, with :meth:`exit_note` appended."""
        return self._died_message(label, exitcode) + self.exit_note(label, exitcode)

    def dead_workers(self) -> list[tuple[str, int | None]]:
        """Workers that have exited, with their exit codes (non-blocking).

        Owners call this on every sample, so while every worker lives it costs one ``poll(2)`` on all
        sentinels, not one exit-status query per worker.
        """
        with self._status_lock:  # also serialises the poll object, which refuses concurrent polls
            if not self._exit_read.is_set() and not self._exits.poll(0):
                return []
            dead = [(label, p.exitcode) for label, p in self._processes.items() if p.exitcode is not None]
            if dead:
                self._exit_read.set()
            return dead

    def shutdown(self, timeout_s: float, *, terminate_join_s: float = 3.0) -> ShutdownReport:
        """Join every worker within ``timeout_s``, then terminate, then kill the stragglers.

        A second shutdown meanwhile waits for the first (as long as the first may take), then finds the
        workers gone.
        """
        bound = timeout_s + terminate_join_s + 1.0 + 2 * _MONITOR_STOP_S
        if not self._shutdown_lock.acquire(timeout=bound):
            raise RuntimeError(f"another shutdown of these workers did not finish within {bound:g} s")
        try:
            return self._shutdown(timeout_s, terminate_join_s)
        finally:
            self._shutdown_lock.release()

    def _shutdown(self, timeout_s: float, terminate_join_s: float) -> ShutdownReport:
        report = ShutdownReport()
        self._join_all(list(self._processes), timeout_s)
        for escalate, join_s in (("terminate", terminate_join_s), ("kill", 1.0)):
            with self._status_lock:
                alive = [label for label, p in self._processes.items() if p.is_alive()]
            if not alive:
                break
            report.forced = True
            self._forcing.set()
            for label in alive:
                process = self._processes[label]
                logger.warning("worker %s did not exit in time; calling %s()", process.name, escalate)
                getattr(process, escalate)()
            self._join_all(alive, join_s)
        with self._status_lock:
            report.exitcodes = {label: p.exitcode for label, p in self._processes.items()}
            report.still_alive = [label for label, p in self._processes.items() if p.is_alive()]
        self._kill_survivors_of_a_dead_fork_server(report)
        for label, leader in list(self._group_leaders.items()):
            if label not in report.still_alive:
                _kill_group(leader)
                del self._group_leaders[label]
        report.monitor_stopped = self.stop_monitor()
        if not report.still_alive and report.monitor_stopped:
            with self._status_lock:
                self._final_exitcodes.update(report.exitcodes)
                # forgotten before they are closed: a Ctrl-C between two closes left closed processes
                # registered, and the next stop() failed joining them
                processes, self._processes = list(self._processes.values()), {}
                pidfds, self._pidfds = list(self._pidfds.values()), {}
                self._exit_signals.clear()
                self._exits = select.poll()  # closed sentinels' numbers may be reused
                self._exit_read.clear()
                with ctrl_c_deferred():  # a Ctrl-C between two closes would leak the rest
                    for fd in pidfds:
                        os.close(fd)
                    for process in processes:
                        process.close()
        return report

    def _kill_survivors_of_a_dead_fork_server(self, report: ShutdownReport) -> None:
        """A ``forkserver`` worker's exit status comes from the fork server: once that is gone (killed), every
        worker reads as exited with code 255, alive or not, and nothing above stopped the live ones. Their
        pidfds tell; the live ones are killed (a pidfd names its process, never a reused pid)."""
        for label, code in report.exitcodes.items():
            fd = self._pidfds.get(label)
            if code != 255 or fd is None or _pidfd_exited(fd, 0.0):
                continue
            logger.warning("worker %s outlived the fork server that started it; killing it", label)
            report.forced = True
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            if not _pidfd_exited(fd, 1.0):
                report.still_alive.append(label)

    def _join_all(self, labels: list[str], timeout_s: float) -> None:
        """Join workers ``labels`` within ``timeout_s`` together (:meth:`wait_exited` takes the status lock
        only to read a status, so :meth:`dead_workers`, as in ``get_stats()`` or a sampling thread's
        liveness check, answers while a stop waits for its workers)."""
        deadline = time.monotonic() + timeout_s
        for label in labels:
            self.wait_exited(label, max(0.0, deadline - time.monotonic()))

    def stop_monitor(self, timeout_s: float = _MONITOR_STOP_S) -> bool:
        """Stop the monitor thread; ``False`` if it did not stop in time."""
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout_s)
            if self._monitor.is_alive():
                return False
            self._monitor = None
        return True


def _wait_out_slice(began: float, deadline: float) -> None:
    """Wait out the rest of a join slice begun at ``began``: an exit signal that is up without a status (a
    worker reaped elsewhere: SIGCHLD ignored, ``os.wait()``) would make its loop a busy one."""
    rest = began + min(_JOIN_SLICE_S, deadline - began) - time.monotonic()
    if rest > 0:
        threading.Event().wait(rest)


def _pidfd_exited(fd: int, timeout_s: float) -> bool:
    """Whether the process of pidfd ``fd`` has exited (waiting up to ``timeout_s``)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(timeout_s * 1000)))


def _read_exit_status_once(process: mp.process.BaseProcess, lock: threading.RLock | None = None) -> None:
    """Make the reads of a worker's exit status take turns, whatever its start method.

    Python's readers are not thread-safe, and the owner has many: this supervisor's monitor and joins, and
    every ``Process.start()`` in the owner (a ``DataLoader``'s workers), which polls all live children. A
    ``forkserver`` status arrives once, over a pipe: of two threads that find it readable at once, one
    reads the status and the other the end of the pipe, which it takes for a dead fork server (exit code
    255). A ``fork``/``spawn`` status is reaped by ``waitpid()``: the thread that loses the race gets
    ``ECHILD`` and reports the exited worker as alive (``None``). With each read under a lock, the second
    reader finds the code set.

    The lock is re-entrant and a read in progress is flagged: a signal handler or a garbage-collected
    object's finalizer (an engine's ``__del__`` stopping it) that runs in the middle of this thread's read
    and asks again gets the code as known so far instead of waiting for itself forever. A supervisor passes
    its status lock: with one lock for both, a read that stops the supervisor from a handler cannot wait
    for the status lock while the monitor, holding it, waits for the read's.
    """
    popen = getattr(process, "_popen", None)
    if popen is None or getattr(popen, "_simstream_reads_in_turn", False):
        return
    # a weak reference: the wrapper is an attribute of the Popen, which it must not keep alive in a cycle
    # (its finalizer closes the status pipe once the process is dropped)
    read, owner = type(popen).poll, weakref.ref(popen)
    lock = lock if lock is not None else threading.RLock()
    forkserver = getattr(popen, "method", None) == "forkserver"
    reading = [False]

    def read_in_turn(target) -> tuple[bool, int | None]:
        """``(read, code)``: ``read`` is False when this thread is already inside a read of its own."""
        if target.returncode is not None:
            return True, target.returncode
        with lock:
            if reading[0]:
                return False, target.returncode
            reading[0] = True
            try:
                return True, read(target, os.WNOHANG)
            finally:
                reading[0] = False

    def poll(flag: int = os.WNOHANG) -> int | None:
        target = owner()
        if target is None:
            return None
        while True:
            done, code = read_in_turn(target)
            if code is not None or flag == os.WNOHANG or not done:
                return code
            if not forkserver and not _waitable(target.pid):
                return None  # reaped by someone else (SIGCHLD ignored, os.wait()): CPython returns None too
            # a blocking poll (join() without a timeout): wait outside the lock, in slices, for a status
            # to read (a fork worker's sentinel stays open while a child it forked holds the pipe)
            wait_for_sentinels([target.sentinel], timeout=_JOIN_SLICE_S)

    popen.poll = poll
    popen._simstream_reads_in_turn = True


def _waitable(pid: int) -> bool:
    """Whether ``pid`` is a child of this process whose status ``waitpid()`` can still take."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _kill_group(leader: int) -> None:
    """SIGKILL what is left of the process group ``leader`` led (it has exited and was reaped: while the
    group has members the kernel does not hand its number out again, and with none there is nothing)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)


def _monitor_workers(
    processes: dict[str, mp.process.BaseProcess],
    channel: ErrorChannel,
    stop: threading.Event,
    forcing: threading.Event,
    status_lock: threading.RLock,
    is_closing: Callable[[], bool],
    died_message: Callable[[str, int | None], str],
    heartbeat: Heartbeat | None,
    hang_timeout_s: float | None,
    on_exit: Callable[[], None] | None,
    exit_read: threading.Event,
    exit_signals: dict[str, int],
) -> None:
    # Waits on what tells each worker's exit (WorkerSupervisor._exit_signal); the exit status is read under
    # the status lock and in turn with every other reader (_read_exit_status_once). Reading a forkserver
    # status drains its pipe, which reads as idle until the fork server closes its end: exit_read tells
    # dead_workers() to look anyway.
    pending = {exit_signals[label]: (label, index, p) for index, (label, p) in enumerate(processes.items())}
    while pending and not stop.is_set():
        ready = wait_for_sentinels(list(pending), timeout=0.1)
        for sentinel in ready:
            label, _, process = pending.pop(sentinel)
            exitcode = _read_exit_code(process, status_lock)
            with status_lock:
                exit_read.set()
            # Deaths we caused with terminate()/kill() are reported by shutdown(), not as failures.
            if not (channel.is_set() or forcing.is_set() or (is_closing() and exitcode == 0)):
                channel.publish(RuntimeError(died_message(label, exitcode)), label, exitcode=exitcode)
            _notify(on_exit)
        if heartbeat is not None and hang_timeout_s is not None and not is_closing():
            for label, index, _ in pending.values():
                age = heartbeat.age_s(index)
                if age > hang_timeout_s and not channel.is_set():
                    message = f"{label} sent no heartbeat for {age:.1f} s (hang_timeout_s={hang_timeout_s})"
                    channel.publish(TimeoutError(message), label)
                    _notify(on_exit)


def _read_exit_code(process: mp.process.BaseProcess, status_lock: threading.RLock) -> int | None:
    """The exit code of a worker whose exit signal fired: read at once, or within a second (a status the
    fork server is still sending), the status lock held for each non-blocking read only."""
    deadline = time.monotonic() + 1.0
    while True:
        with status_lock:
            exitcode = process.exitcode
        if exitcode is not None or time.monotonic() >= deadline:
            return exitcode
        threading.Event().wait(0.01)  # a sentinel at its end reads as ready at once: no busy loop


@contextlib.contextmanager
def sigint_handled(handler) -> Iterator[None]:
    """Run the block with ``handler`` as the SIGINT (Ctrl-C) handler, then put the previous one back.

    Only the main thread can change handlers, and one installed outside Python (``getsignal`` gives
    ``None``) cannot be put back: then the block runs with the handler in place.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C back until the block is done, then deliver it to the handler in place (main thread;
    elsewhere the block runs as it is, since no Ctrl-C lands in another thread).

    Code that turns another signal into a Ctrl-C (a command's SIGTERM) calls the holder's ``interrupt()``
    instead of raising SIGINT: held the same way, it is then raised as ``KeyboardInterrupt`` even where
    SIGINT itself is ignored (a background job), where a re-raised SIGINT would vanish.
    """
    held: list[int] = []
    forced: list[bool] = []

    def hold(number, frame) -> None:
        held.append(number)

    hold.interrupt = lambda: (forced.append(True), held.append(signal.SIGINT))  # type: ignore[attr-defined]
    try:
        with sigint_handled(hold):
            yield
    finally:
        if held:
            handler = signal.getsignal(signal.SIGINT)
            if forced and getattr(handler, "interrupt", None) is not None:
                handler.interrupt()  # an enclosing ctrl_c_deferred: held there too, still forced
            elif forced and not callable(handler):
                raise KeyboardInterrupt
            else:
                signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread for the block. A process started inside it inherits the mask through
    ``fork`` and ``exec``, so it cannot be interrupted before :func:`worker_entry` ignores SIGINT. (A
    ``forkserver`` child inherits the forkserver's mask instead; it only unpickles its arguments first.)"""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _notify(on_exit: Callable[[], None] | None) -> None:
    if on_exit is None:
        return
    try:
        on_exit()
    except Exception:  # the monitor must keep watching the other workers
        logger.exception("on_exit hook of the worker supervisor failed")
