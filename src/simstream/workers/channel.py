"""A broadcast error channel in shared memory: the first failure of any worker, as plain data.

A worker that fails writes one :class:`FailureRecord` into a fixed 64 KiB shared byte buffer. Every process
that holds the channel (the owner, each ``DataLoader`` worker) can read it back at any time, so a failure
reaches every consumer, not only the process that happens to be waiting on a pipe. The record is text
plus, when the exception pickles, the pickled exception: decoding never imports a class by name, and an
exception that cannot be rebuilt still arrives with its type name, message and traceback.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import struct
import traceback
from dataclasses import asdict, dataclass

from ..errors import OnlineDataWorkerError

__all__ = ["ErrorChannel", "FailureRecord", "cap_text", "describe_exit", "signal_name"]

CHANNEL_BYTES = 64 * 1024
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
        ):
            header = asdict(self)
            header.pop("payload")
            header["message"] = cap_text(self.message, text_limit)
            header["representation"] = cap_text(self.representation, text_limit)
            header["traceback_text"] = cap_text(self.traceback_text, tb_limit)
            body = json.dumps(header).encode()
            blob = payload or b""
            data = _HEADER.pack(len(body), len(blob)) + body + blob
            if len(data) <= CHANNEL_BYTES:
                return data
        raise ValueError("failure record does not fit the error channel")  # pragma: no cover

    @classmethod
    def decode(cls, data: bytes) -> FailureRecord:
        body_len, blob_len = _HEADER.unpack_from(data)
        start = _HEADER.size
        header = json.loads(data[start : start + body_len].decode())
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

    Owns a 64 KiB shared byte buffer, its length and a ``failed`` event. Publishing never raises; the first
    published record stays (later failures are usually consequences of the first). Decoded records are
    cached per process, so every call in one process returns the same exception object and notes added to
    it accumulate.

    The channel pickles only while a process is being created (``Process(args=...)``, ``DataLoader``
    workers), like any multiprocessing primitive.
    """

    def __init__(self, ctx: mp.context.BaseContext | None = None) -> None:
        ctx = ctx or mp.get_context("forkserver")
        self._buffer = ctx.Array("B", CHANNEL_BYTES, lock=False)
        self._length = ctx.Value("i", 0)  # its lock guards publication
        self._failed = ctx.Event()
        self._cache: tuple[FailureRecord, BaseException] | None = None

    def __getstate__(self) -> dict:
        return {"_buffer": self._buffer, "_length": self._length, "_failed": self._failed}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._cache = None

    @property
    def failed_event(self):
        """Set once a record is published; wait on it to wake up on failure."""
        return self._failed

    def is_set(self) -> bool:
        return self._failed.is_set()

    def publish(self, error: BaseException, worker: str, *, exitcode: int | None = None) -> bool:
        """Publish ``error`` unless something was published before. Never raises."""
        try:
            record = FailureRecord.from_exception(error, worker, exitcode=exitcode)
        except Exception:
            record = FailureRecord(
                worker,
                os.getpid(),
                "builtins",
                "RuntimeError",
                "unrecordable failure",
                "",
                "",
                exitcode,
            )
        if not self.publish_record(record):
            return False
        # The publishing process keeps the very object it raised, so notes added to it are not lost.
        self._cache = (record, error)
        return True

    def publish_record(self, record: FailureRecord) -> bool:
        """Publish a prepared record unless something was published before. Never raises."""
        try:
            data = record.encode()
            with self._length.get_lock():
                if self._length.value:
                    return False
                self._buffer[: len(data)] = data
                self._length.value = len(data)
            self._failed.set()
            return True
        except Exception:
            return False

    def read(self) -> FailureRecord | None:
        """The published record, or ``None``."""
        if not self._failed.is_set():
            return None
        if self._cache is not None:
            return self._cache[0]
        with self._length.get_lock():
            data = bytes(self._buffer[: self._length.value])
        if not data:
            return None
        try:
            record = FailureRecord.decode(data)
            error = record.rebuild()
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            record = FailureRecord("unknown", 0, "builtins", "RuntimeError", message, "", "")
            error = OnlineDataWorkerError(
                f"OnlineDataEngine could not decode the worker error channel: {message}"
            )
        self._cache = (record, error)
        return record

    def error(self) -> BaseException | None:
        """The published failure rebuilt as an exception (same object on every call), or ``None``."""
        if self.read() is None:
            return None
        return self._cache[1]
