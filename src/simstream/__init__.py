"""simstream: stream live simulation data into robot-learning training.

Producer processes run a simulator with a scripted expert and write whole episodes into a shared-memory
trajectory buffer; trainers (and every ``DataLoader`` worker) sample chunks or causal context windows while
the producers refill it. Importing this package never imports a simulator, and imports torch only when a
name below is first used (``simstream --help`` answers without it, and a Ctrl-C while a command starts up
is not a traceback from inside torch's import).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import OnlineDataEngineCfg
    from .engine.engine import OnlineDataEngine
    from .engine.state import OnlineDataEngineState
    from .errors import (
        DataBudgetExhaustedError,
        DataUnavailableError,
        OnlineDataBudgetExhaustedError,
        OnlineDataWorkerError,
    )
    from .sources import Episode, EpisodeSource, Field, Segment, SourceSpec

__all__ = [
    "DataBudgetExhaustedError",
    "DataUnavailableError",
    "Episode",
    "EpisodeSource",
    "Field",
    "OnlineDataBudgetExhaustedError",
    "OnlineDataEngine",
    "OnlineDataEngineCfg",
    "OnlineDataEngineState",
    "OnlineDataWorkerError",
    "Segment",
    "SourceSpec",
]

__version__ = "0.1.0"

_HOMES = {
    "OnlineDataEngineCfg": "config",
    "OnlineDataEngine": "engine.engine",
    "OnlineDataEngineState": "engine.state",
    "DataBudgetExhaustedError": "errors",
    "DataUnavailableError": "errors",
    "OnlineDataBudgetExhaustedError": "errors",
    "OnlineDataWorkerError": "errors",
    "Episode": "sources",
    "EpisodeSource": "sources",
    "Field": "sources",
    "Segment": "sources",
    "SourceSpec": "sources",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # a submodule, as eager imports bound them
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
