"""Body of one local producer process: build the source, then write windows whenever a generation is
requested.

The worker owns rows ``[row_start, row_end)`` and nothing else; it writes them window by window
(``num_envs`` rows per rollout, the last window shifted back to end at ``row_end``): claim the rows
(:class:`~simstream.engine.publisher.WindowPublisher`), let the source write into them
(:func:`~simstream.engine.window.generate_window`), publish. Failed attempts stay invisible; a window is
published only when every episode in it succeeded. The Ray backend runs the same two halves, split
between an actor and the owner (:mod:`simstream.ray`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
from functools import partial

import torch

from ..errors import OnlineDataWorkerError
from ..workers.supervisor import exit_with_owner, owner_watch
from .publisher import Closing, WindowPublisher
from .shared import EngineShared
from .window import derive_worker_seed, generate_window, window_starts

__all__ = ["publish_owner_gone", "run_producer"]

_IDLE_WAIT_S = 0.5


def run_producer(
    shared: EngineShared,
    worker_index: int,
    row_start: int,
    row_end: int,
    spec_bytes: bytes,
    seed: int,
    shutdown_timeout_s: float,
) -> None:
    """Worker entry (started through :func:`simstream.workers.supervisor.worker_entry`)."""
    # Ctrl-C in a terminal reaches the whole process group: the owner decides (its stop() ends this
    # worker cleanly), instead of every producer failing the engine with a KeyboardInterrupt of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    shared.progress.set_worker_pid(worker_index, os.getpid())
    label = f"producer-{worker_index}"
    # the producer notices its owner's death between control steps and leaves as a stop() makes it leave; a
    # source stuck inside build() or rollout() never looks, and with no owner nobody would terminate() it
    exit_with_owner(shutdown_timeout_s, partial(publish_owner_gone, shared, label))
    spec = pickle.loads(spec_bytes)
    source = spec.build(worker_index, derive_worker_seed(seed, worker_index))
    try:
        _Producer(shared, worker_index, row_start, row_end, spec.num_envs, source).run()
        if not shared.close_flag.is_set():  # it returned for the owner's death, not for a stop()
            publish_owner_gone(shared, label)
    except BaseException as error:
        # Publish before close(): a failing close() must not hide the original failure.
        shared.channel.publish(error, label)
        shared.progress.notify()
        raise
    finally:
        try:
            source.close()
        except BaseException as close_error:
            # A durability failure: the first failure if there is none yet, else a note on it (never lost)
            shared.channel.publish_durability_failure(close_error, label)
            shared.progress.notify()
            raise


def publish_owner_gone(shared: EngineShared, label: str) -> None:
    """The owner died without ``stop()`` (SIGKILL, ``os._exit``): say so to the consumers it started, who
    would otherwise sample a buffer that never changes again, state READY, their refills never served."""
    owner = mp.parent_process()
    pid = owner.pid if owner is not None else "?"
    error = OnlineDataWorkerError(
        f"OnlineDataEngine owner process {pid} exited without stop(): the producers stopped with it, "
        "and the buffer gets no more episodes."
    )
    if shared.channel.publish(error, label):
        shared.progress.notify()


class _Producer:
    def __init__(self, shared: EngineShared, worker: int, start: int, end: int, num_envs: int, source):
        self.shared = shared
        self.worker = worker
        self.starts = window_starts(start, end, num_envs)
        self.num_envs = num_envs
        self.source = source
        self._owner_gone = owner_watch()
        self.publisher = WindowPublisher(shared, worker, self.closing)

    def closing(self) -> bool:
        """Stop when the owner asks, or when the owner process is gone (nobody could ever ask)."""
        return self.shared.close_flag.is_set() or self._owner_gone()

    def run(self) -> None:
        progress = self.shared.progress
        while True:
            generation = self._wait_for_request()
            if generation is None:
                return
            began = time.monotonic_ns()
            for number, start in enumerate(self.starts):
                if not self._write_window(number, start, generation):
                    return
            progress.add_for_worker(self.worker, "production_ns", time.monotonic_ns() - began)
            progress.set_worker_completed(self.worker, generation)

    def _wait_for_request(self) -> int | None:
        progress = self.shared.progress
        while not self.closing():
            done = progress.worker_completed(self.worker)
            if progress.requested_generation > done:
                return done + 1
            progress.wait_for_request(self.worker, _IDLE_WAIT_S)
        return None

    def _write_window(self, number: int, start: int, generation: int) -> bool:
        end = start + self.num_envs
        publisher, storage = self.publisher, self.shared.storage
        try:
            if not publisher.begin(start, end):
                return False
            window = generate_window(
                self.source,
                storage.rows_view(start, end, payload_only=True),
                number=number,
                max_steps=storage.max_steps,
                attempts=self.shared.max_generation_attempts,
                should_stop=self.closing,
                reset=partial(publisher.reset, start, end),
                on_failed=publisher.count_failed,
            )
            if window is None:
                return False
            publisher.finish(start, end, [window], generation)
            return True
        except Closing:  # stopped while waiting for a shared lock: the window stays unpublished
            return False
        finally:
            publisher.abandon()  # no-op once published
