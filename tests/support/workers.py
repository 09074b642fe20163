"""Worker bodies for supervisor tests (importable by name, as ``WorkerSpec.target`` requires)."""

from __future__ import annotations

import os
import signal


def exit_when_told(go, code: int) -> None:
    """Wait (bounded) for ``go``, then exit with ``code`` without running any cleanup: a silent death."""
    go.wait(60.0)
    os._exit(code)


def wait_for(stop) -> None:
    """Return once ``stop`` is set (bounded)."""
    stop.wait(60.0)


def _interrupt_this_process() -> str:
    os.kill(os.getpid(), signal.SIGINT)
    return "unpickled"


class InterruptsItsUnpickling:
    """An argument whose unpickling in the worker sends the worker SIGINT: a Ctrl-C that reaches the
    process group while a ``spawn`` worker is still being prepared (re-importing the main module)."""

    def __reduce__(self):
        return (_interrupt_this_process, ())


def expect_unpickled(value, ran) -> None:
    """Check that the argument was unpickled, then say so through ``ran``."""
    if value != "unpickled":
        raise AssertionError(f"argument arrived as {value!r}")
    ran.set()


def start_a_child_and_die(started) -> None:
    """Start a process that would run for ten minutes, report its pid, then die by SIGKILL: the child is
    left behind (what a killed Ray ingest leaves of the cluster it started)."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    started.value = child.pid  # shared memory: visible at once, unlike a queue's feeder thread
    os.kill(os.getpid(), signal.SIGKILL)


def fork_a_child_and_exit(started, code: int) -> None:
    """Fork a child that keeps every descriptor of this worker (its sentinel pipe too) and waits to be
    killed, report its pid, then exit with ``code``."""
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigtimedwait({signal.SIGINT}, 120.0)  # never sent: the test kills it (bounded anyway)
        os._exit(0)
    started.value = child
    os._exit(code)
