"""A ``DataLoader`` multiprocessing context whose queues write straight to their pipe.

``multiprocessing.Queue.put`` appends the object to a buffer and wakes a feeder thread, which pickles it
and writes it to the pipe. A ``DataLoader`` with workers puts two messages per batch: an index into a
worker's queue (in the trainer) and the result into the shared result queue (in the worker). Each put
therefore wakes a thread that then competes with its process's main thread for the GIL. When the trainer
and two workers share two cores, those wake-ups cost about a tenth of the CPU a low-dim batch takes
(BENCHMARKS.md).

The queues of :func:`loader_context` pickle and write in the calling thread instead, over the same pipe
and the same two locks as ``multiprocessing.Queue``, whenever that cannot block: the message is small
and fits the pipe now (the ``DataLoader`` protocol keeps few of them in flight, but many workers with deep
prefetching can fill it), and the write lock is free. Anything else (a large result sent by value, a
lock held by a writer stuck on a full pipe) goes, in order, through a feeder thread started on first need,
as in ``multiprocessing.Queue``. So a put never
blocks its caller: a worker with a large result still sees the trainer's shutdown, and the trainer's own
wake-up message at shutdown cannot wait behind a worker that nobody reads any more.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import gc
import math
import mmap
import multiprocessing
import os
import select
import struct
import termios
import threading
import time
from multiprocessing import connection, reduction, util
from multiprocessing.context import BaseContext, assert_spawning
from multiprocessing.reduction import ForkingPickler
from queue import Empty

__all__ = ["DirectQueue", "loader_context"]

_DIRECT_MAX_BYTES = 4096
"""Largest message written in the caller's thread. With a few of them in flight per worker (``DataLoader``
bounds that by ``prefetch_factor``) they cannot fill a 64 KiB pipe; a batch reference is ~0.3 KiB."""
_INT32, _UINT64 = struct.Struct("!i"), struct.Struct("!Q")
"""``multiprocessing.connection``'s message header: a signed 32-bit size, or -1 and a 64-bit size."""
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
"""``fcntl`` command for a pipe's capacity (Linux)."""
_FEEDER_SLICE_S = 0.1
"""Longest wait of the feeder thread before it looks whether its queue was closed."""
_CLOSE_WAIT_S = 5.0
"""Longest wait of ``close()`` for this process's feeder thread to write its backlog."""


class _PipeEnd(connection.Connection):
    """One end of a :class:`DirectQueue`'s pipe: a ``Connection`` that, collected as part of a reference
    cycle, stays open until the collection is over.

    A ``DataLoader`` iterator held by an exception's traceback is such a cycle, with its queues in it. The
    collector finalizes a cycle's objects in no particular order, and a ``Connection``'s finalizer closes
    its descriptor without marking it closed: when the iterator's finalizer ran second, its shutdown put
    ``None`` into a closed descriptor (``OSError: [Errno 9] Bad file descriptor``, reported as an exception
    ignored in ``_MultiProcessingDataLoaderIter.__del__``; the workers, which exit on that message, were
    then terminated) and closed the numbers again, which by then could belong to other files.
    """

    def __del__(self) -> None:
        if self._handle is None:
            return
        pending = _close_after_collection  # None late in the interpreter's shutdown
        if _collecting and pending is not None:
            pending.append(self)  # kept alive until every finalizer of the cycle has run
        else:
            self.close()


_collecting = False
"""Whether the cyclic garbage collector is running (set by :func:`_note_collection`)."""
_close_after_collection: list[_PipeEnd] = []
"""Pipe ends finalized during the running collection, closed when it ends."""


