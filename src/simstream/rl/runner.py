"""``AsyncRunner``: the base of learners that train while a spawned collector process gathers data.

The runner owns one collector process and everything it shares with it. It reuses the package's worker
supervision (:mod:`simstream.workers.supervisor`) and error channel (:mod:`simstream.workers.channel`):

* the collector starts through ``worker_entry`` (spawn context), so an exception raised anywhere in it,
  from importing the collector module on, is published as plain data (type name, message, traceback
  capped head + tail) and never has to be unpickled by class;
* the supervisor's monitor thread publishes a silent death (signal, ``os._exit``) within ~0.1 s and a
  hang once the heartbeat is older than ``RunnerConfig.hang_timeout_s``;
* :meth:`AsyncRunner.check_collector` turns whatever was published into a raised
  :class:`~simstream.errors.CollectorDiedError` carrying :func:`format_collector_death`'s report, and every
  wait of the learner (:meth:`AsyncRunner._wait_until`) calls it between slices of
  ``RunnerConfig.poll_interval_s``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.queues
import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, TypeVar

from .._sync import StopSignal, process_is_stopped
from ..errors import CollectorDiedError
from ..workers.channel import ErrorChannel, describe_exit
from ..workers.supervisor import (
    Heartbeat,
    WorkerSpec,
    WorkerSupervisor,
    ctrl_c_deferred,
    refuse_in_preparing_child,
)
from .config import RunnerConfig
from .crash_log import CrashLog
from .diagnosis import CollectorHangError, format_collector_death, format_collector_hang

__all__ = ["AsyncRunner", "CloseReport"]

logger = logging.getLogger(__name__)

_SPAWN = mp.get_context("spawn")
_ENTRY = "simstream.rl._entry:collector_entry"
_LABEL = "collector"
T = TypeVar("T")


@dataclass(frozen=True)
class CloseReport:
    """What :meth:`AsyncRunner.close` did."""

    exitcode: int | None
    """The collector's exit code (``None``: never started, or still alive)."""
    forced: bool
    """``terminate()`` or ``kill()`` was needed: the collector did not stop on its own."""
    still_alive: bool
    """The collector survived even ``kill()`` (should never happen)."""
    released: int
    """Shared resources released."""
    failure: str | None
    """The death report, when the collector had failed (raised or not)."""
    errors: tuple[str, ...] = ()
    """One entry per shared resource that could not be released: which, how, and the error."""

    @property
    def clean(self) -> bool:
        """The collector stopped on request with exit code 0 (or never ran), nothing failed, and every
        shared resource was released."""
        return (
            not self.forced
            and not self.still_alive
            and self.failure is None
            and self.exitcode in (None, 0)
            and not self.errors
        )


