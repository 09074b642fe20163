"""The shared trajectory buffer: one shared-memory tensor per key, ``[buffer_size * T + 1, *frame]``.

Frames are stored flat (row-major: frame ``t`` of row ``r`` is ``r * T + t``) so a chunk is a run of
consecutive indices and a batch is one ``index_select`` per key. One extra frame at the end holds the
padding values; context windows point their padded positions at it, so padding costs no extra pass.
Memory is allocated once, in the owner, and reaches workers and consumers by pickling (file descriptors).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict

from ..config import METADATA_KEYS, PROVENANCE_KEYS, SourceLayout

__all__ = ["KeySpec", "TrajectoryStorage"]

_LANGUAGE_AND_PROVENANCE = {"task_index", "subtask_index", *PROVENANCE_KEYS}


@dataclass(frozen=True)
class KeySpec:
    """One stored key: nested path, dtype, per-frame shape and whether a source writes it."""

    path: tuple[str, ...]
    dtype: torch.dtype
    frame_shape: tuple[int, ...]
    payload: bool

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def unwritten(self) -> float | int | bool:
        """Value of a frame nobody wrote: NaN for float payloads, False, -1 for int metadata."""
        if self.payload:
            return math.nan if self.dtype.is_floating_point else 0
        return False if self.dtype == torch.bool else -1

    @property
    def padding(self) -> int | bool:
        """Value of a padded context position: -1 for language/provenance ids, else zero/False."""
        if self.name in _LANGUAGE_AND_PROVENANCE:
            return -1
        return False if self.dtype == torch.bool else 0


class TrajectoryStorage:
    """Owns the shared tensors of every key (payload, metadata, optional provenance).

    Invariants: ``flat[key]`` has ``buffer_size * T + 1`` frames; the last one always holds the padding
    values. Rows are written only by the producer that owns them (see :mod:`simstream.buffer.writer`).
    """

    def __init__(self, layout: SourceLayout, buffer_size: int, include_provenance: bool) -> None:
        self.buffer_size = buffer_size
        self.max_steps = layout.max_episode_steps
        self.specs: tuple[KeySpec, ...] = _key_specs(layout, include_provenance)
        frames = buffer_size * self.max_steps
        self.flat: dict[tuple[str, ...], torch.Tensor] = {}
        for spec in self.specs:
            # shared first, then filled in place: filling a private tensor and sharing it copies it, and
            # the buffer would briefly take twice its size in memory
            tensor = torch.empty((frames + 1, *spec.frame_shape), dtype=spec.dtype).share_memory_()
            tensor[:frames].fill_(spec.unwritten)
            tensor[frames].fill_(spec.padding)
            self.flat[spec.path] = tensor
        self._metadata_views: dict[str, torch.Tensor] = {}
        self._metadata_arrays: dict[str, np.ndarray] = {}
        self._payload_tails: list[tuple[np.ndarray | torch.Tensor, float | int]] | None = None
        self._float_payloads: list[tuple[str, np.ndarray | torch.Tensor]] | None = None
        self._metadata_resets: list[tuple[np.ndarray | torch.Tensor, float | int]] | None = None

    @staticmethod
    def shared_bytes(layout: SourceLayout, buffer_size: int, include_provenance: bool) -> int:
        """Bytes of shared memory the storage of this layout allocates (exact Python ints: no overflow)."""
        frames = buffer_size * layout.max_episode_steps + 1  # + the padding frame
        return frames * TrajectoryStorage.frame_bytes(layout, include_provenance)

    @staticmethod
    def frame_bytes(layout: SourceLayout, include_provenance: bool) -> int:
        """Bytes of one frame of every key, payload and metadata: what one frame of a batch holds."""
        specs = _key_specs(layout, include_provenance)
        return sum(math.prod(s.frame_shape) * s.dtype.itemsize for s in specs)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_metadata_views"] = {}  # rebuilt on demand in each process
        state["_metadata_arrays"] = {}
        state["_payload_tails"] = None
        state["_float_payloads"] = None
        state["_metadata_resets"] = None
        return state

    @property
    def pad_index(self) -> int:
        """Flat index of the padding frame."""
        return self.buffer_size * self.max_steps

    def rows_view(self, start: int = 0, end: int | None = None, *, payload_only: bool = False) -> TensorDict:
        """A TensorDict ``[end - start, T]`` viewing the shared rows (writes go to shared memory)."""
        end = self.buffer_size if end is None else end
        frames = self.buffer_size * self.max_steps
        data: dict = {}
        for spec in self.specs:
            if payload_only and not spec.payload:
                continue
            view = self.flat[spec.path][:frames].view(self.buffer_size, self.max_steps, *spec.frame_shape)
            _nest(data, spec.path, view[start:end])
        return TensorDict(data, batch_size=[end - start, self.max_steps])

    def metadata(self, name: str) -> torch.Tensor:
        """The ``[buffer_size, T]`` view of one top-level metadata key (cached: writers call it per row)."""
        view = self._metadata_views.get(name)
        if view is None:
            view = self.flat[(name,)][: self.pad_index].view(self.buffer_size, self.max_steps)
            self._metadata_views[name] = view
        return view

    def metadata_array(self, name: str) -> np.ndarray:
        """A NumPy view of :meth:`metadata` (cached): a row-slice assignment through it costs a fraction
        of the same assignment through tensor indexing, and a writer makes 13 per episode."""
        array = self._metadata_arrays.get(name)
        if array is None:
            array = self._metadata_arrays[name] = self.metadata(name).numpy()
        return array

    def has(self, name: str) -> bool:
        return (name,) in self.flat

    def iter_specs(self, payload: bool | None = None) -> Iterator[KeySpec]:
        return (s for s in self.specs if payload is None or s.payload == payload)

    def reset_metadata(self, start: int, end: int) -> None:
        """Metadata of rows ``[start, end)`` back to the unwritten state (``valid`` false, ids -1)."""
        lo, hi = start * self.max_steps, end * self.max_steps
        if self._metadata_resets is None:  # NumPy slice fills: a fraction of torch's fill_ per call
            metadata = self.iter_specs(payload=False)
            self._metadata_resets = [(_array_or_tensor(self.flat[s.path]), s.unwritten) for s in metadata]
        for flat, unwritten in self._metadata_resets:
            flat[lo:hi] = unwritten

    def poison_payload_tail(self, row: int, length: int) -> None:
        """Payload frames ``[length, T)`` of ``row`` back to the unwritten value (NaN for floats)."""
        if length >= self.max_steps:
            return
        lo, hi = row * self.max_steps + length, (row + 1) * self.max_steps
        if self._payload_tails is None:
            payload = self.iter_specs(payload=True)
            self._payload_tails = [(_array_or_tensor(self.flat[s.path]), s.unwritten) for s in payload]
        for flat, unwritten in self._payload_tails:
            flat[lo:hi] = unwritten

    def poison_float_payload(self, start: int, end: int) -> None:
        """Every float payload frame of rows ``[start, end)`` back to NaN, the unwritten value.

        Afterwards a frame the source leaves unwritten is NaN whatever the row held before (an older
        episode, a failed attempt), which is what :meth:`first_unwritten_frame` looks for. Other payload
        keys (e.g. ``uint8`` images) are left alone: they have no unwritten value to check for.
        """
        lo, hi = start * self.max_steps, end * self.max_steps
        for _, flat in self._float_arrays():
            flat[lo:hi] = math.nan

    def first_unwritten_frame(self, row: int, length: int) -> tuple[str, int] | None:
        """The first float payload key (in field order) holding NaN in frames ``[0, length)`` of ``row``,
        and the first such frame; ``None`` when there is none.

        NaN is what unwritten float frames hold, so a hit means the source reported ``length`` frames but
        left one of them unwritten (or wrote NaN itself). Only frames ``t < length`` of float keys are read,
        with one vectorised ``isnan`` per key: about what reading the episode's float payload once costs.
        """
        lo = row * self.max_steps
        for name, flat in self._float_arrays():
            frames = flat[lo : lo + length]
            nan = np.isnan(frames) if isinstance(frames, np.ndarray) else torch.isnan(frames).numpy()
            if nan.any():
                return name, int(nan.reshape(length, -1).any(axis=1).argmax())
        return None

    def first_row_with_unwritten_frames(self, start: int, lengths: np.ndarray) -> int | None:
        """The first of rows ``start, start + 1, ...`` whose float payload holds NaN in a frame
        ``t < lengths[i]`` (its offset ``i``), or ``None``: one vectorised pass per key for all the rows."""
        rows, steps = len(lengths), self.max_steps
        longest = int(lengths.max()) if rows else 0
        if longest == 0:
            return None
        lo, hi = start * steps, (start + rows) * steps
        reported = None if bool((lengths == longest).all()) else np.arange(longest) < lengths[:, None]
        first = rows
        for _, flat in self._float_arrays():
            frames = flat[lo:hi].reshape(rows, steps, -1)[:, :longest]
            nan = np.isnan(frames) if isinstance(frames, np.ndarray) else torch.isnan(frames).numpy()
            if reported is None:  # every row reports every frame read: one test in the usual case
                if not nan.any():
                    continue
                bad = nan.reshape(rows, -1).any(axis=1)
            else:
                bad = (nan.any(axis=2) & reported).any(axis=1)
            if bad[:first].any():
                first = int(bad.argmax())
        return None if first == rows else first

    def _float_arrays(self) -> list[tuple[str, np.ndarray | torch.Tensor]]:
        if self._float_payloads is None:
            floats = (s for s in self.iter_specs(payload=True) if s.dtype.is_floating_point)
            self._float_payloads = [(s.name, _array_or_tensor(self.flat[s.path])) for s in floats]
        return self._float_payloads


def _key_specs(layout: SourceLayout, include_provenance: bool) -> tuple[KeySpec, ...]:
    """Every stored key: the source's payload fields, the derived metadata, optionally provenance."""
    specs = [
        KeySpec(tuple(name.split("/")), f.dtype, tuple(f.shape), True) for name, f in layout.fields.items()
    ]
    specs += [KeySpec((name,), dtype, (), False) for name, dtype in METADATA_KEYS.items()]
    if include_provenance:
        specs += [KeySpec((name,), torch.int64, (), False) for name in PROVENANCE_KEYS]
    return tuple(specs)


def _array_or_tensor(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A NumPy view of ``tensor`` where NumPy has its dtype: slice fills cost a fraction of torch's."""
    try:
        return tensor.numpy()
    except TypeError:  # bfloat16 and other dtypes NumPy lacks
        return tensor


def _nest(tree: dict, path: tuple[str, ...], value: torch.Tensor) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value