def _note_collection(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"
    if phase == "stop":
        while _close_after_collection:
            with contextlib.suppress(OSError):
                _close_after_collection.pop().close()


gc.callbacks.append(_note_collection)


def _rebuild_pipe_end(duplicate, readable: bool, writable: bool) -> _PipeEnd:
    return _PipeEnd(duplicate.detach(), readable, writable)


def _reduce_pipe_end(end: _PipeEnd):
    """Sent to a child as ``multiprocessing`` sends a ``Connection``, rebuilt as a :class:`_PipeEnd`."""
    return _rebuild_pipe_end, (reduction.DupFd(end.fileno()), end.readable, end.writable)


reduction.register(_PipeEnd, _reduce_pipe_end)


class DirectQueue:
    """A process-shared FIFO queue without a feeder thread: ``put`` pickles and writes in the caller.

    Provides the part of ``multiprocessing.Queue``'s interface a ``DataLoader`` uses: ``put``,
    ``get(block, timeout)``, ``close``, ``cancel_join_thread`` and ``join_thread``.
    """

    def __init__(self, context: BaseContext) -> None:
        read, write = os.pipe()
        self._reader, self._writer = _PipeEnd(read, writable=False), _PipeEnd(write, readable=False)
        self._read_lock = context.Lock()
        self._write_lock = context.Lock()
        self._closed = False
        self._reset_process_state()

    def __getstate__(self):
        assert_spawning(self)
        return self._reader, self._writer, self._read_lock, self._write_lock

    def __setstate__(self, state) -> None:
        self._reader, self._writer, self._read_lock, self._write_lock = state
        self._closed = False
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """This process's backlog, feeder thread, poll object and partial message (none yet): a forked
        child starts without any."""
        self._pid = os.getpid()
        self._backlog: collections.deque[bytes] = collections.deque()
        self._backlog_changed = threading.Condition(threading.Lock())
        self._feeder: threading.Thread | None = None
        self._exiting = threading.Event()
        """Set at this process's exit: the feeder writes its backlog and stops."""
        self._writer_owned_by_feeder = False
        """Set by :meth:`close` when the feeder was still running: the feeder closes the write end."""
        self._join_cancelled = threading.Event()
        """Set by :meth:`cancel_join_thread`: closing and exiting do not wait for the feeder."""
        self._partial = bytearray()
        """Bytes of a message a timed-out ``get`` had begun to read."""
        self._poller: select.poll | None = None

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        """Pickle ``obj`` and send it; never blocks (see the module docstring). Messages keep their order."""
        if self._closed:
            raise ValueError("put() on a closed DirectQueue")
        if self._pid != os.getpid():
            self._reset_process_state()
        payload = ForkingPickler.dumps(obj)
        with self._backlog_changed:
            direct = (
                not self._backlog and len(payload) <= _DIRECT_MAX_BYTES and self._write_lock.acquire(False)
            )
            if direct and not self._pipe_has_room(len(payload) + _INT32.size):
                # many workers with deep prefetching can fill the pipe while the trainer is busy: a
                # direct write would then block, holding the write lock and missing the shutdown
                self._write_lock.release()
                direct = False
            if not direct:
                self._backlog.append(payload)
                if self._feeder is None:
                    self._feeder = threading.Thread(target=self._feed, name="DirectQueue-feeder", daemon=True)
                    self._feeder.start()
                    # A DataLoader worker whose dataset ran out exits after its last message without
                    # closing the queue; a daemon feeder killed inside a write would keep the write lock
                    # for good, and no other worker could send again. multiprocessing runs this at the
                    # exit of the processes it starts (as Queue's own join of its feeder).
                    util.Finalize(
                        self,
                        _let_feeder_finish,
                        args=(self._feeder, self._exiting, self._join_cancelled),
                        exitpriority=-5,
                    )
                self._backlog_changed.notify()
                return
        try:
            self._writer.send_bytes(payload)
        finally:
            self._write_lock.release()

    def _pipe_has_room(self, size: int) -> bool:
        """Whether ``size`` more bytes surely fit the pipe now (call holding the write lock: then only
        readers change its level, downwards). True where the pipe cannot be asked (not Linux).

        Linux keeps a pipe's bytes in pages and starts a new page for a write that does not fit the
        last one's rest, so a full pipe may hold little more than half its capacity (of two neighbouring
        pages, the first was closed by a write the second begins with: together they hold more than a
        page). Hence the factor 2 and a page of margin.
        """
        fd = self._writer.fileno()
        try:
            capacity = fcntl.fcntl(fd, _F_GETPIPE_SZ)
            unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, AttributeError):
            return True
        return 2 * (unread + size) + 2 * mmap.PAGESIZE <= capacity

    def _receive(self, deadline: float | None) -> bytes:
        """One message (``Connection``'s framing), read in bounded waits; ``Empty`` at ``deadline``.

        Reads exactly the message's bytes, so a reader in another process finds the next one intact.
        """
        buffer = self._partial
        self._read_into(buffer, 4, deadline)
        (size,) = _INT32.unpack_from(buffer)
        start = 4
        if size == -1:  # a message of 2 GiB or more: the real size follows
            self._read_into(buffer, 12, deadline)
            (size,) = _UINT64.unpack_from(buffer, 4)
            start = 12
        self._read_into(buffer, start + size, deadline)
        payload = bytes(memoryview(buffer)[start:])
        buffer.clear()
        return payload

    def _read_into(self, buffer: bytearray, length: int, deadline: float | None) -> None:
        """Read from the pipe until ``buffer`` holds ``length`` bytes; ``Empty`` at ``deadline``."""
        fd = self._reader.fileno()
        if self._poller is None:  # one poll object per process: Connection.poll builds a selector per call
            self._poller = select.poll()
            self._poller.register(fd, select.POLLIN)
        while len(buffer) < length:
            wait = None if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))
            if not self._poller.poll(wait):
                raise Empty
            chunk = os.read(fd, length - len(buffer))
            if not chunk:
                raise EOFError("DirectQueue: every writer closed the pipe")
            buffer += chunk

    def _feed(self) -> None:
        """Write the backlog in order, each message under the write lock, until this end is closed (and,
        once it is, the backlog is written or the write lock stays out of reach)."""
        try:
            while True:
                with self._backlog_changed:
                    while not self._backlog:
                        if self._closed or self._exiting.is_set():
                            return
                        self._backlog_changed.wait(_FEEDER_SLICE_S)
                    payload = self._backlog[0]
                while not self._write_lock.acquire(True, _FEEDER_SLICE_S):
                    if self._closed:
                        return
                try:
                    self._writer.send_bytes(payload)  # may wait while the pipe is full, as Queue's feeder
                finally:
                    self._write_lock.release()
                with self._backlog_changed:
                    self._backlog.popleft()  # only now: puts meanwhile queue up behind this message
        except OSError:  # the pipe was closed (this end, or every reader): nobody will read the rest
            return
        finally:
            with self._backlog_changed:
                if self._writer_owned_by_feeder:  # close() left the write end to this thread
                    self._writer.close()

    def get(self, block: bool = True, timeout: float | None = None):
        """The next object; raises ``queue.Empty`` if none arrives within ``timeout`` (or at once).

        With a timeout, the wait stays bounded even inside a message: a writer killed halfway through a
        large one never sends the rest, and ``Empty`` lets ``DataLoader`` find the dead worker (what was
        read is kept for this process's next ``get``).
        """
        if self._closed:
            raise ValueError("get() on a closed DirectQueue")
        if self._pid != os.getpid():
            self._reset_process_state()
        if block and timeout is None:
            with self._read_lock:
                payload = self._receive(None)
        else:
            deadline = time.monotonic() + (timeout if block else 0.0)
            if not self._read_lock.acquire(block, timeout):
                raise Empty
            try:
                payload = self._receive(deadline)
            finally:
                self._read_lock.release()
        return ForkingPickler.loads(payload)

    def close(self) -> None:
        """Close this process's ends of the pipe; the queue cannot be used here afterwards.

        First lets this process's feeder thread write its backlog, for at most ``_CLOSE_WAIT_S``: a
        process may exit right after closing, and a feeder killed with its process inside a write kept the
        write lock for good, so no other writer could send again. (A ``DataLoader`` worker whose dataset
        ran out exits without closing: the ``util.Finalize`` registered in :meth:`put` covers it.)
        """
        if not self._closed:
            self._closed = True
            if self._pid == os.getpid():
                _let_feeder_finish(self._feeder, self._exiting, self._join_cancelled)
            self._reader.close()
            with self._backlog_changed:
                feeding = self._pid == os.getpid() and self._feeder is not None and self._feeder.is_alive()
                if feeding:  # it may be inside a write: closed here, the number could be reused under it
                    self._writer_owned_by_feeder = True
            if not feeding:
                self._writer.close()

    def cancel_join_thread(self) -> None:
        """Close and exit without waiting for this process's feeder thread, as ``multiprocessing.Queue``.

        A ``DataLoader`` worker calls it when the loader shuts down: the trainer reads no more results, so
        a feeder blocked on the full pipe would hold the worker's exit for ``_CLOSE_WAIT_S``, and the
        loader's shutdown with it. What the feeder had not written is dropped.
        """
        if self._pid != os.getpid():
            self._reset_process_state()
        self._join_cancelled.set()

    def join_thread(self) -> None:
        """No-op, as after ``cancel_join_thread``: a backlog left at close is dropped (``DataLoader``
        closes its queues only when it shuts down)."""


def _let_feeder_finish(
    feeder: threading.Thread | None, exiting: threading.Event, join_cancelled: threading.Event
) -> None:
    """Have ``feeder`` write its backlog and stop; wait for it at most ``_CLOSE_WAIT_S`` (not at all once
    :meth:`DirectQueue.cancel_join_thread` was called)."""
    exiting.set()
    if feeder is not None and feeder is not threading.current_thread() and not join_cancelled.is_set():
        feeder.join(_CLOSE_WAIT_S)


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
