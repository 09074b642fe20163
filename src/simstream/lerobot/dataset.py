"""Reading a LeRobot v3.0 dataset: metadata, then episodes frame by frame (PyAV decodes the videos).

Episodes are what ``meta/episodes/*/*.parquet`` lists: a dataset interrupted before its ``info.json`` was
updated still opens with every committed episode. Every failure names the file and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .format import (
    BOOKKEEPING_KEYS,
    CODEBASE_VERSION,
    DATA_PATH,
    EXTRA_KEYS,
    VIDEO_PATH,
    Feature,
    LeRobotFormatError,
    features_from_info,
)
from .names import KeyMap

__all__ = ["DatasetMeta", "EpisodeReader", "read_dataset_meta"]

_EPISODE_COLUMNS = (
    "episode_index",
    "length",
    "dataset_from_index",
    "dataset_to_index",
    "data/chunk_index",
    "data/file_index",
)
"""Columns of ``meta/episodes/*/*.parquet`` that reading an episode needs (and each video key's three)."""
_OPEN_VIDEOS_PER_CAMERA = 4
"""Video files an :class:`EpisodeReader` keeps open per camera (each holds a file descriptor)."""
_OPEN_DATA_FILES = 8
"""Data files an :class:`EpisodeReader` keeps open, with their ``index`` columns."""
_CACHE_BYTES = 256 * 2**20
"""Decoded row groups a reader keeps: a replayed dataset of that size is read from its files once."""
_TIMESTAMP_TOLERANCE_S = 1e-4
"""How far a decoded frame's time may be from its place on the episode's grid (``from_timestamp + t / fps``):
LeRobot's own tolerance. A frame further off belongs to no frame of the episode (its timestamps are
wrong), and rounding it to the nearest one served shifted frames, the last from the next episode."""
_SEEK_MARGIN_FRAMES = 2
"""Frames before an episode's start that its video read seeks to: with B-frames and open GOPs (HEVC's
defaults), the keyframe a seek to the start itself finds may come after the start in display order."""


@dataclass
class DatasetMeta:
    """What ``meta/`` says: ``info.json``, the episodes (stats columns left in), tasks and subtasks."""

    root: Path
    info: dict[str, Any]
    episodes: list[dict[str, Any]]
    tasks: list[str]
    subtasks: list[str]

    @property
    def fps(self) -> int:
        return int(self.info["fps"])

    @property
    def video_keys(self) -> list[str]:
        return [k for k, v in self.info["features"].items() if v.get("dtype") == "video"]

    @property
    def stats_keys(self) -> list[str]:
        if not self.episodes:
            return []
        return sorted(
            {  # a key may hold "/" itself (a key_map can name one so)
                c[len("stats/") : -len("/min")]
                for c in self.episodes[0]
                if c.startswith("stats/") and c.endswith("/min")
            }
        )

    def data_path(self, episode: dict[str, Any]) -> Path:
        """The episode's data file, from info.json's ``data_path`` template (as LeRobot reads it)."""
        return self.root / self.info["data_path"].format(
            chunk_index=episode["data/chunk_index"], file_index=episode["data/file_index"]
        )

    def video_path(self, episode: dict[str, Any], key: str) -> Path:
        """The episode's video file of camera ``key``, from info.json's ``video_path`` template."""
        return self.root / self.info["video_path"].format(
            video_key=key,
            chunk_index=episode[f"videos/{key}/chunk_index"],
            file_index=episode[f"videos/{key}/file_index"],
        )


def _path_template(info_path: Path, info: dict[str, Any], name: str, default: str | None) -> str | None:
    """info.json's ``data_path`` or ``video_path``: a relative path template of ``chunk_index`` and
    ``file_index`` (and ``video_key``), which LeRobot formats to find each episode's files. A missing
    field means the default layout; ``video_path`` may be null only in a dataset without videos."""
    template = info.get(name, default)
    if template is None and default is None:
        return None
    example = {"chunk_index": 0, "file_index": 0, "video_key": "camera"}
    problem = None  # why the template cannot name the files ("": it names none, or an absolute path)
    if not isinstance(template, str):
        problem = f" (TypeError: {type(template).__name__})"
    else:
        try:
            if not template.strip() or Path(template.format(**example)).is_absolute():
                problem = ""
        except (TypeError, KeyError, IndexError, ValueError, AttributeError) as error:
            problem = f" ({type(error).__name__}: {error})"
    if problem is not None:
        fields = "chunk_index and file_index" + (" (and video_key)" if name == "video_path" else "")
        raise LeRobotFormatError(
            f"{info_path}: {name} must be a relative path template of {fields} such as "
            f"{default or VIDEO_PATH!r}, got {template!r}{problem}"
        )
    return template


@contextlib.contextmanager
def _parquet(path: Path) -> Iterator[None]:
    """Read the parquet file ``path`` inside the block: a missing or damaged file is a
    ``LeRobotFormatError`` naming it."""
    import pyarrow as pa

    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing (the dataset's metadata refers to it)")
    try:
        yield
    except (pa.ArrowInvalid, OSError) as error:
        raise LeRobotFormatError(
            f"{path}: not a readable parquet file (truncated or damaged?): {error}"
        ) from error


def _read_table(path: Path, columns: list[str] | None = None, *, skip_prefix: str | None = None):
    """The parquet file's ``columns`` (all: ``None``), leaving out those named ``skip_prefix...``."""
    import pyarrow.parquet as pq

    with _parquet(path):
        if skip_prefix is not None:
            names = columns if columns is not None else pq.read_schema(path).names
            columns = [name for name in names if not name.startswith(skip_prefix)]
        return pq.read_table(path, columns=columns)


def _language(path: Path, index_name: str, text_name: str, required: bool) -> list[str]:
    if not path.exists() and not required:
        return []
    table = _read_table(path)
    names = table.column_names
    if text_name not in names:
        # lerobot 0.4.x wrote the text as the frame's unnamed index (its datasets are on the Hub); 0.6.1
        # reads both layouts
        text_name = next((name for name in _pandas_index_columns(table) if name in names), text_name)
    if index_name not in names or text_name not in names:
        raise LeRobotFormatError(f"{path}: needs columns {index_name!r} and {text_name!r}, has {names}")
    indices = table.column(index_name).to_pylist()
    if sorted(i for i in indices if isinstance(i, int)) != list(range(len(indices))):
        shown = indices if len(indices) <= 10 else [*indices[:10], "..."]
        raise LeRobotFormatError(
            f"{path}: {index_name} must number the {len(indices)} rows 0 to {len(indices) - 1} once each, "
            f"got {shown}"
        )
    order = np.argsort(np.asarray(indices))
    texts = table.column(text_name).to_pylist()
    return [texts[i] for i in order]


def _pandas_index_columns(table: Any) -> list[str]:
    """The columns that pandas stored as the frame's index (``__index_level_0__`` when it was unnamed)."""
    try:
        pandas = json.loads((table.schema.metadata or {})[b"pandas"])
        return [name for name in pandas["index_columns"] if isinstance(name, str)]
    except (KeyError, TypeError, ValueError):
        return ["__index_level_0__"]


def read_dataset_meta(root: Path | str, *, stats: bool = True) -> DatasetMeta:
    """Read and check ``meta/`` of the dataset at ``root``; ``stats=False`` leaves out the episodes'
    ``stats/...`` columns (most of the metadata, and most of its reading time: a replay needs none).

    Raises:
        LeRobotFormatError: naming the file: no ``meta/info.json``, not v3.0, a damaged parquet file, or
            episodes that do not tile ``[0, total)`` in order.
    """
    root = Path(root)
    info_path = root / "meta" / "info.json"
    if not root.is_dir():
        raise LeRobotFormatError(f"{root}: no such dataset folder")
    if not info_path.is_file():
        raise LeRobotFormatError(f"{info_path}: missing, so {root} is not a LeRobot dataset")
    try:
        info = json.loads(info_path.read_text())
    except ValueError as error:
        raise LeRobotFormatError(f"{info_path}: not valid JSON ({error})") from error
    version = info.get("codebase_version") if isinstance(info, dict) else None
    if version != CODEBASE_VERSION:
        raise LeRobotFormatError(
            f"{info_path}: codebase_version is {version!r}; only LeRobot format {CODEBASE_VERSION!r} is "
            "supported (convert older datasets with lerobot's convert_dataset_v21_to_v30)"
        )
    for name in ("fps", "features"):
        if name not in info:
            raise LeRobotFormatError(f"{info_path}: has no {name!r}")
    fps = info["fps"]
    if isinstance(fps, float) and fps.is_integer():  # 30.0, as some converters write it
        fps = info["fps"] = int(fps)
    if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise LeRobotFormatError(f"{info_path}: fps must be an int >= 1, got {fps!r}")
    features = info["features"]
    if not isinstance(features, dict) or not all(isinstance(v, dict) for v in features.values()):
        raise LeRobotFormatError(f"{info_path}: features must map each key to a dict, got {features!r:.80}")
    has_video = any(spec.get("dtype") == "video" for spec in features.values())
    info["data_path"] = _path_template(info_path, info, "data_path", DATA_PATH)
    info["video_path"] = _path_template(info_path, info, "video_path", VIDEO_PATH if has_video else None)
    required = [*_EPISODE_COLUMNS]
    for key, spec in features.items():
        if spec.get("dtype") == "video":
            required += [f"videos/{key}/{name}" for name in ("chunk_index", "file_index", "from_timestamp")]
    episodes: list[dict[str, Any]] = []
    folder = root / "meta" / "episodes"
    for path in sorted(folder.glob("chunk-*/file-*.parquet")) if folder.exists() else []:
        table = _read_table(path, skip_prefix=None if stats else "stats/")
        missing = [name for name in required if name not in table.column_names]
        if missing:
            raise LeRobotFormatError(f"{path}: has no column(s) {missing} that every episode needs")
        _check_episode_columns(path, table, required)
        episodes.extend(table.to_pylist())
    episodes.sort(key=lambda e: e["episode_index"])
    expected_from = 0
    for position, ep in enumerate(episodes):
        if ep["episode_index"] != position or ep["dataset_from_index"] != expected_from:
            raise LeRobotFormatError(
                f"{folder}: episode {ep['episode_index']} (frames from {ep['dataset_from_index']}) breaks "
                f"the sequence: expected episode {position} from frame {expected_from}"
            )
        span = ep["dataset_to_index"] - ep["dataset_from_index"]
        if ep["length"] != span or span < 1:
            raise LeRobotFormatError(
                f"{folder}: episode {position} has length {ep['length']} but spans frames "
                f"{ep['dataset_from_index']} to {ep['dataset_to_index']} ({span}); every episode holds "
                "at least one frame and its length is its span"
            )
        expected_from = ep["dataset_to_index"]
    tasks = _language(root / "meta" / "tasks.parquet", "task_index", "task", required=bool(episodes))
    # only simstream's segments name subtasks (through segment_id): another layout of the file elsewhere
    # (lerobot 0.4.x's subtask datasets) is not read
    subtasks = (
        _language(root / "meta" / "subtasks.parquet", "subtask_index", "subtask", required=False)
        if "segment_id" in features
        else []
    )
    return DatasetMeta(root, info, episodes, tasks, subtasks)


