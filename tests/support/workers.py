"""Worker bodies for supervisor tests (importable by name, as ``WorkerSpec.target`` requires)."""

from __future__ import annotations

import os


def exit_when_told(go, code: int) -> None:
    """Wait (bounded) for ``go``, then exit with ``code`` without running any cleanup: a silent death."""
    go.wait(60.0)
    os._exit(code)


def wait_for(stop) -> None:
    """Return once ``stop`` is set (bounded)."""
    stop.wait(60.0)
