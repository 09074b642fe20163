"""simstream: stream live simulation data into robot-learning training.

Producer processes run a simulator with a scripted expert and write whole episodes into a shared-memory
trajectory buffer; trainers (and every ``DataLoader`` worker) sample chunks or causal context windows while
the producers refill it. Importing this package never imports a simulator.
"""

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
