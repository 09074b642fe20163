"""Episode sources for tests: real processes, real shared memory, deterministic content.

``ScriptedSource`` writes frames whose values identify them: ``obs[..., 0]`` is a unique episode tag,
``obs[..., 1]`` the frame index ``t`` and ``obs[..., 2]`` the worker index, and ``actions`` repeat the tag.
Tests can therefore check that every sampled chunk is consecutive frames of one episode. Fault knobs make
a worker fail in every way the engine must report.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from simstream import Episode, Field, Segment


class UnpicklableError(Exception):
    """An exception whose instances cannot be pickled (holds a lock)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class OddInitError(Exception):
    """Pickles, but cannot be rebuilt: ``__init__`` needs two arguments."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


@dataclass(frozen=True)
class ScriptedSpec:
    """A picklable spec with knobs; ``lengths`` cycles per written row."""

    num_envs: int = 2
    max_episode_steps: int = 20
    lengths: tuple[int, ...] = (20,)
    segments: tuple[tuple[int, int, str | None, bool], ...] = ()
    """Segments of every episode (clipped to its length)."""
    continuity: tuple[int, ...] | None = None
    """Per-frame continuity ids of every episode (cut to its length)."""
    instruction: str | None = "stack the blocks"
    image: bool = False
    fail_attempts: int = 0
    """The first N attempts of every window report a failed episode."""
    fault: str | None = None
    """One of: raise, timeout (a ``TimeoutError`` of the source's own), unpicklable, oddinit, exit, sigkill,
    segfault, hang, stall, bad_report, build_raise, build_hang, build_sigkill (``build()`` writes its pid to
    ``stamp``, waits for a file ``stamp + ".go"``, then SIGKILLs its process),
    unwritten (the last row of the rollout leaves its last 3 reported ``actions`` frames unwritten),
    sys_exit (``sys.exit`` with a message), none (returns None without being asked to stop), node_only
    (raises ``NodeOnlyError`` of a module ``simstream_node_only_error`` that only the producer can import)."""
    fault_after: int = 0
    """Rollouts that succeed before the fault fires (per worker)."""
    fault_worker: int = 0
    close_fault: str | None = None
    """``raise`` or ``hang`` in ``close()``."""
    extra_fields: Mapping[str, Field] = field(default_factory=dict)
    """More fields; every element of frame ``t`` holds ``t``."""
    rollout_s: float = 0.0
    """Seconds every rollout takes (a slow simulator)."""
    close_s: float = 0.0
    """Seconds ``close()`` takes (a recorder flushing)."""
    rollout_log: str | None = None
    """A file every rollout appends a line to (``worker attempt``): how many ran, wherever they ran."""
    close_log: str | None = None
    """A file every ``close()`` appends its worker index to (a line)."""
    build_s: tuple[float, ...] = ()
    """Seconds ``build()`` takes, per worker index (a simulator loading its assets); 0 past the end."""
    stamp: str | None = None
    """The file of ``fault="build_sigkill"``; with ``build_s``, each slow build writes ``stamp.<worker>``
    as it begins."""
    fault_after_file: str | None = None
    """The fault fires only once this file exists (waited for, at most 60 s)."""

    def fields(self) -> Mapping[str, Field]:
        fields = {"obs": Field((3,)), "actions": Field((2,)), "rewards": Field(())}
        if self.image:
            fields["obs_image/rgb"] = Field((3, 8, 8), torch.uint8)
        fields.update(self.extra_fields)
        return fields

    def build(self, worker_index: int, seed: int) -> ScriptedSource:
        if self.fault == "build_raise" and worker_index == self.fault_worker:
            raise ValueError("source could not be built")
        if self.fault == "build_hang" and worker_index == self.fault_worker:
            threading.Event().wait(3600)
        if self.fault == "build_sigkill" and worker_index == self.fault_worker:
            with open(self.stamp, "w") as handle:
                handle.write(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not os.path.exists(self.stamp + ".go") and time.monotonic() < deadline:
                threading.Event().wait(0.01)  # a bounded poll: the test's go-ahead is a file
            os.kill(os.getpid(), signal.SIGKILL)
        if worker_index < len(self.build_s) and self.build_s[worker_index]:
            if self.stamp is not None:
                with open(f"{self.stamp}.{worker_index}", "w") as handle:
                    handle.write(str(os.getpid()))
            threading.Event().wait(self.build_s[worker_index])
        return ScriptedSource(self, worker_index, seed)


class ScriptedSource:
    def __init__(self, spec: ScriptedSpec, worker_index: int, seed: int) -> None:
        self.spec = spec
        self.worker = worker_index
        self.rollouts = 0
        self.rows_written = 0

    def _fault(self, should_stop) -> None:
        spec = self.spec
        if spec.fault is None or self.worker != spec.fault_worker or self.rollouts < spec.fault_after:
            return
        if spec.fault_after_file is not None:
            deadline = time.monotonic() + 60
            while not os.path.exists(spec.fault_after_file) and time.monotonic() < deadline:
                threading.Event().wait(0.01)  # a bounded poll: the go-ahead is a file
        kind = spec.fault
        if kind == "raise":
            raise KeyError("scripted failure in rollout")
        if kind == "timeout":
            raise TimeoutError("simulator step timed out")
        if kind == "unpicklable":
            raise UnpicklableError("cannot travel as a pickle")
        if kind == "oddinit":
            raise OddInitError(7, "odd constructor")
        if kind == "exit":
            os._exit(3)
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "segfault":
            ctypes.string_at(0)
        if kind == "hang":
            stamp = os.environ.get("SIMSTREAM_TEST_HANG_STAMP")
            if stamp:  # tells a test the source is inside its hang now
                with open(stamp, "w") as handle:
                    handle.write(str(os.getpid()))
            threading.Event().wait(3600)
        if kind == "stall":
            while not should_stop():
                threading.Event().wait(0.02)
        if kind == "sys_exit":
            sys.exit("the simulator gave up")
        if kind == "node_only":
            import simstream_node_only_error

            raise simstream_node_only_error.NodeOnlyError("raised by a class only the producer's node has")

    def rollout(self, rows, *, attempt: int, should_stop):
        if self.spec.rollout_log:
            with open(self.spec.rollout_log, "a") as log:
                log.write(f"{self.worker} {attempt}\n")
        if self.spec.rollout_s:
            threading.Event().wait(self.spec.rollout_s)
        self._fault(should_stop)
        spec = self.spec
        if spec.fault == "none" and self.worker == spec.fault_worker and self.rollouts >= spec.fault_after:
            return None  # though should_stop() is False: a broken source
        spec = self.spec
        episodes = []
        num_rows = rows.batch_size[0]
        unwritten = spec.fault == "unwritten" and self.worker == spec.fault_worker
        unwritten = unwritten and self.rollouts >= spec.fault_after
        for row in range(num_rows):
            length = spec.lengths[self.rows_written % len(spec.lengths)]
            tag = float(self.worker * 1_000_000 + self.rows_written * 10 + attempt)
            t = torch.arange(length, dtype=torch.float32)
            rows["obs"][row, :length, 0] = tag
            rows["obs"][row, :length, 1] = t
            rows["obs"][row, :length, 2] = float(self.worker)
            last_written = length - 3 if unwritten and row == num_rows - 1 else length
            rows["actions"][row, :last_written] = tag
            rows["rewards"][row, :length] = t
            if spec.image:
                rows["obs_image", "rgb"][row, :length] = (self.rows_written % 250) + 1
            for name, extra in spec.extra_fields.items():  # the frame index t, in every element
                rows.get(tuple(name.split("/")))[row, :length] = t.reshape(-1, *[1] * len(extra.shape))
            segments = [
                Segment(lo, min(hi, length), text, ok) for lo, hi, text, ok in spec.segments if lo < length
            ]
            continuity = None if spec.continuity is None else list(spec.continuity[:length])
            success = attempt >= spec.fail_attempts
            episodes.append(
                Episode(
                    length=length,
                    success=success,
                    instruction=spec.instruction,
                    segments=segments,
                    continuity=continuity,
                    terminated=True,
                )
            )
            self.rows_written += 1
        self.rollouts += 1
        if spec.fault == "bad_report" and self.worker == spec.fault_worker:
            episodes[-1] = Episode(length=spec.max_episode_steps + 1)
        if should_stop():
            return None
        return episodes

    def close(self) -> None:
        if self.spec.close_log:
            with open(self.spec.close_log, "a") as log:
                log.write(f"{self.worker}\n")
        if self.spec.close_s:
            threading.Event().wait(self.spec.close_s)
        if self.spec.close_fault == "raise":
            raise OSError("flush failed while closing the source")
        if self.spec.close_fault == "hang":
            threading.Event().wait(3600)


def assert_whole_chunks(batch) -> None:
    """Every chunk of ``batch`` is consecutive valid frames of one ``ScriptedSource`` episode."""
    obs = batch["obs"]
    assert bool(batch["valid"].all())
    assert bool((obs[:, 1:, 1] - obs[:, :-1, 1] == 1).all())
    assert bool((obs[:, :, 0] == obs[:, :1, 0]).all())
    assert bool((batch["actions"][..., 0] == obs[..., 0]).all())
