"""Holding a lock that other processes share, without waiting forever for a holder that died.

A process killed while it holds a ``multiprocessing`` lock (the OOM killer, ``kill -9``) never releases
it, and a plain ``with lock:`` in another process then blocks for good. :func:`held` waits in bounded
slices and calls ``check`` between them; the engine passes its failure check, which raises the dead
worker's error once the supervisor has published the death.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["held"]

_SLICE_S = 0.1
"""Longest wait between two checks: a live holder keeps a lock for microseconds."""


@contextmanager
def held(lock, check: Callable[[], None] | None, slice_s: float = _SLICE_S) -> Iterator[None]:
    """``with lock:``, calling ``check()`` (which ends the wait by raising) every ``slice_s`` seconds.

    Args:
        lock: Anything with ``acquire(block, timeout)`` and ``release()`` (a multiprocessing lock or
            condition).
        check: Called while the lock is not free; ``None`` waits without bound, like ``with lock:``.
        slice_s: Seconds between two calls of ``check``.
    """
    if check is None:
        lock.acquire()
    else:
        while not lock.acquire(True, slice_s):
            check()
    try:
        yield
    finally:
        lock.release()
