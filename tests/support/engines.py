"""Helpers to build engines on test sources and stop them quietly."""

from __future__ import annotations

from simstream import OnlineDataEngine, OnlineDataEngineCfg
from tests.support.sources import ScriptedSpec


def make_cfg(spec: ScriptedSpec | None = None, **overrides) -> OnlineDataEngineCfg:
    values = {"source": spec or ScriptedSpec(), "buffer_size": 4, "shutdown_timeout": 5.0}
    values.update(overrides)
    return OnlineDataEngineCfg(**values)


def stop_quietly(engine: OnlineDataEngine) -> None:
    try:
        engine.stop()
    except BaseException:
        pass
