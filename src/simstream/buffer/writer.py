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

from ..config import METADATA_KEYS
from ..sources import Episode
from .index import EligibilityIndex, compute_row_tables, segment_row_tables
from .storage import TrajectoryStorage

if TYPE_CHECKING:
    from .gate import RecordGate

__all__ = ["EpisodeWriter", "PublishedWindow", "derive_row_metadata", "derive_rows_metadata"]

UNKNOWN_TASK = "unknown_task"
_MANY_ROWS = 4
"""From this many rows on (several windows published together), a write derives the metadata and run
tables of all its rows in one vectorised pass, a fixed ~70 NumPy operations; below, row by row (~25
small operations each), which costs less for one or two rows."""


@dataclass(frozen=True)
class PublishedWindow:
    """What a publication stamped, for the lifecycle log and the quota table."""

    start: int
    end: int
    generation: int
    episode_ids: torch.Tensor
    published_monotonic_ns: int


def task_text_of(episode: Episode) -> str:
    """The task text stored for ``episode``: its instruction, or ``"unknown_task"`` when it has none (or
    only blanks, as a blank segment instruction falls back to the episode's)."""
    instruction = episode.instruction
    return instruction if instruction is not None and instruction.strip() else UNKNOWN_TASK


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
    task_text = task_text_of(episode)
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


def derive_rows_metadata(
    episodes: Sequence[Episode], attempts: Sequence[int], language, steps: int
) -> dict[str, np.ndarray]:
    """Every metadata key of rows ``[len(episodes), steps]``, frames past each episode's end unwritten."""
    derived = {
        name: np.full((len(episodes), steps), False if dtype == torch.bool else -1, dtype=_NUMPY[dtype])
        for name, dtype in METADATA_KEYS.items()
    }
    _fill_rows(derived, episodes, attempts, language)
    return derived


_NUMPY = {torch.bool: np.bool_, torch.int64: np.int64}


