"""Holding a lock that other processes share, without waiting forever for a holder that died.

A process killed while it holds a ``multiprocessing`` lock (the OOM killer, ``kill -9``) never releases
it, and a plain ``with lock:`` in another process then blocks for good. :func:`held` first waits until
the lock can be taken, in bounded slices with ``check`` between them (the engine passes its failure check,
which raises the dead worker's error once the supervisor has published the death), then hands back the
lock's C-level semaphore for the ``with`` block.

Why the semaphore: Ctrl-C is raised in the main thread as soon as a Python-level call returns or a Python
function starts. A lock taken or released through Python code (``multiprocessing``'s own ``Lock.__enter__``
and ``__exit__`` are Python wrappers, as would be any context manager written here) can therefore be left
taken by a ``KeyboardInterrupt`` that lands in between, and then every producer waits on it forever. The
semaphore's ``__enter__`` and ``__exit__`` are C: nothing can run between them and the ``with`` block.
"""

from __future__ import annotations

from collections.abc import Callable

from ._sync import SharedLock

__all__ = ["held"]

_SLICE_S = 0.1
"""Longest wait between two checks: a live holder keeps a lock for microseconds."""


def held(lock, check: Callable[[], None] | None, slice_s: float = _SLICE_S):
    """What to write ``with`` on: ``lock``'s semaphore, once ``lock`` could be taken (see the module).

    Args:
        lock: A :class:`~simstream._sync.SharedLock` (its own bounded ``held``), a multiprocessing lock,
            rlock or condition (or any lock: it is then used as it is).
        check: Called while the lock is taken elsewhere; it ends the wait by raising. ``None``: no wait
            beforehand, the ``with`` block waits as long as it takes.
        slice_s: Seconds between two calls of ``check``.

    Examples:
        >>> import multiprocessing
        >>> lock = multiprocessing.Lock()
        >>> with held(lock, check=lambda: None):
        ...     pass
    """
    if isinstance(lock, SharedLock):  # released by the kernel when its holder dies: its own bounded wait
        return lock.held(check, slice_s)
    semlock = _semlock(lock)
    if check is None:
        return semlock
    try:
        while not semlock.acquire(True, slice_s):
            check()
        semlock.release()  # it can be taken: the with block takes it in C
    except BaseException:
        if getattr(semlock, "_is_mine", lambda: False)():  # interrupted right after taking it
            semlock.release()
        raise
    return semlock


def _semlock(lock):
    """The C-level semaphore of a multiprocessing lock or condition; other locks as they are."""
    inner = getattr(lock, "_lock", lock)  # a Condition wraps its lock
    return getattr(inner, "_semlock", inner)
