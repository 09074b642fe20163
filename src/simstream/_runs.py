"""Run folders of the commands that write one (``demo``, ``rl``): their default names and valid names."""

from __future__ import annotations

import os
import time

__all__ = ["FOLDER_NAME_RULE", "claim_run_folder", "is_folder_name"]

FOLDER_NAME_RULE = "a folder name (not empty, '.' or '..', no '/' or NUL, at most 255 bytes)"
"""What :func:`is_folder_name` accepts, for error messages."""


def claim_run_folder(runs_dir: str | os.PathLike, prefix: str) -> str:
    """Create a new folder ``<prefix>-<date>-<time>`` in ``runs_dir`` and return its name.

    Runs started in the same second get ``-2``, ``-3``...: the folder is created here (``mkdir`` fails
    for a name another process took first), so two runs never share one.

    Raises:
        OSError: ``runs_dir`` cannot be created or written.
    """
    os.makedirs(runs_dir, exist_ok=True)
    stamp = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    name, k = stamp, 1
    while True:
        try:
            os.mkdir(os.path.join(runs_dir, name))
            return name
        except FileExistsError:
            k += 1
            name = f"{stamp}-{k}"


def is_folder_name(name: str) -> bool:
    """A name one folder can have inside the runs folder: not empty, not ``.`` or ``..``, no ``/`` or NUL,
    at most 255 bytes (the longest file name Linux file systems take)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
        and len(name.encode("utf-8", "surrogateescape")) <= 255
    )
