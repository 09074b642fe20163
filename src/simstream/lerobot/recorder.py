"""``LeRobotRecorder``: copy every episode the producers publish into a LeRobot v3.0 dataset.

The recorder is a thread in the process that owns the engine. It reads published rows the way a sampler
does (note the row's even seqlock version, copy, check the version again) but never inside
``sample_batch``: every tenth of a second, or at once when a producer waits for a row (the doorbell of
the engine's :class:`~simstream.buffer.gate.RecordGate`), it looks in the eligibility index for rows whose
published episode id is newer than what it recorded, copies them, and marks them recorded in the gate.
A producer that wants to overwrite a row it has not recorded yet waits (``on_full="wait"``, the default)
or overwrites it and counts it as skipped (``on_full="skip"``); nothing is dropped silently.

Copying and writing are two threads: the copy thread hands groups of episodes to a writer thread, which
encodes, writes and fsyncs them. A group's fsyncs take tens of milliseconds of waiting on the disk, and a
producer waiting for its rows to be copied must not wait for them; at most ``_GROUPS_IN_FLIGHT`` groups
wait for the writer, after which the copy thread (and so, in ``"wait"`` mode, the producers) waits too.
Encoding and file writes (pyarrow, PyAV) release the GIL, so the threads cost the trainer little
(``BENCHMARKS.md``). The writer thread runs ``writer_niceness`` steps below the process's CPU priority
(Linux, where a nice value is per thread): producers and the trainer keep their cores, and the writer
works in their gaps. Nice 10 still gives it a tenth of a contended core, more than it needs, so it never
falls behind for want of CPU; on 2 vCPUs, recording a camera at full production speed went from 0.945 to
0.968 of the producers' rate without recording, measured in the same run (``BENCHMARKS.md``, run 27).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._validation import require, require_int, require_number
from .format import features_from_fields
from .names import KeyMap
from .writer import DatasetWriter, EpisodeRecord

__all__ = ["LeRobotRecorder"]

logger = logging.getLogger(__name__)

_open_recorders: weakref.WeakSet = weakref.WeakSet()
"""Recorders this process started and has not closed yet."""


@atexit.register
def _close_recorders_at_exit() -> None:
    """A script that ends (or crashes) without ``close()``: its recorder threads are daemons, so the
    episodes copied but not yet flushed would be lost without a word. Stop the recorder's engine first (as
    its own exit hook would: every episode it published is then copied), then close the recorder."""
    for recorder in list(_open_recorders):
        if recorder._pid != os.getpid():
            continue  # a forked child's copy: the parent owns the threads and the dataset
        engine = recorder.engine
        if engine._is_owner() and engine._supervisor is not None:  # this process's, and not stopped yet
            _at_exit("stopping OnlineDataEngine", engine.stop)
        _at_exit(f"closing LeRobotRecorder of {recorder.root}", recorder.close)


def _at_exit(what: str, step: Callable[[], None]) -> None:
    """Run ``step``; a failure is printed (the script's own traceback, if any, is printed already)."""
    try:
        step()
    except BaseException as error:
        print(f"simstream: {what} at exit failed: {type(error).__name__}: {error}", file=sys.stderr)


_POLL_S = 0.01
"""Slice of the copy thread's waits for the writer thread's queue."""
_IDLE_WAIT_S = 0.1
"""Sleep of the copy thread between looks at the index. A producer that must wait for a row wakes it
sooner (the record gate's doorbell), as ``close()`` does; a wake-up per publication instead cost the
producers more CPU than the copies themselves (``BENCHMARKS.md``). It also bounds how late the thread
notices a failed engine or a due flush."""
_GROUPS_IN_FLIGHT = 2
"""Groups copied but not yet written that the copy thread may run ahead of the writer thread."""
_DONE = None
"""Ends the writer thread's queue."""
_METADATA = ("task_index", "subtask_index", "segment_id", "segment_accepted", "terminated", "truncated")


class LeRobotRecorder:
    """Record the episodes an engine publishes into the dataset at ``root`` (created, or appended to).

    Owns a :class:`~simstream.lerobot.writer.DatasetWriter` and its thread. Episodes are written in
    groups of ``flush_every`` (or whatever is pending after ``flush_interval_s``) as closed files;
    :attr:`episodes_flushed` counts what is on disk and survives a SIGKILL.

    Args:
        engine: An ``OnlineDataEngine`` (created; start the recorder before ``engine.start()`` to record
            the first generation too).
        root: Dataset folder.
        fps: Frames per second; default the source spec's ``fps`` (the built-in tasks: 20).
        video: Cameras (uint8 ``[3, H, W]`` fields) as video (default) or PNG images.
        video_codec: ``"av1"`` (LeRobot's default) or ``"h264"`` (a fifth or less of the encoding CPU;
            on small frames about the same bytes); an appended dataset keeps its own.
        key_map: ``{lerobot_key: field_name}`` overrides of the naming rule.
        max_episodes: Stop recording after this many (then producers run freely).
        only_success: Record only episodes that did not end truncated (cut at the source's step limit); the
            others are counted in :attr:`episodes_filtered`. Every recorded episode has ``success=True``:
            the engine publishes only the episodes its source accepted.
        on_full: ``"wait"``: producers wait for the recorder; ``"skip"``: they overwrite and count.
        flush_every: Episodes per group of files. Each group costs a fixed ~18 ms of CPU (two parquet
            files, the JSON metadata) and adds files to the dataset, so groups are large by default;
            ``flush_interval_s`` bounds how much a SIGKILL can lose when episodes arrive slowly or fast.
        flush_interval_s: Flush what is pending at least this often, in seconds (0, 3600].
        robot_type: ``robot_type`` of ``meta/info.json``.
        writer_niceness: How many nice steps [0, 19] below this process the writer thread (encoding,
            parquet, fsync) runs, so that simulation and training keep the CPU and it writes in their
            gaps; 0 keeps the process's priority. Linux only (elsewhere a nice value is per process,
            and the recorder leaves it alone).

    Examples:
        >>> engine = OnlineDataEngine(cfg)  # doctest: +SKIP
        >>> with LeRobotRecorder(engine, "datasets/run1") as recorder, engine:  # doctest: +SKIP
        ...     engine.sample_batch(32, 16)
    """

    def __init__(
        self,
        engine: Any,
        root: Path | str,
        *,
        fps: int | None = None,
        video: bool = True,
        video_codec: str = "av1",
        key_map: dict[str, str] | None = None,
        max_episodes: int | None = None,
        only_success: bool = False,
        on_full: str = "wait",
        flush_every: int = 32,
        flush_interval_s: float = 2.0,
        robot_type: str | None = None,
        writer_niceness: int = 10,
    ) -> None:
        if not engine._is_owner():
            # a producer waiting on the recorder notices the owner's death, not another process's
            raise RuntimeError(
                f"LeRobotRecorder: only the engine's owner process ({engine._owner_pid}) may record; this "
                f"is process {os.getpid()}, where the engine was pickled or forked into"
            )
        spec = engine.cfg.source
        fps = getattr(spec, "fps", None) if fps is None else fps
        if fps is None:
            name = type(spec).__name__
            why = (
                "has no fps attribute"
                if not hasattr(spec, "fps")
                else "gives fps=None (a MixSpec does when its sources' rates differ)"
            )
            raise ValueError(f"LeRobotRecorder.fps: the source spec {name} {why}; pass fps=")
        if type(fps) is not int or fps < 1:
            raise ValueError(f"LeRobotRecorder.fps must be an int >= 1, got {fps!r}")
        if on_full not in ("wait", "skip"):
            raise ValueError(f"LeRobotRecorder.on_full must be 'wait' or 'skip', got {on_full!r}")
        if max_episodes is not None and (type(max_episodes) is not int or max_episodes < 1):
            raise ValueError(
                f"LeRobotRecorder.max_episodes must be an int >= 1 or None, got {max_episodes!r}"
            )
        if type(flush_every) is not int or flush_every < 1:
            raise ValueError(f"LeRobotRecorder.flush_every must be an int >= 1, got {flush_every!r}")
        require_number("LeRobotRecorder", "flush_interval_s", flush_interval_s, 0, 3600, low_open=True)
        require_int("LeRobotRecorder", "writer_niceness", writer_niceness, 0, 19)
        for name, value in (("video", video), ("only_success", only_success)):  # "no" was true
            require(type(value) is bool, "LeRobotRecorder", name, "True or False", value)
        require(
            robot_type is None or (isinstance(robot_type, str) and robot_type.strip() != ""),
            "LeRobotRecorder", "robot_type", "None or a nonempty string", robot_type,
        )  # fmt: skip
        self.engine = engine
        self._shared = engine._shared
        self.features = features_from_fields(dict(spec.fields()), KeyMap(key_map), video)
        self.writer = DatasetWriter(root, self.features, fps, robot_type, video_codec)
        self.root = self.writer.root
        self.max_episodes = max_episodes
        self.only_success = only_success
        self.on_full = on_full
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.writer_niceness = writer_niceness
        self.episodes_recorded = 0
        """Episodes copied out of the buffer (flushed or pending)."""
        self.episodes_filtered = 0
        """Episodes left out by ``only_success``."""
        self.episodes_empty = 0
        """Published episodes of 0 frames (a source may report them): nothing to record, never written."""
        self._base = self.writer.episodes_flushed
        self._skipped_base = self._shared.record_gate.total_skipped()
        self._waited_base = self._shared.record_gate.total_waited_s()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writer_thread: threading.Thread | None = None
        self._groups: queue.Queue = queue.Queue(maxsize=_GROUPS_IN_FLIGHT)
        self._group: list[EpisodeRecord] = []
        """Copied episodes not yet handed to the writer thread (the copy thread's)."""
        self._error: BaseException | None = None
        self._stopped = False
        self._flushed = threading.Condition()
        self._row_views: _RowViews | None = None
        self._texts: dict[tuple[str, int], str] = {}
        self._attached = False
        """This recorder attached the engine's record gate and has not detached it yet."""
        self._closed = False

    # -- public ---------------------------------------------------------------------------------------
    @property
    def episodes_flushed(self) -> int:
        """Episodes of this recording committed to disk (they survive a SIGKILL)."""
        return self.writer.episodes_flushed - self._base

    @property
    def episodes_skipped(self) -> int:
        """Published episodes producers overwrote before this recorder copied them (``on_full="skip"``)."""
        return self._shared.record_gate.total_skipped() - self._skipped_base

    @property
    def producer_wait_s(self) -> float:
        """Seconds producers waited for this recorder to copy an episode before overwriting its row
        (``on_full="wait"``), summed over producers: what recording cost the stream beyond CPU."""
        return self._shared.record_gate.total_waited_s() - self._waited_base

    @property
    def bytes_written(self) -> int:
        return self.writer.bytes_written

    @property
    def done(self) -> bool:
        """``max_episodes`` recorded."""
        return self.max_episodes is not None and self.episodes_recorded >= self.max_episodes

    def wait_flushed(self, count: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until ``count`` episodes of this recording are flushed (or it failed)."""
        with self._flushed:
            return self._flushed.wait_for(
                lambda: self.episodes_flushed >= count or self._error is not None or self._stopped, timeout_s
            )

    def start(self) -> LeRobotRecorder:
        """Attach to the engine's record gate and start copying."""
        if self._thread is not None or self._closed:
            raise RuntimeError("LeRobotRecorder.start() was already called")
        if self._shared.record_gate.attached:
            raise RuntimeError(
                "LeRobotRecorder.start(): another recorder is attached to this engine; one recorder per "
                "engine at a time (close the other first)"
            )
        self._skipped_base = self._shared.record_gate.total_skipped()  # an earlier recorder's skips
        self._waited_base = self._shared.record_gate.total_waited_s()
        self._shared.record_gate.attach(self.on_full)
        self._attached = True
        self._pid = os.getpid()
        _open_recorders.add(self)
        self._writer_thread = threading.Thread(target=self._write, name="lerobot-writer", daemon=True)
        self._writer_thread.start()
        self._thread = threading.Thread(target=self._run, name="lerobot-recorder", daemon=True)
        self._thread.start()
        return self

    def check(self) -> None:
        """Raise the recorder thread's failure, if any."""
        if self._error is not None:
            raise self._error

    def close(self, timeout_s: float = 120.0) -> None:
        """Copy what is published, flush it, detach; raises the thread's failure if there was one.

        Producers stop waiting for the recorder from here on. Raises ``TimeoutError`` when the thread does
        not finish within ``timeout_s`` (it keeps running as a daemon; what it flushed stays valid).
        """
        _open_recorders.discard(self)  # closed, or tried once: the exit hook does not wait for it again
        if self._thread is not None:
            deadline = time.monotonic() + timeout_s
            self._stop.set()
            self._shared.record_gate.wake()
            for thread in (self._thread, self._writer_thread):
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    raise TimeoutError(
                        f"LeRobotRecorder.close: the recorder thread {thread.name!r} did not finish in "
                        f"{timeout_s} s"
                    )
        self._detach()
        self._closed = True
        self.writer.close()
        self.check()

    def __enter__(self) -> LeRobotRecorder:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        """The copy thread: copy published rows, hand groups to the writer thread, end its queue."""
        try:
            last_handoff = time.monotonic()
            while True:
                # both read before the scan: a final pass sees everything published before the stop or
                # the engine's failure (read after an empty scan, the failure could follow a publication
                # that scan missed, and that episode would never be copied)
                stopping = self._stop.is_set()
                failed = self._shared.channel.is_set()
                copied = 0 if self.done else self._copy_published()
                if self.done:
                    self._detach()  # producers run freely past the requested count
                pending = len(self._group)
                due = time.monotonic() - last_handoff >= self.flush_interval_s
                if pending >= self.flush_every or (pending and (stopping or self.done or due)):
                    self._hand_off()
                    last_handoff = time.monotonic()
                if stopping or self._error is not None:
                    return
                if not copied:
                    if failed:  # the engine failed, and nothing more was published: keep what was copied
                        self._hand_off()
                        return
                    self._shared.record_gate.wait_for_demand(_IDLE_WAIT_S)
        except BaseException as error:  # surfaced by check() / close()
            self._fail(error)
        finally:
            self._detach()  # no producer may wait on a recorder that is gone
            self._put(_DONE)

    def _detach(self) -> None:
        """Stop gating the engine's claims, if this recorder is the one that started it (after it detached,
        another recorder may have attached)."""
        if self._attached:
            self._attached = False
            self._shared.record_gate.detach()

    def _hand_off(self) -> None:
        if self._group:
            group, self._group = self._group, []
            self._put(group)

    def _put(self, item: list[EpisodeRecord] | None) -> None:
        """Queue ``item`` for the writer thread, waiting while it is ``_GROUPS_IN_FLIGHT`` groups behind
        (and giving up once it has stopped: a failed writer drains nothing)."""
        while True:
            try:
                self._groups.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                if self._writer_thread is None or not self._writer_thread.is_alive():
                    return

    def _write(self) -> None:
        """The writer thread: write each group as closed files, in order, until the queue ends."""
        try:
            # imported before the priority drops: pyarrow's import starts its allocator's background
            # thread, which serves the whole process and would inherit this thread's nice value
            import av  # noqa: F401
            import pyarrow  # noqa: F401

            _lower_this_thread_priority(self.writer_niceness)
            while True:
                group = self._groups.get()
                if group is _DONE:
                    return
                for episode in group:
                    self.writer.add(episode)
                self.writer.flush()
                with self._flushed:
                    self._flushed.notify_all()
        except BaseException as error:
            self._fail(error)
        finally:
            with self._flushed:
                self._stopped = True
                self._flushed.notify_all()

    def _fail(self, error: BaseException) -> None:
        # detached first: whoever sees the failure (wait_flushed returns on it) finds producers free
        self._detach()  # producers must not wait on a recorder that failed
        if self._error is None:
            self._error = error
            logger.exception("LeRobot recorder failed", exc_info=error)
        with self._flushed:
            self._flushed.notify_all()

    def _views(self) -> _RowViews:
        """NumPy views of what the copy thread reads, built once: a tensor read or ``numpy()`` call costs
        microseconds, and the thread looks at the index at least ten times a second."""
        if self._row_views is None:
            self._row_views = _RowViews.of(self._shared, self.features)
        return self._row_views

    def _copy_published(self) -> int:
        views = self._views()
        ids = views.episode_id
        pending = np.flatnonzero((ids >= 0) & (ids > views.recorded))
        if not len(pending):
            return 0
        copied = 0
        for row in pending[np.argsort(ids[pending], kind="stable")]:
            if self.done:
                break
            record = self._copy_row(views, int(row))
            if record is None:
                continue
            _, episode = record
            copied += 1
            if episode is None:  # no frame: nothing a LeRobot episode could hold
                self.episodes_empty += 1
                continue
            if self.only_success and episode.truncated:
                self.episodes_filtered += 1
                continue
            self._group.append(episode)
            self.episodes_recorded += 1
        return copied

    def _copy_row(self, views: _RowViews, row: int) -> tuple[int, EpisodeRecord | None] | None:
        """Copy one published row under its seqlock and mark it recorded; ``None`` when it changed meanwhile
        or a claim counted it as skipped (skip mode); the episode is ``None`` when it has no frame (it still
        counts as copied: its row may be claimed)."""
        version = int(views.version[row])
        episode_id = int(views.episode_id[row])
        if version & 1 or episode_id < 0:
            return None
        length = int(views.valid_frames[row])
        frames = {name: array[row, :length].copy() for name, array in views.payload.items()}
        meta = {name: array[row, :length].copy() for name, array in views.metadata.items()}

        def unchanged() -> bool:
            return int(views.version[row]) == version and int(views.episode_id[row]) == episode_id

        if not self._shared.record_gate.settle(row, episode_id, unchanged, self._shared.raise_if_failed):
            return None
        if not length:
            return episode_id, None
        task = self._text(int(meta["task_index"][0]), "task")
        subtask_ids = meta["subtask_index"]
        texts = {int(i): self._text(int(i), "subtask") for i in np.unique(subtask_ids)}
        segment_id = meta["segment_id"]
        count = int(segment_id.max()) + 1
        accepted = [True] * count
        for k in range(count):
            hits = np.flatnonzero(segment_id == k)
            if len(hits):
                accepted[k] = bool(meta["segment_accepted"][hits[0]])
        truncated = bool(meta["truncated"][-1])
        episode = EpisodeRecord(
            frames=frames,
            task=task,
            subtasks=[texts[i] for i in subtask_ids.tolist()],
            segment_id=segment_id,
            segment_accepted=accepted,
            success=True,  # the engine publishes only the episodes its source accepted
            terminated=bool(meta["terminated"][-1]),
            truncated=truncated,
        )
        return episode_id, episode

    def _text(self, index: int, kind: str) -> str:
        """The language text of ``index`` (cached: an index names the same text for the engine's life)."""
        known = self._texts.get((kind, index))
        if known is None:
            import torch

            known = self._texts[(kind, index)] = self._shared.language.resolve(torch.tensor(index), kind=kind)
        return known


def _lower_this_thread_priority(steps: int) -> None:
    """Raise the calling thread's nice value by ``steps`` (at most to 19). Only on Linux, where a thread's
    nice value is its own: elsewhere ``setpriority`` would lower the whole process."""
    if not steps or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        niceness = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, niceness + steps))
    except OSError as error:  # a sandbox may forbid it: the writer then runs at the process's priority
        logger.debug("LeRobot writer thread keeps its priority: %s", error)


@dataclass(frozen=True)
class _RowViews:
    """NumPy views of the shared index, record gate, payload fields and metadata the copy thread reads
    (``[buffer_size]`` for the index and gate, ``[buffer_size, T, ...]`` for frames)."""

    version: np.ndarray
    episode_id: np.ndarray
    valid_frames: np.ndarray
    recorded: np.ndarray
    payload: dict[str, np.ndarray]
    metadata: dict[str, np.ndarray]

    @classmethod
    def of(cls, shared: Any, features: list[Any]) -> _RowViews:
        storage, index = shared.storage, shared.index
        rows = storage.rows_view(payload_only=True)
        return cls(
            version=index.version.numpy(),
            episode_id=index.episode_id.numpy(),
            valid_frames=index.valid_frames.numpy(),
            recorded=shared.record_gate.recorded.numpy(),
            payload={f.field: rows[tuple(f.field.split("/"))].numpy() for f in features},
            metadata={name: storage.metadata_array(name) for name in _METADATA},
        )
