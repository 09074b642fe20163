"""A ``DataLoader`` multiprocessing context whose queues write straight to their pipe.

``multiprocessing.Queue.put`` appends the object to a buffer and wakes a feeder thread, which pickles it
and writes it to the pipe. A ``DataLoader`` with workers puts two messages per batch: an index into a
worker's queue (in the trainer) and the result into the shared result queue (in the worker). Each put
therefore wakes a thread that then competes with its process's main thread for the GIL. When the trainer
and two workers share two cores, those wake-ups cost about a tenth of the CPU a low-dim batch takes
(BENCHMARKS.md).

The queues of :func:`loader_context` pickle and write in the calling thread instead: the same pipe and the
same two locks as ``multiprocessing.Queue``, no thread and no buffer. A put blocks only while the pipe is
full, which the ``DataLoader`` protocol bounds: the trainer sends at most ``prefetch_factor`` indices per
worker before it reads results back, and at shutdown it joins its workers with a timeout and terminates
those still alive.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing import connection
from multiprocessing.context import BaseContext, assert_spawning
from multiprocessing.reduction import ForkingPickler
from queue import Empty

__all__ = ["DirectQueue", "loader_context"]


class DirectQueue:
    """A process-shared FIFO queue without a feeder thread: ``put`` pickles and writes in the caller.

    Provides the part of ``multiprocessing.Queue``'s interface a ``DataLoader`` uses: ``put``,
    ``get(block, timeout)``, ``close``, ``cancel_join_thread`` and ``join_thread``.
    """

    def __init__(self, context: BaseContext) -> None:
        self._reader, self._writer = connection.Pipe(duplex=False)
        self._read_lock = context.Lock()
        self._write_lock = context.Lock()
        self._closed = False

    def __getstate__(self):
        assert_spawning(self)
        return self._reader, self._writer, self._read_lock, self._write_lock

    def __setstate__(self, state) -> None:
        self._reader, self._writer, self._read_lock, self._write_lock = state
        self._closed = False

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        """Pickle ``obj`` and write it to the pipe (blocks while the pipe is full)."""
        if self._closed:
            raise ValueError("put() on a closed DirectQueue")
        payload = ForkingPickler.dumps(obj)
        with self._write_lock:
            self._writer.send_bytes(payload)

    def get(self, block: bool = True, timeout: float | None = None):
        """The next object; raises ``queue.Empty`` if none arrives within ``timeout`` (or at once)."""
        if self._closed:
            raise ValueError("get() on a closed DirectQueue")
        if block and timeout is None:
            with self._read_lock:
                payload = self._reader.recv_bytes()
        else:
            deadline = time.monotonic() + (timeout if block else 0.0)
            if not self._read_lock.acquire(block, timeout):
                raise Empty
            try:
                if not self._reader.poll(max(0.0, deadline - time.monotonic())):
                    raise Empty
                payload = self._reader.recv_bytes()
            finally:
                self._read_lock.release()
        return ForkingPickler.loads(payload)

    def close(self) -> None:
        """Close this process's ends of the pipe; the queue cannot be used here afterwards."""
        if not self._closed:
            self._closed = True
            self._reader.close()
            self._writer.close()

    def cancel_join_thread(self) -> None:
        """No-op: there is no feeder thread to join."""

    def join_thread(self) -> None:
        """No-op: there is no feeder thread to join."""


_CONTEXT_TYPES: dict[type, type] = {}


def loader_context(start_method: str | None = None) -> BaseContext:
    """A multiprocessing context for ``DataLoader(multiprocessing_context=...)`` with :class:`DirectQueue`.

    Args:
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; ``None`` is the process-wide default.

    Processes, events and locks are those of ``multiprocessing.get_context(start_method)``; only
    ``Queue()`` differs. :meth:`OnlineDataset.loader <simstream.data.OnlineDataset.loader>` uses it.
    """
    methods = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        raise ValueError(f"start_method must be None or one of {methods}, got {start_method!r}.")
    # get_start_method(allow_none=True) does not pin the default the way get_context(None) would
    method = start_method or multiprocessing.get_start_method(allow_none=True) or methods[0]
    base = type(multiprocessing.get_context(method))
    direct = _CONTEXT_TYPES.get(base)
    if direct is None:

        def queue(self, maxsize: int = 0) -> DirectQueue:
            return DirectQueue(self)

        direct = type(f"Direct{base.__name__}", (base,), {"Queue": queue, "__module__": __name__})
        _CONTEXT_TYPES[base] = direct
    return direct()
