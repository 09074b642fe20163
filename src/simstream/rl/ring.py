"""The shared-memory rollout ring between one collector (writer) and the learner (reader).

Every slot has a state, a sequence number and the policy version that produced it::

    FREE --writer claims--> WRITING --commit(seq, version)--> READY --reader takes--> READING --free--> FREE
      ^                         ^  |                            |
      +------- abandon ---------|--+                            |   (a rollout cut short)
                                +--- drop_oldest overflow ------+   (counted; READING is never taken back)

State changes happen under one :class:`~simstream._sync.SharedLock`, which the kernel releases when its
holder dies (a collector SIGKILLed while holding it wedges nobody), and whose every acquire is bounded
(a holder that is stopped, not dead, makes the other side raise ``TimeoutError``). The writer only ever
writes a slot it holds in ``WRITING``, and a slot in ``READING`` belongs to the reader until it frees it,
so a copy is never torn (UniLab's ring could overwrite the slot being read, reference §7.3). The reader
re-checks the slot's ``(state, seq)`` after copying anyway, and raises if the invariant was ever broken.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from .._sync import SharedLock
from .._validation import require_int

__all__ = ["RingStats", "RolloutRing", "TakenSlot"]

FREE, WRITING, READY, READING = 0, 1, 2, 3
_STATE, _SEQ, _VERSION = 0, 1, 2
_NEXT_SEQ, _COMMITTED, _DROPPED_OVERFLOW, _DROPPED_STALE, _CONSUMED = range(5)
_LOCK_TIMEOUT_S = 5.0
"""Longest wait for the ring's lock; every holder keeps it for microseconds, so only a stopped one (a
dead one released it) makes a wait this long."""
_LOCK_SLICE_S = 0.05


@dataclass(frozen=True)
class TakenSlot:
    """A slot the reader holds: where it is, its sequence number and its policy version."""

    slot: int
    seq: int
    version: int


@dataclass(frozen=True)
class RingStats:
    """Monotonic counters of one ring."""

    committed: int
    """Rollouts the writer completed."""
    consumed: int
    """Rollouts the reader took and freed."""
    dropped_overflow: int
    """READY rollouts overwritten by ``drop_oldest`` before anyone read them."""
    dropped_stale: int
    """READY rollouts discarded by the reader for exceeding the policy-lag cap."""


class RolloutRing:
    """Owns ``num_slots`` rollouts of fixed-shape fields in shared memory, their states and counters.

    Args:
        fields: ``name -> (per-slot shape, dtype)``.
        num_slots: Slots in the ring (>= 2).
        overflow: What the writer does when no slot is free: ``block`` waits for the reader
            (back-pressure); ``drop_oldest`` overwrites the oldest unread rollout and counts it.
        ctx: Multiprocessing context of the processes that share the ring.
    """

    def __init__(
        self,
        fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        num_slots: int,
        overflow: Literal["block", "drop_oldest"],
        ctx,
    ) -> None:
        require_int("RolloutRing", "num_slots", num_slots, 2)
        if overflow not in ("block", "drop_oldest"):
            raise ValueError(f"RolloutRing.overflow must be 'block' or 'drop_oldest', got {overflow!r}")
        self.num_slots = num_slots
        self.overflow = overflow
        self.data = {
            name: torch.zeros((num_slots, *shape), dtype=dtype).share_memory_()
            for name, (shape, dtype) in fields.items()
        }
        self._meta = torch.zeros((num_slots, 3), dtype=torch.int64).share_memory_()
        self._counters = torch.zeros(5, dtype=torch.int64).share_memory_()
        self._lock = SharedLock()
        self._filled = ctx.Semaphore(0)  # doorbell rung by commit(); spurious wake-ups are harmless
        self._freed = ctx.Semaphore(0)  # doorbell rung whenever a slot becomes FREE

    @staticmethod
    def shared_bytes(fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]], num_slots: int) -> int:
        """Bytes of shared memory the rollouts of a ring of ``num_slots`` slots of ``fields`` take."""
        return num_slots * sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields.values())

    @contextmanager
    def _locked(self, check_peer: Callable[[], None] | None = None) -> Iterator[None]:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S

        def check() -> None:
            if check_peer is not None:
                check_peer()
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"RolloutRing lock held for more than {_LOCK_TIMEOUT_S} s by another process: it is "
                    "stopped or stuck (a process that dies holding the lock releases it)"
                )

        with self._lock.held(check, _LOCK_SLICE_S):
            yield

    # ----------------------------------------------------------------- writer (collector)
    def acquire(
        self,
        *,
        should_stop: Callable[[], bool],
        on_wait: Callable[[], None] = lambda: None,
        wait_slice_s: float = 0.05,
    ) -> int | None:
        """Claim a slot to write; ``None`` once ``should_stop()`` is true.

        In ``block`` mode this waits (in slices, calling ``on_wait`` after each, e.g. a heartbeat) until
        the reader frees a slot; in ``drop_oldest`` mode it only waits while every slot is being read.
        """
        while True:
            with self._locked():
                slot = self._claim()
            if slot is not None:
                return slot
            if should_stop():
                return None
            on_wait()
            self._freed.acquire(timeout=wait_slice_s)

    def _claim(self) -> int | None:
        states = self._meta[:, _STATE]
        free = (states == FREE).nonzero().flatten()
        if free.numel():
            slot = int(free[0])
        elif self.overflow == "drop_oldest" and bool((states == READY).any()):
            seqs = torch.where(states == READY, self._meta[:, _SEQ], torch.iinfo(torch.int64).max)
            slot = int(seqs.argmin())
            self._counters[_DROPPED_OVERFLOW] += 1
        else:
            return None
        self._meta[slot, _STATE] = WRITING
        return slot

    def commit(self, slot: int, version: int) -> int:
        """Publish the slot written since :meth:`acquire`, stamped with ``version``; returns its seq."""
        with self._locked():
            if int(self._meta[slot, _STATE]) != WRITING:
                raise RuntimeError(f"RolloutRing.commit: slot {slot} is not held by the writer")
            seq = int(self._counters[_NEXT_SEQ])
            self._counters[_NEXT_SEQ] += 1
            self._meta[slot, _SEQ] = seq
            self._meta[slot, _VERSION] = version
            self._meta[slot, _STATE] = READY
            self._counters[_COMMITTED] += 1
        self._filled.release()
        return seq

    def abandon(self, slot: int) -> None:
        """Give back a slot claimed by :meth:`acquire` and not committed (the rollout was cut short)."""
        with self._locked():
            if int(self._meta[slot, _STATE]) != WRITING:
                return
            self._meta[slot, _STATE] = FREE
        self._freed.release()

    # ----------------------------------------------------------------- reader (learner)
    def take(
        self,
        max_count: int,
        min_version: int | None = None,
        check: Callable[[], None] | None = None,
        newest_at_least: int | None = None,
    ) -> list[TakenSlot]:
        """Hold up to ``max_count`` READY slots, oldest first (non-blocking but for the lock).

        READY slots produced by a policy older than ``min_version`` (their oldest step's version below it),
        or wholly by policies older than ``newest_at_least`` (their newest step's version below it), are
        freed and counted as stale.
        ``check`` runs while the writer holds the lock and ends the wait by raising (the runner's check
        of its collector: one stopped holding the lock is a hang, raised before the lock's own 5 s).
        """
        taken: list[TakenSlot] = []
        freed = 0
        with self._locked(check):
            ready = (self._meta[:, _STATE] == READY).nonzero().flatten().tolist()
            ready.sort(key=lambda s: int(self._meta[s, _SEQ]))
            for slot in ready:
                version = int(self._meta[slot, _VERSION])
                if (min_version is not None and version < min_version) or (
                    newest_at_least is not None and int(self.data["versions"][slot].max()) < newest_at_least
                ):
                    self._meta[slot, _STATE] = FREE
                    self._counters[_DROPPED_STALE] += 1
                    freed += 1
                elif len(taken) < max_count:
                    self._meta[slot, _STATE] = READING
                    taken.append(TakenSlot(slot, int(self._meta[slot, _SEQ]), version))
        for _ in range(freed):
            self._freed.release()
        return taken

    def wait_filled(self, timeout_s: float) -> None:
        """Sleep until a commit rings the doorbell or ``timeout_s`` passes (bounded, never raises)."""
        self._filled.acquire(timeout=timeout_s)

    def gather(self, taken: list[TakenSlot]) -> dict[str, torch.Tensor]:
        """Copy the held slots out: ``name -> [len(taken), *per-slot shape]`` (the reader's own memory)."""
        out = {name: torch.stack([tensor[t.slot] for t in taken]) for name, tensor in self.data.items()}
        for t in taken:
            state, seq = int(self._meta[t.slot, _STATE]), int(self._meta[t.slot, _SEQ])
            if state != READING or seq != t.seq:
                raise RuntimeError(
                    f"RolloutRing: slot {t.slot} changed while it was read "
                    f"(seq {t.seq} -> {seq}, state {state})"
                )
        return out

    def free(self, taken: list[TakenSlot]) -> None:
        """Give held slots back to the writer."""
        with self._locked():
            for t in taken:
                self._meta[t.slot, _STATE] = FREE
            self._counters[_CONSUMED] += len(taken)
        for _ in taken:
            self._freed.release()

    # ----------------------------------------------------------------- both
    def stats(self) -> RingStats:
        """A snapshot of the counters."""
        c = self._counters.tolist()
        return RingStats(c[_COMMITTED], c[_CONSUMED], c[_DROPPED_OVERFLOW], c[_DROPPED_STALE])

    def states(self) -> list[int]:
        """Slot states (``FREE``, ``WRITING``, ``READY``, ``READING``), for tests and debugging."""
        return self._meta[:, _STATE].tolist()

    def release(self) -> None:
        """Drop this process's mappings (memory is freed once every process has dropped them).

        The counters keep their last values (as private copies), so :meth:`stats` still answers. The lock
        (a file descriptor) and the two doorbells (named semaphores) go too: a closed runner kept in a
        sweep to read its history held them until it was collected.
        """
        self.data = {}
        self._meta = self._meta.clone()
        self._counters = self._counters.clone()
        self._lock = self._filled = self._freed = None
