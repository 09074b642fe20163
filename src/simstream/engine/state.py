"""Lifecycle states of the engine."""

from __future__ import annotations

from enum import Enum

__all__ = ["OnlineDataEngineState"]


class OnlineDataEngineState(str, Enum):
    """Lifecycle states; the value is the upper-case name (``state.value == "READY"``).

    ``CREATED -> STARTING -> READY -> STOPPED``; any failure leads to ``FAILED``. ``FAILED`` and
    ``STOPPED`` are terminal: create a new engine to continue.
    """

    CREATED = "CREATED"
    STARTING = "STARTING"
    READY = "READY"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def code(self) -> int:
        """Integer stored in shared memory (declaration order)."""
        return _ORDER.index(self)

    @classmethod
    def from_code(cls, code: int) -> OnlineDataEngineState:
        return _ORDER[code]


_ORDER = list(OnlineDataEngineState)
