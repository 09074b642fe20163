"""Body of one producer worker: build the source, then write windows whenever a generation is requested.

The worker owns rows ``[row_start, row_end)`` and nothing else; it writes them window by window
(``num_envs`` rows per rollout, the last window shifted back to end at ``row_end``). Failed attempts stay
invisible; a window is published only when every episode in it succeeded.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import signal
import time

import numpy as np
import torch

from ..buffer.writer import EpisodeWriter
from ..engine.shared import EngineShared
from ..sources import validate_episodes
from .supervisor import owner_watch

__all__ = ["derive_worker_seed", "run_producer", "window_starts"]

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5


def derive_worker_seed(seed: int, worker_index: int) -> int:
    """Independent, reproducible seed for worker ``worker_index`` of an engine seeded with ``seed``."""
    return int(np.random.SeedSequence([seed, worker_index]).generate_state(1, dtype=np.uint64)[0] >> 1)


def window_starts(row_start: int, row_end: int, num_envs: int) -> list[int]:
    """First row of each window covering ``[row_start, row_end)``; the last one may overlap."""
    count = math.ceil((row_end - row_start) / num_envs)
    return [min(row_start + k * num_envs, row_end - num_envs) for k in range(count)]


def run_producer(
    shared: EngineShared, worker_index: int, row_start: int, row_end: int, spec_bytes: bytes, seed: int
) -> None:
    """Worker entry (started through :func:`simstream.workers.supervisor.worker_entry`)."""
    # Ctrl-C in a terminal reaches the whole process group: the owner decides (its stop() ends this
    # worker cleanly), instead of every producer failing the engine with a KeyboardInterrupt of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    shared.progress.set_worker_pid(worker_index, os.getpid())
    label = f"producer-{worker_index}"
    spec = pickle.loads(spec_bytes)
    source = spec.build(worker_index, derive_worker_seed(seed, worker_index))
    try:
        _Producer(shared, worker_index, row_start, row_end, spec.num_envs, source).run()
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


class _Producer:
    def __init__(self, shared: EngineShared, worker: int, start: int, end: int, num_envs: int, source):
        self.shared = shared
        self.worker = worker
        self.starts = window_starts(start, end, num_envs)
        self.num_envs = num_envs
        self.source = source
        self.writer = EpisodeWriter(
            shared.storage, shared.index, shared.language, shared.run_id, shared.check_unwritten_frames
        )
        self._owner_gone = owner_watch()
        self._reserved_records = 0
        """Lifecycle-log slots reserved for the current window's ``published`` records."""

    def closing(self) -> bool:
        """Stop when the owner asks, or when the owner process is gone (nobody could ever ask)."""
        return self.shared.close_flag.is_set() or self._owner_gone()

    def _raise_if_closing(self) -> None:
        """The check of this worker's bounded waits on shared locks: leave them once closing."""
        if self.closing():
            raise _Closing

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
        events = self.shared.events
        try:
            if events is not None and not self._log_evictions(start, end):
                return False
            return self._fill_and_publish(number, start, end, generation)
        except _Closing:  # stopped while waiting for a shared lock: the window stays unpublished
            return False
        finally:
            if self._reserved_records:  # stopped (or failed) before publishing: give the space back
                events.release(self._reserved_records)
                self._reserved_records = 0

    def _fill_and_publish(self, number: int, start: int, end: int, generation: int) -> bool:
        shared = self.shared
        self.writer.claim(start, end)
        rows = shared.storage.rows_view(start, end, payload_only=True)
        attempts = shared.max_generation_attempts
        for attempt in range(attempts):
            if attempt:
                self.writer.reset_metadata(start, end)
            report = self.source.rollout(rows, attempt=attempt, should_stop=self.closing)
            if report is None:
                return False
            episodes = validate_episodes(report, end - start, shared.storage.max_steps)
            if all(episode.success for episode in episodes):
                break
            shared.progress.add_for_worker(self.worker, "failed_episodes", end - start)
            if self.closing():
                return False
            logger.warning("window %d attempt %d had a failed episode; retrying", number + 1, attempt + 1)
        else:
            raise RuntimeError(
                f"Failed to generate rollout {number + 1} after {attempts} attempts. Every attempt reported "
                "an episode with success=False (a window is published only when all succeed): check the "
                "source, e.g. whether max_episode_steps leaves its expert time to finish, or raise "
                "max_generation_attempts."
            )
        self.writer.write(start, episodes, attempt)
        self._publish(start, end, generation, sum(e.length for e in episodes))
        return True

    def _publish(self, start: int, end: int, generation: int, frames: int) -> None:
        shared, progress = self.shared, self.shared.progress
        check = self._raise_if_closing
        with shared.publish_lock.held(check):
            first_id = progress.allocate_episode_ids(end - start)
            if shared.quota is not None:
                with shared.quota.lock.held(check):
                    ids = torch.arange(first_id, first_id + end - start)
                    shared.quota.publish(torch.arange(start, end), ids, generation)
                    window = self.writer.publish(start, end, generation, first_id)
            else:
                window = self.writer.publish(start, end, generation, first_id)
            if shared.events is not None:
                records = [
                    self._record("published", row, window.published_monotonic_ns) for row in range(start, end)
                ]
                shared.events.append(records, reserved=True, check=check)
                self._reserved_records -= len(records)
        progress.add_for_worker(self.worker, "successful_episodes", end - start)
        progress.add_for_worker(self.worker, "generated_frames", frames)

    def _log_evictions(self, start: int, end: int) -> bool:
        """Reserve the window's records (waiting while the log is full), then log its evictions."""
        events, index = self.shared.events, self.shared.index
        published = [row for row in range(start, end) if int(index.episode_id[row]) >= 0]
        # one reservation for both kinds: other workers cannot take the space between the two appends
        if not events.reserve(end - start + len(published), self.closing):
            return False
        self._reserved_records = end - start
        if published:
            now = time.monotonic_ns()
            records = [self._record("evicted", row, now) for row in published]
            events.append(records, reserved=True, check=self._raise_if_closing)
        return True

    def _record(self, kind: str, row: int, monotonic_ns: int) -> dict:
        storage, index = self.shared.storage, self.shared.index
        valid = storage.metadata("valid")[row].clone()
        return {
            "kind": kind,
            "run_id": self.shared.run_id,
            "episode_id": int(index.episode_id[row]),
            "generation": int(index.generation[row]),
            "slot": row,
            "monotonic_ns": monotonic_ns,
            "valid_mask": valid,
            "anchor_mask": valid & (storage.metadata("continuity_id")[row] >= 0),
        }


class _Closing(Exception):
    """Raised by a producer's lock-wait check once the engine is closing (never leaves the producer)."""
