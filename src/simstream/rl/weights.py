"""A versioned, seqlocked flat float32 buffer: the learner publishes weights, the collector copies them.

Protocol (one writer, any number of readers, no lock a dead process could hold):

* write: ``seq += 1`` (odd: writing) -> copy the vector -> ``version = v`` -> ``seq += 1`` (even: stable);
* read: ``s1 = seq`` (retry while odd) -> copy -> ``s2 = seq``; the copy is whole iff ``s1 == s2``.

A reader therefore never applies a half-written vector (UniLab's APPO collector could, reference §7.2).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .._validation import require_int

__all__ = ["WeightBuffer"]

_SEQ, _VERSION = 0, 1


class WeightBuffer:
    """Owns one flat shared vector of ``size`` floats plus its sequence counter and version.

    Allocated once by the learner; reaches the collector as a process argument (file descriptors, nothing
    named under ``/dev/shm``). ``version`` is ``-1`` until the first :meth:`publish`.
    """

    def __init__(self, size: int) -> None:
        require_int("WeightBuffer", "size", size, 1)
        self.size = size
        self._flat = torch.zeros(size, dtype=torch.float32).share_memory_()
        self._meta = torch.tensor([0, -1], dtype=torch.int64).share_memory_()

    @property
    def version(self) -> int:
        """The last completely published version (``-1``: nothing published yet).

        The version is stored after the vector, so seeing ``v`` means vector ``v`` was written whole.
        """
        return int(self._meta[_VERSION])

    def publish(self, vector: torch.Tensor, version: int) -> None:
        """Write ``vector`` as ``version`` (learner side; only one process may publish)."""
        if vector.numel() != self.size:
            raise ValueError(f"WeightBuffer.publish expects {self.size} values, got {vector.numel()}")
        # absolute values, not increments: a publish interrupted mid-write left the count odd, and
        # increments would keep it odd ("being written") for good
        stable = int(self._meta[_SEQ])
        stable += stable & 1
        self._meta[_SEQ] = stable + 1
        self._flat.copy_(vector.detach().reshape(-1))
        self._meta[_VERSION] = version
        self._meta[_SEQ] = stable + 2

    def read_into(
        self, out: torch.Tensor, *, timeout_s: float = 5.0, on_retry: Callable[[], None] | None = None
    ) -> int:
        """Copy a consistent snapshot into ``out`` and return its version.

        Raises:
            TimeoutError: no stable snapshot within ``timeout_s`` (the publisher died mid-write).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            before = int(self._meta[_SEQ])
            if before % 2 == 0:
                out.copy_(self._flat)
                version = int(self._meta[_VERSION])
                if int(self._meta[_SEQ]) == before:
                    return version
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"WeightBuffer: no consistent weights within {timeout_s} s "
                    "(the learner stopped mid-write)"
                )
            if on_retry is not None:
                on_retry()
            time.sleep(0.0002)

    def release(self) -> None:
        """Drop this process's mapping (the memory is freed when every process has dropped it)."""
        self._flat = torch.empty(0)
        self._meta = torch.tensor([0, -1], dtype=torch.int64)