def _check_episode_columns(path: Path, table: Any, required: list[str]) -> None:
    """Raise unless every column an episode needs holds a number for every episode (integers; a video's
    ``from_timestamp`` may be a float)."""
    import pyarrow as pa

    for name in required:
        column = table.column(name)
        numeric = pa.types.is_integer(column.type) or (
            name.endswith("/from_timestamp") and pa.types.is_floating(column.type)
        )
        if not numeric:
            kind = "numbers" if name.endswith("/from_timestamp") else "integers"
            raise LeRobotFormatError(f"{path}: column {name!r} holds {column.type}, not {kind}")
        if column.null_count:
            raise LeRobotFormatError(
                f"{path}: column {name!r} is empty (null) for {column.null_count} episode(s)"
            )


def _leaf_type(kind: Any) -> Any:
    """The type of the values inside a (nested) list type; the type itself when it is not a list."""
    import pyarrow as pa

    while pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        kind = kind.value_type
    return kind


def _wanted_columns(path: Path, schema: Any, features: list[Feature]) -> list[str]:
    """The columns a reader reads from the data file ``path`` of arrow ``schema``: every payload feature
    but videos, ``index``, ``task_index``, and simstream's extras when it holds them.

    Raises:
        LeRobotFormatError: naming the file: a column is missing, or holds other values than
            ``meta/info.json`` declares (float data declared ``int64`` would be cast without a word).
    """
    import pyarrow as pa

    names = set(schema.names)
    wanted = [f.key for f in features if f.dtype != "video"] + ["index", "task_index"]
    wanted += [k for k in ("subtask_index", "segment_id") if k in names]
    missing = [k for k in wanted if k not in names]
    if missing:
        raise LeRobotFormatError(f"{path}: has no column(s) {missing} that meta/info.json declares")
    for f in features:
        if f.dtype == "image":
            kind = schema.field(f.key).type
            if not (
                pa.types.is_struct(kind)
                and kind.get_field_index("bytes") >= 0
                and (
                    pa.types.is_binary(kind.field("bytes").type)
                    or pa.types.is_large_binary(kind.field("bytes").type)
                )
            ):
                raise LeRobotFormatError(
                    f"{path}: column {f.key!r} holds {kind}; an image column holds a struct of the "
                    "encoded picture's 'bytes' (and its 'path')"
                )
        if f.visual:
            continue
        stored = _leaf_type(schema.field(f.key).type)
        try:  # a cast NumPy calls safe (float32 values of a float64 feature) is fine, any other is not
            fits = np.can_cast(np.dtype(stored.to_pandas_dtype()), np.dtype(f.dtype), "safe")
        except (NotImplementedError, TypeError):  # strings, structs: no NumPy dtype at all
            fits = False
        if not fits:
            raise LeRobotFormatError(
                f"{path}: column {f.key!r} holds {stored} values; meta/info.json declares {f.dtype}"
            )
    for key in ("index", "task_index", "subtask_index", "segment_id"):
        if key in wanted and not pa.types.is_integer(schema.field(key).type):
            raise LeRobotFormatError(f"{path}: column {key!r} holds {schema.field(key).type}, not integers")
    return wanted


