"""``DatasetWriter``: appends episodes to a LeRobot v3.0 dataset in closed files that are never rewritten.

Durability protocol (one *group* of episodes per flush, each group in files of its own):

1. ``meta/tasks.parquet`` and ``meta/subtasks.parquet`` (supersets of what any data file references);
2. ``videos/<key>/chunk-C/file-F.mp4`` for each camera stored as video;
3. ``data/chunk-C/file-F.parquet``;
4. ``meta/episodes/chunk-C/file-F.parquet``: **the commit point** of the group;
5. ``meta/stats.json``, then ``meta/info.json`` (totals).

Every file is written under a hidden temporary name, fsynced, renamed into place and its folder fsynced,
so a reader finds each file whole or absent. A SIGKILL at any moment therefore leaves every group whose
episodes file exists complete; a group killed before step 4 left files that no episode references, which
LeRobot's reader ignores (it counts frames from ``info.json``) and :func:`repair` deletes. ``info.json``
may lag one group behind its episodes files until the next flush or repair.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .format import (
    CHUNKS_SIZE,
    CODEBASE_VERSION,
    DATA_PATH,
    EPISODES_PATH,
    EXTRA_KEYS,
    FIELD_SHAPE_KEY,
    STAT_NAMES,
    VIDEO_CODECS,
    VIDEO_GOP,
    VIDEO_PATH,
    Feature,
    LeRobotFormatError,
    aggregate_stats,
    check_video_frames,
    columns_stats,
    commit_file,
    hf_features,
    image_stats,
    info_features,
    language_table,
    make_folders,
    stats_to_json,
    temp_path,
    write_json,
    write_parquet,
)

__all__ = ["DatasetInUseError", "DatasetWriter", "EpisodeRecord", "check_dataset_folder", "repair"]


@dataclass
class EpisodeRecord:
    """One episode to write: payload frames by field name and its language."""

    frames: dict[str, np.ndarray]
    """Field name -> ``[length, *shape]`` (cameras ``[length, 3, H, W]`` uint8)."""
    task: str
    """The episode's instruction: every frame's ``task``."""
    subtasks: list[str] = field(default_factory=list)
    """Per frame, the subtask text (``meta/subtasks.parquet``); empty: the task."""
    segment_id: np.ndarray | None = None
    """Per frame, the position of its segment in the episode's segment list (-1: none)."""
    segment_accepted: list[bool] = field(default_factory=list)
    """Per segment position, whether it is accepted."""
    success: bool = True
    terminated: bool = False
    truncated: bool = False

    @property
    def length(self) -> int:
        return len(next(iter(self.frames.values())))


