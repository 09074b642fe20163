"""The one integer-range check behind every config's ``<Owner>.<field> must be ...`` message."""

from __future__ import annotations

__all__ = ["require_int"]


def require_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ``ValueError("<owner>.<name> must be an int >= low, got value")`` unless ``value`` fits.

    ``bool`` is rejected (``type(value) is int``); with ``high`` the message names ``[low, high]``.
    """
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{owner}.{name} must be an int {bound}, got {value!r}")
