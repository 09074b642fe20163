"""How every ``simstream`` command turns an outcome into an exit code and a one-line message.

The library raises; a command reports: ``0`` done, ``2`` a bad option (a ``ValueError`` whose message names
the setting and its range), ``130`` interrupted (Ctrl-C), ``143`` terminated (SIGTERM, handled as a Ctrl-C:
the engine is stopped, what was flushed stays), ``1`` any other failure, printed with its type and no
traceback.
"""

from __future__ import annotations

import contextlib
import contextvars
import signal
import sys
import threading
from collections.abc import Callable, Iterator

__all__ = ["EXIT_INTERRUPTED", "EXIT_TERMINATED", "exit_code", "options_checked", "sigterm_as_ctrl_c"]

EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT)."""
EXIT_TERMINATED = 143
"""Exit code after SIGTERM (128 + SIGTERM), which every command handles as a Ctrl-C."""


_checked: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("options_checked", default=None)
"""The running command's "every option is checked" mark (set by :func:`options_checked`)."""


def options_checked() -> None:
    """Mark that the running command has checked its options and starts its work: from here on a
    ``ValueError`` (a producer's, a source's, the writer's) is a failure (exit 1, with its type), not a
    bad option (exit 2). Outside a command (a library call of ``run_*``) it does nothing."""
    mark = _checked.get()
    if mark is not None:
        mark[0] = True


def exit_code(
    prog: str,
    job: Callable[[], int | None],
    *,
    bad_options: tuple[type[Exception], ...] = (ValueError,),
    interrupted: str = "interrupted",
) -> int:
    """Run ``job`` (it returns an exit code or ``None`` for 0) and report how it ended.

    Args:
        prog: The command as the user typed it, e.g. ``"simstream stream"``; every message starts with it.
        job: Parses the flags and runs the command.
        bad_options: Errors reported as a bad option (exit 2): a ``ValueError`` by default; ``()`` once
            the options were parsed, when such errors are failures like any other (exit 1). Once ``job``
            calls :func:`options_checked` they are failures too.
        interrupted: What to say after Ctrl-C.
    """
    terminated: list[int] = []
    checked = [False]
    token = _checked.set(checked)
    try:
        with sigterm_as_ctrl_c(terminated):
            return job() or 0
    except SystemExit as exit_:  # tyro's --help and its own parse errors
        return int(exit_.code or 0)
    except KeyboardInterrupt:
        if terminated:  # "interrupted; the producers are stopped" -> "terminated (SIGTERM); the ..."
            rest = interrupted.partition("; ")[2]
            print(f"\n{prog}: terminated (SIGTERM){'; ' + rest if rest else ''}", file=sys.stderr)
            return EXIT_TERMINATED
        print(f"\n{prog}: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # the command reports; the library raises
        if isinstance(error, bad_options) and not checked[0]:
            print(f"{prog}: {error}", file=sys.stderr)
            return 2
        print(f"\n{prog}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        _checked.reset(token)


@contextlib.contextmanager
def sigterm_as_ctrl_c(terminated: list[int]) -> Iterator[None]:
    """Handle SIGTERM as a Ctrl-C inside the block (noted in ``terminated``): a command stops its engine,
    saves and reports as after Ctrl-C, where SIGTERM's default action skipped all of it (``kill``, a job
    scheduler's time limit). Code that holds a Ctrl-C back holds it back too (the Ctrl-C handler in place
    decides); with Ctrl-C ignored (a background job) it raises at once."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is None:
        yield  # handlers can be set only there, and one installed outside Python cannot be put back
        return

    def on_sigterm(number, frame) -> None:
        terminated.append(number)
        handler = signal.getsignal(signal.SIGINT)
        interrupt = getattr(handler, "interrupt", None)
        if interrupt is not None:  # a Ctrl-C is held back (ctrl_c_deferred): held too, then raised
            interrupt()
        elif handler in (signal.SIG_IGN, signal.SIG_DFL, None):
            raise KeyboardInterrupt
        else:
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