def check_episode_files(meta: DatasetMeta, features: list[Feature], episodes: list[int]) -> None:
    """Check, before anything streams, every data and video file that ``episodes`` (positions in
    ``meta.episodes``) refer to: it exists, a data file holds the columns and dtypes of ``features`` (only
    the parquet footer is read), and a video is long enough for its episodes (only its header is read). A
    partial download then fails at once, not when a producer first draws one of its episodes, deep into
    training.

    Raises:
        LeRobotFormatError: naming the first file that is missing, empty or does not fit.
    """
    import pyarrow.parquet as pq

    data_files = dict.fromkeys(meta.data_path(meta.episodes[i]) for i in episodes)
    for path in data_files:
        with _parquet(path):
            _wanted_columns(path, pq.read_schema(path), features)
    videos: dict[Path, list[tuple[float, dict[str, Any]]]] = {}
    for i in episodes:
        for feature in features:
            if feature.dtype == "video":
                ep = meta.episodes[i]
                start = float(ep[f"videos/{feature.key}/from_timestamp"])
                videos.setdefault(meta.video_path(ep, feature.key), []).append((start, ep))
    for path, uses in videos.items():
        if not path.is_file():
            raise LeRobotFormatError(f"{path}: missing (the dataset's metadata refers to it)")
        if path.stat().st_size == 0:
            raise LeRobotFormatError(f"{path}: empty (the dataset's metadata refers to it)")
        _check_video_length(path, uses, meta.fps)


