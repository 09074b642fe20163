"""Cross-process primitives that no other process's death or stop can wedge.

The engine's owner, its producers and its consumers (``DataLoader`` workers, any process the engine was
pickled into) share state. Any of them may be killed or stopped at any moment, including while holding a
lock or sleeping on a wake-up, so the primitives here follow one rule: **no process ever waits without a
bound on another one**.

* :class:`Doorbell` — a wake-up whose ring never blocks the ringer. ``multiprocessing.Event.set()`` waits,
  without a timeout, for every sleeper to confirm that it woke, so a sleeper that was killed (or stopped)
  wedges whoever sets the event. A doorbell is a POSIX semaphore: ringing is one ``sem_post``; a sleeper
  waits with a timeout and then re-reads the state it cares about, so a lost or spurious ring is harmless.
* :class:`SharedFlag` — a boolean in shared memory, read and written without any lock.
* :class:`StopSignal` — a one-way "stop" for worker processes: a :class:`SharedFlag` and a
  :class:`Doorbell`, with ``multiprocessing.Event``'s ``set``/``is_set``/``wait``. An event guards its flag
  with a lock that ``is_set()`` takes too: a process killed or stopped while it holds that lock (it polls
  the flag every step) wedges every other one, its owner's ``close()`` included.
* :class:`SharedLock` — a mutual-exclusion lock held as an ``fcntl`` record lock: the kernel releases it
  when its holder dies, however it dies, so a killed holder can never leave it taken. Every acquisition is
  bounded in slices with a caller-supplied check between them (a stopped holder is waited for only as
  long as the caller's check allows).
* :class:`ProcessSlots` — each process claims a row of a shared table for itself (again an ``fcntl``
  record lock, released by the kernel when the process ends), so per-process counters with a single
  writer each need no lock at all; readers sum the rows.

All of them pickle only while a child process is being created (like every multiprocessing primitive);
a forked child starts with none of its parent's lock holdings.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import context, reduction
from typing import Any, ClassVar

__all__ = ["Doorbell", "ProcessSlots", "SharedFlag", "SharedLock", "StopSignal", "with_deadline"]

_FLOCK = "@hhqqi4x"
"""Linux's ``struct flock`` (type, whence, start, length, pid), padded to its 32 bytes."""
_SLICE_S = 0.1
"""Longest wait between two calls of a lock wait's check: a live holder keeps a lock for microseconds."""
_FIRST_BACKOFF_S = 2e-5
_LAST_BACKOFF_S = 1e-3


