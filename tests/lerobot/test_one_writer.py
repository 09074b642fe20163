"""One writer per dataset and one recorder per engine: a second one is refused before it changes anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.lerobot import LeRobotFormatError, LeRobotRecorder
from simstream.lerobot.format import features_from_fields
from simstream.lerobot.names import KeyMap
from simstream.lerobot.writer import DatasetInUseError, DatasetWriter, check_dataset_folder, repair

from .sources import PatternSpec, pattern_record

pytestmark = pytest.mark.timeout(120)

_FEATURES = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_writer_on_a_dataset_is_refused_while_the_first_is_open(tmp_path):
    root = tmp_path / "ds"
    with DatasetWriter(root, _FEATURES, 20) as first:
        first.add(pattern_record(0, image_size=None))
        first.flush()
        before = _files(root)
        with pytest.raises(
            DatasetInUseError, match=rf"{root}: another writer is recording into this dataset"
        ):
            DatasetWriter(root, _FEATURES, 20)
        with pytest.raises(DatasetInUseError, match="one writer per dataset at a time"):
            repair(root)  # would delete the first writer's group in progress
        assert _files(root) == before
        first.add(pattern_record(1, image_size=None))
        assert first.flush() == 1
    with DatasetWriter(root, _FEATURES, 20) as second:  # closed: the folder is free again
        assert second.episodes_flushed == 2
    with pytest.raises(RuntimeError, match=rf"DatasetWriter of {root} is closed"):
        second.flush()


def test_a_forked_child_that_closes_the_writer_leaves_the_parent_s_lock(tmp_path):
    root = tmp_path / "ds"
    with DatasetWriter(root, _FEATURES, 20) as writer:
        pid = os.fork()
        if pid == 0:  # a DataLoader worker or a producer forked from the recording process
            try:
                writer.close()
                del writer
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with pytest.raises(DatasetInUseError, match="one writer per dataset at a time"):
            DatasetWriter(root, _FEATURES, 20)
        writer.add(pattern_record(0, image_size=None))
        assert writer.flush() == 1
    with DatasetWriter(root, _FEATURES, 20) as reopened:
        assert reopened.episodes_flushed == 1


def test_a_new_dataset_folder_is_locked_too(tmp_path):
    root = tmp_path / "new"
    with DatasetWriter(root, _FEATURES, 20), pytest.raises(DatasetInUseError):
        DatasetWriter(root, _FEATURES, 20)


_HOLD = """
import sys
from simstream.lerobot.format import features_from_fields
from simstream.lerobot.names import KeyMap
from simstream.lerobot.writer import DatasetWriter
from tests.lerobot.sources import PatternSpec
writer = DatasetWriter(sys.argv[1], features_from_fields(PatternSpec().fields(), KeyMap(), video=True), 20)
if sys.argv[2:] == ["fork"]:  # a DataLoader worker forked by the recording process, outliving it
    import os

    running, running_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(running)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        os.write(running_w, b"x")  # its at-fork hooks have run (a child not yet scheduled holds the lock)
        sys.stdin.readline()  # until the test closes stdin
        os._exit(0)
    os.close(running_w)  # a child that died first reads as EOF, not as a wait for ever
    assert os.read(running, 1) == b"x"
    print("child", child, flush=True)