def _check_video_length(path: Path, uses: list[tuple[float, dict[str, Any]]], fps: int) -> None:
    """Refuse a video that ends before the last frame an episode needs of it (``uses``: each episode's
    ``from_timestamp`` and metadata row), read from its header: found here, not when a producer first
    draws the episode. A video whose header gives no duration is checked frame by frame when read."""
    with _open_video(path) as container:
        stream = container.streams.video[0]
        if stream.duration is None or stream.time_base is None:
            return
        ends_s = float((stream.duration + (stream.start_time or 0)) * stream.time_base)
    start, ep = max(uses, key=lambda use: use[0] + int(use[1]["length"]) / fps)
    needed_s = start + int(ep["length"]) / fps
    if ends_s + 0.5 / fps < needed_s:
        raise LeRobotFormatError(
            f"{path}: ends at {ends_s:.6f} s, but episode {ep['episode_index']} needs it up to "
            f"{needed_s:.6f} s (from_timestamp {start:g} s + {int(ep['length'])} frames at {fps:g} fps): "
            "the video is shorter than the episodes that refer to it (truncated, or re-encoded?)"
        )


def _open_video(path: Path) -> Any:
    """``path`` opened with PyAV (a container holding a video stream); closed again on failure."""
    import av

    try:
        container = av.open(str(path))
    except av.error.FFmpegError as error:
        raise LeRobotFormatError(f"{path}: not a readable video ({error})") from error
    if not container.streams.video:
        container.close()
        raise LeRobotFormatError(f"{path}: holds no video stream")
    return container