class DatasetWriter:
    """Writes episodes into a new dataset or appends to an existing one (repaired first).

    Owns the dataset folder while open: one writer per dataset. Episodes wait in memory until
    :meth:`flush` writes them as one group (see the module docstring); :attr:`episodes_flushed` counts the
    episodes whose files are committed.
    """

    def __init__(
        self,
        root: Path | str,
        features: list[Feature],
        fps: int,
        robot_type: str | None = None,
        video_codec: str = "av1",
    ) -> None:
        if video_codec not in VIDEO_CODECS:
            raise ValueError(f"video_codec must be one of {sorted(VIDEO_CODECS)}, got {video_codec!r}")
        self.video_codec = video_codec
        """Codec of new video files; an appended dataset keeps the one its ``info.json`` names."""
        self.root = Path(root)
        self.features = features
        self.fps = int(fps)
        self.robot_type = robot_type
        self.tasks: dict[str, int] = {}
        self.subtasks: dict[str, int] = {}
        self.stats: dict[str, dict[str, np.ndarray]] = {}
        """Stats over every flushed episode, updated per group (the aggregation is associative)."""
        self.episodes_flushed = 0
        self.frames_flushed = 0
        self._failed_after_commit: str | None = None
        """Set by a flush that failed after its commit point; every later flush refuses."""
        self.bytes_written = 0
        self.next_file = 0
        self._pending: list[EpisodeRecord] = []
        self._language_written = (0, 0)
        self._lock_fd: int | None = None
        self._lock_pid = os.getpid()
        checked = (self.root / "meta" / "info.json").exists()
        if checked:
            from .dataset import read_dataset_meta

            # a refused append changes nothing: checked before the lock and the repair (it may switch to
            # the dataset's codec); a dataset that exists keeps its fps and features, so once is enough
            self._check_appendable(read_dataset_meta(self.root, stats=False))
        check_video_frames(self.features, self.video_codec)
        make_folders(self.root)
        self._lock_fd = _lock_folder(self.root)
        try:
            if (self.root / "meta" / "info.json").exists():  # again: another writer may have made it since
                self._resume(checked)
            else:
                self._write_meta()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let other writers open the dataset (queued episodes not flushed are dropped). Idempotent.

        In a forked child that inherited the writer this does nothing: the lock belongs to the process
        that took it, and the child's copy of its descriptor was closed when it was forked.
        """
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        # in a forked child the descriptor was closed at the fork (its number may be another file's
        # now); LOCK_UN there would also have freed the parent's lock, which shares the description
        if os.getpid() == self._lock_pid:
            _unlock_folder(fd)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_lock_fd", None) is not None:
            self.close()

    # -- append ---------------------------------------------------------------------------------------
    def _resume(self, checked: bool) -> None:
        state = _repair(self.root)
        if not checked:  # made by another writer since this one looked
            self._check_appendable(state["meta"])
            check_video_frames(self.features, self.video_codec)
        self.tasks = {t: i for i, t in enumerate(state["tasks"])}
        self.subtasks = {t: i for i, t in enumerate(state["subtasks"])}
        self._language_written = (len(self.tasks), len(self.subtasks))
        self.stats = state["stats"]
        self.episodes_flushed = state["total_episodes"]
        self.frames_flushed = state["total_frames"]
        self.next_file = state["next_file"]

    def _check_appendable(self, meta) -> None:
        """Raise unless the recording's fps and features match the dataset's; take its codec and robot."""
        _check_simstream_recording(meta)
        info = meta.info
        codecs = {
            entry.get("info", {}).get("video.codec")
            for entry in info["features"].values()
            if entry.get("dtype") == "video"
        }
        if len(codecs) == 1 and next(iter(codecs)) in VIDEO_CODECS:
            self.video_codec = next(iter(codecs))
        if info.get("fps") != self.fps:
            raise ValueError(
                f"{self.root}/meta/info.json: fps is {info.get('fps')}, the recording's is {self.fps}"
            )
        expected = info_features(self.features, self.fps, self.video_codec)
        differences = _feature_differences(info["features"], expected)
        if differences:
            raise ValueError(
                f"{self.root}/meta/info.json: the dataset's features do not match the recording's "
                f"({'; '.join(differences)}); appending needs the same keys, dtypes and shapes"
            )
        if meta.episodes:
            self._check_scalars(meta)
        if self.robot_type is None:  # a recording that does not say keeps what the dataset says
            self.robot_type = info.get("robot_type")

    def _check_scalars(self, meta) -> None:
        """A column holds one value per frame (LeRobot's shape ``[1]``) or a list per frame: appending
        the other kind (onto a list of one that an earlier simstream wrote for a ``(1,)`` field) would
        leave a column of two types that no reader can replay."""
        from .dataset import scalar_columns

        stored = scalar_columns(meta)
        for feature in self.features:
            if not feature.visual and feature.plain != (feature.key in stored):
                kind = "one value per frame" if feature.key in stored else "a list per frame"
                shape = () if feature.scalar else feature.shape
                raise ValueError(
                    f"{meta.data_path(meta.episodes[0])}: column {feature.key!r} holds {kind}; the "
                    f"recording's field {feature.field!r} has shape {shape}, which would store the other "
                    "kind (same field shapes needed to append)"
                )

    # -- writing --------------------------------------------------------------------------------------
    def add(self, episode: EpisodeRecord) -> None:
        """Queue one episode for the next :meth:`flush`.

        Raises:
            ValueError: a field of the dataset is missing, or holds another number of frames or another
                shape per frame than the episode's first field (a camera with fewer frames than the rest
                would be committed with the next episode's pixels), or the episode has no frames, naming
                the field.
        """
        missing = {f.field for f in self.features} - set(episode.frames)
        if missing:
            raise ValueError(f"episode lacks field(s) {sorted(missing)} of the dataset")
        length = episode.length
        if length < 1:
            raise ValueError("EpisodeRecord.frames must hold at least one frame, got an episode of 0 frames")
        for feature in self.features:
            shape = tuple(getattr(episode.frames[feature.field], "shape", ()))
            expected = (length, *feature.field_spec().shape)
            # a plain column (a scalar or a (1,) field) holds one value per frame either way
            if shape != expected and not (feature.plain and shape in ((length,), (length, 1))):
                raise ValueError(
                    f"EpisodeRecord.frames[{feature.field!r}] must have shape {expected} (the episode's "
                    f"{length} frames of the dataset's {feature.key!r}), got {shape}"
                )
        for name, values in (("subtasks", episode.subtasks), ("segment_id", episode.segment_id)):
            if values is not None and len(values) not in (0, length):
                raise ValueError(
                    f"EpisodeRecord.{name} must hold one value per frame ({length}) or none, got "
                    f"{len(values)}"
                )
        self._pending.append(episode)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self) -> int:
        """Write the queued episodes as one group of closed files; returns how many were committed."""
        if self._lock_fd is None:
            raise RuntimeError(f"DatasetWriter of {self.root} is closed; open a new one to write")
        if self._failed_after_commit is not None:
            raise RuntimeError(
                f"DatasetWriter of {self.root}: an earlier flush failed after committing its episodes "
                f"({self._failed_after_commit}); close this writer and open the dataset again (opening "
                "repairs meta/info.json from the committed episodes)"
            )
        group, self._pending = self._pending, []
        if not group:
            return 0
        chunk, file = divmod(self.next_file, CHUNKS_SIZE)
        episodes_path = None  # set once the group's files are written: only the commit point remains
        try:
            for episode in group:
                self.tasks.setdefault(episode.task, len(self.tasks))
                for text in dict.fromkeys(episode.subtasks or [episode.task]):
                    self.subtasks.setdefault(text, len(self.subtasks))
            self._write_language()
            videos = {
                f.key: self._write_video(f, group, chunk, file) for f in self.features if f.dtype == "video"
            }
            data_path = self.root / DATA_PATH.format(chunk_index=chunk, file_index=file)
            table, stats = self._data_table(group)
            write_parquet(data_path, table)
            episodes_path = self.root / EPISODES_PATH.format(chunk_index=chunk, file_index=file)
            write_parquet(episodes_path, self._episodes_table(group, stats, videos, chunk, file))  # commit
        except BaseException as error:
            if episodes_path is not None and episodes_path.exists():
                # renamed into place, then its folder's fsync failed: committed, so the counts below are
                # wrong from now on, as when info.json fails (flushing the group again would duplicate it)
                self._failed_after_commit = f"{type(error).__name__}: {error}"
                raise
            # nothing of the group is committed: it stays queued, and a later flush writes it again over
            # the same file numbers (a full disk that was freed); the files it wrote are not referred to
            self._pending = group + self._pending
            raise
        self.bytes_written += data_path.stat().st_size + episodes_path.stat().st_size
        self.next_file += 1
        try:
            for key in stats[0]:
                previous = [self.stats[key]] if key in self.stats else []
                self.stats[key] = aggregate_stats(previous + [s[key] for s in stats])
            # the counts others read as "flushed" move only once info.json says so: LeRobot's reader sizes
            # the dataset from it, and a SIGKILL before it is replaced must not lose what was reported
            self._write_meta(
                self.episodes_flushed + len(group), self.frames_flushed + sum(e.length for e in group)
            )
        except BaseException as error:
            # the group's episodes are committed but the counts (the next episode's and frame's indices)
            # did not move: another flush would write those indices again, breaking the dataset for good
            self._failed_after_commit = f"{type(error).__name__}: {error}"
            raise
        self.episodes_flushed += len(group)
        self.frames_flushed += sum(e.length for e in group)
        return len(group)

    def _write_language(self) -> None:
        if self._language_written == (len(self.tasks), len(self.subtasks)):
            return
        write_parquet(
            self.root / "meta" / "tasks.parquet", language_table(list(self.tasks), "task_index", "task")
        )
        write_parquet(
            self.root / "meta" / "subtasks.parquet",
            language_table(list(self.subtasks), "subtask_index", "subtask"),
        )
        self._language_written = (len(self.tasks), len(self.subtasks))

    def _write_video(
        self, feature: Feature, group: list[EpisodeRecord], chunk: int, file: int
    ) -> list[float]:
        """Encode the group's frames of one camera into one mp4; returns each episode's first timestamp."""
        import av

        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner on every stream otherwise
        path = self.root / VIDEO_PATH.format(video_key=feature.key, chunk_index=chunk, file_index=file)
        make_folders(path.parent)
        tmp = temp_path(path)
        _, height, width = feature.shape
        starts, count = [], 0
        with av.open(str(tmp), "w", format="mp4") as container:
            codec = VIDEO_CODECS[self.video_codec]
            options = {"g": str(VIDEO_GOP), "crf": str(codec["crf"]), "preset": str(codec["preset"])}
            stream = container.add_stream(codec["encoder"], rate=self.fps, options=options)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            # One encoder thread: frames this small gain nothing from threads, whose hand-offs doubled
            # x264's CPU per episode (10 ms against 5 for 560 64x64 frames), taken from the producers
            stream.codec_context.thread_count = 1
            for episode in group:
                starts.append(count / self.fps)
                for image in _rgb_frames(episode.frames[feature.field]):
                    image.pts = count
                    count += 1
                    container.mux(stream.encode(image))
            container.mux(stream.encode())
        commit_file(tmp, path)
        self.bytes_written += path.stat().st_size
        return starts

    def _data_table(self, group: list[EpisodeRecord]):
        import pyarrow as pa

        columns: dict[str, Any] = {}
        lengths = [e.length for e in group]
        total = sum(lengths)
        for feature in self.features:
            if feature.dtype == "video":
                continue
            if feature.dtype == "image":
                columns[feature.key] = _png_column([e.frames[feature.field] for e in group])
                continue
            values = np.concatenate([np.asarray(e.frames[feature.field]) for e in group])
            values = values.astype(feature.dtype, copy=False)
            if feature.plain:
                columns[feature.key] = pa.array(values.reshape(total))
            else:
                flat = pa.array(values.reshape(-1))
                columns[feature.key] = pa.FixedSizeListArray.from_arrays(flat, feature.shape[0])
        frame_index = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        first = self.episodes_flushed
        bookkeeping = {
            "timestamp": (frame_index / self.fps).astype(np.float32),
            "frame_index": frame_index,
            "episode_index": np.repeat(np.arange(first, first + len(group), dtype=np.int64), lengths),
            "index": np.arange(self.frames_flushed, self.frames_flushed + total, dtype=np.int64),
            "task_index": np.repeat(np.array([self.tasks[e.task] for e in group], dtype=np.int64), lengths),
            "subtask_index": np.concatenate([self._subtask_ids(e) for e in group]),
            "segment_id": np.concatenate([_segment_ids(e) for e in group]),
        }
        stats: list[dict[str, dict[str, np.ndarray]]] = []
        start = 0
        for episode, n in zip(group, lengths):
            numeric = {f.key: episode.frames[f.field] for f in self.features if not f.visual}
            numeric.update({key: values[start : start + n] for key, values in bookkeeping.items()})
            numeric_stats = columns_stats(numeric)
            stats.append(  # in the features' order, then the bookkeeping columns' (the files' column order)
                {
                    f.key: image_stats(episode.frames[f.field]) if f.visual else numeric_stats[f.key]
                    for f in self.features
                }
                | {key: numeric_stats[key] for key in bookkeeping}
            )
            start += n
        columns.update({key: pa.array(values) for key, values in bookkeeping.items()})
        table = pa.table(columns)
        return table.replace_schema_metadata({"huggingface": json.dumps(hf_features(self.features))}), stats

    def _subtask_ids(self, episode: EpisodeRecord) -> np.ndarray:
        if not episode.subtasks:
            return np.full(episode.length, self.subtasks[episode.task], dtype=np.int64)
        return np.array([self.subtasks[text] for text in episode.subtasks], dtype=np.int64)

    def _episodes_table(self, group, stats, videos: dict[str, list[float]], chunk: int, file: int):
        import pyarrow as pa

        lengths = [e.length for e in group]
        ends = np.cumsum(lengths) + self.frames_flushed
        columns: dict[str, Any] = {
            "episode_index": pa.array(np.arange(self.episodes_flushed, self.episodes_flushed + len(group))),
            "tasks": pa.array([[e.task] for e in group], pa.list_(pa.string())),
            "length": pa.array(lengths, pa.int64()),
            "data/chunk_index": pa.array([chunk] * len(group), pa.int64()),
            "data/file_index": pa.array([file] * len(group), pa.int64()),
            "dataset_from_index": pa.array(ends - lengths, pa.int64()),
            "dataset_to_index": pa.array(ends, pa.int64()),
        }
        for key, starts in videos.items():
            columns[f"videos/{key}/chunk_index"] = pa.array([chunk] * len(group), pa.int64())
            columns[f"videos/{key}/file_index"] = pa.array([file] * len(group), pa.int64())
            columns[f"videos/{key}/from_timestamp"] = pa.array(starts, pa.float64())
            columns[f"videos/{key}/to_timestamp"] = pa.array(
                [s + n / self.fps for s, n in zip(starts, lengths)], pa.float64()
            )
        for key in stats[0]:
            for name in STAT_NAMES:
                values = [np.asarray(s[key][name]).tolist() for s in stats]
                columns[f"stats/{key}/{name}"] = pa.array(values)
        columns["meta/episodes/chunk_index"] = pa.array([chunk] * len(group), pa.int64())
        columns["meta/episodes/file_index"] = pa.array([file] * len(group), pa.int64())
        columns["success"] = pa.array([bool(e.success) for e in group], pa.bool_())
        columns["terminated"] = pa.array([bool(e.terminated) for e in group], pa.bool_())
        columns["truncated"] = pa.array([bool(e.truncated) for e in group], pa.bool_())
        columns["segment_accepted"] = pa.array(
            [list(map(bool, e.segment_accepted)) for e in group], pa.list_(pa.bool_())
        )
        return pa.table(columns)

    def _write_meta(self, episodes: int | None = None, frames: int | None = None) -> None:
        """``stats.json`` then ``info.json`` (with ``episodes`` and ``frames`` in all, default the counts
        so far), each replaced atomically."""
        episodes = self.episodes_flushed if episodes is None else episodes
        frames = self.frames_flushed if frames is None else frames
        meta = self.root / "meta"
        if self.stats:
            write_json(meta / "stats.json", stats_to_json(self.stats), indent=None)
        has_video = any(f.dtype == "video" for f in self.features)
        info = {
            "codebase_version": CODEBASE_VERSION,
            "fps": self.fps,
            "features": info_features(self.features, self.fps, self.video_codec),
            "total_episodes": episodes,
            "total_frames": frames,
            "total_tasks": len(self.tasks),
            "chunks_size": CHUNKS_SIZE,
            "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200,
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if has_video else None,
            "robot_type": self.robot_type,
            "splits": {"train": f"0:{episodes}"},
        }
        write_json(meta / "info.json", info)


def _rgb_frames(frames: np.ndarray):
    """PyAV frames of uint8 ``[n, 3, H, W]`` without a transpose: channel-first frames are planar RGB,
    FFmpeg's ``gbrp`` with the planes in G, B, R order, so each plane is one contiguous copy
    (``from_ndarray`` of a transposed ``rgb24`` frame cost about 6x as much per frame)."""
    import av

    frames = np.ascontiguousarray(frames)
    n, _, height, width = frames.shape
    planar = None  # whether FFmpeg's planes are unpadded rows (the same for every frame of one size)
    for k in range(n):
        image = av.VideoFrame(width, height, "gbrp")
        if planar is None:
            planar = all(plane.line_size == width for plane in image.planes)
        if planar:
            green, blue, red = image.planes
            green.update(frames[k, 1])
            blue.update(frames[k, 2])
            red.update(frames[k, 0])
        else:  # rows padded for alignment: let PyAV copy row by row
            image = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[k].transpose(1, 2, 0)), "rgb24")
        yield image


def _segment_ids(episode: EpisodeRecord) -> np.ndarray:
    if episode.segment_id is None:
        return np.zeros(episode.length, dtype=np.int64)
    return np.asarray(episode.segment_id, dtype=np.int64)


def _png_column(arrays: list[np.ndarray]):
    """LeRobot's image column: ``struct<bytes: binary, path: string>`` holding PNG files."""
    import pyarrow as pa
    from PIL import Image

    encoded = []
    for frames in arrays:
        for frame in frames:
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(frame.transpose(1, 2, 0))).save(
                buffer, format="PNG", compress_level=1
            )
            encoded.append(buffer.getvalue())
    return pa.StructArray.from_arrays(
        [pa.array(encoded, pa.binary()), pa.array([None] * len(encoded), pa.string())],
        names=["bytes", "path"],
    )


