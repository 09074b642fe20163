"""Which stored keys a batch copies: ``keys=`` of ``sample_batch`` and ``sample_batch_with_context``.

A key names a stored tensor or a nested group of them, as a TensorDict key (``"actions"``,
``("obs", "state")``, ``"obs"``) or as a field name (``"obs/state"``). The gather copies only the selected
keys, so a batch of one camera of three costs that camera's bytes, not all three.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["refuse_ambiguous_keys", "select_keys"]


def select_keys(
    paths: tuple[tuple[str, ...], ...], keys: object, always: Iterable[str] = ("valid",)
) -> tuple[int, ...] | None:
    """Positions in ``paths`` of the stored keys that ``keys`` names, plus ``always``; storage order.

    Args:
        paths: Every stored key as a path (``("obs", "state")``).
        keys: ``None`` (every key), one key, or a list of keys. A key is a string (``"actions"``; a ``/``
            nests: ``"obs/state"``) or a tuple of strings (``("obs", "state")``); a key naming a group
            (``"obs"``) selects every stored key under it. A nested key given alone is wrapped in a list,
            ``keys=[("obs", "state")]``: a bare tuple of two or more strings could mean one nested key (as
            in TensorDict) or several keys, and is refused.
        always: Keys added to every selection (``valid``).

    Returns:
        Sorted positions, or ``None`` when ``keys`` is ``None``.

    Raises:
        ValueError: ``keys`` or one of its entries is not a key, or ``keys`` is a bare tuple of strings.
        KeyError: a key names no stored key (the message names it and lists the stored keys).
    """
    if keys is None:
        return None
    refuse_ambiguous_keys(keys)
    entries = [keys] if isinstance(keys, str) else keys
    if not isinstance(entries, (list, tuple)):
        raise ValueError(
            f"keys must be None, a key or a list of keys (str or tuple of str), got {type(keys).__name__}."
        )
    selected: set[int] = set()
    for key in (*entries, *always):
        path = _path(key)
        matches = [i for i, stored in enumerate(paths) if stored[: len(path)] == path]
        if not matches:
            known = ", ".join(repr("/".join(p)) for p in paths)
            raise KeyError(f"keys: no stored key {key!r}; the buffer holds {known}.")
        selected.update(matches)
    return tuple(sorted(selected))


def refuse_ambiguous_keys(keys: object) -> None:
    """Raise ``ValueError`` for a bare tuple of two or more strings: one nested key, or several keys?"""
    if isinstance(keys, tuple) and len(keys) > 1 and all(isinstance(key, str) for key in keys):
        raise ValueError(
            f"keys={keys!r} is ambiguous: pass [{keys!r}] for the nested key {'/'.join(keys)!r}, or "
            f"{list(keys)!r} for {len(keys)} keys."
        )


def _path(key: object) -> tuple[str, ...]:
    if isinstance(key, str) and key and all(key.split("/")):
        return tuple(key.split("/"))
    if isinstance(key, tuple) and key and all(isinstance(part, str) and part for part in key):
        return key
    raise ValueError(
        f"keys: {key!r} is not a key; a key is a nonempty str ('actions', 'obs/state') or a tuple of "
        "nonempty str (('obs', 'state'))."
    )
