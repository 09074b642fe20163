"""The producer's write protocol: claim rows, derive metadata from episode reports, publish.

A window of rows moves through three steps, all done by the worker that owns the rows:

1. :meth:`EpisodeWriter.claim` makes the rows odd in the index (no sampler picks them any more) and resets
   them to the unwritten state;
2. the source writes payload frames, the engine checks its report, then :meth:`EpisodeWriter.write`
   checks that no reported float frame still holds NaN (the unwritten value) and derives every metadata
   key and the run tables (still invisible to samplers);
3. :meth:`EpisodeWriter.publish` stamps provenance and makes the rows even: from then on they are sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..sources import Episode
from .index import EligibilityIndex, RowTables, compute_row_tables, segment_row_tables
from .storage import TrajectoryStorage

if TYPE_CHECKING:
    from .gate import RecordGate

__all__ = ["EpisodeWriter", "PublishedWindow", "derive_row_metadata"]

UNKNOWN_TASK = "unknown_task"


@dataclass(frozen=True)
class PublishedWindow:
    """What a publication stamped, for the lifecycle log and the quota table."""

    start: int
    end: int
    generation: int
    episode_ids: torch.Tensor
    published_monotonic_ns: int


def derive_row_metadata(episode: Episode, attempt: int, language) -> dict[str, np.ndarray | int | bool]:
    """Every metadata key of one row's ``episode.length`` valid frames.

    Keys constant over the episode map to a scalar (stored by broadcasting), the others to an array of
    ``episode.length`` values.
    """
    length = episode.length
    segments = _segments_of(episode)
    segment_id = np.full(length, -1, dtype=np.int64)
    segment_step = np.full(length, -1, dtype=np.int64)
    accepted = np.zeros(length, dtype=bool)
    segment_start = np.zeros(length, dtype=bool)
    segment_end = np.zeros(length, dtype=bool)
    task_text = episode.instruction or UNKNOWN_TASK
    task = language.intern(task_text, kind="task") if length else -1
    fallback = language.intern(task_text, kind="subtask") if length else -1
    subtask = np.full(length, fallback, dtype=np.int64)
    for k, segment in enumerate(segments):
        lo, hi = segment.start, segment.end
        if lo == hi:
            continue  # empty: no frame carries its id, and its text is never interned
        segment_id[lo:hi] = k
        segment_step[lo:hi] = _steps(hi - lo)
        accepted[lo:hi] = bool(segment.accepted)
        segment_start[lo] = True
        segment_end[hi - 1] = True
        if segment.instruction is not None and segment.instruction.strip():
            subtask[lo:hi] = language.intern(segment.instruction, kind="subtask")
    terminated = np.zeros(length, dtype=bool)
    truncated = np.zeros(length, dtype=bool)
    if length:
        terminated[-1], truncated[-1] = bool(episode.terminated), bool(episode.truncated)
        segment_end[-1] |= terminated[-1] or truncated[-1]
    continuity = 0 if episode.continuity is None else np.asarray(list(episode.continuity), dtype=np.int64)
    return {
        "valid": True,
        "episode_step": _steps(length),
        "segment_id": segment_id,
        "segment_step": segment_step,
        "segment_start": segment_start,
        "segment_end": segment_end,
        "segment_accepted": accepted,
        "segment_attempt_id": attempt,
        "continuity_id": continuity,
        "terminated": terminated,
        "truncated": truncated,
        "task_index": task,
        "subtask_index": subtask,
    }


_STEPS = np.arange(4096, dtype=np.int64)
_STEPS.flags.writeable = False


def _steps(count: int) -> np.ndarray:
    """``0, 1, ..., count - 1`` (a read-only view for the usual lengths)."""
    return _STEPS[:count] if count <= len(_STEPS) else np.arange(count, dtype=np.int64)


def _segments_of(episode: Episode) -> list:
    """The episode's segments; an episode reported without any is one accepted segment."""
    return list(episode.segments) or ([_WholeEpisode(episode.length)] if episode.length else [])


@dataclass(frozen=True)
class _WholeEpisode:
    end: int
    start: int = 0
    instruction: str | None = None
    accepted: bool = True


