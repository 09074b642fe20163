"""``OnlineDataset``: a ``torch.utils.data.IterableDataset`` over a running engine.

Each iterator (one per ``DataLoader`` worker) samples from the shared buffer forever. Item mode yields one
chunk ``[chunk_size]`` at a time but fetches them in blocks, so it pays one selection and one gather per
block instead of per item.

Inside a ``DataLoader`` worker, batches (batch mode) and collated items (item mode) are written straight
into shared memory, into output slots the worker reuses once the trainer has dropped a batch (see
:mod:`simstream.data.worker_slots`): a batch then crosses to the trainer as a small reference instead of a
new shared-memory segment, file descriptor and mapping per batch. :meth:`OnlineDataset.loader` builds the
``DataLoader`` for the dataset's mode, with queues that skip ``multiprocessing.Queue``'s feeder threads
(see :mod:`simstream.data.loader_context`).
"""

from __future__ import annotations

import gc
import numbers
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from ..errors import DataBudgetExhaustedError
from ..sampling.gather import BatchLayout
from ..sampling.keys import select_keys
from ..workers.supervisor import exit_with_owner
from .chunk_sizes import ChunkSizeSampler
from .loader_context import loader_context
from .worker_slots import release_exited_workers, worker_batch, worker_slots

__all__ = ["OnlineDataset"]

_frozen_in: int | None = None
"""The worker process whose inherited objects :func:`_freeze_inherited_objects` froze."""


def _freeze_inherited_objects() -> None:
    """In a ``DataLoader`` worker, once: move what the process inherited out of the garbage collector's
    reach. A forked worker inherits the trainer's uncollected garbage, typically an earlier iterator left in
    a reference cycle by a worker's exception; collected here, its ``__del__`` shuts down workers and
    queues that are not this process's. (The 30-s stalls of a loop that caught a transform's exception
    and iterated again had another cause, the feeder thread of ``DirectQueue``; this only keeps such
    foreign shutdowns out of the workers.) Garbage the worker makes itself is collected as usual."""
    global _frozen_in
    if _frozen_in != os.getpid():
        _frozen_in = os.getpid()
        gc.freeze()
        # end with the trainer, however it ends: torch's workers compare os.getppid() with its value at their
        # start, and a forkserver worker's parent is the fork server, which every worker keeps alive (they
        # hold its "alive" pipe): the workers of a SIGKILLed trainer ran forever, keeping its memory mapped
        exit_with_owner()


