"""Owner-side lifecycle of the engine: start, stop, context manager, and their failure rules.

:class:`EngineLifecycle` is the half of :class:`~simstream.OnlineDataEngine` that owns processes. Only
the owner process (the one that built the engine) may call its methods; consumers that received the engine
by pickling may sample but never start or stop producers.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

from ..errors import OnlineDataWorkerError, add_note
from ..ray.backend import RAY_LEAVE_S
from ..workers.channel import describe_exit
from ..workers.supervisor import (
    WorkerSpec,
    WorkerSupervisor,
    ctrl_c_deferred,
    refuse_in_preparing_child,
    sigint_blocked,
)
from .shared import EngineShared
from .state import OnlineDataEngineState as State

__all__ = ["EngineLifecycle"]

logger = logging.getLogger(__name__)

_PRODUCER_TARGET = "simstream.engine.producer:run_producer"
_DURABILITY_MESSAGE = (
    "OnlineDataEngine worker required terminate()/kill(); graceful close and recorder durability "
    "could not be confirmed."
)


_START_ABORT_SLACK_S = 10.0
"""How much longer than the workers' exit bound a ``stop()`` from another thread waits for a cancelled
``start()`` to end (once its workers are launched)."""

_running_engines: weakref.WeakSet = weakref.WeakSet()
"""Engines whose producers this process started and has not stopped yet."""


@atexit.register
def _stop_engines_at_exit() -> None:
    """A script that ends (or crashes) without ``stop()``: stop its engines before the interpreter
    waits for child processes, which would otherwise be forever (producers are not daemons: a source
    may start processes of its own)."""
    for engine in list(_running_engines):
        if not engine._is_owner() or engine._supervisor is None:
            continue
        try:
            engine.stop()
        except BaseException as error:  # the script's own traceback is already printed; add this one
            print(
                f"simstream: stopping OnlineDataEngine at exit failed: {type(error).__name__}: {error}",
                file=sys.stderr,
            )


class EngineLifecycle:
    """Mixin owning the worker processes; expects ``self._shared``, ``self.cfg``, ``self._spec_bytes``."""

    _supervisor: WorkerSupervisor | None
    _ray_joining: object
    """Ray backend: when the ingest was launched (``time.monotonic()``) until it has connected to Ray (or
    saw the stop first), then 0.0."""

    # -- state ---------------------------------------------------------------------------------------
    @property
    def state(self) -> State:
        """Current lifecycle state, the same in every process that shares the engine."""
        if self._shared.channel.is_set():
            return State.FAILED
        return State.from_code(self._shared.state_code.value)

    @property
    def is_init(self) -> bool:
        """``True`` while the engine is READY."""
        return self.state is State.READY

    def _set_state(self, state: State) -> None:
        self._shared.state_code.value = state.code

    def _is_owner(self) -> bool:
        return os.getpid() == self._owner_pid

    def _require_owner(self, operation: str) -> None:
        if not self._is_owner():
            raise RuntimeError(
                f"OnlineDataEngine.{operation}() may only be called by owner process {self._owner_pid}; "
                f"current process is {os.getpid()}."
            )

    # -- start ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the producer workers and block until the first generation fills every row.

        Raises:
            RuntimeError: not in state CREATED, called outside the owner, or cancelled by ``stop()``.
            TimeoutError: the first generation took longer than ``initialization_timeout``.
            Exception: a producer's original exception (or ``OnlineDataWorkerError``).
        """
        self._require_owner("start")
        refuse_in_preparing_child("OnlineDataEngine.start() was called", "start the engine")
        with self._lifecycle:
            state = self.state
            if state is not State.CREATED:
                raise RuntimeError(
                    f"OnlineDataEngine.start() requires state CREATED; current state is {state.value}."
                )
            self._stop_requested = False
            self._launching = True  # with the state: a stop() that sees STARTING sees the launch too
            self._set_state(State.STARTING)
            self._lifecycle.notify_all()
        self._busy_thread = threading.get_ident()
        try:
            try:
                self._launch_workers()
            finally:
                self._launching = False
            self._wait_for_initial_fill()
            with self._lifecycle:
                self._raise_if_start_interrupted()
                self._set_state(State.READY)
                self._lifecycle.notify_all()
        except BaseException as error:
            self._abort_start(error)
            raise
        finally:
            self._busy_thread = None

    def _launch_workers(self) -> None:
        shared, cfg = self._shared, self.cfg
        ctx = shared.context()
        start_forkserver()
        if cfg.backend is not None:  # Ray actors, fed into the buffer by one ingest process
            # joining from now: the ingest's imports and ray.init cannot be interrupted (it clears it)
            self._ray_joining = ctx.Value("d", time.monotonic(), lock=False)
            specs = [_ray_ingest_spec(shared, cfg, self._num_envs, self._ray_joining)]
        else:
            specs = [
                WorkerSpec(
                    label=f"producer-{worker}",
                    target=_PRODUCER_TARGET,
                    args=(shared, worker, start, end, self._spec_bytes, cfg.seed, cfg.shutdown_timeout),
                )
                for worker, (start, end) in enumerate(cfg.worker_row_ranges(self._num_envs))
            ]
        supervisor = self._supervisor = WorkerSupervisor(
            ctx,
            shared.channel,
            is_closing=shared.close_flag.is_set,
            died_message=lambda label, code: (
                f"OnlineDataEngine simulation worker exited unexpectedly ({describe_exit(code)})."
            ),
            on_exit=shared.progress.notify,  # a silent death wakes the owner's waits at once
        )
        _running_engines.add(self)
        supervisor.start(specs)
        if self._supervisor is not supervisor:
            # a stop() from another thread gave up waiting for this launch (initialization_timeout) and
            # cleaned up before it ended: the workers launched since are this thread's to end
            supervisor.shutdown(self._workers_exit_s())
            raise RuntimeError("OnlineDataEngine.start() was cancelled by stop().")
        shared.request_generation(self.cfg.initialization_timeout)

    def _wait_for_initial_fill(self) -> None:
        timeout = self.cfg.initialization_timeout
        deadline = time.monotonic() + timeout
        if not self._shared.progress.wait_for_completed(1, deadline, self._raise_if_start_interrupted):
            raise TimeoutError(f"OnlineDataEngine initial buffer fill exceeded {timeout} seconds.")

    def _raise_if_start_interrupted(self) -> None:
        if self._stop_requested:
            raise RuntimeError("OnlineDataEngine.start() was cancelled by stop().")
        self._raise_if_failed()
        self._check_workers_alive()

    def _abort_start(self, error: BaseException) -> None:
        channel = self._shared.channel
        cancelled = self._stop_requested
        if channel.read() is None and not cancelled and isinstance(error, Exception):
            # Published, so consumers see why the engine failed instead of a bare state error (a Ctrl-C
            # of this thread is not a failure of the engine: it is raised, not published for later calls)
            channel.publish(error, "owner")
        cleanup_failure: BaseException | None = None
        try:
            forced = self._shutdown_workers()
            self._cleanup_complete = True
        except BaseException as cleanup_error:
            forced, cleanup_failure = self._forced_shutdown, cleanup_error
            add_note(error, f"Worker cleanup also failed: {type(cleanup_error).__name__}: {cleanup_error}")
        published = channel.error()
        if published is not None and published is not error:
            add_note(error, f"Worker also failed during cleanup: {type(published).__name__}: {published}")
        cleanup_failed = cleanup_failure is not None
        if cleanup_failed and isinstance(cleanup_failure, Exception):
            # FAILED always carries a published error: consumers see why, stop() raises it. A Ctrl-C in
            # the cleanup is not published: a later stop() finishes the cleanup and ends STOPPED.
            channel.publish(cleanup_failure, "owner")
        if forced:
            channel.publish(OnlineDataWorkerError(_DURABILITY_MESSAGE), "owner")
            add_note(error, _DURABILITY_MESSAGE)
        interrupted = not isinstance(error, Exception)  # Ctrl-C: the start is cancelled, not failed
        clean = (cancelled or interrupted) and channel.read() is None and not cleanup_failed and not forced
        with self._lifecycle:
            self._set_state(State.STOPPED if clean else State.FAILED)
            self._lifecycle.notify_all()
        if cleanup_failed and not isinstance(cleanup_failure, Exception) and not interrupted:
            # a Ctrl-C during the cleanup of a failed start: the caller gets it (a retry loop around
            # start() must stay interruptible), with the start's error as its context
            raise cleanup_failure

    # -- liveness ------------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        self._shared.raise_if_failed()

    def _check_workers_alive(self) -> None:
        """Raise if a producer died (owner) or the owner stopped the producers (consumer)."""
        shared = self._shared
        if not self._is_owner():
            if shared.close_flag.is_set() and self.state is State.READY:
                raise RuntimeError("OnlineDataEngine owner has stopped the simulation worker.")
            return
        supervisor = self._supervisor
        if supervisor is None or shared.close_flag.is_set():
            return
        dead = supervisor.dead_workers()
        if shared.close_flag.is_set():
            # stop() began meanwhile (it may have joined workers while dead_workers() ran): these
            # are the graceful exits it asked for, and stop() itself reports any death before it
            return
        for label, code in dead:
            error = RuntimeError(supervisor.died_message(label, code))
            logger.error("%s exited: %s", label, describe_exit(code))
            shared.channel.publish(error, label, exitcode=code)
            self._raise_if_failed()

    # -- stop ----------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the producers (idempotent, bounded by ``shutdown_timeout`` plus terminate/kill; from another
        thread while ``start()`` launches the workers, after that launch, up to ``initialization_timeout``).

        Raises:
            Exception: a producer's error, including one raised by a source's ``close()``.
            OnlineDataWorkerError: a worker had to be terminated or killed (durability unconfirmed);
                the engine is then FAILED.
        """
        self._require_owner("stop")
        if getattr(self, "_busy_thread", None) == threading.get_ident():
            # called inside this thread's own start() or stop(), by a signal handler: waiting for them
            # would wait for itself; asking them to stop is all this call can do, and they finish it
            self._stop_requested = True
            self._shared.close_flag.set()
            self._shared.wake_all()
            self._shared.progress.notify()
            return
        with self._lifecycle:
            state = self.state
            if state is State.STOPPED:
                return
            if state is State.FAILED and self._cleanup_complete:
                return
            if state is State.CREATED:
                self._shared.close_flag.set()
                self._shared.wake_all()
                self._cleanup_complete = True
                self._set_state(State.STOPPED)
                return
            if state is State.STARTING:
                self._stop_requested = True
                self._shared.close_flag.set()
                self._shared.wake_all()
                self._shared.progress.notify()  # start() sleeps on it: it sees the cancellation at once
                # the start's own bounded shutdown (with a wait for an ingest inside ray.init), and more;
                # the start's launch first, up to initialization_timeout (the fork server's first start
                # imports torch): a cleanup here beside it found no workers yet, and the ones launched
                # after were nobody's
                limit = self._workers_exit_s() + self._ray_join_bound_s() + _START_ABORT_SLACK_S
                launch_ends = time.monotonic() + self.cfg.initialization_timeout
                launched = not self._launching  # for a whole wait: the start's cleanup had all of it
                while not self._lifecycle.wait_for(lambda: self.state is not State.STARTING, timeout=limit):
                    if launched or time.monotonic() >= launch_ends:
                        break
                    launched = not self._launching
                if self.state is State.STOPPED:
                    return
                # start() failed after all (a source's close() raised, or a worker had to be forced):
                # its cleanup is done, and this stop() raises what the channel holds, once
                state = self.state
            self._busy_thread = threading.get_ident()
            try:
                self._stop_running(state)
            finally:
                self._busy_thread = None

    def _stop_running(self, state: State) -> None:
        channel = self._shared.channel
        error = channel.error()
        # after a stop() that a Ctrl-C cut short, the producers' exits are the ones it asked for
        if error is None and state is State.READY and not self._shared.close_flag.is_set():
            error = self._detect_death_before_stop()
        try:
            forced = self._shutdown_workers()
        except BaseException as cleanup_error:
            if not isinstance(cleanup_error, Exception):
                # Ctrl-C (or an exit) in this thread during the cleanup: no failure of the engine, so
                # nothing is published and the state stays; a later stop() (the context manager's, the
                # exit hook's) finishes the cleanup and ends STOPPED
                raise
            # the error is on the channel before the state says FAILED: a consumer that reads FAILED
            # finds the error it must raise (it reads the state first)
            error = channel.error() or error
            if self._forced_shutdown:
                durability = OnlineDataWorkerError(_DURABILITY_MESSAGE)
                if error is None:
                    channel.publish(durability, "owner")
                    error = durability
                else:
                    add_note(error, _DURABILITY_MESSAGE)
            if error is not None:
                self._set_state(State.FAILED)
                add_note(error, f"Worker cleanup also failed: {cleanup_error}")
                raise error from None
            channel.publish(cleanup_error, "owner")  # a later stop() retries cleanup, then raises it
            self._set_state(State.FAILED)
            raise
        error = channel.error() or error
        if forced:
            durability = OnlineDataWorkerError(_DURABILITY_MESSAGE)
            if error is None:
                channel.publish(durability, "owner")
                error = durability
            else:
                add_note(error, _DURABILITY_MESSAGE)
        self._cleanup_complete = True
        if error is not None:
            self._set_state(State.FAILED)
            raise error
        self._set_state(State.STOPPED)

    def _detect_death_before_stop(self) -> BaseException | None:
        supervisor = self._supervisor
        if supervisor is None:
            error = RuntimeError("OnlineDataEngine simulation worker was not created.")
            self._shared.channel.publish(error, "owner")
            return error
        for label, code in supervisor.dead_workers():
            error = RuntimeError(
                "OnlineDataEngine simulation worker exited unexpectedly before stop() "
                f"({describe_exit(code)}).{supervisor.exit_note(label, code)}"
            )
            self._shared.channel.publish(error, label, exitcode=code)
            return self._shared.channel.error()
        return None

    def _workers_exit_s(self) -> float:
        """How long a stop waits for the workers to exit by themselves: ``shutdown_timeout``, and with Ray
        ``RAY_LEAVE_S`` more (the ingest kills its actors and leaves Ray after the sources' closes)."""
        return self.cfg.shutdown_timeout + (RAY_LEAVE_S if self.cfg.backend is not None else 0.0)

    def _ray_join_bound_s(self) -> float:
        return self.cfg.initialization_timeout if self.cfg.backend is not None else 0.0

    def _wait_while_joining_ray(self, supervisor: WorkerSupervisor) -> None:
        """Let a Ray ingest finish starting and ``ray.init`` before its exit is timed.

        Neither can be interrupted, and starting a local cluster takes seconds (15 on a loaded 2-core
        machine): an ingest stopped inside it would be terminated past its exit bound and the stop
        reported as a forced one. An ingest that sees the stop before ``ray.init`` does not connect. The
        wait ends ``initialization_timeout`` after the ingest was launched, or when it is gone.
        """
        joining = self._ray_joining
        while joining is not None and joining.value:
            if (
                time.monotonic() >= joining.value + self.cfg.initialization_timeout
                or supervisor.dead_workers()
            ):
                return
            time.sleep(0.05)

    def _shutdown_workers(self) -> bool:
        """Signal close, then join/terminate/kill every worker. Returns whether force was needed."""
        shared = self._shared
        shared.close_flag.set()
        shared.wake_all()
        supervisor = self._supervisor
        if supervisor is None:
            return False
        self._wait_while_joining_ray(supervisor)
        report = supervisor.shutdown(self._workers_exit_s())
        self._forced_shutdown = self._forced_shutdown or report.forced
        if report.still_alive:
            raise RuntimeError(
                "OnlineDataEngine simulation worker remained alive after graceful shutdown, terminate(), "
                "and kill()."
            )
        if not report.monitor_stopped:  # cleanup stays incomplete: a later stop() tries again
            raise RuntimeError("OnlineDataEngine worker monitor did not stop after the worker exited.")
        self._supervisor = None
        return report.forced

    # -- context manager -----------------------------------------------------------------------------
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.stop()
        except BaseException as cleanup_error:
            if exc is None:
                raise
            if cleanup_error is not exc:
                add_note(
                    exc,
                    f"OnlineDataEngine cleanup also failed: {type(cleanup_error).__name__}: {cleanup_error}",
                )

    def __del__(self) -> None:
        try:
            if self._is_owner() and self._supervisor is not None:
                self.stop()
        except BaseException:
            pass


def _ray_ingest_spec(shared, cfg, num_envs: int, joining) -> WorkerSpec:
    """The ingest process of the Ray backend (``ray`` is imported here, only for such an engine);
    ``joining`` holds when it entered ``ray.init`` while it is inside it."""
    import pickle

    import ray

    # A spec class defined in the user's script travels to the actors by value (cloudpickle), pickled
    # here where it is __main__'s; with address=None, the cluster this process is connected to, if any, is
    # the one to join.
    spec_bytes = ray.cloudpickle.dumps(cfg.source)
    # Ray's own exit hook (registered on import) disconnects this process from a cluster it started; ours,
    # registered again now, runs first, so the ingest closes the sources before that cluster goes away
    atexit.unregister(_stop_engines_at_exit)
    atexit.register(_stop_engines_at_exit)
    address = cfg.backend.address
    if address is None and ray.is_initialized():  # an explicit address is the user's choice
        address = ray.get_runtime_context().gcs_address
    return WorkerSpec(
        label="ray-ingest",
        target="simstream.ray.ingest:run_ingest",
        args=(shared, pickle.dumps(cfg), spec_bytes, num_envs, address, joining),
        # a local cluster its ray.init starts (GCS, raylet, agents) would outlive an ingest SIGKILLed
        own_process_group=True,
    )


def start_forkserver() -> None:
    """Start the forkserver every engine's workers come from, unless it runs: with its preload, and with
    Ctrl-C ignored for the seconds of that preload when called on the main thread.

    ``start()`` calls it itself. A caller that runs ``start()`` on another thread (to show progress while
    the first generation fills) calls it first on the main thread: from another thread the handler cannot
    be changed, and a terminal's Ctrl-C during the preload printed the forkserver's traceback, or broke a
    producer's imports mid-way (a misleading producer error, exit 1, instead of the interrupt).
    """
    if _forkserver_not_started():
        EngineShared.context().set_forkserver_preload(["simstream.engine.forkserver_preload"])
        _start_forkserver_holding_ctrl_c()


def _start_forkserver_holding_ctrl_c() -> None:
    """Start the forkserver with SIGINT blocked, which it inherits through ``exec`` and keeps through its
    preload (:mod:`simstream.engine.forkserver_preload` unblocks it). A Ctrl-C meanwhile is held here and
    delivered once the forkserver runs: ignoring SIGINT for the spawn, as before, dropped it (the script
    went on as if never interrupted)."""
    from multiprocessing import forkserver

    with ctrl_c_deferred(), sigint_blocked():  # for the few ms of its spawn
        forkserver.ensure_running()


def _forkserver_not_started() -> bool:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None) is None