def check_dataset_folder(root: Path | str, what: str) -> bool:
    """Whether ``root`` holds a dataset (to append to); ``False`` for a new or empty folder.

    Raises:
        ValueError: naming ``what`` (the option), when ``root`` is a file or a folder holding other files:
            a recording would mix its dataset with them.
    """
    root = Path(root)
    if (root / "meta" / "info.json").is_file():
        return True
    if root.exists() and (not root.is_dir() or _holds_files(root)):
        raise ValueError(f"{what}: {root} exists and is not a LeRobot dataset; choose a new or empty folder")
    return False


def _holds_files(root: Path) -> bool:
    """Whether ``root`` holds a file other than our hidden temporary ones: a writer killed while creating
    a dataset, before its first ``info.json``, leaves empty folders and temporary files only."""
    return any(
        path.is_file() and not (path.name.startswith(".") and path.name.endswith(".tmp"))
        for path in root.rglob("*")
    )


class DatasetInUseError(RuntimeError):
    """Another writer (in this process or another) has the dataset folder open."""


_FOLDER_LOCKS: set[int] = set()
"""Descriptors of :func:`_lock_folder` this process holds."""


def _close_inherited_folder_locks() -> None:
    """In a forked child: close the folder locks' descriptors it inherited. A ``flock`` belongs to every
    copy of its descriptor, so a child (a ``DataLoader`` worker forked by the trainer) kept the dataset
    locked after the recording process was SIGKILLed, until the child exited. The parent's lock is
    unaffected: it holds a descriptor of its own."""
    for fd in _FOLDER_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _FOLDER_LOCKS.clear()


