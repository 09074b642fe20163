"""Helpers to build engines on test sources and wait on them with bounds."""

from __future__ import annotations

import time
from collections.abc import Callable

from simstream import OnlineDataEngine, OnlineDataEngineCfg
from tests.support.sources import ScriptedSpec


def make_cfg(spec: ScriptedSpec | None = None, **overrides) -> OnlineDataEngineCfg:
    values = {"source": spec or ScriptedSpec(), "buffer_size": 4, "shutdown_timeout": 5.0}
    values.update(overrides)
    return OnlineDataEngineCfg(**values)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> float:
    """Poll ``predicate`` until true; returns the seconds it took. Fails the test past ``timeout_s``."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - began


def stop_quietly(engine: OnlineDataEngine) -> None:
    try:
        engine.stop()
    except BaseException:
        pass
