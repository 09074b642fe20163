"""Files a command writes whole: checkpoints, videos, JSON summaries."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_whole"]


def write_whole(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """``write`` a hidden sibling of ``path`` (with its suffix, which may name the format), then rename it
    into place: an interrupted write (Ctrl-C, SIGTERM, a full disk) leaves the file that was there before,
    or none, never a truncated or plausible but wrong one. Returns ``path``."""
    path = Path(path)
    partial = path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
