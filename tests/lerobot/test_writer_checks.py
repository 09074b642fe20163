"""What ``DatasetWriter`` refuses before writing anything, and flushes that failed before or after their
commit point."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from simstream.lerobot import LeRobotSpec
from simstream.lerobot import writer as writer_module
from simstream.lerobot.dataset import read_dataset_meta
from simstream.lerobot.format import features_from_fields
from simstream.lerobot.names import KeyMap
from simstream.lerobot.writer import DatasetWriter

from .sources import PatternSpec, pattern_record

pytestmark = pytest.mark.timeout(120)


def _writer(root) -> DatasetWriter:
    features = features_from_fields(PatternSpec(image_size=32).fields(), KeyMap(), video=True)
    return DatasetWriter(root, features, 20, video_codec="h264")


def _with_frames(record, **frames):
    return dataclasses.replace(record, frames={**record.frames, **frames})


def test_add_refuses_frames_that_do_not_make_one_episode_naming_the_field(tmp_path):
    record = pattern_record(0)  # 12 frames
    cases = [
        (  # a camera short of frames was committed with the next episode's pixels in its last frames
            _with_frames(record, **{"obs/image": record.frames["obs/image"][:10]}),
            "EpisodeRecord.frames['obs/image'] must have shape (12, 3, 32, 32) (the episode's 12 frames of "
            "the dataset's 'observation.image'), got (10, 3, 32, 32)",
        ),
        (
            _with_frames(record, actions=np.zeros((12, 3), np.float32)),
            "EpisodeRecord.frames['actions'] must have shape (12, 2)",
        ),
        (
            _with_frames(record, rewards=np.zeros((11,), np.float32)),
            "EpisodeRecord.frames['rewards'] must have shape (12,)",
        ),
        (  # it failed the whole flush with NumPy's reshape error, dropping the group's other episodes
            _with_frames(record, **{name: frames[:0] for name, frames in record.frames.items()}),
            "EpisodeRecord.frames must hold at least one frame, got an episode of 0 frames",
        ),
        (
            dataclasses.replace(record, subtasks=record.subtasks[:-1]),
            "EpisodeRecord.subtasks must hold one value per frame (12) or none, got 11",
        ),
        (
            dataclasses.replace(record, segment_id=record.segment_id[:5]),
            "EpisodeRecord.segment_id must hold one value per frame (12) or none, got 5",
        ),
    ]
    with _writer(tmp_path / "ds") as writer:
        for bad, message in cases:
            with pytest.raises(ValueError, match=re.escape(message)):
                writer.add(bad)
        assert writer.pending == 0
        writer.add(record)
        assert writer.flush() == 1
    assert [e["length"] for e in read_dataset_meta(tmp_path / "ds").episodes] == [12]


def test_an_episodes_file_renamed_into_place_whose_folder_sync_failed_counts_as_committed(
    tmp_path, monkeypatch
):
    """The rename is the commit point: when the folder's fsync after it failed, the group was on disk but
    kept queued as uncommitted, and a retry would have written its episodes a second time."""
    from simstream.lerobot import format as format_module

    root = tmp_path / "ds"
    writer = _writer(root)
    writer.add(pattern_record(0))
    writer.flush()
    real = format_module.fsync_dir

    def failing_sync(folder):
        if folder.parent.name == "episodes":
            raise OSError(5, "Input/output error")
        return real(folder)

    monkeypatch.setattr(format_module, "fsync_dir", failing_sync)
    writer.add(pattern_record(1))
    with pytest.raises(OSError, match="Input/output error"):
        writer.flush()
    monkeypatch.undo()
    with pytest.raises(
        RuntimeError, match=re.escape("an earlier flush failed after committing its episodes (OSError: ")
    ):
        writer.flush()
    writer.close()
    with _writer(root) as reopened:  # the committed group is the dataset's, once
        assert reopened.episodes_flushed == 2
    assert [e["episode_index"] for e in read_dataset_meta(root).episodes] == [0, 1]


def test_a_flush_that_failed_after_its_commit_point_refuses_the_next_and_reopening_repairs(
    tmp_path, monkeypatch
):
    """info.json failed (a full disk) after the group's episodes were committed: the counts did not move,
    and the next flush wrote episode indices again, which no reader, append or repair could open."""
    root = tmp_path / "ds"
    writer = _writer(root)
    writer.add(pattern_record(0))
    writer.flush()
    real = writer_module.write_json

    def full_disk(path, value, **kwargs):
        if path.name == "info.json":
            raise OSError(28, "No space left on device")
        return real(path, value, **kwargs)

    monkeypatch.setattr(writer_module, "write_json", full_disk)
    writer.add(pattern_record(1))
    with pytest.raises(OSError, match="No space left on device"):
        writer.flush()
    monkeypatch.undo()
    writer.add(pattern_record(2))
    with pytest.raises(
        RuntimeError, match=re.escape("an earlier flush failed after committing its episodes (OSError: ")
    ):
        writer.flush()
    writer.close()
    with _writer(root) as reopened:  # repairs info.json from the committed episodes
        assert reopened.episodes_flushed == 2
        reopened.add(pattern_record(3))
        reopened.flush()
    meta = read_dataset_meta(root)
    assert [e["episode_index"] for e in meta.episodes] == [0, 1, 2] and meta.info["total_episodes"] == 3
    source = LeRobotSpec(root).build(0, 0)
    try:
        tags = [int(source.reader.read(e).frames["obs/state"][0, 0]) for e in range(3)]
    finally:
        source.close()
    assert tags == [0, 1, 3]


def test_a_flush_that_failed_before_its_commit_point_keeps_its_group_for_the_next(tmp_path, monkeypatch):
    """A full disk while the group's data file was written dropped the group: its episodes were gone,
    though nothing of them was committed. They stay queued, and the next flush writes them."""
    root = tmp_path / "ds"
    writer = _writer(root)
    writer.add(pattern_record(0))
    writer.flush()
    write_parquet = writer_module.write_parquet

    def full_disk(path, table):
        if path.parent.parent.name == "data":
            raise OSError(28, "No space left on device")
        return write_parquet(path, table)

    monkeypatch.setattr(writer_module, "write_parquet", full_disk)
    writer.add(pattern_record(1))
    writer.add(pattern_record(2))
    with pytest.raises(OSError, match="No space left on device"):
        writer.flush()
    assert writer.pending == 2 and writer.episodes_flushed == 1
    monkeypatch.undo()
    writer.add(pattern_record(3))
    assert writer.flush() == 3
    writer.close()
    meta = read_dataset_meta(root)
    assert [e["episode_index"] for e in meta.episodes] == [0, 1, 2, 3] and meta.info["total_episodes"] == 4
    source = LeRobotSpec(root).build(0, 0)
    try:
        tags = [int(source.reader.read(e).frames["obs/state"][0, 0]) for e in range(4)]
    finally:
        source.close()
    assert tags == [0, 1, 2, 3]
