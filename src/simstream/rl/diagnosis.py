"""Turn how a collector process ended into a report a person can act on.

The learner only sees an exit status and, when the collector managed to send one, a Python traceback. A
signal death leaves no traceback, so the report names the signal and says what usually sends it.
"""

from __future__ import annotations

import signal

from ..errors import CollectorDiedError
from ..workers.channel import signal_name

__all__ = ["CollectorDiedError", "CollectorHangError", "format_collector_death", "format_collector_hang"]

_HINTS: dict[int, str] = {
    int(signal.SIGKILL): (
        "SIGKILL is almost always the kernel's OOM killer (the machine ran out of memory) or an operator's "
        "`kill -9`. Check `dmesg | grep -i oom`, then lower num_envs or the ring size."
    ),
    int(signal.SIGBUS): (
        "SIGBUS means a page of native mmap/shared memory could not be backed: usually /dev/shm is full "
        "(check `df -h /dev/shm`; in Docker raise --shm-size), otherwise CUDA pinned memory or a WSL "
        "runtime/driver fault."
    ),
    int(signal.SIGSEGV): (
        "SIGSEGV is a segmentation fault in native code: the simulator, a C extension or a CUDA kernel. "
        "The native stack (faulthandler), when one was written, follows."
    ),
    int(signal.SIGABRT): (
        "SIGABRT means native code called abort(): a failed C/C++ assertion, heap corruption detected by "
        "the allocator, or an uncaught C++ exception."
    ),
}


def _hint(number: int) -> str:
    text = _HINTS.get(number)
    return f"\nHint: {text}" if text else ""


def format_collector_death(exitcode: int | None, traceback_text: str | None = None) -> str:
    """Describe a dead collector, picking the first branch that applies.

    1. A Python traceback arrived: it is the cause, quoted in full.
    2. ``exitcode < 0``: killed by signal ``-exitcode``; no traceback exists.
    3. ``exitcode >= 128``: a shell-style status, signal ``exitcode - 128``.
    4. Any other exit code.
    5. No exit code at all.

    SIGKILL (OOM killer), SIGBUS (shared memory full), SIGSEGV and SIGABRT get a hint. The first line
    carries the reference runner's phrases ("crashed.", "killed by signal N (NAME)", "exited with code X
    (shell-style signal N, NAME)", "died (exit code unknown)"), so reports can be matched the same way.

    Args:
        exitcode: The process exit code (negative for a signal), or ``None`` when unknown.
        traceback_text: The Python traceback the collector sent, if any (``None``: none arrived).

    Returns:
        A multi-line report.

    Examples:
        >>> format_collector_death(-9, None).splitlines()[0]
        'Collector process was killed by signal 9 (SIGKILL) and left no Python traceback.'
    """
    if traceback_text and traceback_text.strip():
        status = "" if exitcode is None else f" (exit code {exitcode})"
        return f"Collector process crashed. Its Python traceback{status}:\n{traceback_text.rstrip()}"
    if exitcode is None:
        return "Collector process died (exit code unknown) and left no Python traceback."
    if exitcode < 0:
        number = -exitcode
        return (
            f"Collector process was killed by signal {number} ({signal_name(number)}) and left no Python "
            "traceback.\nSomething outside the interpreter ended it: an external kill or a native crash."
            + _hint(number)
        )
    if exitcode >= 128:
        number = exitcode - 128
        return (
            f"Collector process exited with code {exitcode} (shell-style signal {number}, "
            f"{signal_name(number)}).\nA native termination like this leaves no Python traceback."
            + _hint(number)
        )
    return f"Collector process exited with code {exitcode} without sending a Python traceback."


def format_collector_hang(
    age_s: float, hang_timeout_s: float, stack_text: str | None, *, stopped: bool = False
) -> str:
    """Describe a collector that stopped sending heartbeats (it was alive but made no progress);
    ``stopped``: the process is stopped (SIGSTOP, Ctrl-Z, a debugger), which explains it."""
    report = (
        f"Collector process hung: no heartbeat for {age_s:.1f} s (hang_timeout_s={hang_timeout_s:g}). "
        "close() terminates it.\n"
    )
    if stopped:
        return report + (
            "The process is stopped (SIGSTOP, Ctrl-Z or a debugger): it runs no code until it is continued "
            "(SIGCONT)."
        )
    report += (
        "A deadlocked native call, a blocking read or an endless loop without heartbeats causes this; raise "
        "RunnerConfig.hang_timeout_s if a step is legitimately that slow."
    )
    if stack_text and stack_text.strip():
        report += f"\nIts Python stacks when it was stopped (faulthandler):\n{stack_text.rstrip()}"
    return report


class CollectorHangError(CollectorDiedError, TimeoutError):
    """The collector stopped sending heartbeats; a ``CollectorDiedError`` and a ``TimeoutError``."""
