"""Refuse to run the lock-free readers on a CPU whose memory model they were not written for.

Samplers, the recorder and the async RL collector read shared memory without locks, under sequence
counters (``docs/design.md``, "Reading without locks"). They use plain loads and stores, with no fences,
which is correct on x86, whose stores (and loads) become visible in program order. On weakly ordered CPUs
(ARM64, POWER, RISC-V) a reader could pass both counter checks and still copy frames from before a
rewrite: a torn episode, served without any error. Starting there fails loudly instead, unless the user
accepts the risk with ``SIMSTREAM_ALLOW_WEAK_MEMORY_ORDER=1``.
"""

from __future__ import annotations

import os
import platform

__all__ = ["ALLOW_WEAK_MEMORY_ORDER", "require_ordered_memory"]

ALLOW_WEAK_MEMORY_ORDER = "SIMSTREAM_ALLOW_WEAK_MEMORY_ORDER"
"""Environment variable: ``1`` lets the engine and the weight buffer start on any CPU."""

_ORDERED_MACHINES = frozenset({"x86_64", "amd64", "x64", "i386", "i686"})
"""``platform.machine()`` values (lower case) of CPUs that keep stores and loads in program order."""


def require_ordered_memory(what: str) -> None:
    """Raise unless this CPU keeps shared-memory stores in program order (x86) or the user opted out.

    Args:
        what: What is being created, for the message (``"OnlineDataEngine"``).

    Raises:
        RuntimeError: on any other CPU, naming it and the environment variable that overrides the check.
    """
    machine = platform.machine()
    if machine.lower() in _ORDERED_MACHINES or os.environ.get(ALLOW_WEAK_MEMORY_ORDER) == "1":
        return
    raise RuntimeError(
        f"{what} reads shared memory without locks and relies on x86's memory ordering; this CPU is "
        f"{machine or 'unknown'!r}, where a reader could copy a half-rewritten row without noticing "
        f"(docs/design.md, 'Reading without locks'). Set {ALLOW_WEAK_MEMORY_ORDER}=1 to start anyway."
    )
