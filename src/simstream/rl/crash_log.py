"""The collector's crash log: ``faulthandler`` output, full tracebacks and on-demand stack dumps.

The collector writes it (see :mod:`simstream.rl._entry`); the learner reads it when the collector died
without a Python traceback (SIGSEGV, SIGABRT, SIGBUS) and asks for a stack dump (SIGUSR1) of a hung one.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

__all__ = ["CrashLog", "clean_up"]

FILE_NAME = "collector_crash.log"


class CrashLog:
    """Owns ``<directory>/collector_crash.log``, emptied when created (else a temporary directory)."""

    def __init__(self, directory: str | None) -> None:
        self.owns_directory = directory is None
        directory = tempfile.mkdtemp(prefix="simstream-rl-") if directory is None else directory
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, FILE_NAME)
        # a run directory may be reused: an earlier run's crash must never read as this run's
        with open(self.path, "w"):
            pass

    def size(self) -> int:
        return os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def read(self, start: int = 0, limit: int = 16 * 1024) -> str:
        """The log from byte ``start`` on, at most its last ``limit`` characters."""
        if not os.path.exists(self.path):
            return ""
        with open(self.path, errors="replace") as log:
            log.seek(start)
            text = log.read()
        return text[-limit:].strip()

    def dump_stacks(self, pid: int, timeout_s: float = 1.0) -> str:
        """Ask process ``pid`` (which registered faulthandler on SIGUSR1) for its Python stacks."""
        if not hasattr(signal, "SIGUSR1"):
            return ""
        before = self.size()
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            return ""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.size() == before:
            time.sleep(0.02)
        time.sleep(0.05)  # let faulthandler finish writing
        return self.read(start=before)

    def cleanup(self) -> None:
        """Remove a temporary directory, or the log when it stayed empty (nothing went wrong)."""
        clean_up(self.path, self.owns_directory)


def clean_up(path: str, owns_directory: bool) -> None:
    """:meth:`CrashLog.cleanup` by the log's path (the collector's, when the learner is gone)."""
    if owns_directory:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    elif os.path.exists(path) and os.path.getsize(path) == 0:
        os.remove(path)
