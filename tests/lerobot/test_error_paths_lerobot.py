"""Error paths of ``LeRobotSpec``'s arguments and of a damaged ``meta/tasks.parquet`` (on a copy of the
fixture): each names the field or the file and what is wrong with it."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from simstream.lerobot import LeRobotFormatError, LeRobotSpec

from .test_names_and_fixture import FIXTURE

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------ LeRobotSpec
@pytest.mark.parametrize("num_envs", [0, -1, 1.0, True, "2", None])
def test_num_envs_must_be_a_positive_int(num_envs):
    with pytest.raises(
        ValueError, match=re.escape(f"LeRobotSpec.num_envs must be an int >= 1, got {num_envs!r}")
    ):
        LeRobotSpec(FIXTURE, num_envs=num_envs)


def test_num_envs_is_checked_before_the_dataset_is_read(tmp_path):
    with pytest.raises(ValueError, match=re.escape("LeRobotSpec.num_envs must be an int >= 1, got 0")):
        LeRobotSpec(tmp_path / "nope", num_envs=0)


@pytest.mark.parametrize("steps", [0, -5, 2.5, 10.0, True, "17"])
def test_max_episode_steps_must_be_a_positive_int_or_none(steps):
    with pytest.raises(
        ValueError,
        match=re.escape(f"LeRobotSpec.max_episode_steps must be an int >= 1 or None, got {steps!r}"),
    ):
        LeRobotSpec(FIXTURE, max_episode_steps=steps)


@pytest.mark.parametrize(
    ("key_map", "shown"),
    [
        ({"": "obs/x"}, "'': 'obs/x'"),
        ({"action": ""}, "'action': ''"),
        ({"action": 3}, "'action': 3"),
        ({3: "obs/x"}, "3: 'obs/x'"),
        ({"action": None}, "'action': None"),
    ],
    ids=["empty-key", "empty-name", "int-name", "int-key", "None-name"],
)
def test_key_map_entries_must_map_a_key_to_a_field_name(key_map, shown):
    with pytest.raises(
        ValueError,
        match=re.escape(f"key_map entries must map a LeRobot key to a field name, got {shown}"),
    ):
        LeRobotSpec(FIXTURE, key_map=key_map)


def test_key_map_must_map_each_field_name_once():
    key_map = {"action": "obs/x", "observation.state": "obs/x"}
    with pytest.raises(ValueError, match=re.escape("key_map must map each field name once, got {")):
        LeRobotSpec(FIXTURE, key_map=key_map)


@pytest.mark.parametrize("subset", [("obs/state", 3), (None,)], ids=["int", "None"])
def test_fields_subset_must_hold_field_names(subset):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"LeRobotSpec.fields_subset must be a non-empty list of field names or None, got {subset!r}"
        ),
    ):
        LeRobotSpec(FIXTURE, fields_subset=subset)


def test_a_dataset_without_episodes_is_refused(fixture_copy):
    shutil.rmtree(fixture_copy / "meta" / "episodes")
    with pytest.raises(ValueError, match=re.escape(f"LeRobotSpec.root: {fixture_copy} holds no episode")):
        LeRobotSpec(fixture_copy)


def test_a_dataset_without_a_payload_feature_is_refused(fixture_copy):
    info_path = fixture_copy / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    bookkeeping = ("timestamp", "frame_index", "episode_index", "index", "task_index")
    info["features"] = {key: spec for key, spec in info["features"].items() if key in bookkeeping}
    info_path.write_text(json.dumps(info))
    with pytest.raises(
        ValueError, match=re.escape(f"LeRobotSpec.root: {fixture_copy} holds no feature a replay can stream")
    ):
        LeRobotSpec(fixture_copy)


# ------------------------------------------------------------------------------ meta/tasks.parquet
def test_truncated_tasks_file(fixture_copy):
    path = fixture_copy / "meta" / "tasks.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        LeRobotFormatError, match=re.escape(f"{path}: not a readable parquet file (truncated or damaged?)")
    ):
        LeRobotSpec(fixture_copy)


def test_empty_tasks_file(fixture_copy):
    path = fixture_copy / "meta" / "tasks.parquet"
    path.write_bytes(b"")
    with pytest.raises(
        LeRobotFormatError, match=re.escape(f"{path}: not a readable parquet file (truncated or damaged?)")
    ):
        LeRobotSpec(fixture_copy)


def test_missing_tasks_file(fixture_copy):
    path = fixture_copy / "meta" / "tasks.parquet"
    path.unlink()
    with pytest.raises(
        LeRobotFormatError, match=re.escape(f"{path}: missing (the dataset's metadata refers to it)")
    ):
        LeRobotSpec(fixture_copy)


@pytest.mark.parametrize(
    ("columns", "names"),
    [
        ({"index": [0], "task": ["a"]}, "['index', 'task']"),
        ({"task_index": [0], "text": ["a"]}, "['task_index', 'text']"),
        ({"task": ["a"]}, "['task']"),
    ],
    ids=["no-index", "no-text", "text-only"],
)
def test_tasks_file_without_its_columns_names_them(fixture_copy, columns, names):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = fixture_copy / "meta" / "tasks.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(
        LeRobotFormatError,
        match=re.escape(f"{path}: needs columns 'task_index' and 'task', has {names}"),
    ):
        LeRobotSpec(fixture_copy)
