"""Asynchronous RL: a supervised collector process feeding a learner through shared memory.

:class:`AsyncRunner` is the base (collector lifecycle, failure diagnosis, bounded waits, shutdown);
:class:`APPORunner` is asynchronous PPO with V-trace and a target network on gymnasium MuJoCo tasks.
Importing this package does not import a simulator; the collector imports gymnasium when it starts.
"""

from ..errors import CollectorDiedError
from .appo import NonFiniteError
from .appo_runner import APPORunner
from .config import APPOConfig, RunnerConfig
from .diagnosis import CollectorHangError, format_collector_death
from .ring import RingStats, RolloutRing
from .runner import AsyncRunner, CloseReport
from .weights import WeightBuffer

__all__ = [
    "APPOConfig",
    "APPORunner",
    "AsyncRunner",
    "CloseReport",
    "CollectorDiedError",
    "CollectorHangError",
    "NonFiniteError",
    "RingStats",
    "RolloutRing",
    "RunnerConfig",
    "WeightBuffer",
    "format_collector_death",
]