class OnlineDataset(IterableDataset):
    """Endless stream of chunks (item mode) or batches of chunks (batch mode) from an engine.

    Args:
        engine: A READY (or soon READY) ``OnlineDataEngine``; start it before creating ``DataLoader`` workers.
        chunk_size: Frames per chunk, or a :class:`ChunkSizeSampler`. In item mode the size is drawn once per
            iterator so every item of a ``DataLoader`` batch has the same shape; in batch mode once per batch.
        batch_size: ``None`` for item mode (use ``DataLoader(batch_size=..., collate_fn=OnlineDataset.
            collate_fn)``), else chunks per yielded batch (use ``DataLoader(batch_size=None,
            collate_fn=OnlineDataset.passthrough_collate_fn)``).
        transform: Applied to every yielded TensorDict; its return value is yielded.
        sampling_mode: ``"episode"``, ``"segment"`` or ``"boundary"``.
        seed: Base seed; iterator ``i`` (``DataLoader`` worker ``i``) uses ``seed + i``, so every epoch
            replays the same draws. ``None``: a fresh stream per iterator, drawn from torch's global RNG
            of the process that iterates (``DataLoader`` seeds each worker's; a persistent worker's
            moves on from epoch to epoch), so ``torch.manual_seed`` makes a run reproducible, chunk sizes
            included (a :class:`ChunkSizeSampler` given a seed of its own keeps it in the main process).
        item_block: Chunks fetched per selection in item mode. With per-episode quotas a fetch is charged
            whole, before its chunks are yielded: chunks fetched but never consumed still count. Use
            ``item_block=1`` for exact accounting.
        worker_slots: Output slots per ``DataLoader`` worker, reused once the trainer process holds no
            reference to a batch (0: a fresh shared-memory batch each time). A batch the trainer forwards
            to another process must be cloned first when slots are on.
        keys: Copy only these keys (plus ``valid``), as ``OnlineDataEngine.sample_batch(keys=...)`` does;
            ``None``: every key. Checked here, against the engine's buffer.

    Examples:
        >>> dataset = OnlineDataset(engine, chunk_size=16, batch_size=64)  # doctest: +SKIP
        >>> loader = dataset.loader(num_workers=2)  # doctest: +SKIP
    """

    def __init__(
        self,
        engine,
        chunk_size: int | ChunkSizeSampler,
        batch_size: int | None = None,
        transform: Callable[[TensorDict], object] | None = None,
        sampling_mode: Literal["episode", "segment", "boundary"] = "episode",
        *,
        seed: int | None = None,
        item_block: int = 32,
        worker_slots: int = 6,
        keys: str | Sequence[str | tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool):
            chunk_size = int(chunk_size)  # a NumPy int, as sample_batch takes it
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, ChunkSizeSampler)):
            raise TypeError(
                f"chunk_size must be an int or a ChunkSizeSampler, got {type(chunk_size).__name__}."
            )
        if isinstance(chunk_size, int) and chunk_size < 1:
            raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}.")
        if sampling_mode not in ("episode", "segment", "boundary"):
            raise ValueError(
                f"sampling_mode must be 'episode', 'segment', or 'boundary', got {sampling_mode!r}."
            )
        if batch_size is not None and (type(batch_size) is not int or batch_size < 1):
            raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}.")
        if type(item_block) is not int or item_block < 1:
            raise ValueError(f"item_block must be an int >= 1, got {item_block!r}.")
        if type(worker_slots) is not int or not 0 <= worker_slots <= 64:
            raise ValueError(f"worker_slots must be an int in [0, 64], got {worker_slots!r}.")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63 - 1], got {seed!r}.")
        steps = getattr(engine, "max_episode_steps", None)
        if steps is not None:
            _check_chunk_sizes(chunk_size, sampling_mode, steps)
        self.engine = engine
        self.chunk_size = chunk_size
        self.batch_size = batch_size
        self.transform = transform
        self.sampling_mode = sampling_mode
        self.seed = seed
        self.item_block = item_block
        self.worker_slots = worker_slots
        self.keys = keys
        self._paths = None if keys is None else _selected_paths(engine.shared_buffer, keys)

    def _draw_chunk_size(self) -> int:
        if not isinstance(self.chunk_size, ChunkSizeSampler):
            return self.chunk_size
        size, steps = self.chunk_size(), getattr(self.engine, "max_episode_steps", None)
        ok = not isinstance(size, bool) and isinstance(size, numbers.Integral) and size >= 1
        if not ok or (steps is not None and size > steps):
            accepted = (
                "an int >= 1" if steps is None else f"an int in [1, {steps}] (the engine's max_episode_steps)"
            )
            drew = f"OnlineDataset.chunk_size: {self.chunk_size!r} drew {size!r}"
            raise ValueError(f"{drew}; a chunk size must be {accepted}")
        return int(size)

    def _generator(self) -> torch.Generator:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        # without a seed, the process's global generator, which DataLoader seeds per iterator and worker:
        # not initial_seed(), which never changes in one process, so a persistent worker (or the trainer
        # itself, without workers) replayed the same draws every epoch
        base = self.seed if self.seed is not None else int(torch.randint(2**62, (), dtype=torch.int64))
        sampler = self.chunk_size
        if isinstance(sampler, ChunkSizeSampler) and (
            self.seed is not None or info is not None or not getattr(sampler, "_seeded_by_user", False)
        ):
            sampler.seed(base + worker)
        return torch.Generator().manual_seed((base + worker) % 2**63)

    def __iter__(self) -> Iterator[object]:
        generator = self._generator()
        # in a DataLoader worker, batches leave this process: write them where they are going
        in_worker = get_worker_info() is not None
        if in_worker:
            _freeze_inherited_objects()
            worker_slots(self.worker_slots)
        if self.batch_size is None:
            chunk = self._draw_chunk_size()
            while True:
                for item in self._block(chunk, generator).unbind(0):
                    yield self._apply(item)
        layouts: dict[int, BatchLayout] = {}
        while True:
            chunk = self._draw_chunk_size()
            out = None
            if in_worker:
                layout = layouts.get(chunk)
                if layout is None:
                    layout = layouts[chunk] = BatchLayout.of(self._template(), (self.batch_size, chunk))
                out = worker_batch(layout)
            batch = self.engine.sample_batch(
                self.batch_size, chunk, self.sampling_mode, generator=generator, out=out, keys=self.keys
            )
            yield self._apply(batch)

    def _template(self) -> TensorDict:
        """The engine's buffer restricted to the copied keys (what a batch's layout follows)."""
        buffer = self.engine.shared_buffer
        return buffer if self._paths is None else buffer.select(*self._paths)

    def _block(self, chunk: int, generator: torch.Generator) -> TensorDict:
        sample, mode, keys = self.engine.sample_batch, self.sampling_mode, self.keys
        try:
            return sample(self.item_block, chunk, mode, generator=generator, keys=keys)
        except DataBudgetExhaustedError:
            if self.item_block == 1:
                raise
            # Quotas nearly spent: fall back to single chunks rather than failing early.
            return sample(1, chunk, mode, generator=generator, keys=keys)

    def _apply(self, data: TensorDict) -> object:
        return data if self.transform is None else self.transform(data)

    def loader(self, num_workers: int = 0, batch_size: int | None = None, **dataloader_kwargs) -> DataLoader:
        """A ``torch.utils.data.DataLoader`` over this dataset, set up for its mode.

        Args:
            num_workers: ``DataLoader`` worker processes (0: sample in the calling process).
            batch_size: Item mode only, and required there: chunks collated per batch. In batch mode the
                dataset already yields whole batches and this must stay ``None``.
            **dataloader_kwargs: Passed on to ``DataLoader``. ``collate_fn`` defaults to :meth:`collate_fn`
                (item mode) or :meth:`passthrough_collate_fn` (batch mode). With workers,
                ``multiprocessing_context`` defaults to :func:`~simstream.data.loader_context`, whose queues
                skip ``multiprocessing.Queue``'s feeder threads; a start-method name is wrapped in it, a
                context object is used as given.
        """
        if type(num_workers) is not int or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}.")
        item_mode = self.batch_size is None
        if not item_mode and batch_size is not None:
            raise ValueError(
                f"batch_size must be None in batch mode: the dataset already yields batches of "
                f"{self.batch_size} chunks, got batch_size={batch_size!r}."
            )
        if item_mode and (type(batch_size) is not int or batch_size < 1):
            raise ValueError(
                f"batch_size must be an int >= 1 in item mode (chunks per batch), got {batch_size!r}."
            )
        dataloader_kwargs.setdefault(
            "collate_fn", self.collate_fn if item_mode else self.passthrough_collate_fn
        )
        if num_workers > 0:
            # the earliest point in a worker: before DataLoader's own start-up can trigger a collection
            dataloader_kwargs["worker_init_fn"] = _WorkerInit(dataloader_kwargs.get("worker_init_fn"))
            context = dataloader_kwargs.get("multiprocessing_context")
            if context is None or isinstance(context, str):
                dataloader_kwargs["multiprocessing_context"] = loader_context(context)
        return _OnlineDataLoader(self, batch_size=batch_size, num_workers=num_workers, **dataloader_kwargs)

    @staticmethod
    def collate_fn(items: list[TensorDict]) -> TensorDict:
        """Stack item-mode chunks into a batch ``[len(items), chunk_size]`` (one arena; a slot in workers).

        Items a ``transform`` turned into something else (a dict or tuple of tensors, a tensor) are
        collated by torch's ``default_collate``.
        """
        first = items[0] if items else None
        if first is not None and not isinstance(first, TensorDictBase):
            return default_collate(items)
        if first is None or not _tensors_only(first):
            return torch.stack(items)  # stack(out=) keeps only the keys ``out`` has: non-tensors would go
        keys = list(first.keys(include_nested=True))
        if any(list(item.keys(include_nested=True)) != keys for item in items[1:]):
            return torch.stack(items)  # it raises for items that do not match, as the default collate
        layout = BatchLayout.of(first, (len(items), *first.batch_size))
        out = layout.empty() if get_worker_info() is None else worker_batch(layout)
        try:
            return torch.stack(items, 0, out=out)
        except (RuntimeError, ValueError, KeyError, TypeError):  # items that do not share one layout
            return torch.stack(items)

    @staticmethod
    def passthrough_collate_fn(batch: TensorDict) -> TensorDict:
        """Batch mode: the dataset already yields whole batches."""
        return batch


