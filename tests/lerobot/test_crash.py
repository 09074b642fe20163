"""SIGKILL a real recording process at many points; the dataset then opens with every episode the
recorder reported flushed, and appending repairs it to the last complete episode."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from simstream.lerobot.dataset import EpisodeReader, payload_features, read_dataset_meta
from simstream.lerobot.format import features_from_fields
from simstream.lerobot.names import KeyMap
from simstream.lerobot.writer import DatasetWriter

from . import crash_child
from .sources import PatternSpec, pattern_record

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _start(mode: str, root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.lerobot.crash_child", mode, str(root), "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _reported(lines: list[str]) -> int:
    counts = [int(line.split()[1]) for line in lines if line.startswith("flushed ")]
    return max(counts, default=0)


def _check_opens_with(root: Path, reported: int) -> int:
    """Our reader and LeRobot's view (info.json totals, referenced files) both hold >= ``reported``."""
    meta = read_dataset_meta(root)
    assert len(meta.episodes) >= reported
    info = json.loads((root / "meta" / "info.json").read_text())
    # LeRobot counts episodes and frames from info.json and reads the files the episodes reference
    assert reported <= info["total_episodes"] <= len(meta.episodes)
    assert info["total_frames"] == sum(e["length"] for e in meta.episodes[: info["total_episodes"]])
    reader = EpisodeReader(meta, payload_features(meta, KeyMap())[0])
    try:
        for e, ep in enumerate(meta.episodes):
            read = reader.read(e)
            tag = int(read.frames["obs/state"][0, 0])
            want = pattern_record(tag)
            np.testing.assert_array_equal(read.frames["obs/state"], want.frames["obs/state"])
            assert len(read.frames["obs/image"]) == ep["length"]
    finally:
        reader.close()
    return len(meta.episodes)


def _append_repairs(root: Path, committed: int) -> None:
    features = features_from_fields(PatternSpec(image_size=32).fields(), KeyMap(), video=True)
    writer = DatasetWriter(root, features, 20)
    assert writer.episodes_flushed == committed
    assert not list(root.rglob(".*.tmp"))
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["total_episodes"] == committed
    referenced = {p.name for p in (root / "meta" / "episodes").rglob("*.parquet")} if committed else set()
    assert {p.name for p in (root / "data").rglob("*.parquet")} == referenced
    writer.add(pattern_record(100))
    writer.flush()
    meta = read_dataset_meta(root)
    assert len(meta.episodes) == committed + 1 == meta.info["total_episodes"]
    reader = EpisodeReader(meta, payload_features(meta, KeyMap())[0])
    try:
        assert int(reader.read(committed).frames["obs/state"][0, 0]) == 100
    finally:
        reader.close()


# Commit points (each file: "written, not renamed", then "renamed"): creating the dataset commits info.json
# (1, 2); the first flush tasks (3, 4), subtasks (5, 6), the video (7, 8), the data file (9, 10), the
# episodes file, the commit point (11, 12), stats.json (13, 14) and info.json (15, 16); the second flush
# (no new task) the video (17, 18), data (19, 20), episodes (21, 22), stats (23, 24) and info (25, 26).
@pytest.mark.parametrize("kill_at", [2, 4, 6, 7, 10, 11, 12, 14, 15, 20, 22, 25])
def test_writer_killed_at_a_commit_point(tmp_path, kill_at):
    root = tmp_path / "ds"
    # a real process from the forkserver (torch and simstream preloaded: no import cost per kill point)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["tests.lerobot.crash_child", "simstream.lerobot.writer", "pyarrow.parquet", "av"]
    )
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=crash_child.run_writer, args=(str(root), kill_at, sender.send))
    child.start()
    sender.close()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL
    reports = []
    while receiver.poll():
        try:
            reports.append(receiver.recv())
        except EOFError:
            break
    reported = max(reports, default=0)
    if not (root / "meta" / "info.json").exists():
        assert reported == 0  # killed before the dataset existed
        return
    committed = _check_opens_with(root, reported)
    _append_repairs(root, committed)


@pytest.mark.parametrize("after_reports", [1, 4])
def test_recording_engine_process_killed_from_outside(tmp_path, after_reports):
    root = tmp_path / "ds"
    child = _start("engine", root)
    lines = []
    try:
        for line in child.stdout:
            lines.append(line.strip())
            if sum(1 for x in lines if x.startswith("flushed ") and x != "flushed 0") >= after_reports:
                child.send_signal(signal.SIGKILL)  # while it keeps recording
                break
    finally:
        child.kill()
        child.wait(timeout=30)  # its producer notices the owner's death (owner_watch) and exits
    reported = _reported(lines)
    assert reported >= 1
    committed = _check_opens_with(root, reported)
    _append_repairs(root, committed)


def test_new_folders_are_fsynced_into_their_parents(tmp_path, monkeypatch):
    """A file committed into a new chunk folder survives a power loss only if the folder's entry does."""
    from simstream.lerobot import format as lerobot_format

    synced = []
    monkeypatch.setattr(lerobot_format, "fsync_dir", lambda path: synced.append(path))
    lerobot_format.make_folders(tmp_path / "data" / "chunk-001")
    assert (tmp_path / "data" / "chunk-001").is_dir()
    assert synced == [tmp_path, tmp_path / "data"]
    lerobot_format.make_folders(tmp_path / "data" / "chunk-001")  # nothing new: nothing to sync
    assert synced == [tmp_path, tmp_path / "data"]
