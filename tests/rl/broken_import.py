"""A collector module that fails while being imported (only ever imported by a spawned collector)."""

from tests.rl.fault_env import stamp

stamp()
raise ImportError("tests.rl.broken_import fails at import time (injected)")


def collect(stop_event, heartbeat, **kwargs):  # pragma: no cover - never reached
    pass
