"""A tiny gymnasium environment that fails on purpose inside the collector process.

Registered as ``SimstreamFault-<fault>-v0``; use the id ``tests.rl.fault_env:SimstreamFault-<fault>-v0`` so a
spawned collector imports this module (and registers the ids) before making the environment. The fault
fires only in a child process, after ``FAULT_AFTER_STEPS`` steps of the first environment, and first
writes ``time.monotonic()`` (system-wide on Linux) to the file named by ``SIMSTREAM_RL_FAULT_STAMP``.
The ``close`` fault instead fires in any process: the first ``close()`` of an environment that has stepped
raises (a simulator that fails to release its resources). With ``slow_close`` the first environment's
``close()`` in the collector writes the stamp, then takes ``SLOW_CLOSE_S`` (a simulator that flushes its
logs): the learner is inside ``close()`` meanwhile.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import time

import gymnasium as gym
import numpy as np

FAULTS = (
    "none",
    "create",
    "raise",
    "unpicklable",
    "huge",
    "nan",
    "sigkill",
    "segfault",
    "abort",
    "exit135",
    "hang",
    "close",
    "slow_close",
)
FAULT_AFTER_STEPS = 40
HUGE_HEAD, HUGE_TAIL = "HUGE-HEAD-MARK", "HUGE-TAIL-MARK"
SLOW_CLOSE_S = 3.0


class UnpicklableFaultError(Exception):
    """Carries a lambda, so it cannot be pickled to the parent."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.callback = lambda: None


def stamp() -> None:
    path = os.environ.get("SIMSTREAM_RL_FAULT_STAMP")
    if path:
        with open(path, "w") as f:
            f.write(repr(time.monotonic()))


def in_child() -> bool:
    return mp.parent_process() is not None


class FaultEnv(gym.Env):
    """A 3-d point that drifts with the action; reward ``-|x|``; truncated after 50 steps."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, fault: str = "none") -> None:
        self.fault = fault
        self.state = np.zeros(3)
        self.t = 0
        self.stepped = False
        if fault == "create" and in_child():
            stamp()
            raise RuntimeError("FaultEnv could not be created (injected)")

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state = self.np_random.normal(size=3)
        self.t = 0
        return self.state.copy(), {}

    def step(self, action):
        self.t += 1
        self.stepped = True
        if in_child():
            _maybe_fault(self.fault)
        self.state = self.state + 0.1 * float(np.asarray(action).reshape(-1)[0])
        reward = -float(np.abs(self.state).sum())
        if self.fault == "nan" and _COUNT["steps"] >= FAULT_AFTER_STEPS and in_child():
            stamp()
            reward = float("nan")
        return self.state.copy(), reward, False, self.t >= 50, {}

    def close(self):
        if self.fault == "close" and self.stepped:
            self.stepped = False  # once: a second close() (gymnasium's __del__) finds nothing to release
            raise OSError("FaultEnv.close could not release the simulator (injected)")
        if self.fault == "slow_close" and self.stepped and in_child():
            self.stepped = False
            stamp()
            time.sleep(SLOW_CLOSE_S)
        super().close()


_COUNT = {"steps": 0}


def _maybe_fault(fault: str) -> None:
    _COUNT["steps"] += 1
    if fault in ("none", "create", "nan", "close", "slow_close") or _COUNT["steps"] != FAULT_AFTER_STEPS:
        return
    stamp()
    if fault == "raise":
        raise ValueError("injected failure in the middle of a rollout")
    if fault == "unpicklable":
        raise UnpicklableFaultError("an exception that cannot travel as a pickle")
    if fault == "huge":
        raise ValueError(HUGE_HEAD + "x" * 200_000 + HUGE_TAIL)
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "segfault":
        ctypes.string_at(0)
    if fault == "abort":
        os.abort()
    if fault == "exit135":
        os._exit(135)
    if fault == "hang":
        time.sleep(3600)


for _fault in FAULTS:
    gym.register(id=f"SimstreamFault-{_fault}-v0", entry_point=FaultEnv, kwargs={"fault": _fault})


def env_id(fault: str) -> str:
    """The id a spawned collector can make (imports this module first)."""
    return f"tests.rl.fault_env:SimstreamFault-{fault}-v0"