def _tensors_only(item: TensorDictBase) -> bool:
    """Whether a :class:`BatchLayout` of ``item`` rebuilds all of it: every entry a tensor or a sub-dict on
    the way to one (no non-tensor entry, no empty sub-dict), and no dimension names."""
    leaves = [
        (key if isinstance(key, tuple) else (key,), leaf)
        for key, leaf in item.items(include_nested=True, leaves_only=True)
    ]
    implied = {path[:depth] for path, _ in leaves for depth in range(1, len(path) + 1)}
    every = {key if isinstance(key, tuple) else (key,) for key in item.keys(include_nested=True)}
    return (
        every == implied
        and all(type(leaf) is torch.Tensor for _, leaf in leaves)
        and all(name is None for name in item.names)
    )


def _selected_paths(buffer: TensorDict, keys: object) -> list[tuple[str, ...]]:
    """The stored paths ``keys`` selects in ``buffer`` (plus ``valid``); raises as ``select_keys`` does."""
    paths = tuple(k if type(k) is tuple else (k,) for k in buffer.keys(include_nested=True, leaves_only=True))
    return [paths[i] for i in select_keys(paths, keys)]


def _check_chunk_sizes(chunk_size: int | ChunkSizeSampler, sampling_mode: str, steps: int) -> None:
    """Refuse chunk sizes the engine can never serve now, not at a random later batch in a worker.

    A sampler is checked by its ``low``/``high`` bounds when it has them (the built-in ones do; a custom
    sampler without them is trusted).
    """
    boundary = sampling_mode == "boundary"
    if isinstance(chunk_size, int):
        if chunk_size > steps:
            raise ValueError(f"chunk_size must be in [1, max_episode_steps = {steps}], got {chunk_size}.")
        if boundary and chunk_size < 2:
            raise ValueError(f"sampling_mode='boundary' needs chunk_size >= 2, got {chunk_size}.")
        return
    if not (hasattr(chunk_size, "low") and hasattr(chunk_size, "high")):
        return
    low, high = chunk_size.low, chunk_size.high
    if high is None or high > steps:
        bound = "can draw any size" if high is None else f"can draw up to {high}"
        raise ValueError(
            f"chunk_size {chunk_size!r} {bound}; a chunk holds at most max_episode_steps = {steps} frames: "
            f"give it high <= {steps}."
        )
    if boundary and (low is None or low < 2):
        raise ValueError(
            f"sampling_mode='boundary' needs chunks of at least 2 frames (one each side of a segment "
            f"boundary); chunk_size {chunk_size!r} can be {low or 1}: give it low >= 2."
        )


class _WorkerInit:
    """The ``worker_init_fn`` of :meth:`OnlineDataset.loader`: freezes the worker's inherited objects
    (:func:`_freeze_inherited_objects`), then runs the caller's own ``worker_init_fn``, if any."""

    def __init__(self, user: Callable[[int], None] | None) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        _freeze_inherited_objects()
        if self.user is not None:
            self.user(worker_id)


class _OnlineDataLoader(DataLoader):
    """A ``DataLoader`` whose iterators, once collected, let go of their exited workers' output slots.

    The trainer keeps each worker's slot arena mapped while the worker may still send batches; without
    this, a finished loader's arenas (worker count x 6 batches, gigabytes with images) stayed mapped until
    the next loader's first batch or the end of the process.
    """

    def _get_iterator(self):
        iterator = super()._get_iterator()
        if self.num_workers > 0:  # called after the iterator's own __del__ has shut its workers down
            weakref.finalize(iterator, release_exited_workers)
        return iterator
