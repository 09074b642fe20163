"""Bounded shared-memory log of episode lifecycle records (publications and evictions).

Producers append records when they publish or overwrite a buffer row; the owner drains them. The log is
one ring of ``capacity`` records with fixed-size storage (``capacity * (7 * 8 + 2 * max_steps)`` bytes):
scalar fields in an int64 table and the frame lists as two boolean masks per record. It has its own lock
(a :class:`~simstream._sync.SharedLock`, which a holder's death releases) and a doorbell that a drain
rings for producers waiting for space, so appending and draining never touch the buffer's locks.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .._sync import Doorbell, SharedLock

__all__ = ["EVICTED", "PUBLISHED", "LifecycleEventLog"]

_KINDS = ("published", "evicted")
PUBLISHED, EVICTED = range(2)
"""Kind codes of :meth:`LifecycleEventLog.append_columns` (indices into the kinds)."""
# Column order of the int64 record table.
_FIELDS = ("kind", "sequence", "run_id", "episode_id", "generation", "slot", "monotonic_ns")
_SCALARS = _FIELDS[2:]
_CURSOR_LEN = 5
"""Shared counters: next sequence, drained, reserved, reservations waiting, slots the latest one wants."""


def _shared_tensor(ctx: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[Any, torch.Tensor]:
    """Allocates a zeroed ``ctx.RawArray`` and a tensor view of it (the array is what pickles)."""
    raw = ctx.RawArray("B", math.prod(shape) * dtype.itemsize)
    return raw, _view(raw, dtype, shape)


def _view(raw: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(raw, dtype=dtype).view(shape)


class LifecycleEventLog:
    """Owns a bounded FIFO of lifecycle records in shared memory, appended by several processes.

    Records get consecutive sequence numbers ``0, 1, 2, ...`` in append order; ``drain`` returns them in
    that order. Invariants: ``0 <= next_sequence - drained <= capacity``; records ``drained ..
    next_sequence - 1`` are pending at ring positions ``sequence % capacity``; ``pending + reserved <=
    capacity``. A full log rejects an append whole. Producers :meth:`reserve` their records' space first,
    which waits while the log is full (back-pressure), then append into the reservation: space two
    producers saw free at the same moment cannot be promised to both.

    Args:
        capacity: Maximum number of pending records.
        max_steps: Length ``T`` of the frame masks of each record (the buffer's row capacity).
        ctx: Multiprocessing context that allocates the shared state (default: forkserver).

    Raises:
        ValueError: If ``capacity`` or ``max_steps`` is not an ``int`` of at least 1.

    Examples:
        >>> log = LifecycleEventLog(capacity=4, max_steps=3)
        >>> mask = torch.tensor([True, True, False])
        >>> log.append([dict(kind="published", run_id=7, episode_id=0, generation=1, slot=0,
        ...                  monotonic_ns=1, valid_mask=mask, anchor_mask=mask)])
        [0]
        >>> log.drain()[0]["valid_frame_indices"]
        [0, 1]
    """

    def __init__(self, capacity: int, max_steps: int, ctx: Any = None) -> None:
        for name, value in (("capacity", capacity), ("max_steps", max_steps)):
            if type(value) is not int or value < 1:
                raise ValueError(f"LifecycleEventLog.{name} must be an int >= 1, got {value!r}")
        ctx = ctx if ctx is not None else multiprocessing.get_context("forkserver")
        self.capacity = capacity
        self.max_steps = max_steps
        self._lock = SharedLock()
        self._space_freed = Doorbell(ctx)
        # [next_sequence, drained, reserved, waiting, wanted]: sequences below `drained` have been handed
        # to the owner; `reserved` slots are promised to appends that have not happened yet; `waiting`
        # reservations wait for room, the latest of them for `wanted` slots.
        self._raw_cursor, self._cursor = _shared_tensor(ctx, torch.int64, (_CURSOR_LEN,))
        self._raw_table, self._table = _shared_tensor(ctx, torch.int64, (capacity, len(_FIELDS)))
        self._raw_masks, self._masks = _shared_tensor(ctx, torch.bool, (capacity, 2, max_steps))
        self._numpy: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._holding = threading.local()
        """``active`` while this thread holds the log's lock through :meth:`holding`."""

    # Tensor views are rebuilt from the raw arrays, which pickle only while a child is being created.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_cursor", "_table", "_masks", "_numpy", "_holding"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._holding = threading.local()
        self._cursor = _view(self._raw_cursor, torch.int64, (_CURSOR_LEN,))
        self._table = _view(self._raw_table, torch.int64, (self.capacity, len(_FIELDS)))
        self._masks = _view(self._raw_masks, torch.bool, (self.capacity, 2, self.max_steps))
        self._numpy = None

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """NumPy views of cursor, table and masks (per process): an append's few small writes cost a
        fraction of the same writes through torch."""
        if self._numpy is None:
            self._numpy = (self._cursor.numpy(), self._table.numpy(), self._masks.numpy())
        return self._numpy

    @property
    def lock(self) -> SharedLock:
        """The log's lock (for a check that bounds waits on a stopped holder: ``with_deadline``)."""
        return self._lock

    @contextlib.contextmanager
    def holding(self, check: Callable[[], None] | None) -> Iterator[None]:
        """Hold the log's lock for a block (waiting for it with ``check``); appends in the block take it
        without waiting. A producer holds it across a publication: what can wait (and be abandoned when the
        engine closes) is over before its rows become visible, so their records are never lost."""
        with self._lock.held(check):
            self._holding.active = True
            try:
                yield
            finally:
                self._holding.active = False

    def pending(self) -> int:
        """Number of records appended and not drained yet."""
        with self._lock.held(None):
            return self._pending_locked()

    def fill_estimate(self) -> tuple[int, int]:
        """``(pending, reserved)`` read without the lock: exact when nothing appends meanwhile, and never a
        wait (for messages about a full log, which must not hang on a stopped holder)."""
        cursor = self._arrays()[0]
        return int(cursor[0]) - int(cursor[1]), int(cursor[2])

    def waiting_for_room(self) -> int:
        """Slots a reservation waits for while fewer are free (the latest to wait, if several do); 0 when
        none waits, or when a drain has freed enough meanwhile. Read without the lock, as
        :meth:`fill_estimate`: it tells the owner that its writers are paused until it drains."""
        cursor = self._arrays()[0]
        waiting, wanted = int(cursor[3]), int(cursor[4])
        free = self.capacity - (int(cursor[0]) - int(cursor[1])) - int(cursor[2])
        return wanted if waiting > 0 and free < wanted else 0

    def free_slots(self) -> int:
        """Number of records that can be appended or reserved before the log is full."""
        with self._lock.held(None):
            return self._free_locked()

    def append(
        self,
        records: Sequence[dict[str, Any]],
        *,
        reserved: bool = False,
        check: Callable[[], None] | None = None,
    ) -> list[int]:
        """Appends ``records`` in order, all or none, and returns their sequence numbers.

        Args:
            records: Dicts with ``kind`` (``"published"`` or ``"evicted"``), int ``run_id``,
                ``episode_id``, ``generation``, ``slot``, ``monotonic_ns`` and bool tensors ``valid_mask``
                and ``anchor_mask`` of shape ``[max_steps]``. Anchors are kept only where frames are
                valid.
            reserved: Use space taken earlier with :meth:`reserve` (at least ``len(records)`` slots).
            check: Called every 0.1 s while another process holds the log's lock; ends the wait by
                raising.

        Returns:
            The sequence numbers assigned, consecutive and in the order of ``records``.

        Raises:
            ValueError: If a record is malformed; nothing is written.
            RuntimeError: If fewer than ``len(records)`` slots are free (or reserved, with
                ``reserved=True``); nothing is written.
        """
        if not records:
            return []
        rows, valid, anchor = self._encode(records)
        return self._write(rows.numpy(), valid.numpy(), anchor.numpy(), reserved, check)

    def append_columns(
        self,
        kind: np.ndarray,
        scalars: np.ndarray,
        valid_mask: np.ndarray,
        anchor_mask: np.ndarray,
        *,
        reserved: bool = False,
        check: Callable[[], None] | None = None,
    ) -> list[int]:
        """:meth:`append` for records given as NumPy columns: one check and one copy for all of them.

        Args:
            kind: ``[N]`` integer kinds, :data:`PUBLISHED` or :data:`EVICTED`.
            scalars: ``[N, 5]`` int64 ``(run_id, episode_id, generation, slot, monotonic_ns)``.
            valid_mask: ``[N, max_steps]`` bool.
            anchor_mask: ``[N, max_steps]`` bool (kept only where frames are valid).
            reserved, check: As in :meth:`append`.

        Returns:
            The sequence numbers assigned, consecutive and in row order.

        Raises:
            ValueError: If a column has the wrong shape or a kind is unknown; nothing is written.
            RuntimeError: As in :meth:`append`.
        """
        kind = np.asarray(kind)
        count = len(kind) if kind.ndim == 1 else -1
        shapes_ok = (
            count >= 0
            and np.shape(scalars) == (count, len(_SCALARS))
            and np.shape(valid_mask) == (count, self.max_steps)
            and np.shape(anchor_mask) == (count, self.max_steps)
        )
        if not shapes_ok:
            raise ValueError(
                f"lifecycle columns must be kind [N], scalars [N, {len(_SCALARS)}] and masks "
                f"[N, {self.max_steps}]"
            )
        if count == 0:
            return []
        if ((kind < 0) | (kind >= len(_KINDS))).any():
            raise ValueError(f"lifecycle kinds must be indices into {_KINDS}")
        rows = np.empty((count, len(_FIELDS)), dtype=np.int64)
        rows[:, 0] = kind
        rows[:, 2:] = scalars
        valid = np.asarray(valid_mask, dtype=bool)
        return self._write(rows, valid, np.asarray(anchor_mask, dtype=bool) & valid, reserved, check)

    def _write(
        self,
        rows: np.ndarray,
        valid: np.ndarray,
        anchor: np.ndarray,
        reserved: bool,
        check: Callable[[], None] | None,
    ) -> list[int]:
        """Appends encoded records (``rows`` in table layout, sequence column unset) all or none."""
        count = len(rows)
        cursor, table, masks = self._arrays()
        held = getattr(self._holding, "active", False)
        with contextlib.nullcontext() if held else self._lock.held(check):
            first = int(cursor[0])
            if reserved:
                if int(cursor[2]) < count:
                    raise RuntimeError(
                        f"ODS lifecycle event log: appending {count} records into a reservation of "
                        f"{int(cursor[2])}"
                    )
                cursor[2] -= count
            elif self._free_locked() < count:
                raise RuntimeError("ODS lifecycle event capacity exhausted")
            sequences = np.arange(first, first + count, dtype=np.int64)
            positions = sequences % self.capacity
            rows[:, 1] = sequences
            table[positions] = rows
            masks[positions, 0] = valid
            masks[positions, 1] = anchor
            # Publishing the cursor last keeps a concurrent drain from reading half-written records.
            cursor[0] = first + count
        return sequences.tolist()

    def reserve(self, count: int, should_stop: Callable[[], bool], poll_s: float = 0.05) -> bool:
        """Takes ``count`` slots for later ``append(..., reserved=True)``, waiting while they are not free.

        Sleeps on the log's doorbell in slices of at most ``poll_s`` seconds (a drain rings it) and calls
        ``should_stop`` between slices, without holding the log's lock. Give back what will not
        be appended with :meth:`release`.

        Args:
            count: Slots needed, ``0 <= count <= capacity`` (more could never become free).
            should_stop: Polled between waits; returning true abandons the wait.
            poll_s: Longest single wait in seconds.

        Returns:
            True once the slots are reserved, False if stopped first (nothing reserved).

        Raises:
            ValueError: If ``count`` is outside ``[0, capacity]`` or ``poll_s`` is not positive.
        """
        if type(count) is not int or not 0 <= count <= self.capacity:
            raise ValueError(
                f"LifecycleEventLog.reserve count must be an int in [0, {self.capacity}], got {count!r}"
            )
        if not poll_s > 0:
            raise ValueError(f"LifecycleEventLog.reserve poll_s must be > 0, got {poll_s!r}")

        def check() -> None:
            if should_stop():
                raise _Stopped

        cursor, waited, done = self._arrays()[0], False, False
        try:
            while True:
                with self._lock.held(check):
                    if self._free_locked() >= count:
                        cursor[2] += count
                        cursor[3] -= int(waited)
                        done = True
                        return True
                    if not waited:
                        waited = True
                        cursor[3] += 1
                    cursor[4] = count
                check()
                # a drain between the look above and this sleep rang the bell: the sleep ends at once
                self._space_freed.wait(poll_s)
        except _Stopped:
            return False
        finally:
            if waited and not done:  # stopped, or the lock's check raised: not with that check again
                with self._lock.held(None):
                    cursor[3] -= 1

    def release(self, count: int, check: Callable[[], None] | None = None) -> None:
        """Gives back ``count`` reserved slots that will not be appended (at most what is reserved).

        ``check`` is called every 0.1 s while another process holds the log's lock; it ends the wait by
        raising (nothing is given back then).
        """
        if type(count) is not int or count < 0:
            raise ValueError(f"LifecycleEventLog.release count must be an int >= 0, got {count!r}")
        cursor = self._arrays()[0]
        with self._lock.held(check):
            cursor[2] -= min(count, int(cursor[2]))
        self._space_freed.ring()

    def drain(self, check: Callable[[], None] | None = None) -> list[dict[str, Any]]:
        """Removes and returns every pending record in sequence order, waking producers waiting for space.

        Args:
            check: Called every 0.1 s while the log's lock is held elsewhere; it ends the wait by raising
                (a producer killed while appending never releases the lock).

        Returns:
            Plain dicts (no shared memory) with ``kind``, ``sequence``, ``run_id``, ``episode_id``,
            ``generation``, ``slot``, ``monotonic_ns``, ``valid_frame_indices``,
            ``eligible_anchor_indices`` (lists of frame indices), ``valid_frames`` and
            ``eligible_anchors`` (their lengths).
        """
        with self._lock.held(check):
            end, start = int(self._cursor[0]), int(self._cursor[1])
            if end == start:
                return []
            positions = torch.arange(start, end, dtype=torch.int64) % self.capacity
            table = self._table[positions].clone()
            masks = self._masks[positions].clone()
            self._cursor[1] = end
        self._space_freed.ring()
        return _decode(table, masks)

    def state_dict(self) -> dict[str, int]:
        """Counters of the log: ``next_sequence`` (records ever appended), ``pending`` and ``reserved``."""
        with self._lock.held(None):
            end, start, reserved = (int(value) for value in self._cursor[:3])
        return {"next_sequence": end, "pending": end - start, "reserved": reserved}

    def _pending_locked(self) -> int:
        cursor = self._arrays()[0]
        return int(cursor[0]) - int(cursor[1])

    def _free_locked(self) -> int:
        return self.capacity - self._pending_locked() - int(self._arrays()[0][2])

    def _encode(self, records: Sequence[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
        """Validates records and packs them into the table row and mask layout."""
        rows = torch.empty((len(records), len(_FIELDS)), dtype=torch.int64)
        valid = torch.empty((len(records), self.max_steps), dtype=torch.bool)
        anchor = torch.empty_like(valid)
        for i, record in enumerate(records):
            if record.get("kind") not in _KINDS:
                raise ValueError(
                    f"lifecycle record {i} kind must be one of {_KINDS}, got {record.get('kind')!r}"
                )
            values = [_KINDS.index(record["kind"]), -1]
            for name in _SCALARS:
                value = record.get(name)
                if type(value) is not int or not -(2**63) <= value < 2**63:
                    raise ValueError(f"lifecycle record {i} {name} must be an int64, got {value!r}")
                values.append(value)
            rows[i] = torch.tensor(values, dtype=torch.int64)
            for name, out in (("valid_mask", valid), ("anchor_mask", anchor)):
                mask = record.get(name)
                if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (self.max_steps,):
                    raise ValueError(
                        f"lifecycle record {i} {name} must be a tensor of shape ({self.max_steps},)"
                    )
                out[i] = mask.detach().to(device="cpu", dtype=torch.bool)
        return rows, valid, anchor & valid


class _Stopped(Exception):
    """Ends :meth:`LifecycleEventLog.reserve`'s wait once ``should_stop`` is true."""


def _decode(table: torch.Tensor, masks: torch.Tensor) -> list[dict[str, Any]]:
    """Turns drained table rows and masks into plain Python records."""
    valid_lists = _frame_lists(masks[:, 0])
    anchor_lists = _frame_lists(masks[:, 1])
    records = []
    for values, frames, anchors in zip(table.tolist(), valid_lists, anchor_lists):
        record: dict[str, Any] = dict(zip(_FIELDS, values))
        record["kind"] = _KINDS[record["kind"]]
        record["valid_frame_indices"] = frames
        record["eligible_anchor_indices"] = anchors
        record["valid_frames"] = len(frames)
        record["eligible_anchors"] = len(anchors)
        records.append(record)
    return records


def _frame_lists(mask: torch.Tensor) -> list[list[int]]:
    """Per row of a ``[N, T]`` bool mask, the list of set column indices (one nonzero for all rows)."""
    counts = mask.sum(dim=1).tolist()
    columns = mask.nonzero()[:, 1]
    return [part.tolist() for part in torch.split(columns, counts)]