class EpisodeWriter:
    """Writes windows of rows of one producer; knows storage and index, nothing of simulators."""

    def __init__(
        self,
        storage: TrajectoryStorage,
        index: EligibilityIndex,
        language,
        run_id: int,
        check_unwritten_frames: bool = True,
        record_gate: RecordGate | None = None,
    ) -> None:
        self.storage = storage
        self.index = index
        self.language = language
        self.run_id = run_id
        self.check_unwritten_frames = check_unwritten_frames
        self.record_gate = record_gate

    def claim(self, start: int, end: int, check: Callable[[], None] | None = None) -> None:
        """Take rows ``[start, end)`` away from samplers and reset their metadata to unwritten.

        With a recorder attached to ``record_gate``, first wait (in bounded slices, running ``check``
        between them; it raises to abandon the claim) until the recorder copied the episodes these rows
        hold, or, in its skip mode, count them as skipped: every claim path (local producers, the Ray
        ingest) passes through here, so no published episode is overwritten unrecorded.

        Other payload keys are left alone: the source overwrites them, and :meth:`write` poisons the frames
        past each episode's end, so (``uint8``) image payloads cross the memory bus once per episode instead
        of twice. With ``check_unwritten_frames`` the float payload is poisoned (NaN) here, so that a frame
        the source leaves unwritten is caught even in a row that held an older episode.
        """
        if self.record_gate is not None:
            self.record_gate.before_claim(start, end, self.index.episode_id, check)
        self.index.begin_write(start, end)
        self.reset_metadata(start, end)

    def reset_metadata(self, start: int, end: int) -> None:
        """Metadata back to unwritten, on claim and before another attempt (and the float payload too, with
        ``check_unwritten_frames``: a failed attempt's frames must not pass for the next one's)."""
        self.storage.reset_metadata(start, end)
        if self.check_unwritten_frames:
            self.storage.poison_float_payload(start, end)

    def write(
        self,
        start: int,
        episodes: Sequence[Episode],
        attempt: int,
        check: Callable[[], None] | None = None,
    ) -> list[RowTables]:
        """Derive and store metadata and run tables of every row of the window (rows stay invisible).

        ``check`` bounds the wait for the language registry's append lock (a producer's stop check).

        Raises:
            ValueError: with ``check_unwritten_frames``, when a float payload holds NaN (the unwritten
                value) in frames ``[0, length)`` of a row; nothing is written and the rows stay claimed.
        """
        if self.check_unwritten_frames:
            self._reject_unwritten_frames(start, episodes)
        tables = []
        for offset, episode in enumerate(episodes):
            row = start + offset
            derived = derive_row_metadata(episode, attempt, _Interning(self.language, check))
            length = episode.length
            for name, values in derived.items():
                self.storage.metadata_array(name)[row, :length] = values
            # frames past the end may hold an older episode or a failed attempt's longer one
            self.storage.poison_payload_tail(row, length)
            if episode.continuity is None:
                segments = [(s.start, s.end, bool(s.accepted)) for s in _segments_of(episode)]
                row_tables = segment_row_tables(length, segments)
            else:
                row_tables = compute_row_tables(
                    derived["continuity_id"], derived["segment_id"], derived["segment_accepted"]
                )
            self.index.write_tables(row, row_tables)
            tables.append(row_tables)
        return tables

    def _reject_unwritten_frames(self, start: int, episodes: Sequence[Episode]) -> None:
        for offset, episode in enumerate(episodes):
            row = start + offset
            found = self.storage.first_unwritten_frame(row, episode.length)
            if found is not None:
                key, frame = found
                raise ValueError(
                    f"Episode of buffer row {row} (row {offset} of the rollout) reports length="
                    f"{episode.length} but its payload {key!r} holds NaN, the value of unwritten frames, "
                    f"first at frame {frame}: a source must write every frame t < length of every field. "
                    "If NaN is real data, set OnlineDataEngineCfg.check_unwritten_frames=False."
                )

    def publish(self, start: int, end: int, generation: int, episode_start: int) -> PublishedWindow:
        """Stamp provenance, then make the rows sampleable. Call while holding the publication lock."""
        episode_ids = torch.arange(episode_start, episode_start + (end - start), dtype=torch.int64)
        published_ns = time.monotonic_ns()
        if self.storage.has("ods_run_id"):
            self._stamp_provenance(start, end, generation, episode_ids, published_ns)
        self.index.end_write(start, end, generation, episode_ids)
        return PublishedWindow(start, end, generation, episode_ids, published_ns)

    def _stamp_provenance(
        self, start: int, end: int, generation: int, episode_ids: torch.Tensor, published_ns: int
    ) -> None:
        valid = self.storage.metadata("valid")[start:end]
        steps = self.storage.max_steps
        values = {
            "ods_run_id": torch.full((end - start, steps), self.run_id, dtype=torch.int64),
            "ods_episode_id": episode_ids[:, None].expand(-1, steps),
            "ods_generation": torch.full((end - start, steps), generation, dtype=torch.int64),
            "ods_frame_index": torch.arange(steps, dtype=torch.int64).expand(end - start, -1),
            "ods_accepted_at_ns": torch.full((end - start, steps), time.time_ns(), dtype=torch.int64),
            "ods_published_at_monotonic_ns": torch.full((end - start, steps), published_ns),
        }
        for name, value in values.items():
            target = self.storage.metadata(name)[start:end]
            target.copy_(torch.where(valid, value, torch.full_like(value, -1)))


class _Interning:
    """The language registry as ``derive_row_metadata`` uses it, with a caller's lock-wait check."""

    def __init__(self, language, check: Callable[[], None] | None) -> None:
        self._language, self._check = language, check

    def intern(self, text: str, *, kind: str) -> int:
        return self._language.intern(text, kind=kind, check=self._check)
