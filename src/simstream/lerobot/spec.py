"""``LeRobotSpec``: a ``SourceSpec`` that streams a LeRobot v3.0 dataset's episodes into the engine."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..sources import Episode, Field, Segment
from .names import KeyMap

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .dataset import DatasetMeta
    from .format import Feature

__all__ = ["LeRobotEpisodeSource", "LeRobotSpec"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeRobotSpec:
    """Stream the episodes of the LeRobot v3.0 dataset at ``root`` (a ``SourceSpec``).

    Fields are named by the rule (``observation.a.b`` -> ``obs/a/b``, ``action`` -> ``actions``, else ``.``
    -> ``/``) or ``key_map``; cameras (``image`` or ``video``) are uint8 ``[3, H, W]``. An episode's
    instruction is the task of its first frame; each maximal run of frames with one task is a ``Segment``
    with that task as instruction, unless the dataset holds simstream's ``segment_id`` / ``subtask_index``
    columns, which restore the recorded segments exactly. Episodes recorded with ``success=False`` are
    skipped (the engine publishes successes only). Every producer worker streams all episodes in its own
    seeded order, a fresh permutation per pass.

    Examples:
        >>> spec = LeRobotSpec("datasets/pick_place")  # doctest: +SKIP
        >>> sorted(spec.fields())  # doctest: +SKIP
        ['actions', 'obs/image', 'obs/objects', 'obs/state', 'rewards']
    """

    root: Path | str
    """The dataset folder (holding ``meta/info.json``); kept as an absolute path."""
    num_envs: int = 1
    """Episodes (buffer rows) per rollout."""
    max_episode_steps: int | None = None
    """Row capacity T; ``None``: the longest episode streamed. Longer episodes are cut at T (truncated)."""
    key_map: Mapping[str, str] | None = None
    """Overrides ``{lerobot_key: field_name}`` of the naming rule."""
    fields_subset: Sequence[str] | None = None
    """Stream only these fields (e.g. to mix with a source that has fewer); ``None``: all."""
    _features: tuple = field(default=(), init=False, repr=False, compare=False)
    _skipped: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _fps: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from .dataset import check_episode_files, payload_features, read_dataset_meta

        if type(self.num_envs) is not int or self.num_envs < 1:
            raise ValueError(f"LeRobotSpec.num_envs must be an int >= 1, got {self.num_envs!r}")
        meta = read_dataset_meta(self.root, stats=False)
        # the folder read here, wherever a producer runs from (a Ray worker's working directory differs)
        object.__setattr__(self, "root", Path(meta.root).resolve())
        if not meta.episodes:
            raise ValueError(f"LeRobotSpec.root: {meta.root} holds no episode")
        streamed = accepted_episodes(meta)
        if not streamed:
            raise ValueError(
                f"LeRobotSpec.root: every episode of {meta.root} is recorded with success=False; nothing to "
                "stream"
            )
        key_map = KeyMap(self.key_map)
        features, skipped = payload_features(meta, key_map)
        if self.fields_subset is not None:
            subset = self.fields_subset
            if isinstance(subset, str) or not all(isinstance(name, str) for name in subset) or not subset:
                raise ValueError(
                    "LeRobotSpec.fields_subset must be a non-empty list of field names or None, got "
                    f"{subset!r}"
                )
            names = {f.field for f in features}
            unknown = sorted(set(subset) - names)
            if unknown:
                reasons = {key_map.field(key): reason for key, reason in skipped.items()}
                why = "".join(
                    f"; {name!r} cannot be streamed: {reasons[name]}" for name in unknown if name in reasons
                )
                raise ValueError(
                    f"LeRobotSpec.fields_subset names {unknown}, not fields of {meta.root}: "
                    f"{sorted(names)}{why}"
                )
            features = [f for f in features if f.field in set(subset)]
        elif skipped:
            logger.warning(
                "LeRobotSpec: %s: not streamed: %s",
                meta.root,
                "; ".join(f"{key!r} ({reason})" for key, reason in skipped.items()),
            )
        if not features:
            raise ValueError(f"LeRobotSpec.root: {meta.root} holds no feature a replay can stream")
        check_episode_files(meta, features, streamed)
        object.__setattr__(self, "_skipped", dict(skipped))
        longest = max(int(meta.episodes[i]["length"]) for i in streamed)
        steps = longest if self.max_episode_steps is None else self.max_episode_steps
        if type(steps) is not int or steps < 1:
            raise ValueError(f"LeRobotSpec.max_episode_steps must be an int >= 1 or None, got {steps!r}")
        object.__setattr__(self, "max_episode_steps", steps)
        object.__setattr__(self, "_features", tuple(features))
        object.__setattr__(self, "_fps", meta.fps)

    @property
    def fps(self) -> int:
        """Frames per second of the dataset (a recorder of this source writes at the same rate)."""
        return self._fps

    @property
    def skipped_features(self) -> dict[str, str]:
        """LeRobot keys of the dataset that are not streamed (string and audio features, unreadable dtypes),
        each with the reason; a ``key_map`` or ``fields_subset`` naming one is an error."""
        return dict(self._skipped)

    def fields(self) -> dict[str, Field]:
        return {f.field: f.field_spec() for f in self._features}

    def build(self, worker_index: int, seed: int) -> LeRobotEpisodeSource:
        from .dataset import read_dataset_meta

        return LeRobotEpisodeSource(
            self, read_dataset_meta(self.root, stats=False), list(self._features), seed
        )


class LeRobotEpisodeSource:
    """Writes dataset episodes into buffer rows, in a seeded order (inside one producer worker)."""

    def __init__(self, spec: LeRobotSpec, meta: DatasetMeta, features: list[Feature], seed: int) -> None:
        from .dataset import EpisodeReader

        self.spec = spec
        self.meta = meta
        self.reader = EpisodeReader(meta, features)
        self.rng = np.random.default_rng(seed)
        accepted = accepted_episodes(meta)
        if not accepted:
            raise ValueError(f"{meta.root}: every episode is recorded with success=False; nothing to stream")
        self.episodes = np.asarray(accepted)
        self._order: list[int] = []

    def _next(self) -> int:
        if not self._order:
            self._order = self.rng.permutation(self.episodes).tolist()
        return self._order.pop()

    def rollout(
        self, rows: TensorDict, *, attempt: int, should_stop: Callable[[], bool]
    ) -> list[Episode] | None:
        episodes = []
        capacity = self.spec.max_episode_steps
        for row in range(self.spec.num_envs):
            if should_stop():
                return None
            index = self._next()
            read = self.reader.read(index, limit=capacity)  # frames past the row's capacity stay unread
            length = len(read.task_index)
            for name, values in read.frames.items():
                target = rows.get(tuple(name.split("/")))
                view = target[row, :length]
                view.numpy()[...] = values[:length].reshape(view.shape)  # arrow's arrays are read-only
            episodes.append(self._episode(index, read, length))
        return episodes

    def _episode(self, index: int, read: Any, length: int) -> Episode:
        ep = self.meta.episodes[index]
        tasks = self.meta.tasks
        instruction = tasks[int(read.task_index[0])] if length else None
        truncated = bool(ep.get("truncated", False)) or length < int(ep["length"])
        terminated = bool(ep.get("terminated", False)) and not truncated
        if read.segment_id is not None and read.subtask_index is not None and self.meta.subtasks:
            segments = _recorded_segments(read, length, ep.get("segment_accepted") or [], self.meta.subtasks)
        else:
            segments = _task_runs(read.task_index[:length], tasks)
        return Episode(length, True, instruction, segments, terminated=terminated, truncated=truncated)

    def close(self) -> None:
        self.reader.close()


def accepted_episodes(meta: DatasetMeta) -> list[int]:
    """Positions of the episodes a replay streams: all but those recorded with ``success=False``."""
    return [i for i, ep in enumerate(meta.episodes) if ep.get("success", True) is not False]


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    if len(values) == 0:
        return []
    cuts = np.flatnonzero(values[1:] != values[:-1]) + 1
    edges = [0, *cuts.tolist(), len(values)]
    return list(itertools.pairwise(edges))


def _task_runs(task_index: np.ndarray, tasks: list[str]) -> list[Segment]:
    """Each maximal run of one task is a segment with that task as its instruction."""
    return [Segment(lo, hi, tasks[int(task_index[lo])]) for lo, hi in _runs(task_index)]


def _recorded_segments(read: Any, length: int, accepted: list[bool], subtasks: list[str]) -> list[Segment]:
    """The segments a simstream recording stored: ids are positions, so skipped (empty) ones come back."""
    segment_id, subtask = read.segment_id[:length], read.subtask_index[:length]
    found: dict[int, tuple[int, int]] = {}
    for lo, hi in _runs(segment_id):
        k = int(segment_id[lo])
        if k >= 0:
            found[k] = (lo, hi)
    segments, cursor = [], 0
    for k in range(max(found, default=-1) + 1):
        lo, hi = found.get(k, (cursor, cursor))  # an empty segment sits where the previous one ended
        text = subtasks[int(subtask[lo])] if hi > lo else None
        segments.append(Segment(lo, hi, text, bool(accepted[k]) if k < len(accepted) else True))
        cursor = hi
    return segments
