"""First code of the collector process after the shared ``worker_entry`` guard (kept free of heavy imports).

It ignores SIGINT (the learner handles Ctrl-C), arms ``faulthandler`` on the run's crash log (so SIGSEGV,
SIGABRT and SIGBUS leave a Python stack, and SIGUSR1 dumps the stacks of a hung collector), grants the
start-up grace on the heartbeat, then imports the collector function by name: an import error happens
here, inside the guard, and is reported.
"""

from __future__ import annotations

import faulthandler
import importlib
import signal
import traceback
from functools import partial

from ..workers.supervisor import Heartbeat, owner_watch
from .crash_log import clean_up

__all__ = ["collector_entry", "resolve_target"]

HEARTBEAT_INDEX = 0


def resolve_target(target: str):
    """``"package.module:Class.attribute"`` -> the object (imports the module)."""
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def collector_entry(
    target: str,
    stop_event,
    heartbeat: Heartbeat,
    startup_grace_s: float,
    crash_path: str,
    crash_dir_is_temporary: bool,
    kwargs: dict,
) -> None:
    """Run ``target(stop_event=..., heartbeat=..., **kwargs)`` with crash reporting armed.

    The crash log is the learner's to clean up (a temporary directory is removed, an empty log in a run
    directory too); when the learner is gone (killed, so its ``close()`` never ran) the collector does
    it on its way out, as nobody is left to read the log.
    """
    # Ctrl-C reaches the whole process group: the learner decides, and close() stops the collector cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    crash_log = open(crash_path, "a", buffering=1)  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.enable(crash_log, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, crash_log, all_threads=True)
    heartbeat.hold(HEARTBEAT_INDEX, startup_grace_s)
    try:
        collector_fn = resolve_target(target)
        collector_fn(stop_event=stop_event, heartbeat=partial(heartbeat.beat, HEARTBEAT_INDEX), **kwargs)
    except BaseException:
        # The channel carries a capped copy; the log keeps every line of it.
        traceback.print_exc(file=crash_log)
        raise
    finally:
        faulthandler.disable()
        crash_log.close()
        if owner_watch()():  # the learner is gone: clean up as its close() would have
            clean_up(crash_path, crash_dir_is_temporary)
