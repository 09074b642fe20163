"""What the forkserver imports before it serves: the producer module, then Python's Ctrl-C handler back.

A terminal's Ctrl-C reaches the whole process group. The owner handles it (its ``stop()`` ends the producers
cleanly), so the forkserver must not: a Ctrl-C during its preload (torch's import, a couple of seconds)
printed a ``KeyboardInterrupt`` traceback of the forkserver on top of the owner's own message. The owner
therefore starts it with SIGINT blocked, a mask inherited through ``exec`` (ignoring SIGINT in the owner for
the spawn, as before, was inherited too, but dropped a Ctrl-C that reached the owner meanwhile). This module,
imported last, discards a Ctrl-C held pending during the preload and gives the forkserver Python's usual
handler back, unblocked, before it records the handler its children start with: the user's own forkserver
processes get Ctrl-C as usual, and simstream's workers ignore SIGINT as their first act.

It also arranges for the owner's ``pymp-*`` directory, which holds the forkserver's listening socket, to
be removed when the owner was killed: multiprocessing removes it in the owner's exit handlers, which a
SIGKILL skips, and the forkserver outlives its owner by a moment (it exits once the owner's end of its
pipe closes).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import stat
import time

from . import producer  # noqa: F401

ORPHAN_GRACE_S = 1.0
"""How long the exiting forkserver waits to be re-parented before it decides its owner still lives."""


def listener_directory() -> str | None:
    """The ``pymp-*`` directory of this process's listening Unix socket, or ``None`` (none, or not Linux)."""
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in descriptors:
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            with socket.socket(fileno=os.dup(int(name))) as sock:
                address = sock.getsockname() if sock.family == socket.AF_UNIX else None
        except (OSError, ValueError):
            continue
        directory = os.path.dirname(address) if isinstance(address, str) else ""
        if os.path.basename(directory).startswith("pymp-"):
            return directory
    return None


def remove_if_orphaned(directory: str, owner_pid: int, grace_s: float = ORPHAN_GRACE_S) -> bool:
    """Remove ``directory`` once this process is no longer ``owner_pid``'s child; ``True`` when removed.

    An owner that exits normally has removed the directory already, and one that stops its forkserver
    while it lives keeps it (the forkserver is not re-parented within ``grace_s``). The kernel closes a
    killed owner's descriptors before it re-parents its children, hence the wait.
    """
    if not os.path.isdir(directory):
        return False
    deadline = time.monotonic() + grace_s
    while os.getppid() == owner_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    shutil.rmtree(directory, ignore_errors=True)
    return True


_directory = listener_directory()
if _directory is not None:
    atexit.register(remove_if_orphaned, _directory, os.getppid())

# the owner starts this process with SIGINT blocked (inherited through exec): a Ctrl-C during the preload
# is pending, not delivered. Ignoring it discards it; then Python's usual handler, unblocked.
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