os.register_at_fork(after_in_child=_close_inherited_folder_locks)


def _lock_folder(root: Path) -> int:
    """An exclusive ``flock`` on the folder itself (no lock file to leave behind); the kernel drops it when
    the holder dies, SIGKILL included (forked children close their copies: see
    :func:`_close_inherited_folder_locks`)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DatasetInUseError(
            f"{root}: another writer is recording into this dataset (a second `simstream record --out`, "
            "`demo --record` or LeRobotRecorder on the same folder); one writer per dataset at a time"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    _FOLDER_LOCKS.add(fd)
    return fd


def _unlock_folder(fd: int) -> None:
    """Release :func:`_lock_folder`'s lock in the process that took it (``LOCK_UN``: released even while
    forked children still hold copies of the descriptor), and close the descriptor."""
    _FOLDER_LOCKS.discard(fd)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _check_simstream_recording(meta) -> None:
    if not all(k in meta.info["features"] for k in EXTRA_KEYS):
        raise LeRobotFormatError(
            f"{meta.root}/meta/info.json: not a simstream recording; cannot append to it"
        )
    video_path = VIDEO_PATH if meta.video_keys else None
    if meta.info["data_path"] != DATA_PATH or meta.info["video_path"] != video_path:
        # the writer writes, and repair keeps, files of the default layout only: another layout's files
        # would be taken for unreferenced ones and deleted
        raise LeRobotFormatError(
            f"{meta.root}/meta/info.json: data_path {meta.info['data_path']!r} and video_path "
            f"{meta.info['video_path']!r} are not simstream's layout ({DATA_PATH!r}, {video_path!r}); "
            "cannot append to it or repair it"
        )


def repair(root: Path | str) -> dict[str, Any]:
    """Bring an interrupted dataset back to its last committed group; returns what it holds.

    Deletes temporary files and the data and video files no committed episode references, then rewrites
    ``stats.json`` and ``info.json`` from the episodes files (``info.json`` may lag one group behind).

    Raises:
        LeRobotFormatError: naming the file, when ``info.json`` is not v3.0 or an episodes file is damaged.
        DatasetInUseError: a writer has the dataset open (its group in progress would look uncommitted).
    """
    root = Path(root)
    if not root.is_dir():  # before the lock, which would fail with the OS's error naming no dataset
        raise LeRobotFormatError(f"{root}: no such dataset folder")
    fd = _lock_folder(root)
    try:
        return _repair(root)
    finally:
        _unlock_folder(fd)


def _repair(root: Path) -> dict[str, Any]:
    """:func:`repair` for a caller that holds the folder's lock."""
    from .dataset import read_dataset_meta

    meta = read_dataset_meta(root)
    _check_simstream_recording(meta)
    for tmp in root.rglob(".*.tmp"):
        tmp.unlink()
    referenced = set()
    next_file = 0
    for ep in meta.episodes:
        referenced.add(
            root / DATA_PATH.format(chunk_index=ep["data/chunk_index"], file_index=ep["data/file_index"])
        )
        next_file = max(
            next_file, ep["meta/episodes/chunk_index"] * CHUNKS_SIZE + ep["meta/episodes/file_index"] + 1
        )
        for key in meta.video_keys:
            referenced.add(
                root
                / VIDEO_PATH.format(
                    video_key=key,
                    chunk_index=ep[f"videos/{key}/chunk_index"],
                    file_index=ep[f"videos/{key}/file_index"],
                )
            )
    for folder, pattern in (("data", "*.parquet"), ("videos", "*.mp4")):
        for path in sorted((root / folder).rglob(pattern)) if (root / folder).exists() else []:
            if path not in referenced:
                path.unlink()
    episode_stats = [
        {key: {name: np.asarray(ep[f"stats/{key}/{name}"]) for name in STAT_NAMES} for key in meta.stats_keys}
        for ep in meta.episodes
    ]
    info = dict(meta.info)
    total_frames = sum(ep["length"] for ep in meta.episodes)
    stats = {}
    if episode_stats:
        stats = {key: aggregate_stats([s[key] for s in episode_stats]) for key in meta.stats_keys}
        write_json(root / "meta" / "stats.json", stats_to_json(stats), indent=None)
    info.update(
        total_episodes=len(meta.episodes),
        total_frames=total_frames,
        total_tasks=len(meta.tasks),
        splits={"train": f"0:{len(meta.episodes)}"},
    )
    write_json(root / "meta" / "info.json", info)
    return {
        "meta": meta,
        "info": info,
        "tasks": meta.tasks,
        "subtasks": meta.subtasks,
        "stats": stats,
        "total_episodes": len(meta.episodes),
        "total_frames": total_frames,
        "next_file": next_file,
    }