def _fill_rows(
    out: dict[str, np.ndarray], episodes: Sequence[Episode], attempts: Sequence[int], language
) -> list[list[tuple[int, int, bool]]]:
    """Write the metadata of ``episodes`` into ``out`` (key -> ``[rows, T]`` arrays, C-contiguous, every
    frame in the unwritten state); returns each row's ``(start, end, accepted)`` segments.

    Texts are interned row by row, task before subtask, segments in order (the ids a registry hands
    out follow that order); the rest is a fixed number of NumPy operations for all the rows, whatever
    their count: several windows published together cost little more than one.
    """
    rows = len(episodes)
    steps = out["valid"].shape[1]
    lengths = np.fromiter((episode.length for episode in episodes), dtype=np.int64, count=rows)
    tasks = np.full((rows, 1), -1, dtype=np.int64)
    fallbacks = np.full((rows, 1), -1, dtype=np.int64)
    spans: list[tuple[int, int, int, bool, int]] = []  # (first frame, size, id, accepted, subtask)
    row_segments: list[list[tuple[int, int, bool]]] = []
    ends: list[tuple[int, bool, bool]] = []  # (flat index of the last frame, terminated, truncated)
    continuities: list[tuple[int, Sequence[int]]] = []
    for row, episode in enumerate(episodes):
        segments = _segments_of(episode)
        row_segments.append([(s.start, s.end, bool(s.accepted)) for s in segments])
        length = episode.length
        if episode.continuity is not None:
            continuities.append((row, episode.continuity))
        if not length:
            continue  # no frame: nothing interned, every segment empty
        text = task_text_of(episode)
        tasks[row] = language.intern(text, kind="task")
        fallbacks[row] = fallback = language.intern(text, kind="subtask")
        for k, segment in enumerate(segments):
            lo, hi = segment.start, segment.end
            if lo == hi:
                continue  # empty: no frame carries its id, and its text is never interned
            instruction = segment.instruction
            has_text = instruction is not None and instruction.strip()
            subtask = language.intern(instruction, kind="subtask") if has_text else fallback
            spans.append((row * steps + lo, hi - lo, k, bool(segment.accepted), subtask))
        ends.append((row * steps + length - 1, bool(episode.terminated), bool(episode.truncated)))
    flat = {name: array.reshape(-1) for name, array in out.items()}  # views: out is contiguous
    valid = out["valid"]
    np.less(_steps(steps), lengths[:, None], out=valid)
    np.copyto(out["episode_step"], _steps(steps), where=valid)
    np.copyto(out["segment_attempt_id"], np.asarray(attempts, dtype=np.int64)[:, None], where=valid)
    np.copyto(out["task_index"], tasks, where=valid)
    np.copyto(out["subtask_index"], fallbacks, where=valid)
    if not continuities:
        np.copyto(out["continuity_id"], 0, where=valid)
    else:
        continuity = np.zeros((rows, steps), dtype=np.int64)
        for row, values in continuities:
            continuity[row, : lengths[row]] = np.asarray(list(values), dtype=np.int64)
        np.copyto(out["continuity_id"], continuity, where=valid)
    if spans:
        first, sizes, ids, accepted, texts = (np.array(column) for column in zip(*spans))
        within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        covered = np.repeat(first, sizes) + within  # flat index of every frame inside a segment
        flat["segment_id"][covered] = np.repeat(ids, sizes)
        flat["segment_step"][covered] = within
        flat["segment_accepted"][covered] = np.repeat(accepted, sizes)
        flat["subtask_index"][covered] = np.repeat(texts, sizes)
        flat["segment_start"][first] = True
        flat["segment_end"][first + sizes - 1] = True
    if ends:
        last, terminated, truncated = (np.array(column) for column in zip(*ends))
        flat["terminated"][last] = terminated
        flat["truncated"][last] = truncated
        flat["segment_end"][last] |= terminated | truncated
    return row_segments


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
        attempt: int | Sequence[int],
        check: Callable[[], None] | None = None,
        window_rows: int | None = None,
    ) -> None:
        """Derive and store metadata and run tables of every row of the window (rows stay invisible).

        Args:
            start: First row; ``episodes[i]`` is row ``start + i``.
            episodes: The checked reports.
            attempt: The attempt that made the rows (``segment_attempt_id``), one for all or one per row
                (several windows written together).
            check: Bounds the wait for the language registry's append lock (a producer's stop check).
            window_rows: Rows per window when several consecutive windows are written together (error
                messages name a row's position in its window); ``None``: one window.

        Raises:
            ValueError: with ``check_unwritten_frames``, when a float payload holds NaN (the unwritten
                value) in frames ``[0, length)`` of a row; nothing is written and the rows stay claimed.
        """
        window_rows = window_rows or len(episodes)
        if self.check_unwritten_frames:
            self._reject_unwritten_frames(start, episodes, window_rows)
        attempts = [attempt] * len(episodes) if isinstance(attempt, int) else list(attempt)
        interning = _Interning(self.language, check)
        if len(episodes) >= _MANY_ROWS:
            self._write_rows(start, episodes, attempts, interning)
        else:
            for offset, episode in enumerate(episodes):
                self._write_row(start + offset, episode, attempts[offset], interning)

    def _write_row(self, row: int, episode: Episode, attempt: int, interning: _Interning) -> None:
        derived = derive_row_metadata(episode, attempt, interning)
        length = episode.length
        for name, values in derived.items():
            self.storage.metadata_array(name)[row, :length] = values
        # frames past the end may hold an older episode or a failed attempt's longer one
        self.storage.poison_payload_tail(row, length)
        if episode.continuity is None:
            segments = [(s.start, s.end, bool(s.accepted)) for s in _segments_of(episode)]
            tables = segment_row_tables(length, segments)
        else:
            tables = compute_row_tables(
                derived["continuity_id"], derived["segment_id"], derived["segment_accepted"]
            )
        self.index.write_tables(row, tables)

    def _write_rows(
        self, start: int, episodes: Sequence[Episode], attempts: Sequence[int], interning: _Interning
    ) -> None:
        """:meth:`_write_row` for every row, with metadata and segment tables in one vectorised pass."""
        end = start + len(episodes)
        # the claimed rows are unwritten (claim and every retry reset them): only valid frames are set
        derived = {name: self.storage.metadata_array(name)[start:end] for name in METADATA_KEYS}
        row_segments = _fill_rows(derived, episodes, attempts, interning)
        plain, spans = [], []  # rows without continuity breaks: their tables follow from the segments
        for offset, episode in enumerate(episodes):
            row, length = start + offset, episode.length
            self.storage.poison_payload_tail(row, length)
            if episode.continuity is None:
                spans += [(len(plain), lo, hi) for lo, hi, ok in row_segments[offset] if ok and lo < hi]
                plain.append(offset)
            else:
                tables = compute_row_tables(
                    derived["continuity_id"][offset, :length],
                    derived["segment_id"][offset, :length],
                    derived["segment_accepted"][offset, :length],
                )
                self.index.write_tables(row, tables)
        if plain:
            lengths = np.fromiter(
                (episodes[offset].length for offset in plain), dtype=np.int64, count=len(plain)
            )
            spans_array = np.array(spans, dtype=np.int64).reshape(-1, 3)
            self.index.write_segment_tables(start + np.array(plain, dtype=np.int64), lengths, spans_array)

    def _reject_unwritten_frames(self, start: int, episodes: Sequence[Episode], window_rows: int) -> None:
        lengths = np.fromiter((episode.length for episode in episodes), dtype=np.int64, count=len(episodes))
        offset = self.storage.first_row_with_unwritten_frames(start, lengths)
        if offset is None:
            return
        row, length = start + offset, int(lengths[offset])
        key, frame = self.storage.first_unwritten_frame(row, length)
        raise ValueError(
            f"Episode of buffer row {row} (row {offset % window_rows} of the rollout) reports length="
            f"{length} but its payload {key!r} holds NaN, the value of unwritten frames, "
            f"first at frame {frame}: a source must write every frame t < length of every field. "
            "If NaN is real data, set OnlineDataEngineCfg.check_unwritten_frames=False."
        )

    def publish(self, start: int, end: int, generation: int, episode_start: int) -> PublishedWindow:
        """Stamp provenance, then make the rows sampleable. Call while holding the publication lock."""
        episode_ids = torch.from_numpy(
            np.arange(episode_start, episode_start + (end - start), dtype=np.int64)
        )
        published_ns = time.monotonic_ns()
        if self.storage.has("ods_run_id"):
            self._stamp_provenance(start, end, generation, episode_ids, published_ns)
        self.index.end_write(start, end, generation, episode_ids)
        return PublishedWindow(start, end, generation, episode_ids, published_ns)

    def _stamp_provenance(
        self, start: int, end: int, generation: int, episode_ids: torch.Tensor, published_ns: int
    ) -> None:
        valid = self.storage.metadata_array("valid")[start:end]
        values = {
            "ods_run_id": self.run_id,
            "ods_episode_id": episode_ids.numpy()[:, None],
            "ods_generation": generation,
            "ods_frame_index": _steps(self.storage.max_steps),
            "ods_accepted_at_ns": time.time_ns(),
            "ods_published_at_monotonic_ns": published_ns,
        }
        for name, value in values.items():  # NumPy broadcasting: one pass per key over the rows
            self.storage.metadata_array(name)[start:end] = np.where(valid, value, -1)


class _Interning:
    """The language registry as ``derive_row_metadata`` uses it, with a caller's lock-wait check and a
    memo (ids never change once handed out, and the rows of one write often share their texts)."""

    def __init__(self, language, check: Callable[[], None] | None) -> None:
        self._language, self._check = language, check
        self._known: dict[tuple[str, str], int] = {}

    def intern(self, text: str, *, kind: str) -> int:
        known = self._known.get((kind, text))
        if known is None:
            known = self._known[(kind, text)] = self._language.intern(text, kind=kind, check=self._check)
        return known
