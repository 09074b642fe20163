"""How every ``simstream`` command turns an outcome into an exit code and a one-line message.

The library raises; a command reports: ``0`` done, ``2`` a bad option (a ``ValueError`` whose message names
the setting and its range), ``130`` interrupted, ``1`` any other failure, printed with its type and no
traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["exit_code"]


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
            the options were parsed, when such errors are failures like any other (exit 1).
        interrupted: What to say after Ctrl-C.
    """
    try:
        return job() or 0
    except SystemExit as exit_:  # tyro's --help and its own parse errors
        return int(exit_.code or 0)
    except KeyboardInterrupt:
        print(f"\n{prog}: {interrupted}", file=sys.stderr)
        return 130
    except Exception as error:  # the command reports; the library raises
        if isinstance(error, bad_options):
            print(f"{prog}: {error}", file=sys.stderr)
            return 2
        print(f"\n{prog}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
