"""Output slots that ``DataLoader`` workers reuse once the trainer process has dropped a batch.

Without slots, every batch a worker yields is a fresh shared-memory segment: created, faulted in page by
page, then passed to the trainer as a new file descriptor that the trainer maps again. For a low-dim batch
that hand-off costs several times the sampling itself. With slots, a worker writes its batches into a few
shared arenas allocated once. The first time a slot crosses to the trainer it travels as a shared storage
(one file descriptor); afterwards only its ``(pool, slot, generation)`` reference is pickled, and the
trainer rebuilds the batch's tensors on the storage it already maps.

Release protocol, two shared int64 counters per slot, each written by one process only:

* ``handed``: the worker counts every trip of the slot to the trainer (each time a tensor viewing it is
  pickled), the same slot possibly several times (a transform that also returns the previous batch);
* ``returned``: the trainer process, each time it receives a batch from any worker, adds to it the trips
  of every slot it received earlier that nothing in the trainer process references any more (no tensor,
  view, storage object or NumPy array: the storage's use count and its storage object's Python reference
  count are those of the registry alone, the check :class:`~simstream.sampling.gather.ArenaPool` makes
  in-process);
* the worker writes a slot again only when ``returned == handed`` (no trip in flight or held) and the
  worker holds no reference to it either.

A worker whose slots are all in use allocates a fresh shared batch instead, so nobody ever waits on a slot.
What cannot be tracked is a batch the trainer forwards to a third process and then drops: clone such a
batch first, or turn slots off with ``OnlineDataset(..., worker_slots=0)``.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict._reductions import _reduce_td as _tensordict_reduce
from torch.multiprocessing.reductions import reduce_storage as _torch_reduce_storage

from .._sync import process_state
from ..sampling.gather import BatchLayout, shared_arena, storage_use_count, use_counts_work

__all__ = ["WorkerSlots", "current_worker_slots", "worker_batch", "worker_slots"]

_HANDED, _RETURNED = 0, 1
"""Rows of a worker's ``[2, max_slots]`` trip counters."""


def _counts(anchor: torch.Tensor) -> tuple[int, int]:
    """Storage use count and Python references of ``anchor``'s storage object, seen from here."""
    storage = anchor.untyped_storage()
    return storage_use_count(storage), sys.getrefcount(storage)