@dataclass
class _DataFile:
    """An open data file of the dataset, as :class:`EpisodeReader` keeps it."""

    handle: Any
    """``pyarrow.parquet.ParquetFile``."""
    index: np.ndarray
    """The ``index`` column: where each episode's frames sit in the file."""
    starts: np.ndarray
    """First row of each row group, then the row count."""
    wanted: list[str]
    """Columns read."""


@dataclass
class EpisodeFrames:
    """One episode read back: payload by field name and its per-frame language columns."""

    frames: dict[str, np.ndarray]
    task_index: np.ndarray
    subtask_index: np.ndarray | None
    segment_id: np.ndarray | None


class EpisodeReader:
    """Reads episodes of one dataset; keeps video files and parquet files open.

    Reads only the row groups of a data file that hold the episode, and keeps decoded row groups up to
    :data:`_CACHE_BYTES` (least recently used first): a replay draws episodes in random order, and a whole
    data file decoded per episode (LeRobot's hold up to 100 MB, many episodes each) made every read as slow
    as the file is large. Owns open PyAV containers and parquet files (close with :meth:`close`).
    """

    def __init__(self, meta: DatasetMeta, features: list[Feature]) -> None:
        self.meta = meta
        self.features = features
        self._files: OrderedDict[Path, _DataFile] = OrderedDict()
        self._groups: OrderedDict[tuple[Path, int, int], tuple[dict[str, Any], int]] = OrderedDict()
        """(file, first row group, last row group) -> decoded columns and their bytes, least recent first."""
        self._cached_bytes = 0
        self._containers: OrderedDict[Path, Any] = OrderedDict()
        """Open video files, least recently used first: a dataset holds one file per camera per recorded
        group, thousands in a long recording, more than a process may keep open."""
        self._open_videos = _OPEN_VIDEOS_PER_CAMERA * max(1, sum(f.dtype == "video" for f in features))

    def _file(self, path: Path) -> _DataFile:
        """The open data file, its ``index`` column and where its row groups start (kept, LRU)."""
        known = self._files.get(path)
        if known is not None:
            self._files.move_to_end(path)
            return known
        import pyarrow.parquet as pq

        with _parquet(path):
            handle = pq.ParquetFile(path)
            try:
                wanted = _wanted_columns(path, handle.schema_arrow, self.features)
                index_column = handle.read(columns=["index"]).column("index")
                if index_column.null_count:
                    raise LeRobotFormatError(f"{path}: column 'index' is empty (null) for some frames")
            except BaseException:
                handle.close()  # the error (kept by the caller, with its traceback) holds no open file
                raise
        index = index_column.to_numpy()
        rows = [handle.metadata.row_group(g).num_rows for g in range(handle.metadata.num_row_groups)]
        starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        known = self._files[path] = _DataFile(handle, index, starts, wanted)
        while len(self._files) > _OPEN_DATA_FILES:
            self._files.popitem(last=False)[1].handle.close()
        return known

    def _rows(self, path: Path, data: _DataFile, lo: int, hi: int) -> tuple[dict[str, Any], int]:
        """Decoded columns of the row groups holding rows ``[lo, hi)``, and the first row they hold."""
        first = int(np.searchsorted(data.starts, lo, side="right")) - 1
        last = int(np.searchsorted(data.starts, hi - 1, side="right")) - 1
        key = (path, first, last)
        cached = self._groups.get(key)
        if cached is not None:
            self._groups.move_to_end(key)
            return cached[0], int(data.starts[first])
        with _parquet(path):
            table = data.handle.read_row_groups(range(first, last + 1), columns=data.wanted)
        columns = self._convert(table, path)
        size = sum(len(b) for v in columns.values() if isinstance(v, list) for b in v)
        size += sum(v.nbytes for v in columns.values() if isinstance(v, np.ndarray))
        self._groups[key] = (columns, size)
        self._cached_bytes += size
        while self._cached_bytes > _CACHE_BYTES and len(self._groups) > 1:
            self._cached_bytes -= self._groups.popitem(last=False)[1][1]
        return columns, int(data.starts[first])

    def _convert(self, table: Any, path: Path) -> dict[str, Any]:
        import pyarrow as pa

        columns: dict[str, Any] = {}
        for key in ("task_index", "subtask_index", "segment_id"):
            if key in table.column_names:
                column = table.column(key)
                if column.null_count:
                    raise LeRobotFormatError(f"{path}: column {key!r} is empty (null) for some frames")
                columns[key] = column.to_numpy()
        for f in self.features:
            if f.dtype == "video":
                continue
            column = table.column(f.key).combine_chunks()
            if _null_values(column):
                raise LeRobotFormatError(f"{path}: column {f.key!r} holds empty (null) values")
            if f.dtype == "image":
                columns[f.key] = column.field("bytes").to_pylist()
            elif f.scalar:
                columns[f.key] = column.to_numpy(zero_copy_only=False)
            elif not pa.types.is_nested(column.type):  # a (1,) field, stored one value per frame
                columns[f.key] = _per_frame(column.to_numpy(zero_copy_only=False), len(column), f, path)
            else:
                _check_even(column, f, path)
                values = column
                while pa.types.is_nested(values.type):  # a list per frame, of lists for a feature of 2+ dims
                    values = values.flatten()
                columns[f.key] = _per_frame(values.to_numpy(zero_copy_only=False), len(column), f, path)
        return columns

    def read(self, episode_index: int, limit: int | None = None) -> EpisodeFrames:
        """The payload frames of one episode: every frame, or its first ``limit``."""
        ep = self.meta.episodes[episode_index]
        path = self.meta.data_path(ep)
        data = self._file(path)
        first_index = int(ep["dataset_from_index"])
        hits = np.flatnonzero(data.index == first_index)
        length = int(ep["length"])
        # the episode's rows are its indices in order, with none missing: a gap served the next
        # episode's first frames as its last
        if (
            len(hits) != 1
            or hits[0] + length > len(data.index)
            or not np.array_equal(
                data.index[hits[0] : hits[0] + length], np.arange(first_index, first_index + length)
            )
        ):
            raise LeRobotFormatError(
                f"{path}: does not hold the {length} frames of episode {episode_index} (rows with index "
                f"{first_index} to {first_index + length - 1}, in order)"
            )
        count = length if limit is None else min(length, limit)
        columns, offset = self._rows(path, data, int(hits[0]), int(hits[0]) + count)
        lo = int(hits[0]) - offset
        frames: dict[str, np.ndarray] = {}
        for f in self.features:
            if f.dtype == "video":
                frames[f.field] = self._decode(ep, f, count)
            elif f.dtype == "image":
                frames[f.field] = np.stack([_png(b, f, path) for b in columns[f.key][lo : lo + count]])
            else:
                frames[f.field] = columns[f.key][lo : lo + count]
        extra = {
            k: columns[k][lo : lo + count] if k in columns else None for k in ("subtask_index", "segment_id")
        }
        task_index = columns["task_index"][lo : lo + count]
        _check_indices(task_index, len(self.meta.tasks), "task_index", "tasks.parquet", path, episode_index)
        if extra["subtask_index"] is not None and extra["segment_id"] is not None and self.meta.subtasks:
            named = extra["subtask_index"][extra["segment_id"] >= 0]  # frames outside a segment name none
            _check_indices(
                named, len(self.meta.subtasks), "subtask_index", "subtasks.parquet", path, episode_index
            )
        return EpisodeFrames(frames, task_index, **extra)

    def _decode(self, ep: dict[str, Any], feature: Feature, length: int) -> np.ndarray:

        path = self.meta.video_path(ep, feature.key)
        container = self._containers.get(path)
        if container is None:
            if not path.is_file():
                raise LeRobotFormatError(f"{path}: missing (episode {ep['episode_index']} refers to it)")
            container = self._containers[path] = _open_video(path)
            while len(self._containers) > self._open_videos:
                self._containers.popitem(last=False)[1].close()
        else:
            self._containers.move_to_end(path)
        stream = container.streams.video[0]
        start = float(ep[f"videos/{feature.key}/from_timestamp"])
        out = np.empty((length, *feature.shape), dtype=np.uint8)
        filled = np.zeros(length, dtype=bool)
        # Seek a little before the start; should the episode's first frame still be missing (a long
        # open GOP), read again from the beginning of the file, which finds every frame.
        for seek_s in (max(0.0, start - _SEEK_MARGIN_FRAMES / self.meta.fps), 0.0):
            self._decode_from(container, stream, path, ep, feature, start, seek_s, out, filled)
            if filled[0] or seek_s == 0.0:
                break
        if not filled.all():
            missing = np.flatnonzero(~filled)
            raise LeRobotFormatError(
                f"{path}: holds {int(filled.sum())} of the {length} frames of episode {ep['episode_index']} "
                f"(truncated?); frame {int(missing[0])} and {len(missing) - 1} more have no picture"
            )
        return out

    def _decode_from(
        self,
        container: Any,
        stream: Any,
        path: Path,
        ep: dict[str, Any],
        feature: Feature,
        start: float,
        seek_s: float,
        out: np.ndarray,
        filled: np.ndarray,
    ) -> None:
        """Decode from the keyframe at or before ``seek_s`` into ``out`` (frame ``t`` of the episode at
        ``start + t / fps``) until past its last frame, marking ``filled``."""
        import av

        fps, length = self.meta.fps, len(out)
        try:
            container.seek(int(seek_s / stream.time_base), stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                if frame.pts is None:  # no time, no place in the episode (LeRobot skips them too)
                    continue
                offset_s = float(frame.pts * stream.time_base) - start
                index = round(offset_s * fps)
                if index < 0:
                    continue
                if index >= length:
                    break
                if abs(offset_s - index / fps) > _TIMESTAMP_TOLERANCE_S:
                    raise LeRobotFormatError(
                        f"{path}: a frame at {offset_s + start:.6f} s is {offset_s - index / fps:+.6f} s off "
                        f"the grid of episode {ep['episode_index']} (from_timestamp {start:g} s + t / "
                        f"{fps:g} fps; tolerance {_TIMESTAMP_TOLERANCE_S:g} s): its from_timestamp does "
                        "not match the video"
                    )
                image = frame.to_ndarray(format="rgb24")
                if image.shape[:2] != feature.shape[1:]:
                    raise LeRobotFormatError(
                        f"{path}: frames are {image.shape[:2]}, info.json says {feature.shape[1:]}"
                    )
                out[index] = image.transpose(2, 0, 1)
                filled[index] = True
        except av.error.FFmpegError as error:
            raise LeRobotFormatError(f"{path}: decoding failed (truncated or damaged?): {error}") from error

    def close(self) -> None:
        """Close every open video and data file (each one, even when closing another fails: the first
        failure is raised after)."""
        handles = [*self._containers.values(), *(data.handle for data in self._files.values())]
        self._containers.clear()
        self._files.clear()
        self._groups.clear()
        self._cached_bytes = 0
        failure: BaseException | None = None
        for handle in handles:
            try:
                handle.close()
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure


def _null_values(column: Any) -> bool:
    """Whether ``column`` or any list level inside it holds a null."""
    import pyarrow as pa

    values = column
    while True:
        if values.null_count:
            return True
        if not pa.types.is_nested(values.type) or pa.types.is_struct(values.type):
            return False
        values = values.flatten()


def _check_even(column: Any, feature: Feature, path: Path) -> None:
    """Raise unless every frame of the list column holds the feature's number of values: flattened, a
    frame of 22 values and one of 24 fit 2 frames of 23, each value then sitting in the wrong frame."""
    import pyarrow as pa

    bounds = np.arange(len(column) + 1) + column.offset  # each frame's first and end element, per level
    values = column
    while pa.types.is_nested(values.type):
        if pa.types.is_fixed_size_list(values.type):
            bounds = bounds * values.type.list_size
        else:
            bounds = values.offsets.to_numpy()[bounds - values.offset]
        values = values.values
        if not pa.types.is_nested(values.type):
            break
        bounds = bounds + values.offset
    counts = np.diff(bounds)
    per_frame = int(np.prod(feature.shape))
    if len(counts) and not (counts == per_frame).all():
        frame = int(np.flatnonzero(counts != per_frame)[0])
        where = "per frame" if (counts == counts[0]).all() else f"in frame {frame} of a row group"
        raise LeRobotFormatError(
            f"{path}: column {feature.key!r} holds {int(counts[frame])} values {where}; meta/info.json "
            f"declares shape {list(feature.shape)} ({per_frame} per frame)"
        )
    _check_dimensions(column, feature, path)


def _check_dimensions(column: Any, feature: Feature, path: Path) -> None:
    """Raise unless a column of one list level per dimension (a ``[2, 3]`` feature as a list of 2 lists of
    3 values per frame) holds lists of the declared length at every level: with the right total, lists of
    3 and 3 shaped ``[3, 2]`` or ragged ones of 2 and 4 would be read as ``[2, 3]`` silently."""
    import pyarrow as pa

    shape = [int(n) for n in feature.shape]
    depth, kind = 0, column.type
    while pa.types.is_nested(kind):
        depth, kind = depth + 1, kind.value_type
    if depth != len(shape) or depth < 2 or len(column) == 0:
        return  # one flat list per frame (the total was checked) or a scalar per frame
    edges = np.arange(len(column) + 1) + column.offset  # the bounds of every list at this level
    values = column
    for dimension, size in enumerate(shape):
        if pa.types.is_fixed_size_list(values.type):
            lengths = np.full(len(edges) - 1, values.type.list_size)
            child = (edges[0] * values.type.list_size, edges[-1] * values.type.list_size)
        else:
            offsets = values.offsets.to_numpy()[edges - values.offset]
            lengths = np.diff(offsets)
            child = (int(offsets[0]), int(offsets[-1]))
        if not (lengths == size).all():
            wrong = int(lengths[np.flatnonzero(lengths != size)[0]])
            raise LeRobotFormatError(
                f"{path}: column {feature.key!r} holds a list of {wrong} values at dimension {dimension} of "
                f"a frame; meta/info.json declares shape {shape} ({size} at that dimension)"
            )
        values = values.values
        if dimension < len(shape) - 1:
            edges = np.arange(child[0], child[1] + 1) + values.offset


def _per_frame(values: np.ndarray, frames: int, feature: Feature, path: Path) -> np.ndarray:
    """A column's flat values as ``[frames, *shape]``, or an error naming the file when they do not fit."""
    per_frame = int(np.prod(feature.shape))
    if values.size != frames * per_frame:
        raise LeRobotFormatError(
            f"{path}: column {feature.key!r} holds {values.size} values for {frames} frames; meta/info.json "
            f"declares shape {list(feature.shape)} ({per_frame} per frame)"
        )
    return values.reshape(frames, *feature.shape)


def _check_indices(values: np.ndarray, count: int, column: str, table: str, path: Path, episode: int) -> None:
    if len(values) and (int(values.min()) < 0 or int(values.max()) >= count):
        bad = int(values.max()) if int(values.max()) >= count else int(values.min())
        raise LeRobotFormatError(
            f"{path}: {column} {bad} of episode {episode} names no row of meta/{table} ({count} rows)"
        )


def _png(data: bytes, feature: Feature, path: Path) -> np.ndarray:
    from PIL import Image

    try:
        image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    except Exception as error:
        raise LeRobotFormatError(
            f"{path}: column {feature.key!r} holds an unreadable image ({error})"
        ) from error
    if image.shape[:2] != tuple(feature.shape[1:]):
        raise LeRobotFormatError(
            f"{path}: column {feature.key!r} holds {image.shape[0]}x{image.shape[1]} images; meta/info.json "
            f"says {feature.shape[1]}x{feature.shape[2]}"
        )
    return image.transpose(2, 0, 1)


def payload_features(meta: DatasetMeta, key_map: KeyMap) -> tuple[list[Feature], dict[str, str]]:
    """The dataset's payload features, named by the rule and ``key_map``, and those a replay cannot
    stream, each with the reason.

    Raises:
        ValueError: ``key_map`` names a key the dataset lacks, one of its bookkeeping columns, or a feature
            that cannot be streamed.
    """
    info_path = meta.root / "meta" / "info.json"
    key_map.check_known(meta.info["features"], str(info_path))
    features, skipped = features_from_info(meta.info, scalar_columns(meta), key_map, info_path)
    for key in key_map.overrides:
        if key in BOOKKEEPING_KEYS or key in EXTRA_KEYS:
            raise ValueError(
                f"key_map names {key!r}, one of the dataset's bookkeeping columns of {info_path}, not a "
                "payload feature: it is never a field"
            )
        if key in skipped:
            raise ValueError(
                f"key_map names {key!r} of {info_path}, which a replay cannot stream: {skipped[key]}"
            )
    return features, skipped


def scalar_columns(meta: DatasetMeta) -> set[str]:
    """Columns of the first data file that hold one value per frame, not a list (LeRobot's shape ``[1]``
    is either); empty for a dataset without episodes."""
    import pyarrow.parquet as pq

    scalar: set[str] = set()
    if meta.episodes:
        path = meta.data_path(meta.episodes[0])
        if not path.is_file():
            raise LeRobotFormatError(f"{path}: missing (episode 0 refers to it)")
        try:
            schema = pq.read_schema(path)
        except Exception as error:
            raise LeRobotFormatError(
                f"{path}: not a readable parquet file (truncated or damaged?): {error}"
            ) from error

        scalar = {
            name for name in schema.names if _leaf_type(schema.field(name).type) == schema.field(name).type
        }
    return scalar
