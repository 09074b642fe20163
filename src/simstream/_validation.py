"""The shared checks behind every config's ``<Owner>.<field> must be <accepted range>, got <value>`` message.

Each helper raises ``ValueError`` naming the owner, the field, what is accepted and the value received, so
every config (engine, async RL, behaviour cloning, the CLIs) words its errors the same way.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable
from numbers import Real
from pathlib import Path

__all__ = [
    "MAX_TORCH_THREADS",
    "finite_number",
    "require",
    "require_choice",
    "require_int",
    "require_number",
    "require_writable",
]

MAX_TORCH_THREADS = 256
"""Most torch threads a command takes (``--num-threads``, ``--idle-threads``): far past this, OpenMP is
asked for threads no machine has, and past a C int ``torch.set_num_threads`` fails naming no option."""


def require(ok: bool, owner: str, name: str, accepted: str, value: object, consequence: str = "") -> None:
    """Raise ``ValueError("<owner>.<name> must be <accepted>, got <value!r>")`` unless ``ok``.

    The general form, for rules the typed helpers below do not express (a relation between fields, a
    non-empty tuple, ...). ``consequence``, appended after a full stop, says what would go wrong when that
    is not obvious.
    """
    if not ok:
        message = f"{owner}.{name} must be {accepted}, got {value!r}"
        raise ValueError(f"{message}. {consequence}" if consequence else message)


def require_default(config: object, owner: str, name: str, when: str, consequence: str) -> None:
    """Raise ``ValueError("<owner>.<name> must be <default> (its default) <when>, got <value!r>")`` unless
    field ``name`` of the dataclass ``config`` holds its default: an option that has no effect ``when``
    would be accepted, ignored, and recorded as if applied."""
    default = type(config).__dataclass_fields__[name].default
    value = getattr(config, name)
    require(value == default, owner, name, f"{default!r} (its default) {when}", value, consequence)


def require_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ``ValueError("<owner>.<name> must be an int >= low, got value")`` unless ``value`` fits.

    ``bool`` is rejected (``type(value) is int``); with ``high`` the message names ``[low, high]``.
    """
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{owner}.{name} must be an int {bound}, got {value!r}")


def finite_number(value: object) -> bool:
    """A finite real number of any type (Python or NumPy), not a ``bool``; an int too large for a float is
    not finite (``math.isfinite`` raises ``OverflowError`` on it)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def require_number(
    owner: str,
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    consequence: str = "",
) -> None:
    """Require a finite real number (``bool`` excluded) within the bounds; ``optional`` also accepts ``None``.

    ``low_open`` / ``high_open`` exclude the bound itself. Messages read ``a finite number > 0``,
    ``a number in (0, 1]`` or ``None or a finite number >= 0``.

    Examples:
        >>> require_number("APPOConfig", "gamma", 1.5, 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: APPOConfig.gamma must be a number in [0, 1], got 1.5
    """
    if optional and value is None:
        return
    ok = finite_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if low is not None and high is not None:
        accepted = (
            f"a number in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"
        )
    elif low is not None:
        accepted = f"a finite number {'>' if low_open else '>='} {_bound(low)}"
    elif high is not None:
        accepted = f"a finite number {'<' if high_open else '<='} {_bound(high)}"
    else:
        accepted = "a finite number"
    require(ok, owner, name, f"None or {accepted}" if optional else accepted, value, consequence)


def require_choice(owner: str, name: str, value: object, choices: Iterable[object]) -> None:
    """Require one of ``choices`` (a ``Literal`` field's values): ``must be 'a' or 'b'`` or ``one of ...``."""
    choices = tuple(choices)
    listed = [repr(choice) for choice in choices]
    accepted = " or ".join(listed) if len(listed) <= 2 else "one of " + ", ".join(listed)
    require(value in choices, owner, name, accepted, value)


def _bound(value: float) -> str:
    """``0`` -> ``0``, ``0.5`` -> ``0.5``, ``1e6`` -> ``1e6`` (not ``1e+06``)."""
    text = f"{value:g}"
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if e else text


def require_writable(owner: str, name: str, path: object, *, folder: bool = False) -> None:
    """Raise ``ValueError("<owner>.<name> cannot be written: ...")`` unless this process can create (or
    write) the file, or with ``folder`` the folder, ``path``, together with its missing parent folders.

    Checked by creating and removing a scratch folder where ``path`` would go (permission bits say nothing
    for root, a read-only file system or ``/proc``), so a command fails before its work, not after it.
    """
    path = Path(path)
    if path.exists():
        if folder != path.is_dir():
            kind = "a folder" if folder else "a file"
            raise ValueError(f"{owner}.{name} must be {kind}, got {str(path)!r}")
        if not folder:
            try:
                with open(path, "ab"):
                    return
            except OSError as error:
                raise ValueError(
                    f"{owner}.{name} cannot be written: {str(path)!r}: {error.strerror}"
                ) from None
    where = path if path.exists() else next(parent for parent in path.parents if parent.exists())
    if not where.is_dir():
        raise ValueError(f"{owner}.{name} cannot be written: {str(where)!r} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".simstream-write-check-", dir=where))
    except OSError as error:
        raise ValueError(
            f"{owner}.{name} cannot be written: {str(path)!r} (creating a folder in {str(where)!r} failed: "
            f"{error.strerror})"
        ) from None
