"""A broadcast error channel in shared memory: the first failure of any worker, as plain data.

A worker that fails writes one :class:`FailureRecord` into a fixed 64 KiB shared byte buffer. Every process
that holds the channel (the owner, each ``DataLoader`` worker) can read it back at any time, so a failure
reaches every consumer, not only the process that happens to be waiting on a pipe. The record is text
plus, when the exception pickles, the pickled exception: decoding never imports a class by name, and an
exception that cannot be rebuilt still arrives with its type name, message and traceback.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import pickle
import signal
import struct
import time
import traceback
from dataclasses import asdict, dataclass

from .._sync import SharedLock
from ..errors import OnlineDataWorkerError, add_note, ended_process_error

__all__ = ["ErrorChannel", "FailureRecord", "cap_text", "describe_exit", "signal_name"]

CHANNEL_BYTES = 64 * 1024
NOTES_BYTES = 8 * 1024
_NOTE_LIMIT = 1024
_PUBLISH_WAIT_S = 2.0
_PAYLOAD_LIMIT = 32 * 1024
_TEXT_LIMIT = 4096
_TRACEBACK_LIMIT = 24 * 1024
_HEADER = struct.Struct("<II")  # json length, payload length


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``SIG<n>`` for numbers the platform does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def describe_exit(exitcode: int | None) -> str:
    """Human-readable exit status: ``exit code -9, signal SIGKILL`` / ``exit code 3``."""
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        return f"exit code {exitcode}, signal {signal_name(-exitcode)}"
    return f"exit code {exitcode}"


def cap_text(text: str, limit: int) -> str:
    """Keep the head and the tail of ``text`` within ``limit`` characters (tracebacks end with the cause)."""
    if len(text) <= limit:
        return text
    marker = f"\n... [{len(text) - limit} characters cut] ...\n"
    keep = max(0, limit - len(marker))
    head = keep // 3
    return text[:head] + marker + text[len(text) - (keep - head) :]


@dataclass(frozen=True)
class FailureRecord:
    """One worker failure as plain data."""

    worker: str
    """Label of the failed worker, e.g. ``producer-0`` or ``collector``."""
    pid: int
    type_module: str
    type_qualname: str
    message: str
    representation: str
    traceback_text: str
    exitcode: int | None = None
    """Set for a death detected by the supervisor (no Python exception was raised)."""
    payload: bytes | None = None
    """The pickled exception when it pickles and fits, else ``None``."""

    @property
    def type_name(self) -> str:
        return (
            self.type_qualname
            if self.type_module == "builtins"
            else f"{self.type_module}.{self.type_qualname}"
        )

    @classmethod
    def from_exception(
        cls, error: BaseException, worker: str, *, exitcode: int | None = None
    ) -> FailureRecord:
        """Describe ``error`` (with its traceback) without keeping a reference to it."""
        kind = type(error)
        payload = None
        try:
            data = pickle.dumps(error)
            pickle.loads(data)  # an exception that pickles but cannot be rebuilt travels as text
            payload = data if len(data) <= _PAYLOAD_LIMIT else None
        except Exception:
            payload = None
        text = "".join(traceback.format_exception(kind, error, error.__traceback__))
        return cls(
            worker=worker,
            pid=os.getpid(),
            type_module=kind.__module__,
            type_qualname=kind.__qualname__,
            message=cap_text(_safe_str(error), _TEXT_LIMIT),
            representation=cap_text(_safe_repr(error), _TEXT_LIMIT),
            traceback_text=cap_text(text, _TRACEBACK_LIMIT),
            exitcode=exitcode,
            payload=payload,
        )

    def rebuild(self) -> BaseException:
        """The original exception when it unpickles, else an ``OnlineDataWorkerError`` describing it."""
        if self.payload is not None:
            try:
                error = pickle.loads(self.payload)
            except Exception as exc:
                return OnlineDataWorkerError(
                    f"Worker raised {self.type_name}: {self.message} "
                    f"(exception reconstruction failed: {type(exc).__name__}: {exc})"
                )
            if isinstance(error, BaseException):
                return error
        return OnlineDataWorkerError(f"Worker raised {self.type_name}: {self.message}")

    def encode(self) -> bytes:
        """Bytes that fit the channel: payload dropped, then texts shortened, when too large."""
        for payload, text_limit, tb_limit in (
            (self.payload, _TEXT_LIMIT, _TRACEBACK_LIMIT),
            (None, _TEXT_LIMIT, _TRACEBACK_LIMIT),
            (None, 1024, 8 * 1024),
            (None, 256, 1024),
        ):
            header = asdict(self)
            header.pop("payload")
            header["message"] = cap_text(self.message, text_limit)
            header["representation"] = cap_text(self.representation, text_limit)
            header["traceback_text"] = cap_text(self.traceback_text, tb_limit)
            # UTF-8, not JSON's \u escapes: at most 4 bytes a character, where an escaped emoji takes 12
            # (the caps count characters); surrogatepass keeps a lone surrogate of a decoding error
            body = json.dumps(header, ensure_ascii=False).encode("utf-8", "surrogatepass")
            blob = payload or b""
            data = _HEADER.pack(len(body), len(blob)) + body + blob
            if len(data) <= CHANNEL_BYTES:
                return data
        raise ValueError("failure record does not fit the error channel")  # pragma: no cover

    @classmethod
    def decode(cls, data: bytes) -> FailureRecord:
        body_len, blob_len = _HEADER.unpack_from(data)
        start = _HEADER.size
        header = json.loads(data[start : start + body_len].decode("utf-8", "surrogatepass"))
        blob = data[start + body_len : start + body_len + blob_len]
        return cls(**header, payload=blob or None)


def _safe_str(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:
        return f"<unprintable {type(error).__name__}>"


def _safe_repr(error: BaseException) -> str:
    try:
        return repr(error)
    except Exception:
        return f"<unrepresentable {type(error).__name__}>"


class ErrorChannel:
    """First-failure-wins broadcast slot, readable by every process that holds the channel.

    Owns a 64 KiB shared byte buffer and its length, plus a small area of **durability notes**: failures
    of a source's ``close()`` that happened after another failure had been published (they are attached
    to the published exception as notes, never lost). Publishing never raises and never waits without a
    bound; reading takes no lock (the record is in place before its length is written, and does not
    change afterwards, except after a publisher stopped mid-publication: see ``_publishing``). The first
    published record stays (later failures are usually consequences of the first). Decoded records are
    cached per process, so every call in one process returns the same exception object and notes added
    to it accumulate.

    The channel pickles only while a process is being created (``Process(args=...)``, ``DataLoader``
    workers), like any multiprocessing primitive.
    """

    def __init__(self, ctx: mp.context.BaseContext | None = None) -> None:
        ctx = ctx or mp.get_context("forkserver")
        self._buffer = ctx.RawArray("B", CHANNEL_BYTES)
        self._length = ctx.RawValue("i", 0)
        self._notes = ctx.RawArray("B", NOTES_BYTES)
        self._notes_length = ctx.RawValue("i", 0)
        self._lock = SharedLock()
        self._cache: tuple[FailureRecord, BaseException] | None = None
        self._notes_attached = 0

    def __getstate__(self) -> dict:
        return {
            name: getattr(self, name) for name in ("_buffer", "_length", "_notes", "_notes_length", "_lock")
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._cache = None
        self._notes_attached = 0

    def is_set(self) -> bool:
        return self._length.value != 0

    def wait_published(self, timeout: float) -> bool:
        """Poll (bounded) until a record is published; ``True`` if one is. For tests and tools."""
        deadline = time.monotonic() + timeout
        while not self.is_set():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def publish(self, error: BaseException, worker: str, *, exitcode: int | None = None) -> bool:
        """Publish ``error`` unless something was published before. Never raises."""
        record = _record_of(error, worker, exitcode)
        if not self.publish_record(record):
            return False
        # The publishing process keeps the very object it raised, so notes added to it are not lost.
        self._cache = (record, error)
        return True

    def publish_record(self, record: FailureRecord) -> bool:
        """Publish a prepared record unless something was published before. Never raises."""
        try:
            data = record.encode()
            with self._publishing():
                if self._length.value:
                    return False
                self._buffer[: len(data)] = data
                self._length.value = len(data)  # last: readers see the whole record or none
            return True
        except Exception:
            return False

    def publish_durability_failure(self, error: BaseException, worker: str) -> None:
        """A source's ``close()`` failed: publish it, or note it on the earlier failure. Never raises.

        Every process sees the note on its copy of the published exception (``error()``), so the owner's
        ``start()``/``stop()`` and ``check_health()`` report it beside the original failure.
        """
        if self.publish(error, worker):
            return
        if self._cache is not None and self._cache[1] is error:
            return
        note = f"{worker}: source close() also failed: {type(error).__name__}: {_safe_str(error)}"
        encoded = (cap_text(note, _NOTE_LIMIT) + "\n").encode()
        try:
            with self._publishing():
                start = self._notes_length.value
                if start + len(encoded) <= NOTES_BYTES:
                    self._notes[start : start + len(encoded)] = encoded
                    self._notes_length.value = start + len(encoded)
        except Exception:
            pass

    def notes(self) -> list[str]:
        """The durability notes published after the first failure, oldest first."""
        length = self._notes_length.value
        return bytes(self._notes[:length]).decode(errors="replace").splitlines()

    @contextlib.contextmanager
    def _publishing(self):
        """The publication lock, waited for at most a few seconds: a publisher must never hang.

        A holder keeps it for microseconds and the kernel releases it if the holder dies; only a holder
        stopped mid-publication can keep it longer, and then this one publishes without it. That is the
        one way a record can change once published: a holder stopped (SIGSTOP, a debugger) after it found
        the channel empty and before it wrote, for longer than the wait, writes its own record over this
        one when it is continued; a process that read the channel in between keeps the earlier record.
        The alternative, a failure nobody sees while the holder stays stopped, is the worse of the two.
        """
        deadline = time.monotonic() + _PUBLISH_WAIT_S

        def give_up() -> None:
            if time.monotonic() >= deadline:
                raise _LockTimeout

        try:
            self._lock.acquire(give_up, slice_s=0.05)
        except _LockTimeout:
            yield
            return
        try:
            yield
        finally:
            self._lock.release()

    def read(self) -> FailureRecord | None:
        """The published record, or ``None``."""
        length = self._length.value
        if not length:
            return None
        if self._cache is not None:
            return self._cache[0]
        data = bytes(self._buffer[:length])
        try:
            record = FailureRecord.decode(data)
            error = record.rebuild()
            if not isinstance(error, Exception):
                error = _from_another_process(error, record)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            record = FailureRecord("unknown", 0, "builtins", "RuntimeError", message, "", "")
            error = OnlineDataWorkerError(
                f"OnlineDataEngine could not decode the worker error channel: {message}"
            )
        if "Traceback (most recent call last)" in record.traceback_text:
            # a note, not a cause: a cause would hide the caller's own exception that this one interrupts
            # (its __context__), and notes also survive ``raise ... from None`` and one-line reports
            add_note(error, f"Traceback in {record.worker}:\n{record.traceback_text.rstrip()}")
        self._cache = (record, error)
        return record

    def holds(self, error: BaseException) -> bool:
        """Whether ``error`` is the very exception this process published (see :func:`worker_entry`)."""
        return self._cache is not None and self._cache[1] is error

    def error(self) -> BaseException | None:
        """The published failure rebuilt as an exception (same object on every call), or ``None``.

        Durability notes published since the last call are attached to it first.
        """
        if self.read() is None:
            return None
        error = self._cache[1]
        if self._notes_length.value:
            notes = self.notes()
            for note in notes[self._notes_attached :]:
                add_note(error, note)
            self._notes_attached = len(notes)
        return error


def _from_another_process(error: BaseException, record: FailureRecord) -> OnlineDataWorkerError:
    """A non-``Exception`` (a source's ``sys.exit()``) another process published, as this one raises it."""
    wrapper = ended_process_error(record.worker, record.type_name, record.message)
    wrapper.__cause__ = error
    return wrapper


class _LockTimeout(Exception):
    pass


def _record_of(error: BaseException, worker: str, exitcode: int | None) -> FailureRecord:
    try:
        return FailureRecord.from_exception(error, worker, exitcode=exitcode)
    except Exception:
        return FailureRecord(
            worker, os.getpid(), "builtins", "RuntimeError", "unrecordable failure", "", "", exitcode
        )
