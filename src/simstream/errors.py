"""Exception types raised by simstream.

The names follow the reference online data engine so that its users can switch without changing their
``except`` clauses: every error a trainer may want to catch subclasses a builtin (``RuntimeError``,
``ValueError``, ``TimeoutError``) as well.
"""

from __future__ import annotations

__all__ = [
    "CollectorDiedError",
    "DataBudgetExhaustedError",
    "DataUnavailableError",
    "OnlineDataBudgetExhaustedError",
    "OnlineDataWorkerError",
    "add_note",
    "ended_process_error",
    "unsendable_error",
]


class OnlineDataWorkerError(RuntimeError):
    """A producer worker failed and its original exception could not be rebuilt.

    Also raised by ``stop()`` when a worker had to be terminated or killed, because a graceful close (and
    with it the durability of whatever the source flushes in ``close()``) could not be confirmed.
    """


class DataUnavailableError(RuntimeError):
    """No sampleable window satisfies the request right now (subclasses RuntimeError for existing callers).

    Producers keep running; the same call may succeed once more episodes are published.
    """


class DataBudgetExhaustedError(RuntimeError):
    """The per-episode sampling quotas of the eligible episodes cannot supply a complete batch.

    Nothing was charged. Request a refill (or let the refill policy publish fresh episodes) to continue.
    """


OnlineDataBudgetExhaustedError = DataBudgetExhaustedError
"""Alias kept for users of the reference engine."""


class CollectorDiedError(RuntimeError):
    """The RL collector process died; ``str(error)`` is the full diagnostic report.

    Attributes:
        report: The text produced by :func:`simstream.rl.format_collector_death`.
        exitcode: The process exit code (negative for a signal), or ``None`` when unknown.
        traceback_text: The collector's Python traceback when it managed to send one, else ``None``.
    """

    def __init__(self, report: str, exitcode: int | None, traceback_text: str | None) -> None:
        super().__init__(report)
        self.report = report
        self.exitcode = exitcode
        self.traceback_text = traceback_text

    def __reduce__(self):
        return (type(self), (self.report, self.exitcode, self.traceback_text))


def add_note(error: BaseException, note: str) -> None:
    """Attach a PEP 678 note to ``error`` (works on Python versions without ``add_note``)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # pragma: no cover - Python < 3.11
        notes = getattr(error, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            error.__notes__ = notes
        notes.append(note)


def unsendable_error(error: BaseException, traceback_text: str) -> OnlineDataWorkerError:
    """What stands for ``error`` where it cannot travel as itself (it does not pickle): its type, message
    and the traceback where it was raised."""
    kind = f"{type(error).__module__}.{type(error).__qualname__}"
    return OnlineDataWorkerError(f"Worker raised {kind}: {error}\n{traceback_text}")


def ended_process_error(worker: str, kind: str, message: str) -> OnlineDataWorkerError:
    """What a consumer raises for a worker's ``SystemExit``/``KeyboardInterrupt`` (named ``kind``): raised as
    it is, it would end the consumer's process too (a ``DataLoader`` worker catches only ``Exception``), or
    read as a lost Ray actor, without a word of where it came from."""
    return OnlineDataWorkerError(f"Worker {worker} raised {kind}: {message} (it ended that process)")