def _anchor(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a received storage: what keeps it mapped here."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class _SendStorage:
    """Pickles as the storage itself (torch's shared-memory reduction), bypassing the slot reducer."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage

    def __reduce__(self):
        return _torch_reduce_storage(self.storage)


# -- worker side ------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Slot:
    layout: BatchLayout
    anchor: torch.Tensor
    leaves: list[torch.Tensor]
    generation: int
    baseline: tuple[int, int] = (0, 0)
    sent: bool = False
    layout_sent: bool = False
    last_used: int = 0
    signature: list[tuple] = field(default_factory=list)
    """What :func:`_signature` gives for a batch as :meth:`WorkerSlots.acquire` hands it out."""


class WorkerSlots:
    """A worker process's slots: at most ``max_slots`` arenas and ``max_bytes`` in total.

    Thread-safe: the ``DataLoader`` worker acquires slots in its main thread while its result queue's
    feeder thread pickles batches (and marks their slots HANDED).
    """

    def __init__(self, max_slots: int, max_bytes: int = 1 << 30) -> None:
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self.key = (os.getpid(), secrets.token_hex(8))
        self._flags_anchor = shared_arena(2 * 8 * max_slots)
        self._flags = self._flags_anchor.view(torch.int64).view(2, max_slots).numpy()
        self._flags[:] = 0
        self._flags_sent = False
        self._slots: list[_Slot | None] = [None] * max_slots
        self._by_pointer: dict[int, int] = {}
        self._lock = threading.Lock()
        self._tick = 0
        self.fallbacks = 0
        """Batches allocated outside the slots because every slot was in use (or too small a budget)."""

    def acquire(self, layout: BatchLayout) -> TensorDict:
        """An uninitialised batch of ``layout`` in a free slot (or, if none is free, a fresh shared one).

        Of the free slots of ``layout`` the most recently written is taken: its lines are the likeliest
        to still be in the cache (writing a cold arena first reads every line from memory).
        """
        with self._lock:
            self._tick += 1
            unused, reusable, best = None, None, None
            for index, slot in enumerate(self._slots):
                if slot is None:
                    unused = index if unused is None else unused
                elif self._is_free(index, slot):
                    if slot.layout != layout:
                        reusable = index if reusable is None else reusable
                    elif best is None or slot.last_used > self._slots[best].last_used:
                        best = index
            if best is not None:
                slot = self._slots[best]
                slot.last_used = self._tick
                return layout.tensordict([leaf.detach() for leaf in slot.leaves])
            target = unused if unused is not None else reusable
            if target is not None and self._fits(target, layout.nbytes):
                batch = self._create(target, layout)
                self._slots[target].last_used = self._tick
                return batch
        self.fallbacks += 1
        return layout.empty(shared=True)

    def _fits(self, index: int, nbytes: int) -> bool:
        held = sum(s.anchor.untyped_storage().nbytes() for i, s in enumerate(self._slots) if s and i != index)
        return held + nbytes <= self.max_bytes

    def _is_free(self, index: int, slot: _Slot) -> bool:
        trips = self._flags[:, index]
        return int(trips[_RETURNED]) == int(trips[_HANDED]) and _counts(slot.anchor) == slot.baseline

    def _create(self, index: int, layout: BatchLayout) -> TensorDict:
        old = self._slots[index]
        if old is not None:
            self._by_pointer.pop(old.anchor.untyped_storage().data_ptr(), None)
        anchor = shared_arena(layout.nbytes)
        slot = _Slot(layout, anchor, layout.carve(anchor), 0 if old is None else old.generation + 1)
        batch = layout.tensordict(slot.leaves)
        slot.signature = _signature(batch)
        del batch
        slot.baseline = _counts(anchor)
        self._slots[index] = slot
        self._by_pointer[anchor.untyped_storage().data_ptr()] = index
        return layout.tensordict([leaf.detach() for leaf in slot.leaves])

    def slot_of(self, storage: torch.UntypedStorage) -> int | None:
        """The slot whose arena ``storage`` is, if any."""
        index = self._by_pointer.get(storage.data_ptr())
        if index is None:
            return None
        slot = self._slots[index]
        if slot is None or slot.anchor.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        return index

    def _handover(self, index: int, whole_batch: bool = False) -> tuple:
        """Count a trip of slot ``index``; its reference (with its storage the first time) for pickling.

        ``whole_batch`` appends the slot's layout, which travels once per slot generation.
        """
        with self._lock:
            slot = self._slots[index]
            self._flags[_HANDED, index] += 1  # this process is the only writer of the row
            storage = None if slot.sent else _SendStorage(slot.anchor.untyped_storage())
            flags = None if self._flags_sent else _SendStorage(self._flags_anchor.untyped_storage())
            slot.sent = self._flags_sent = True
            if not whole_batch:
                return (self.key, index, slot.generation, storage, flags)
            layout = None if slot.layout_sent else slot.layout
            slot.layout_sent = True
            return (self.key, index, slot.generation, storage, flags, layout)

    def reduce(self, index: int) -> tuple:
        return (_receive_slot, self._handover(index))

    def reduce_batch(self, batch: TensorDict) -> tuple | None:
        """Pickle ``batch`` as a slot reference if it is exactly a batch of one slot, else ``None``.

        "Exactly": the same keys in the same order, each the very view :meth:`acquire` handed out. A
        transform that added, dropped, replaced or reshaped a key makes the batch travel key by key
        (views of a slot among its keys still travel by reference, see :meth:`reduce`).
        """
        items = list(batch.items(include_nested=True, leaves_only=True))
        first = items[0][1] if items else None
        if type(first) is not torch.Tensor or not first.is_cpu:
            return None
        index = self.slot_of(first.untyped_storage())
        if index is None:
            return None
        slot = self._slots[index]
        if batch.batch_size != slot.layout.batch_shape or _signature(batch, items) != slot.signature:
            return None
        return (_receive_slot_batch, self._handover(index, whole_batch=True))


def _signature(batch: TensorDict, items: list[tuple[object, object]] | None = None) -> list[object]:
    """Every key of a batch (non-tensor entries and empty sub-dicts too), its dimension names, device and
    lock, each sub-dict's batch size and names, and per tensor leaf its key, address, shape, strides and
    dtype (``None`` for a leaf no slot holds): a batch with anything the slot's layout cannot rebuild
    must travel by value."""
    if items is None:
        items = list(batch.items(include_nested=True, leaves_only=True))
    leaves = [
        (key, leaf.data_ptr(), leaf.shape, leaf.stride(), leaf.dtype)
        if type(leaf) is torch.Tensor and not leaf.requires_grad
        else None
        for key, leaf in items
    ]
    branches = [
        (key, value.batch_size, value.names)
        for key, value in batch.items(include_nested=True)
        if isinstance(value, TensorDictBase)
    ]
    return [
        list(batch.keys(include_nested=True)),
        list(batch.names),
        batch.device,
        batch.is_locked,
        branches,
        *leaves,
    ]


_WORKER_SLOTS: WorkerSlots | None = None


def _reduce_tensordict(batch: TensorDict):
    """This process's pickling of TensorDicts: a whole slot batch by reference, else as tensordict does."""
    slots = _WORKER_SLOTS
    if slots is not None and slots.key[0] == os.getpid() and type(batch) is TensorDict:
        reduced = slots.reduce_batch(batch)
        if reduced is not None:
            return reduced
    return _tensordict_reduce(batch)


def _reduce_storage(storage: torch.UntypedStorage):
    """This process's pickling of storages: slots by reference, everything else as torch does it."""
    slots = _WORKER_SLOTS
    if slots is not None and slots.key[0] == os.getpid() and storage.device.type == "cpu":
        index = slots.slot_of(storage)
        if index is not None:
            return slots.reduce(index)
    return _torch_reduce_storage(storage)


def worker_slots(max_slots: int) -> WorkerSlots | None:
    """This (``DataLoader`` worker) process's slots, created on first use with ``max_slots`` slots.

    Creating them registers the slot-aware storage reduction with multiprocessing's ``ForkingPickler`` in
    this process only; storages that are not slots are still pickled by torch's own reduction. ``None``
    when this torch build does not report storage use counts (release could not be detected).
    """
    global _WORKER_SLOTS
    if max_slots < 1 or not use_counts_work():
        return None
    if _WORKER_SLOTS is None or _WORKER_SLOTS.key[0] != os.getpid():
        _WORKER_SLOTS = WorkerSlots(max_slots)
        ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
        ForkingPickler.register(TensorDict, _reduce_tensordict)
    return _WORKER_SLOTS


def current_worker_slots() -> WorkerSlots | None:
    """This process's slots if :func:`worker_slots` created them here, else ``None``."""
    slots = _WORKER_SLOTS
    return slots if slots is not None and slots.key[0] == os.getpid() else None


def worker_batch(layout: BatchLayout) -> TensorDict:
    """An uninitialised batch of ``layout`` to send from this worker: a slot, else fresh shared memory."""
    slots = current_worker_slots()
    return layout.empty(shared=True) if slots is None else slots.acquire(layout)


# -- trainer side -----------------------------------------------------------------------------------
@dataclass(eq=False)
class _ReceivedSlot:
    anchor: torch.Tensor
    generation: int
    trips: int = 0
    """Trips of this slot received and not yet counted as returned to the worker."""
    leaves: list[torch.Tensor] | None = None
    """Views of the slot's batch layout, carved once (aliases of them are handed out)."""
    leaf_uses: int = 0
    """Storage uses that ``leaves`` hold (a view also holds the tensor it was made from)."""

    layout: BatchLayout | None = None

    def carve(self, layout: BatchLayout) -> None:
        self.layout = layout
        storage = self.anchor.untyped_storage()
        before = storage_use_count(storage)
        self.leaves = layout.carve(self.anchor)
        self.leaf_uses = storage_use_count(storage) - before

    def idle(self, anchor_alone: tuple[int, int]) -> tuple[int, int]:
        uses, references = anchor_alone
        return uses + self.leaf_uses, references


@dataclass(eq=False)
class _ReceivedPool:
    pid: int
    flags: np.ndarray
    flags_anchor: torch.Tensor
    slots: dict[int, _ReceivedSlot] = field(default_factory=dict)

    def release_unused(self, idle: tuple[int, int]) -> None:
        for index, slot in self.slots.items():
            if slot.trips and _counts(slot.anchor) == slot.idle(idle):
                self.flags[_RETURNED, index] += slot.trips  # this process is the only writer of the row
                slot.trips = 0


_RECEIVED: dict[tuple[int, str], _ReceivedPool] = {}
_RECEIVED_LOCK = threading.Lock()
_IDLE: tuple[int, int] | None = None


def _idle_counts() -> tuple[int, int]:
    """What :func:`_counts` reports for an arena referenced by its registry anchor alone."""
    global _IDLE
    if _IDLE is None:
        _IDLE = _counts(torch.empty(1, dtype=torch.uint8))
    return _IDLE


_prune_wanted = False
"""A prune that could not take ``_RECEIVED_LOCK`` left it to the next arrival."""


def release_exited_workers() -> None:
    """Let go of the output slots of ``DataLoader`` workers that have exited (their arenas' mappings and
    file descriptors in this process). Runs when a pool arrives, and when an iterator of
    :meth:`OnlineDataset.loader` is collected (after it has shut its workers down).

    Never blocks: the cyclic garbage collector may run it inside this thread's own locked section (an
    iterator left in a cycle by a worker's exception, collected during an arrival), where waiting for the
    lock would wait forever; the next arrival then prunes instead.
    """
    global _prune_wanted
    if not _RECEIVED_LOCK.acquire(blocking=False):
        _prune_wanted = True
        return
    try:
        _prune_exited_workers()
    finally:
        _RECEIVED_LOCK.release()


def _prune_exited_workers() -> None:
    for key, pool in list(_RECEIVED.items()):
        # a zombie has exited too: torch gives a worker that is slow to stop 5 s, then terminates it
        # without reaping it, and its slots would stay mapped until something reaps it
        if process_state(pool.pid) in (None, "Z", "X"):
            del _RECEIVED[key]


def _arrive(
    key: tuple[int, str],
    index: int,
    generation: int,
    storage: torch.UntypedStorage | None,
    flags: torch.UntypedStorage | None,
) -> _ReceivedSlot:
    """Register a slot arriving in the trainer process; free the slots nobody references.

    Call with ``_RECEIVED_LOCK`` held.
    """
    global _prune_wanted
    if _prune_wanted:
        _prune_wanted = False
        _prune_exited_workers()
    pool = _RECEIVED.get(key)
    if pool is None:
        if flags is None:
            raise RuntimeError(
                f"[OnlineDataset] A DataLoader worker (pid {key[0]}) sent output slot {index} by "
                "reference, but this process never received its slot table; batches from worker "
                "slots can only be unpickled by the process that iterates the DataLoader."
            )
        _prune_exited_workers()
        flags_anchor = _anchor(flags)
        pool = _ReceivedPool(key[0], flags_anchor.view(torch.int64).view(2, -1).numpy(), flags_anchor)
        _RECEIVED[key] = pool
    if storage is not None:
        pool.slots[index] = _ReceivedSlot(_anchor(storage), generation)
    slot = pool.slots.get(index)
    if slot is None or slot.generation != generation:
        raise RuntimeError(
            f"[OnlineDataset] A DataLoader worker (pid {key[0]}) sent output slot {index} "
            f"(generation {generation}) by reference before its storage reached this process."
        )
    # every worker's dropped slots, not only this one's: a slot returns to its worker a batch sooner,
    # so workers cycle through fewer slots and write into arenas still in the cache
    idle = _idle_counts()
    for received in _RECEIVED.values():
        received.release_unused(idle)
    slot.trips += 1
    return slot


def _receive_slot(
    key: tuple[int, str],
    index: int,
    generation: int,
    storage: torch.UntypedStorage | None,
    flags: torch.UntypedStorage | None,
) -> torch.UntypedStorage:
    """Unpickling a slot's storage in the trainer process (tensors viewing it are rebuilt on it)."""
    with _RECEIVED_LOCK:
        return _arrive(key, index, generation, storage, flags).anchor.untyped_storage()


def _receive_slot_batch(
    key: tuple[int, str],
    index: int,
    generation: int,
    storage: torch.UntypedStorage | None,
    flags: torch.UntypedStorage | None,
    layout: BatchLayout | None,
) -> TensorDict:
    """Unpickling a whole slot batch in the trainer process: fresh aliases of the slot's views."""
    with _RECEIVED_LOCK:
        slot = _arrive(key, index, generation, storage, flags)
        if layout is not None:
            slot.carve(layout)
        if slot.layout is None:
            raise RuntimeError(
                f"[OnlineDataset] A DataLoader worker (pid {key[0]}) sent a batch of output slot {index} "
                "by reference before its layout reached this process."
            )
        return slot.layout.tensordict([leaf.detach() for leaf in slot.leaves])