print("open", flush=True)
sys.stdin.readline()
"""


def test_a_writer_in_another_process_holds_the_folder_until_it_is_killed(tmp_path):
    root = tmp_path / "ds"
    repo = Path(__file__).resolve().parents[2]
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(DatasetInUseError):
            DatasetWriter(root, _FEATURES, 20)
    finally:
        holder.kill()  # no clean-up runs: the kernel drops the lock
        holder.wait(30)
        holder.stdin.close()
        holder.stdout.close()
    with DatasetWriter(root, _FEATURES, 20) as writer:
        assert writer.episodes_flushed == 0


def test_a_process_forked_by_a_killed_writer_does_not_keep_the_folder(tmp_path):
    """The forked child had a copy of the lock's descriptor, and a flock belongs to every copy: the folder
    stayed locked after the writer's SIGKILL until the child exited."""
    from tests.support.processes import wait_for_exit

    root = tmp_path / "ds"
    repo = Path(__file__).resolve().parents[2]
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(root), "fork"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    child = None
    try:
        line = holder.stdout.readline().split()
        assert line[0] == "child", line
        child = int(line[1])
        assert holder.stdout.readline().strip() == "open"
        holder.kill()
        holder.wait(30)
        os.kill(child, 0)  # alive, and with the descriptor it inherited
        with DatasetWriter(root, _FEATURES, 20) as writer:
            assert writer.episodes_flushed == 0
    finally:
        holder.kill()
        holder.wait(30)
        holder.stdin.close()  # the child's readline ends
        holder.stdout.close()
        if child is not None:
            wait_for_exit([child], 30, "the forked child")


def test_a_refused_append_changes_nothing(tmp_path):
    root = tmp_path / "ds"
    with DatasetWriter(root, _FEATURES, 20) as writer:
        writer.add(pattern_record(0, image_size=None))
        writer.flush()
    orphan = root / "data" / "chunk-000" / "file-009.parquet"  # what an interrupted group leaves
    orphan.write_bytes(b"an interrupted group")
    before = _files(root)
    with pytest.raises(ValueError, match=r"info.json: fps is 20, the recording's is 30"):
        DatasetWriter(root, _FEATURES, 30)
    other = features_from_fields(PatternSpec(image_size=16).fields(), KeyMap(), video=True)
    with pytest.raises(ValueError, match="the dataset's features do not match the recording's"):
        DatasetWriter(root, other, 20)
    assert _files(root) == before  # no repair ran
    with DatasetWriter(root, _FEATURES, 20):  # an accepted append repairs
        assert not orphan.exists()


def test_one_recorder_per_engine(tmp_path):
    engine = OnlineDataEngine(OnlineDataEngineCfg(source=PatternSpec(), buffer_size=2, num_workers=1))
    gate = engine._shared.record_gate
    first = LeRobotRecorder(engine, tmp_path / "a").start()
    idle = LeRobotRecorder(engine, tmp_path / "b")
    try:
        with pytest.raises(RuntimeError, match="another recorder is attached to this engine"):
            idle.start()
        idle.close()  # never started: it must not detach the first one
        assert gate.attached
    finally:
        first.close()
    assert not gate.attached
    with pytest.raises(RuntimeError, match=r"LeRobotRecorder.start\(\) was already called"):
        first.start()  # closed: its writer let the folder go
    LeRobotRecorder(engine, tmp_path / "a").start().close()  # the folder and the gate are free again


def test_repairing_a_folder_that_does_not_exist_names_it(tmp_path):
    with pytest.raises(LeRobotFormatError, match=f"{tmp_path / 'nope'}: no such dataset folder"):
        repair(tmp_path / "nope")


def test_a_dataset_killed_before_its_first_info_json_can_be_recorded_into(tmp_path):
    """What a writer killed while creating a dataset leaves (folders, a temporary file) was refused as
    "not a LeRobot dataset"; a folder with a file of its own still is."""
    root = tmp_path / "ds"
    (root / "meta").mkdir(parents=True)
    (root / "data" / "chunk-000").mkdir(parents=True)
    (root / "meta" / ".info.json.tmp").write_text("{")
    assert check_dataset_folder(root, "--out") is False
    with DatasetWriter(root, _FEATURES, 20) as writer:
        writer.add(pattern_record(0, image_size=None))
        writer.flush()
    assert check_dataset_folder(root, "--out") is True
    other = tmp_path / "notes"
    (other / "sub").mkdir(parents=True)
    (other / "sub" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"--out: {other} exists and is not a LeRobot dataset"):
        check_dataset_folder(other, "--out")