def _feature_differences(stored: dict, expected: dict) -> list[str]:
    """What differs between a dataset's features and a recording's, one phrase per key."""
    differences = [f"{key!r} only in the dataset" for key in sorted(set(stored) - set(expected))]
    differences += [f"{key!r} only in the recording" for key in sorted(set(expected) - set(stored))]
    for key in sorted(set(stored) & set(expected)):
        have, want = stored[key], expected[key]
        if have.get("dtype") != want["dtype"] or list(have.get("shape", ())) != list(want["shape"]):
            differences.append(
                f"{key!r} is {have.get('dtype')} {list(have.get('shape', ()))} in the dataset, "
                f"{want['dtype']} {list(want['shape'])} in the recording"
            )
        elif have.get(FIELD_SHAPE_KEY) != want.get(FIELD_SHAPE_KEY):  # both stored as shape [1]
            shapes = ["(1,)" if entry.get(FIELD_SHAPE_KEY) == [1] else "()" for entry in (have, want)]
            if shapes[0] == "()":  # a (1,) field recorded before such fields were marked reads as ()
                shapes[0] = "() (or (1,), recorded before simstream marked such fields: record anew)"
            differences.append(
                f"{key!r} is a field of shape {shapes[0]} in the dataset, {shapes[1]} in the recording"
            )
    return differences
