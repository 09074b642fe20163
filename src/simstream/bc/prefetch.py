"""``BatchPrefetcher``: sample and convert training batches in a helper thread, ahead of the trainer.

A vision batch copies ~50 MB of camera frames out of shared memory; done inline, that copy would stall every
gradient step. The helper thread runs the copy (torch releases the GIL while it gathers) while the main
thread runs the forward and backward pass, and keeps up to ``depth`` batches ready. The trainer measures
how long :meth:`BatchPrefetcher.get` blocks: the share of a step spent waiting for data.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BatchPrefetcher"]

_POLL_S = 0.5


class BatchPrefetcher:
    """Owns one daemon thread calling ``make_batch()`` into a queue of at most ``depth`` batches.

    ``make_batch`` is the only code the thread runs; its exception (a producer's error from the engine, a
    ``DataUnavailableError``) is handed to the next :meth:`get`, which raises it. :meth:`close` stops the
    thread after its current batch.
    """

    def __init__(self, make_batch: Callable[[], Any], depth: int = 2) -> None:
        self._make_batch = make_batch
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="simstream-batch-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item: tuple[bool, Any] = (True, self._make_batch())
            except BaseException as error:  # handed to the trainer's get()
                item = (False, error)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return

    def get(self, timeout_s: float) -> tuple[Any, float]:
        """The next batch and the seconds this call waited for it.

        Raises:
            TimeoutError: no batch after ``timeout_s`` (the helper thread keeps running; :meth:`close` it).
            Exception: what ``make_batch`` raised, as it was raised.
        """
        began = time.monotonic()
        while True:
            try:
                ok, value = self._queue.get(timeout=min(_POLL_S, timeout_s))
                break
            except queue.Empty:
                if time.monotonic() - began >= timeout_s:
                    raise TimeoutError(f"no training batch after {timeout_s:.0f} s") from None
                if not self._thread.is_alive() and self._queue.empty():
                    message = "the batch prefetch thread stopped without a batch or an error"
                    raise RuntimeError(message) from None
        if not ok:
            raise value  # the sampler's own exception, re-raised in the trainer's thread
        return value, time.monotonic() - began

    def close(self) -> None:
        """Stop the helper thread (bounded: it finishes the batch it is copying)."""
        self._stop.set()
        while True:  # make room so a blocked put sees the stop flag at once
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30.0)
