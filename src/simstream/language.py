"""Append-only registry of task and subtask instructions shared by every process of an engine.

Buffer rows store language as small integer ids (``task_index``, ``subtask_index``); this module maps
them back to text. The texts live in one shared byte array as UTF-8 JSON lines, so a text interned by any
process (a producer or a ``DataLoader`` worker) can be resolved by all of them, and an index once handed
out means the same text for the lifetime of the registry.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._sync import SharedLock

__all__ = ["SharedLanguageRegistry"]

_KINDS = ("task", "subtask")
_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"language kind must be task or subtask, got {kind!r}")


class SharedLanguageRegistry:
    """Interns instruction texts into per-kind 0-based indices readable from every process.

    Owns a shared byte array of ``capacity_bytes`` and a shared length counter. A
    :class:`~simstream._sync.SharedLock` (released by the kernel if its holder dies) serialises appends;
    readers take no lock: the bytes of a line are in place before the length moves past them. Each new
    entry appends the line ``json.dumps([kind, text]) + "\\n"`` (compact
    separators, UTF-8, non-ASCII kept), so newlines inside a text survive. Invariants: the bytes below
    the shared length never change; the ``i``-th line of kind ``k`` is index ``i`` of ``k`` forever.

    Every process keeps its own parsed cache and extends it by parsing only the bytes appended since its
    last look; the cache is rebuilt after unpickling and after a fork.

    Args:
        capacity_bytes: Size of the shared byte array; the registry cannot grow past it.
        context: Multiprocessing context that allocates the shared memory (default: forkserver).

    Raises:
        ValueError: If ``capacity_bytes`` is not an ``int`` of at least 1.

    Examples:
        >>> registry = SharedLanguageRegistry(4096)
        >>> registry.intern("open the drawer")
        0
        >>> registry.resolve(torch.tensor([0, 0]))
        ['open the drawer', 'open the drawer']
    """

    def __init__(self, capacity_bytes: int = 1048576, context: Any = None) -> None:
        if type(capacity_bytes) is not int or capacity_bytes < 1:
            raise ValueError(f"language_buffer_bytes must be a positive integer, got {capacity_bytes!r}")
        ctx = context if context is not None else multiprocessing.get_context("forkserver")
        self._buffer = ctx.RawArray("B", capacity_bytes)
        self._length = ctx.RawValue("Q", 0)
        self._append_lock = SharedLock()
        self._reset_cache()

    # Multiprocessing primitives only pickle while a child process is being created; the parsed cache
    # is private to each process and is rebuilt from the shared bytes on arrival.
    def __getstate__(self) -> dict[str, Any]:
        return {"_buffer": self._buffer, "_length": self._length, "_append_lock": self._append_lock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_cache()

    @property
    def capacity_bytes(self) -> int:
        """Size of the shared byte array."""
        return len(self._buffer)

    @property
    def used_bytes(self) -> int:
        """Bytes occupied by the entries interned so far, by any process."""
        return int(self._length.value)

    def count(self, kind: str = "task") -> int:
        """Number of distinct texts of ``kind`` interned so far, by any process."""
        _check_kind(kind)
        self._refresh()
        return len(self._texts[kind])

    def intern(self, description: str, *, kind: str = "task", check: Callable[[], None] | None = None) -> int:
        """Returns the index of ``description`` within ``kind``, appending it when it is new.

        Args:
            description: Non-blank text; compared exactly (no normalisation).
            kind: ``"task"`` or ``"subtask"``; each kind has its own indices.
            check: Called every 0.1 s while another process holds the append lock (a producer passes
                its stop check); ends the wait by raising.

        Returns:
            The 0-based index, identical in every process and stable forever.

        Raises:
            ValueError: On an unknown ``kind`` or a non-``str``/blank ``description``.
            OverflowError: If the new entry does not fit; nothing is written in that case.
        """
        _check_kind(kind)
        if not isinstance(description, str) or not description.strip():
            raise ValueError("language description must be nonempty text")
        self._ensure_process()
        known = self._indices[kind].get(description)
        if known is not None:
            return known
        line = json.dumps([kind, description], ensure_ascii=False, separators=(",", ":")) + "\n"
        try:
            encoded = line.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"language description must be valid Unicode text (UTF-8 encodable), got "
                f"{description!r:.80} ({error.reason})"
            ) from None
        with self._append_lock.held(check), self._cache_lock:
            self._refresh_cache()
            known = self._indices[kind].get(description)
            if known is not None:
                return known
            start = int(self._length.value)
            end = start + len(encoded)
            if end > len(self._buffer):
                raise OverflowError(
                    f"Online language registry exhausted language_buffer_bytes={len(self._buffer)}; "
                    "increase the capacity and create a new engine."
                )
            memoryview(self._buffer).cast("B")[start:end] = encoded
            # The bytes are in place before the length moves, so readers never see a partial line.
            self._length.value = end
            self._refresh_cache()
            return self._indices[kind][description]

    def resolve(self, indices: torch.Tensor, *, kind: str = "task") -> str | list[Any]:
        """Maps an integer tensor of indices to texts, nested like the tensor.

        Each distinct index is looked up once, so a ``[B, C]`` batch of repeated ids costs one pass.

        Args:
            indices: Integer tensor (int8, int16, int32, int64 or uint8) of any shape.
            kind: ``"task"`` or ``"subtask"``.

        Returns:
            A ``str`` for a 0-d tensor, else nested lists of ``str`` with the tensor's shape.

        Raises:
            ValueError: On an unknown ``kind``, or an index ``< 0`` or ``>= count(kind)`` (padding ``-1``
                included); the message names the first such index in row-major order.
            TypeError: If ``indices`` is not an integer tensor.
        """
        _check_kind(kind)
        if not isinstance(indices, torch.Tensor) or indices.dtype not in _INDEX_DTYPES:
            raise TypeError("language indices must be an integer tensor")
        flat = indices.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
        unique, inverse = torch.unique(flat, return_inverse=True)
        self._ensure_process()
        if unique.numel() and int(unique[-1]) >= len(self._texts[kind]):
            self._refresh()
        known = len(self._texts[kind])
        if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= known):
            bad = flat[(flat < 0) | (flat >= known)]
            raise ValueError(f"Unknown online {kind} index {int(bad[0])}")
        table = self._texts[kind]
        texts = [table[i] for i in unique.tolist()]
        values = [texts[i] for i in inverse.tolist()]
        if indices.dim() == 0:
            return values[0]
        return _nest(values, tuple(indices.shape))

    def _reset_cache(self) -> None:
        self._pid = os.getpid()
        self._cache_lock = threading.RLock()
        self._parsed: tuple[int, dict[str, int]] = (0, dict.fromkeys(_KINDS, 0))
        """Bytes parsed and the texts of each kind they hold, set in one assignment once a parse ends:
        a parse cut short (a Ctrl-C in the owner) leaves texts past these counts, dropped by the next."""
        self._texts: dict[str, list[str]] = {kind: [] for kind in _KINDS}
        self._indices: dict[str, dict[str, int]] = {kind: {} for kind in _KINDS}

    def _ensure_process(self) -> None:
        # A forked child inherits a cache it cannot vouch for; start over from the shared bytes.
        if self._pid != os.getpid():
            self._reset_cache()

    def _refresh(self) -> None:
        """Parse the lines appended since the last look (no shared lock: only whole lines lie below the
        length; the per-process cache lock keeps this process's threads from parsing a line twice)."""
        self._ensure_process()
        with self._cache_lock:
            self._refresh_cache()

    def _refresh_cache(self) -> None:
        length = int(self._length.value)
        parsed, counts = self._parsed
        if length <= parsed:
            return
        for kind, count in counts.items():  # what a parse cut short added past its last commit
            texts, indices = self._texts[kind], self._indices[kind]
            while len(texts) > count:
                indices.pop(texts[-1], None)
                texts.pop()
        chunk = bytes(memoryview(self._buffer).cast("B")[parsed:length]).decode("utf-8")
        # Split on "\n" only: JSON escapes it inside texts, but str.splitlines() would also break on
        # characters such as U+2028 that ensure_ascii=False leaves raw.
        for line in chunk.split("\n")[:-1]:
            kind, text = json.loads(line)
            self._indices[kind][text] = len(self._texts[kind])
            self._texts[kind].append(text)
        self._parsed = (length, {kind: len(texts) for kind, texts in self._texts.items()})


def _nest(values: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """Groups a row-major flat list into nested lists of ``shape`` (zero-sized dimensions included)."""
    nested = values
    for axis in range(len(shape) - 1, 0, -1):
        width = shape[axis]
        groups = math.prod(shape[:axis])
        nested = [nested[g * width : (g + 1) * width] for g in range(groups)]
    return nested