class AsyncRunner(ABC):
    """Owns one collector process, its supervision, and the shared resources registered with it.

    Subclasses implement the four extension points; :meth:`_start_collector` spawns
    ``type(self)._collector_fn`` (a ``staticmethod``, imported by name in the child), and the learner
    waits only through :meth:`_wait_until`. ``close()`` is idempotent; the runner is a context manager.

    Examples:
        >>> class MyRunner(AsyncRunner):                       # doctest: +SKIP
        ...     def _get_default_device(self): return "cpu"
        ...     def _build_learner(self): return MyLearner()
        ...     @staticmethod
        ...     def _collector_fn(stop_event, heartbeat, queue_like): ...
        ...     def learn(self, max_iterations, save_interval=50, log_dir="logs"): ...
    """

    def __init__(
        self,
        runner_config: RunnerConfig | None = None,
        *,
        device: str | None = None,
        collector_device: str | None = None,
    ) -> None:
        self.runner_config = runner_config if runner_config is not None else RunnerConfig()
        self.device = device or self._get_default_device()
        self.collector_device = collector_device or self.device
        self._stop_event = StopSignal(_SPAWN)
        self._shared_resources: list[Any] = []
        self._channel: ErrorChannel | None = None
        self._heartbeat: Heartbeat | None = None
        self._supervisor: WorkerSupervisor | None = None
        self._finalizer: weakref.finalize | None = None
        self._crash_log: CrashLog | None = None
        self._failure: CollectorDiedError | None = None
        self.last_close_report: CloseReport | None = None

    # ------------------------------------------------------------------ extension points
    @abstractmethod
    def _get_default_device(self) -> str:
        """The learner's device when none is given."""

    @abstractmethod
    def _build_learner(self) -> Any:
        """Build the learner (networks, optimiser) in the learner process."""

    @staticmethod
    @abstractmethod
    def _collector_fn(stop_event, **kwargs) -> None:
        """Collector process body; returns once ``stop_event`` is set. Gets ``heartbeat`` (call it often)."""

    @abstractmethod
    def learn(self, max_iterations: int, save_interval: int = 50, log_dir: str | None = "logs") -> Any:
        """Train for ``max_iterations`` updates; checkpoint every ``save_interval`` (0: no periodic ones)."""

    def _collector_target(self) -> str:
        """``"module:Class._collector_fn"`` of the class defining the collector (imported in the child)."""
        owner = next(c for c in type(self).__mro__ if "_collector_fn" in c.__dict__)
        return f"{owner.__module__}:{owner.__qualname__}._collector_fn"

    # ------------------------------------------------------------------ collector lifecycle
    def _start_collector(self, kwargs: dict, *, crash_dir: str | None = None) -> None:
        """Spawn the collector with ``kwargs`` (shared objects travel as process arguments).

        Args:
            kwargs: Keyword arguments of ``_collector_fn`` besides ``stop_event`` and ``heartbeat``.
            crash_dir: Where ``collector_crash.log`` (faulthandler output, full tracebacks) is kept;
                ``None`` uses a temporary directory removed by :meth:`close`.
        """
        self._raise_if_closed()
        if self._supervisor is not None:
            raise RuntimeError(f"{type(self).__name__}: the collector was already started")
        refuse_in_preparing_child(f"{type(self).__name__} started its collector", "train")
        cfg = self.runner_config
        self._crash_log = CrashLog(crash_dir)
        self._channel = ErrorChannel(_SPAWN)
        self._heartbeat = Heartbeat(1, _SPAWN)
        self._heartbeat.hold(0, cfg.startup_timeout_s)
        self._supervisor = WorkerSupervisor(
            _SPAWN,
            self._channel,
            is_closing=self._stop_event.is_set,
            died_message=lambda label, code: f"{label} exited unexpectedly ({describe_exit(code)}).",
            heartbeat=self._heartbeat,
            hang_timeout_s=cfg.hang_timeout_s,
        )
        args = (
            self._collector_target(),
            self._stop_event,
            self._heartbeat,
            cfg.startup_timeout_s,
            self._crash_log.path,
            self._crash_log.owns_directory,
            kwargs,
        )
        try:
            self._supervisor.start([WorkerSpec(label=_LABEL, target=_ENTRY, args=args)])
        except BaseException:
            # leave no half-built state: the spawn failed before the child existed, or a Ctrl-C, held back
            # until the collector was started and registered, lands here and it is stopped again
            supervisor, self._supervisor = self._supervisor, None
            if supervisor.processes:
                self._stop_event.set()
                supervisor.shutdown(cfg.shutdown_timeout_s)
            else:
                supervisor.stop_monitor()
            self._crash_log.cleanup()
            raise
        self._finalizer = weakref.finalize(
            self, _emergency_stop, self._stop_event, self._supervisor, self._crash_log
        )

    def _raise_if_closed(self) -> None:
        if self.last_close_report is not None:
            raise RuntimeError(f"{type(self).__name__} is closed; create a new runner to train again")

    def _register_shared(self, resource: T) -> T:
        """Have :meth:`close` release ``resource`` (``release``, ``cleanup`` or ``close``), newest first.

        A ``multiprocessing.Queue`` also gets ``join_thread()`` after ``close()``, so what it buffered has
        reached the pipe when ``close`` returns (bounded: see :meth:`close`).
        """
        self._shared_resources.append(resource)
        return resource

    @property
    def collector_pid(self) -> int | None:
        """The collector process's pid while it is started; ``None`` before and after :meth:`close`."""
        process = self._process()
        return None if process is None else process.pid

    def _process(self) -> mp.process.BaseProcess | None:
        if self._supervisor is None:
            return None
        return self._supervisor.processes.get(_LABEL)

    def check_collector(self) -> None:
        """Raise :class:`CollectorDiedError` if the collector failed, died or hung; else return at once.

        The same error object is raised on every later call.
        """
        if self._failure is not None:
            raise self._failure
        if self._supervisor is None or self._stop_event.is_set():
            return
        if not self._channel.is_set() and not self._supervisor.dead_workers():
            return
        self._failure = self._diagnose()
        raise self._failure

    def _wait_until(self, poll: Callable[[float], T | None], timeout_s: float, what: str) -> T:
        """Return ``poll(slice_s)``'s first non-``None`` result; check the collector between slices.

        Raises:
            CollectorDiedError: the collector failed while waiting (within one poll interval).
            TimeoutError: nothing within ``timeout_s`` although the collector stayed alive.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_collector()
            remaining = deadline - time.monotonic()
            try:
                result = poll(max(0.0, min(self.runner_config.poll_interval_s, remaining)))
            except TimeoutError:  # e.g. a shared lock never released: the collector died holding it?
                self.check_collector()
                raise
            if result is not None:
                return result
            if time.monotonic() >= deadline:
                self.check_collector()
                raise TimeoutError(
                    f"{type(self).__name__}: no {what} within {timeout_s:g} s, although the collector "
                    f"(pid {self.collector_pid}) is alive and sending heartbeats; it keeps running"
                )

    def _diagnose(self) -> CollectorDiedError:
        record = self._channel.read()
        # Records published by this process come from the supervisor's monitor thread: a silent death
        # or a hang. Only a record published by the collector itself carries a Python traceback.
        from_monitor = record is not None and record.pid == os.getpid()
        if from_monitor and record.type_qualname == "TimeoutError" and record.exitcode is None:
            process = self._process()
            # a stopped process (SIGSTOP, Ctrl-Z, a debugger) cannot write the stacks it is asked for
            stopped = process is not None and process_is_stopped(process.pid)
            stack = self._crash_log.dump_stacks(process.pid) if process is not None and not stopped else ""
            age = self._heartbeat.age_s(0)
            report = format_collector_hang(age, self.runner_config.hang_timeout_s, stack, stopped=stopped)
            return CollectorHangError(report, None, stack or None)
        exitcode = self._wait_for_exitcode(0.25)
        if exitcode is None and record is not None:
            exitcode = record.exitcode
        traceback_text = None
        if record is not None and not from_monitor and record.traceback_text:
            traceback_text = record.traceback_text
        report = format_collector_death(exitcode, traceback_text)
        # no traceback: it may have died preparing (a script without a main guard). The learner can see the
        # death before the monitor thread publishes it, so the note does not wait for the monitor's record
        if (record is None or from_monitor) and exitcode is not None:
            note = self._supervisor.exit_note(_LABEL, exitcode).strip()
            if note:
                report += f"\n{note}"
        if traceback_text is None:
            native = self._crash_log.read()
            if native:
                report += f"\nOutput in the collector's crash log (faulthandler):\n{native}"
        if not self._crash_log.owns_directory and self._crash_log.size():  # an empty log is removed at close
            report += f"\nCrash log: {self._crash_log.path}"
        error = CollectorDiedError(report, exitcode, traceback_text)
        if traceback_text is not None:
            error.__cause__ = self._channel.error()
        return error

    def _wait_for_exitcode(self, timeout_s: float) -> int | None:
        # A collector that published an exception exits right after; its code makes the report complete.
        process = self._process()
        if process is None or not wait_for_sentinels([process.sentinel], timeout=timeout_s):
            return None
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # the monitor thread may hold the status lock for a moment
            for label, code in self._supervisor.dead_workers():
                if label == _LABEL:
                    return code
            time.sleep(0.005)
        return None

    # ------------------------------------------------------------------ shutdown
    def close(self) -> CloseReport:
        """Stop and reap the collector, release shared memory; idempotent, bounded, never raises.

        Order: set the stop event -> join (``shutdown_timeout_s``; none for a hung collector) ->
        ``terminate()`` -> ``kill()`` -> release shared resources, newest first. A resource whose release
        raises is logged and listed in ``CloseReport.errors`` (the report is then not ``clean``); the
        others are still released. A registered queue's ``join_thread()`` waits at most
        ``max(shutdown_timeout_s, 1)`` s: a feeder thread blocked on a full pipe that nobody reads any more
        is reported as an error, and left behind (a daemon thread) rather than waited for forever.

        A Ctrl-C (or a SIGTERM a command handles as one) meanwhile is held back until the collector is
        reaped and every resource released, then delivered.

        Returns:
            The :class:`CloseReport` (also kept as ``last_close_report``).
        """
        if self.last_close_report is not None:
            return self.last_close_report
        with ctrl_c_deferred():  # interrupted half-way, the collector would be left to the exit finalizer
            return self._close()

    def _close(self) -> CloseReport:
        if self._failure is None and self._supervisor is not None and self._channel.is_set():
            # a failure nobody has diagnosed yet (published after the last check): diagnose it while the
            # collector may still be alive, so a hang gets its stack dump and no grace, not a SIGTERM
            # that would read as an external kill
            try:
                self._failure = self._diagnose()
            except Exception:  # close() never raises; the report below still says what it can
                logger.exception("diagnosing the collector's failure failed")
        self._stop_event.set()
        exitcode, forced, still_alive, failure = None, False, False, None
        if self._supervisor is not None:
            # A hung collector will not react to the stop event; anything else gets the full grace
            # (one that published an exception is still tearing its interpreter down).
            hung = isinstance(self._failure, CollectorHangError)
            grace = 0.0 if hung else self.runner_config.shutdown_timeout_s
            shutdown = self._supervisor.shutdown(grace)
            exitcode = shutdown.exitcodes.get(_LABEL)
            forced, still_alive = shutdown.forced, bool(shutdown.still_alive)
            if self._failure is not None:
                failure = self._failure.report
            elif self._channel.is_set():
                record = self._channel.read()
                from_collector = record is not None and record.pid != os.getpid()
                failure = format_collector_death(exitcode, record.traceback_text if from_collector else None)
            elif exitcode not in (0, None) and not forced:
                failure = format_collector_death(exitcode, None)
            if failure is not None and self._failure is None:
                logger.error("collector failed before close():\n%s", failure)
        if self._finalizer is not None:
            self._finalizer.detach()
        released, errors = self._release_resources()
        if self._crash_log is not None:
            self._crash_log.cleanup()
        # a closed runner the user keeps must not keep the channel's lock file (a descriptor) or the
        # heartbeat's shared memory: nothing reads them after close (check_collector returns at once)
        self._channel = self._heartbeat = self._supervisor = None
        self.last_close_report = CloseReport(exitcode, forced, still_alive, released, failure, tuple(errors))
        return self.last_close_report

    def _release_resources(self) -> tuple[int, list[str]]:
        """Release every registered resource, newest first; returns how many succeeded and the errors."""
        released, errors = 0, []
        join_timeout_s = max(self.runner_config.shutdown_timeout_s, 1.0)
        while self._shared_resources:
            resource = self._shared_resources.pop()
            kind = type(resource).__name__
            name = next(
                (n for n in ("release", "cleanup", "close") if callable(getattr(resource, n, None))), None
            )
            if name is None:
                continue
            try:
                getattr(resource, name)()
                if isinstance(resource, mp.queues.Queue):
                    name = "join_thread"
                    _join_feeder(resource, join_timeout_s)
                released += 1
            except Exception as error:
                logger.exception("releasing %s failed", kind)
                errors.append(f"{kind}.{name}() failed: {type(error).__name__}: {error}")
        return released, errors

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> bool:
        self.close()
        return False


def _join_feeder(queue: mp.queues.Queue, timeout_s: float) -> None:
    """``queue.join_thread()``, bounded: its feeder thread blocks for good on a full pipe nobody reads."""
    joiner = threading.Thread(target=queue.join_thread, name="simstream-queue-join", daemon=True)
    joiner.start()
    joiner.join(timeout_s)
    if joiner.is_alive():
        queue.cancel_join_thread()  # nor may the interpreter's exit wait for it
        raise TimeoutError(
            f"its feeder thread did not finish within {timeout_s:g} s: it is blocked writing items nobody "
            "read into a full pipe; those items are lost and the thread stays blocked"
        )


def _emergency_stop(stop_event, supervisor: WorkerSupervisor, crash_log: CrashLog) -> None:
    """Runs if a started runner is garbage-collected or the interpreter exits without ``close()``."""
    try:
        stop_event.set()
        supervisor.shutdown(2.0)
    except Exception:  # at interpreter exit nothing can be reported any more
        pass
    try:
        crash_log.cleanup()  # its temporary directory (a crash_dir given by the user is kept)
    except Exception:
        pass