def with_deadline(
    check: Callable[[], None] | None, timeout_s: float, what: str, lock: SharedLock
) -> Callable[[], None]:
    """A wait for ``lock``'s check that also raises ``TimeoutError`` once its holder has been a stopped
    process for ``timeout_s``.

    A holder that died releases a :class:`SharedLock`, and a failed engine ends a wait through ``check``;
    a holder that is stopped (SIGSTOP, a debugger) does neither. Only the seconds while the holder is
    stopped count: a live holder (a long batch copy under the quota lock) is waited for.
    """
    stopped: tuple[int, float] | None = None  # (holder, since when it is seen stopped)

    def bounded() -> None:
        nonlocal stopped
        if check is not None:
            check()
        now = time.monotonic()
        holder = lock.holder_pid()
        if holder is None or not process_is_stopped(holder):
            stopped = None
            return
        if stopped is None or stopped[0] != holder:
            stopped = (holder, now)
        elif now - stopped[1] > timeout_s:
            raise TimeoutError(
                f"{what} was held for more than {timeout_s:g} s by process {holder}, which is stopped "
                "(SIGSTOP or a debugger?) and cannot release it"
            )

    return bounded


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie...);
    ``None`` when there is no such process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (by a signal or a tracer); ``False`` when it is gone."""
    return process_state(pid) in ("T", "t")


class Doorbell:
    """A wake-up that can be rung from any process without ever blocking the ringer.

    Args:
        ctx: Multiprocessing context that allocates the semaphore (default: forkserver).

    Examples:
        >>> bell = Doorbell()
        >>> bell.ring()
        >>> bell.wait(0.0)
        True
        >>> bell.wait(0.0)
        False
    """

    def __init__(self, ctx: Any = None) -> None:
        ctx = ctx if ctx is not None else mp.get_context("forkserver")
        self._semaphore = ctx.Semaphore(0)

    def ring(self) -> None:
        """Wake one sleeper (or the next one to sleep). Never blocks, never raises."""
        try:
            self._semaphore.release()
        except (OSError, ValueError):  # at SEM_VALUE_MAX: it is rung already
            pass

    def wait(self, timeout: float) -> bool:
        """Sleep until rung or ``timeout`` seconds pass; ``True`` if rung. Rings that piled up are consumed.

        Callers re-read the state they wait for after every return: a ring may have been consumed by
        another sleeper, or belong to a change already seen.
        """
        rung = self._semaphore.acquire(True, max(0.0, timeout))
        if rung:
            while self._semaphore.acquire(False):
                pass
        return rung


class SharedFlag:
    """A shared boolean, set and read without a lock (one aligned byte).

    Examples:
        >>> flag = SharedFlag()
        >>> flag.is_set()
        False
        >>> flag.set(); flag.is_set()
        True
    """

    def __init__(self, ctx: Any = None) -> None:
        ctx = ctx if ctx is not None else mp.get_context("forkserver")
        self._value = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return self._value.value != 0


class StopSignal:
    """Set once by the owner, read by workers: a lock-free stand-in for ``multiprocessing.Event``.

    ``set()`` never blocks and ``is_set()`` is one shared-memory read, so no process's death or stop can
    wedge another here. ``wait()`` sleeps on a doorbell that ``set()`` rings, and every sleeper it wakes
    rings it again for the next one.

    Examples:
        >>> stop = StopSignal()
        >>> stop.wait(0.0)
        False
        >>> stop.set(); stop.is_set(), stop.wait(0.0)
        (True, True)
    """

    def __init__(self, ctx: Any = None) -> None:
        self._flag = SharedFlag(ctx)
        self._bell = Doorbell(ctx)

    def set(self) -> None:
        self._flag.set()
        self._bell.ring()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Return ``True`` once set, or ``False`` after ``timeout`` seconds (``None``: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag.is_set():
            remaining = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if remaining <= 0:
                return False
            if self._bell.wait(remaining):
                self._bell.ring()  # one ring wakes one sleeper: pass it on
        return True


def _memfd(size: int) -> int:
    fd = os.memfd_create("simstream-lock", os.MFD_CLOEXEC)
    os.ftruncate(fd, max(1, size))
    return fd


class _LockFile:
    """One process's handle on a lock file: its descriptor and one thread lock per byte range in use.

    ``fcntl`` record locks belong to a process, not a thread, and closing *any* descriptor of the file
    drops all of the process's locks on it. So each process keeps one descriptor per lock file (a second
    unpickled copy reuses it) while any object of this process uses the file, and closes it when the last
    one is collected (:meth:`adopt` counts them), so an owner that creates engine after engine does not
    run out of descriptors; threads are kept apart by a ``threading.Lock`` per range.
    """

    _by_inode: ClassVar[dict[tuple[int, int], _LockFile]] = {}
    _guard = threading.RLock()
    """Re-entrant: a collected user's finalizer (:meth:`_drop_user`) may run inside a guarded section."""

    def __init__(self, fd: int, key: tuple[int, int]) -> None:
        self.fd = fd
        self.key = key
        self.users = 0
        """Live objects of this process (locks, slot tables) that use this file."""
        self.extra_fds: list[int] = []
        """Duplicates that arrived while this process held a lock on the file (closing them would have
        dropped it); closed with :attr:`fd`."""
        self.thread_locks: dict[int, threading.Lock] = {}
        self.holders: dict[int, int] = {}
        """Range offset -> ident of the thread of this process that holds it."""
        self.claim_pid: int | None = None
        self.claimed: int | None = None
        """:class:`ProcessSlots`: the slot process ``claim_pid`` claimed (``None``: none was free)."""

    @classmethod
    def adopt(cls, fd: int, user: object) -> _LockFile:
        """The handle for the file behind ``fd``, used by ``user`` until it is collected.

        Closes ``fd`` when this process already has a descriptor of the file and holds nothing on it.
        """
        status = os.fstat(fd)
        key = (status.st_dev, status.st_ino)
        with cls._guard:
            known = cls._by_inode.get(key)
            if known is None:
                known = cls._by_inode[key] = cls(fd, key)
            elif known.fd != fd:
                if not known.holders and known.claim_pid != os.getpid():
                    os.close(fd)  # closing drops this process's record locks on the file: only if it has none
                else:
                    known.extra_fds.append(fd)
            known.users += 1
        # not at interpreter exit: a daemon thread may still use the lock then; the kernel closes it after
        weakref.finalize(user, cls._drop_user, known).atexit = False
        return known

    @classmethod
    def _drop_user(cls, handle: _LockFile) -> None:
        """A user was collected; the last one closes the descriptors (releasing whatever they hold)."""
        with cls._guard:
            handle.users -= 1
            if handle.users > 0:
                return
            if cls._by_inode.get(handle.key) is handle:
                del cls._by_inode[handle.key]
            fds, handle.fd, handle.extra_fds = [handle.fd, *handle.extra_fds], -1, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def thread_lock(self, offset: int) -> threading.Lock:
        lock = self.thread_locks.get(offset)
        if lock is None:
            with self._guard:
                lock = self.thread_locks.setdefault(offset, threading.Lock())
        return lock

    @classmethod
    def forget_holdings(cls) -> None:
        """In a forked child: the parent's record locks and thread locks were not inherited."""
        cls._guard = threading.RLock()
        for handle in list(cls._by_inode.values()):
            handle.thread_locks = {}
            handle.holders = {}
            handle.claim_pid = handle.claimed = None


