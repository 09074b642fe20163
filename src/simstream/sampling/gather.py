"""Copy sampled frames out of the shared buffer: one ``index_select`` per key into one output arena.

``index_select`` of flattened frame indices is the memory-bus-bound way to gather runs of frames (an
element-wise advanced-indexing gather was 14x slower on 64x64 images). Every key of a batch is a view of
one freshly reserved byte arena, so a batch is one allocation and, when a ``DataLoader`` worker sends it to
the trainer, one shared-memory segment instead of one per key.

Arenas are recycled by :class:`ArenaPool`: a first-touch allocation of a 100 MB image batch costs 4-7x the
copy itself (page faults), so an arena whose batch the caller has dropped is written again instead. An
arena is reused only when nothing outside the pool references its storage (see :meth:`ArenaPool.acquire`),
so a batch never changes while any tensor, view, storage or NumPy array of it is alive.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cache, cached_property

import torch
from tensordict import TensorDict

from ..buffer.storage import TrajectoryStorage

__all__ = ["ArenaPool", "BatchGatherer", "BatchLayout", "ChunkFrames", "empty_batch", "shared_arena"]

_ALIGN = 64
"""Byte alignment of each key inside an arena (a cache line; any dtype's element size divides it)."""


@cache
def physical_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its container's (cgroup) limit when lower
    (the bound of one batch, see ``BatchGatherer.check_fits``)."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            memory = min(memory, int(text))
    return memory


def require_batch_fits(
    batch_size: int, item_bytes: int, subject: str, *, batch: str = "batch", limit: str = "it", hint: str = ""
) -> None:
    """Refuse ``batch_size`` items of ``item_bytes`` each that need more than :func:`physical_memory`:
    such a batch would fail, or be OOM-killed, half-way through its copy.

    Raises:
        ValueError: ``"{subject} needs X GiB for one {batch}, more than this machine's Y GiB of memory:
            {limit} can be at most N here{hint}"``.
    """
    memory = physical_memory()
    item_bytes = max(1, item_bytes)
    if batch_size * item_bytes <= memory:
        return
    raise ValueError(
        f"{subject} needs {batch_size * item_bytes / 2**30:.1f} GiB for one {batch}, more than this "
        f"machine's {memory / 2**30:.1f} GiB of memory: {limit} can be at most {memory // item_bytes} "
        f"here{hint}"
    )


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many tensors and storage handles share ``storage`` (torch's private use count)."""
    return torch._C._storage_Use_Count(storage._cdata)


def use_counts_work() -> bool:
    """Whether this torch reports storage references the way :class:`ArenaPool` relies on."""
    try:
        base = torch.empty(_ALIGN * 2, dtype=torch.uint8)
        storage = base.untyped_storage()
        baseline = storage_use_count(storage)
        view = base[_ALIGN:].view(torch.int64)
        held = storage_use_count(storage)
        del view
        return held > baseline and storage_use_count(storage) == baseline
    except Exception:  # any private-API change disables recycling; batches are then freshly allocated
        return False


Carve = Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""Splits an arena (uint8 tensor) into per-key write targets and the batch-shaped views handed out."""


@dataclass(eq=False)
class _Arena:
    layout: Hashable
    storage: torch.UntypedStorage
    targets: list[torch.Tensor]
    leaves: list[torch.Tensor]
    baseline: int = 0
    """Storage use count with only the pool's own references (storage object, targets and leaves)."""
    py_baseline: int = 0
    """Python references to ``storage`` held by the pool alone. torch keeps one storage object per
    storage, so a caller's ``tensor.untyped_storage()`` is this very object: it adds a Python reference,
    not a storage use."""

    def snapshot(self) -> tuple[int, int]:
        return storage_use_count(self.storage), sys.getrefcount(self.storage)


class ArenaPool:
    """Recycles output arenas that no caller references any more.

    Owns at most ``max_arenas`` arenas (``max_bytes`` in total), each carved once into per-key views for
    one batch layout. :meth:`acquire` returns a free arena of the requested layout (least recently used
    first) or allocates a new one, keeping it when there is room or a free arena to evict. Thread-safe;
    after ``fork`` the child starts with an empty pool.

    Freeness: the storage's use count and its storage object's Python reference count both equal those
    taken when the pool carved it (its own storage object and views only). The leaves handed out are
    fresh aliases, so any tensor or view of a batch or a NumPy array over it raises the use count, and a
    caller holding the storage object raises its Python count; an arena that was ever moved to shared
    memory (pickled to another process, e.g. by a ``DataLoader`` worker) is dropped, because another
    process may still map it.
    """

    def __init__(self, max_arenas: int = 4, max_bytes: int = 1 << 30) -> None:
        self.max_arenas = max_arenas
        self.max_bytes = max_bytes
        self.enabled = use_counts_work()
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._arenas: list[_Arena] = []

    def __getstate__(self) -> dict:
        return {"max_arenas": self.max_arenas, "max_bytes": self.max_bytes, "enabled": self.enabled}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def acquire(self, layout: Hashable, nbytes: int, carve: Carve) -> tuple[list[torch.Tensor], ...]:
        """Write targets and batch views of an arena of ``nbytes`` that nobody else references.

        Args:
            layout: Identifies what ``carve`` makes of an arena; only arenas of the same layout are reused.
            nbytes: Arena size in bytes.
            carve: Makes ``(targets, leaves)`` from a new arena.

        Returns:
            ``(targets, leaves)``: write into ``targets``, hand ``leaves`` (aliases owned by the caller) out.
        """
        if not self.enabled or nbytes > self.max_bytes:
            return carve(torch.empty(nbytes, dtype=torch.uint8))
        if self._pid != os.getpid():
            self._reset()
        with self._lock:
            # shared arenas may be mapped by another process: never written again, forgotten here
            self._arenas = [a for a in self._arenas if not a.storage.is_shared()]
            # aliases are made under the lock: from then on the arena counts as taken
            free = [a for a in self._arenas if self._is_free(a)]
            for arena in free:
                if arena.layout == layout:
                    self._arenas.remove(arena)
                    self._arenas.append(arena)  # most recently used last
                    return arena.targets, [leaf.detach() for leaf in arena.leaves]
            pooled = sum(a.storage.nbytes() for a in self._arenas)

            def full() -> bool:
                return len(self._arenas) >= self.max_arenas or pooled + nbytes > self.max_bytes

            for victim in free:  # least recently used first
                if not full():
                    break
                self._arenas.remove(victim)
                pooled -= victim.storage.nbytes()
            base = torch.empty(nbytes, dtype=torch.uint8)
            targets, leaves = carve(base)
            if full():
                return targets, leaves
            arena = _Arena(layout, base.untyped_storage(), targets, leaves)
            del base
            arena.baseline, arena.py_baseline = arena.snapshot()
            self._arenas.append(arena)
            return targets, [leaf.detach() for leaf in leaves]

    @staticmethod
    def _is_free(arena: _Arena) -> bool:
        """Nobody else references it (a shared arena was dropped before this is asked)."""
        return arena.snapshot() == (arena.baseline, arena.py_baseline)


@dataclass(frozen=True)
class ChunkFrames:
    """Frames of ``n`` windows of ``length`` consecutive frames: ``starts[:, None] + arange(length)``.

    Knowing that each item is one run lets the gatherer copy a whole window per index for keys with small
    frames (one ``memcpy`` of ``length`` frames instead of ``length`` copies of a few bytes).
    """

    starts: torch.Tensor
    """int64 ``[n]`` flat index of each window's first frame."""
    length: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.starts.shape[0], self.length)

    def to_index(self) -> torch.Tensor:
        """The equivalent ``[n, length]`` frame-index tensor."""
        return self.starts[:, None] + torch.arange(self.length)


_WINDOWED_MAX_FRAME_BYTES = 4096
"""Keys with frames up to this size gather whole windows per index (1.7x faster for the reference
low-dim keys); larger frames (images) are already one long ``memcpy`` per frame, where the per-frame
kernel measured faster."""


class BatchGatherer:
    """Gathers frames of the stored keys (all, or a selection) into a new (or given) TensorDict ``[n, L]``.

    A selection is a tuple of positions in the storage's key order (see
    :func:`simstream.sampling.keys.select_keys`); ``None`` selects every key. Keys outside a selection
    are never read.
    """

    def __init__(self, storage: TrajectoryStorage, pool: ArenaPool | None = None) -> None:
        self._sources = [storage.flat[spec.path] for spec in storage.specs]
        self._paths = tuple(spec.path for spec in storage.specs)
        self._dtypes = tuple(spec.dtype for spec in storage.specs)
        self._frames = tuple(spec.frame_shape for spec in storage.specs)
        self._frame_bytes = [source[0].numel() * source.element_size() for source in self._sources]
        self._all_frame_bytes = sum(self._frame_bytes)
        self._checked: tuple | None = None
        self._every = tuple(range(len(self._paths)))
        self._layouts: dict[tuple[int, int, tuple[int, ...]], BatchLayout] = {}
        self._windows: dict[int, list[torch.Tensor | None]] = {}
        self._buffer_memory: list[tuple[int, int]] | None = None
        self.pool = pool if pool is not None else ArenaPool()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_windows"] = {}  # views are rebuilt on demand, never pickled
        state["_checked"] = None
        state["_buffer_memory"] = None  # addresses of this process's mappings
        return state

    def _buffer_ranges(self) -> list[tuple[int, int]]:
        """Per key, the addresses of its shared memory in this process."""
        if self._buffer_memory is None:
            self._buffer_memory = [
                (source.data_ptr(), source.data_ptr() + source.numel() * source.element_size())
                for source in self._sources
            ]
        return self._buffer_memory

    @property
    def paths(self) -> tuple[tuple[str, ...], ...]:
        """Every stored key, in storage order (the positions a selection refers to)."""
        return self._paths

    def layout(self, n: int, length: int, columns: tuple[int, ...] | None = None) -> BatchLayout:
        """The layout of a batch ``[n, length]`` of the selected keys (every key by default)."""
        columns = self._every if columns is None else columns
        layout = self._layouts.get((n, length, columns))
        if layout is None:
            if len(self._layouts) > 16:  # a chunk-size sampler may ask for many lengths
                self._layouts.clear()
            layout = self._new_layout(n, length, columns)
            self._layouts[n, length, columns] = layout
        return layout

    def _new_layout(self, n: int, length: int, columns: tuple[int, ...]) -> BatchLayout:
        return BatchLayout(
            tuple(self._paths[i] for i in columns),
            tuple(self._dtypes[i] for i in columns),
            tuple(self._frames[i] for i in columns),
            (n, length),
        )

    def gather(
        self,
        frames: torch.Tensor | ChunkFrames,
        out: TensorDict | None = None,
        columns: tuple[int, ...] | None = None,
    ) -> TensorDict:
        """Copy ``frames`` of the selected keys.

        Args:
            frames: An ``[n, L]`` tensor of flat frame indices (the padding frame index yields padding
                values), or :class:`ChunkFrames` for windows of consecutive frames.
            out: Optional TensorDict ``[n, L]`` holding the selected keys, to write into instead of
                allocating; only the selected keys are checked and written.
            columns: The selected keys (``None``: every key).

        Returns:
            A TensorDict ``[n, L]`` that owns its memory (``out`` when given).
        """
        n, length = frames.shape
        columns = self._every if columns is None else columns
        if out is not None:
            checked = self._checked  # the targets check_out() found for this very call, if any
            if checked is not None and checked[0] is out and checked[1] == (n, length, columns):
                self._checked, targets = None, checked[2]
            else:
                targets = self._out_targets(out, n, length, columns)
            self._copy(frames, targets, columns)
            return out
        layout = self.layout(n, length, columns)
        key = (n, length, columns)
        targets, leaves = self.pool.acquire(key, layout.nbytes, lambda base: _targets(layout, base))
        self._copy(frames, targets, columns)
        return layout.tensordict(leaves)

    def check_fits(self, n: int, length: int, columns: tuple[int, ...] | None) -> None:
        """Refuse a batch ``[n, length]`` of the selected keys that needs more bytes than this machine's
        memory, before anything is drawn (it would fail or be OOM-killed half-way through the copy)."""
        memory = physical_memory()
        if n * length * self._all_frame_bytes <= memory:
            return
        per_item = length * sum(self._frame_bytes[i] for i in (self._every if columns is None else columns))
        require_batch_fits(
            n,
            per_item,
            f"batch_size={n} with {length} frames per item",
            limit="batch_size",
            hint=" (or copy fewer keys with keys=).",
        )

    def check_out(self, out: TensorDict, n: int, length: int, columns: tuple[int, ...] | None) -> None:
        """Raise as :meth:`gather` would for ``out`` (before anything is drawn or written); the next
        :meth:`gather` into the same ``out`` reuses the targets found here instead of checking again."""
        columns = self._every if columns is None else columns
        self._checked = (out, (n, length, columns), self._out_targets(out, n, length, columns))

    def forget_checked(self) -> None:
        """Drop what :meth:`check_out` kept for a gather that did not come (the call failed)."""
        self._checked = None

    def _out_targets(
        self, out: TensorDict, n: int, length: int, columns: tuple[int, ...]
    ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """``(None, shaped)`` write targets of the selected keys in ``out``, checked before any write.

        The flat view a per-frame gather needs is made by :meth:`_copy` for the keys that use it.
        """
        if not isinstance(out, TensorDict) or tuple(out.batch_size[:2]) != (n, length):
            raise ValueError(
                f"out must be a TensorDict of batch size [{n}, {length}] (a batch from sample_batch with "
                f"the same batch_size and chunk_size), got "
                f"{list(out.batch_size) if isinstance(out, TensorDict) else type(out).__name__}"
            )
        # one pass over out's leaves: a nested ``out.get`` per key cost more than the checks
        leaves = {
            key if type(key) is tuple else (key,): leaf
            for key, leaf in out.items(include_nested=True, leaves_only=True)
        }
        targets = []
        buffer = self._buffer_ranges()
        for column in columns:
            path, dtype, frame = self._paths[column], self._dtypes[column], self._frames[column]
            target = leaves.get(path)
            if target is None:
                raise KeyError(
                    f"out has no tensor at {'/'.join(path)!r}; pass a batch from sample_batch as out."
                )
            if (
                target.dtype is not dtype
                or target.shape != (n, length, *frame)
                or not target.is_contiguous()
                or target.device.type != "cpu"
            ):
                raise ValueError(
                    f"out[{'/'.join(path)!r}] must be a contiguous {dtype} tensor of shape "
                    f"{(n, length, *frame)} on the CPU (where the buffer is), got {target.dtype} "
                    f"{tuple(target.shape)} on {target.device}"
                    f"{'' if target.is_contiguous() else ' (not contiguous)'}."
                )
            low, high = buffer[column]
            if low <= target.data_ptr() < high:  # engine.shared_buffer (a view of its own key) as out
                raise ValueError(
                    f"out[{'/'.join(path)!r}] is memory of the shared buffer itself (engine.shared_buffer "
                    "or a view of it): a batch written there would overwrite published rows; pass a batch "
                    "from sample_batch as out"
                )
            targets.append((None, target))
        return targets

    def empty(self, n: int, length: int, columns: tuple[int, ...] | None = None) -> TensorDict:
        """A fresh, unpooled batch ``[n, length]`` of the selected keys (one arena).

        For one-off shapes such as re-gathered torn items: pooling them would evict the arenas of the
        steady batch shape and bring its first-touch page faults back.
        """
        return self._new_layout(n, length, self._every if columns is None else columns).empty()

    @staticmethod
    def replace_items(batch: TensorDict, items: torch.Tensor, values: TensorDict) -> None:
        """``batch[items] = values`` for every key of ``values``, as contiguous row copies.

        A TensorDict item assignment (``index_put_``) and ``index_copy_`` run element-wise: on image
        frames they cost 20x a plain copy of each replaced item's rows.
        """
        rows = items.tolist()
        for key in values.keys(include_nested=True, leaves_only=True):
            target, source = batch.get(key), values.get(key)
            if source[0].numel() * source.element_size() <= _WINDOWED_MAX_FRAME_BYTES * source.shape[1]:
                target.index_copy_(0, items, source)
                continue
            for position, row in enumerate(rows):
                target[row].copy_(source[position])

    def _copy(
        self,
        frames: torch.Tensor | ChunkFrames,
        targets: list[tuple[torch.Tensor | None, torch.Tensor]],
        columns: tuple[int, ...],
    ) -> None:
        sources = self._sources
        if isinstance(frames, ChunkFrames):
            windows = self._window_views(frames.length)
            flat_index = None
            for column, (flat, shaped) in zip(columns, targets):
                window = windows[column]
                if window is not None:
                    torch.index_select(window, 0, frames.starts, out=shaped)
                    continue
                if flat_index is None:
                    flat_index = frames.to_index().view(-1)
                torch.index_select(sources[column], 0, flat_index, out=_flat(flat, shaped))
            return
        flat_index = frames.reshape(-1)
        for column, (flat, shaped) in zip(columns, targets):
            torch.index_select(sources[column], 0, flat_index, out=_flat(flat, shaped))

    def _window_views(self, length: int) -> list[torch.Tensor | None]:
        """Per key, an overlapping view ``[frames - length + 1, length, *frame]`` (or None: gather frames)."""
        views = self._windows.get(length)
        if views is None:
            views = []
            for source, shape, size in zip(self._sources, self._frames, self._frame_bytes):
                if size > _WINDOWED_MAX_FRAME_BYTES or length > source.shape[0]:
                    views.append(None)
                    continue
                step = source.stride(0)
                size_windows = (source.shape[0] - length + 1, length, *shape)
                views.append(source.as_strided(size_windows, (step, step, *source.stride()[1:])))
            if len(self._windows) > 16:  # a chunk-size sampler may ask for many lengths
                self._windows.clear()
            self._windows[length] = views
        return views


def _flat(flat: torch.Tensor | None, shaped: torch.Tensor) -> torch.Tensor:
    """The ``[n * L, *frame]`` view of a target ``[n, L, *frame]`` (``flat`` when already made)."""
    return flat if flat is not None else shaped.view(-1, *shaped.shape[2:])


def _targets(layout: BatchLayout, arena: torch.Tensor) -> tuple[list, list[torch.Tensor]]:
    """``(targets, leaves)`` of an arena: per key, flat ``[n * L, *frame]`` and ``[n, L, *frame]`` views."""
    leaves = layout.carve(arena)
    count = math.prod(layout.batch_shape)
    return [(leaf.view(count, *leaf.shape[2:]), leaf) for leaf in leaves], leaves


_KEY_TREES: dict[tuple[tuple[str, ...], ...], dict] = {}
"""Key nesting per key list (layouts are few; building a tree per batch showed in profiles)."""


@dataclass(frozen=True)
class BatchLayout:
    """Where each key of a batch lives inside one byte arena: keys, dtypes, frame shapes, batch shape.

    Hashable, so arenas carved for one layout can be recycled for the next batch of the same layout.
    """

    paths: tuple[tuple[str, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    frames: tuple[tuple[int, ...], ...]
    batch_shape: tuple[int, ...]

    @classmethod
    def of(cls, template: TensorDict, batch_shape: tuple[int, ...]) -> BatchLayout:
        """The layout of a batch of ``batch_shape`` with ``template``'s keys, dtypes and frame shapes."""
        paths, dtypes, frames = [], [], []
        dims = template.batch_dims
        for key, leaf in template.items(include_nested=True, leaves_only=True):
            paths.append(key if type(key) is tuple else (key,))
            dtypes.append(leaf.dtype)
            frames.append(tuple(leaf.shape[dims:]))
        return cls(tuple(paths), tuple(dtypes), tuple(frames), tuple(batch_shape))

    @cached_property
    def _sizes(self) -> tuple[int, ...]:
        count = math.prod(self.batch_shape)
        return tuple(count * math.prod(f) * dtype.itemsize for dtype, f in zip(self.dtypes, self.frames))

    @cached_property
    def nbytes(self) -> int:
        """Arena size: every key's bytes, each rounded up to a cache line (at least one byte)."""
        return max(sum(-(-size // _ALIGN) * _ALIGN for size in self._sizes), 1)

    def carve(self, arena: torch.Tensor) -> list[torch.Tensor]:
        """Per-key views ``[*batch_shape, *frame]`` of a uint8 ``arena`` of :attr:`nbytes` bytes."""
        leaves, offset = [], 0
        for dtype, frame, size in zip(self.dtypes, self.frames, self._sizes):
            leaves.append(arena[offset : offset + size].view(dtype).view(*self.batch_shape, *frame))
            offset += -(-size // _ALIGN) * _ALIGN
        return leaves

    def tensordict(self, leaves: list[torch.Tensor]) -> TensorDict:
        """A TensorDict of ``leaves`` (as made by :meth:`carve`), built without re-validation."""
        return _tensordict(self._tree, leaves, self._size)

    @cached_property
    def _tree(self) -> dict:
        tree = _KEY_TREES.get(self.paths)
        if tree is None:
            if len(_KEY_TREES) > 64:
                _KEY_TREES.clear()
            tree = _KEY_TREES[self.paths] = _key_tree(list(self.paths))
        return tree

    @cached_property
    def _size(self) -> torch.Size:
        return torch.Size(self.batch_shape)

    def empty(self, *, shared: bool = False) -> TensorDict:
        """A new uninitialised batch of this layout in one arena, optionally in shared memory."""
        arena = shared_arena(self.nbytes) if shared else torch.empty(self.nbytes, dtype=torch.uint8)
        return self.tensordict(self.carve(arena))


def shared_arena(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of new shared memory (what a process can pass on by reference)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


def empty_batch(template: TensorDict, batch_shape: tuple[int, ...], *, shared: bool = False) -> TensorDict:
    """An uninitialised TensorDict of ``batch_shape`` with ``template``'s keys, dtypes and frame shapes.

    Every key is a view of one arena, optionally allocated directly in shared memory: a ``DataLoader``
    worker then sends the batch as one segment, without the copy into shared memory that pickling a
    private tensor makes.

    Args:
        template: Any TensorDict; each leaf contributes ``leaf.shape[template.batch_dims:]`` per frame.
        batch_shape: Leading dimensions of the new batch.
        shared: Allocate the arena in shared memory.
    """
    return BatchLayout.of(template, batch_shape).empty(shared=shared)


def _key_tree(paths: list[tuple[str, ...]]) -> dict:
    """Nesting of the keys: ``{name: position in paths | subtree}``, in the order of ``paths``."""
    tree: dict = {}
    for position, path in enumerate(paths):
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = position
    return tree


def _tensordict(tree: dict, leaves: list[torch.Tensor], batch_size: torch.Size) -> TensorDict:
    """Build the (nested) TensorDict without re-validating the shapes the gatherer just produced."""
    source = {
        key: leaves[value] if type(value) is int else _tensordict(value, leaves, batch_size)
        for key, value in tree.items()
    }
    try:
        return TensorDict._new_unsafe(source=source, batch_size=batch_size)
    except AttributeError:  # a tensordict without the unchecked constructor
        return TensorDict(source, batch_size=batch_size)
