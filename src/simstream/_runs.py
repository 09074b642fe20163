"""Run folders of the commands that write one (``demo``, ``rl``): their default names and valid names."""

from __future__ import annotations

import os
import time

__all__ = ["is_folder_name", "new_run_name"]


def new_run_name(runs_dir: str | os.PathLike, prefix: str) -> str:
    """``<prefix>-<date>-<time>``, with ``-2``, ``-3``... when runs started in the same second."""
    stamp = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    name, k = stamp, 1
    while os.path.exists(os.path.join(runs_dir, name)):
        k += 1
        name = f"{stamp}-{k}"
    return name


def is_folder_name(name: str) -> bool:
    """A name one folder can have inside the runs folder (not empty, no ``/``, not ``.`` or ``..``)."""
    return bool(name) and "/" not in name and name not in (".", "..")