os.register_at_fork(after_in_child=_LockFile.forget_holdings)


def _try_record_lock(fd: int, offset: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
    except (BlockingIOError, PermissionError):
        return False
    return True


class SharedLock:
    """A lock shared by processes that the kernel releases when its holder dies.

    Use :meth:`held` as the ``with`` target; every wait is bounded in slices of ``slice_s`` seconds with
    ``check`` between them, which ends the wait by raising (the engine passes its failure check, a
    producer its stop check). A thread that finds the lock recorded as its own was interrupted (Ctrl-C)
    between taking and using it: it takes it over instead of waiting on itself.

    Examples:
        >>> lock = SharedLock()
        >>> with lock.held(check=None):
        ...     lock.is_held_here()
        True
    """

    def __init__(self) -> None:
        self._file = _LockFile.adopt(_memfd(1), self)
        self._offset = 0

    def __reduce__(self):
        # like every multiprocessing lock, only into a child being created: a descriptor duplicated for
        # anything else is closed by this process later, which would drop its record locks on the file
        context.assert_spawning(self)
        return _rebuild_lock, (reduction.DupFd(self._file.fd), self._offset)

    def is_held_here(self) -> bool:
        """Whether a thread of this process holds the lock."""
        return self._offset in self._file.holders

    def holder_pid(self) -> int | None:
        """The process that holds the lock, when it is another process (``fcntl``'s ``F_GETLK``)."""
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, self._offset, 1, 0)
        try:
            kind, _, _, _, pid = struct.unpack(_FLOCK, fcntl.fcntl(self._file.fd, fcntl.F_GETLK, query))
        except OSError:
            return None
        return None if kind == fcntl.F_UNLCK else pid

    def acquire(self, check: Callable[[], None] | None, slice_s: float = _SLICE_S) -> None:
        """Take the lock, calling ``check`` every ``slice_s`` seconds while another holder keeps it.

        ``check=None`` waits as long as it takes (in slices); every holder is alive (a dead one released
        it) and keeps it for microseconds, so only a stopped holder makes such a wait long.
        """
        handle, offset = self._file, self._offset
        me = threading.get_ident()
        if handle.holders.get(offset) == me:  # left taken by an interrupt in this very thread
            self.release()
        thread_lock = handle.thread_lock(offset)
        while not thread_lock.acquire(True, slice_s):
            if check is not None:
                check()
        try:
            backoff = _FIRST_BACKOFF_S
            next_check = time.monotonic() + slice_s
            while not _try_record_lock(handle.fd, offset):
                time.sleep(backoff)
                backoff = min(backoff * 2, _LAST_BACKOFF_S)
                if check is not None and time.monotonic() >= next_check:
                    check()
                    next_check = time.monotonic() + slice_s
            handle.holders[offset] = me
        except BaseException:
            if handle.holders.get(offset) != me:
                # interrupted (Ctrl-C) right after the record lock was taken, before it was recorded: give
                # it back too (no other thread of this process can hold it: this one has the thread lock)
                fcntl.lockf(handle.fd, fcntl.LOCK_UN, 1, offset)
                thread_lock.release()
            raise

    def release(self) -> None:
        handle, offset = self._file, self._offset
        if offset not in handle.holders:
            raise RuntimeError("SharedLock.release() of a lock this process does not hold")
        # the record lock first: interrupted after it, the lock is still recorded as this thread's, and
        # its next acquire takes it over (releasing again is harmless)
        fcntl.lockf(handle.fd, fcntl.LOCK_UN, 1, offset)
        del handle.holders[offset]
        handle.thread_lock(offset).release()

    def __enter__(self) -> SharedLock:
        """``with lock:`` waits as long as it takes (in slices, no check); prefer :meth:`held`."""
        self.acquire(None)
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    @contextlib.contextmanager
    def held(self, check: Callable[[], None] | None, slice_s: float = _SLICE_S) -> Iterator[None]:
        """Context manager: :meth:`acquire` with ``check``, :meth:`release` on the way out."""
        self.acquire(check, slice_s)
        try:
            yield
        finally:
            self.release()