def stop_then_close(engine: Any, after: Any | None, in_flight: BaseException | None) -> None:
    """Stop ``engine``, then close ``after`` (when given: a recorder, which then commits every episode
    published before the stop, whatever ``stop()`` raised): the end of a run that records.

    With an exception in flight (the run failed, or a Ctrl-C/SIGTERM ended it), their errors become notes
    on it, as the engine's context manager does: a SIGTERM sent to the whole process group kills the
    producers and the fork server too, and the stop's report of those deaths replaced the interruption
    (exit 1, "worker exited unexpectedly", instead of 143). Otherwise the first error is raised, a second
    as a note on it. A Ctrl-C during the cleanup itself is raised after both steps ran.
    """
    errors: list[BaseException] = []
    for step in [engine.stop] if after is None else [engine.stop, after.close]:
        try:
            step()
        except BaseException as error:
            errors.append(error)
    errors = [error for error in errors if error is not in_flight]
    if not errors:
        return
    if in_flight is not None and all(isinstance(error, Exception) for error in errors):
        for error in errors:
            add_note(in_flight, f"Stopping after it also failed: {type(error).__name__}: {error}")
        return
    first, *rest = sorted(errors, key=lambda error: isinstance(error, Exception))  # a Ctrl-C first
    for error in rest:
        add_note(first, f"Stopping also failed: {type(error).__name__}: {error}")
    raise first