def _rebuild_lock(dup_fd, offset: int) -> SharedLock:
    lock = SharedLock.__new__(SharedLock)
    lock._file = _LockFile.adopt(dup_fd.detach(), lock)
    lock._offset = offset
    return lock


class ProcessSlots:
    """``count`` slots, each claimed by at most one live process; a dead process's slot is free again.

    A process claims a slot the first time it asks for one (:meth:`mine`) and keeps it for life; the
    kernel frees it when the process exits, however it exits. Whatever the slot indexes (a row of
    counters) keeps its values, so a new process that claims it continues from there: sums over all rows
    stay exact.

    Args:
        count: Number of slots.
    """

    def __init__(self, count: int) -> None:
        if type(count) is not int or count < 1:
            raise ValueError(f"ProcessSlots.count must be an int >= 1, got {count!r}")
        self.count = count
        self._file = _LockFile.adopt(_memfd(count), self)

    def __reduce__(self):
        context.assert_spawning(self)  # see SharedLock.__reduce__
        return _rebuild_slots, (reduction.DupFd(self._file.fd), self.count)

    def mine(self) -> int | None:
        """This process's slot (claimed on first call), or ``None`` if all are held by live processes."""
        handle = self._file
        if handle.claim_pid != os.getpid():  # first call here (a forked child forgets its parent's claim)
            with _LockFile._guard:
                if handle.claim_pid != os.getpid():
                    handle.claimed = next(
                        (s for s in range(self.count) if _try_record_lock(handle.fd, s)), None
                    )
                    handle.claim_pid = os.getpid()
        return handle.claimed


def _rebuild_slots(dup_fd, count: int) -> ProcessSlots:
    slots = ProcessSlots.__new__(ProcessSlots)
    slots.count = count
    slots._file = _LockFile.adopt(dup_fd.detach(), slots)
    return slots
