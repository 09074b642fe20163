"""Bad input: each error names the file (or field) and what is wrong with it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from simstream import Field
from simstream.lerobot import LeRobotFormatError, LeRobotSpec
from simstream.lerobot.format import features_from_fields
from simstream.lerobot.names import KeyMap
from simstream.lerobot.writer import DatasetWriter

from .sources import PatternSpec, pattern_record
from .test_names_and_fixture import FIXTURE

pytestmark = pytest.mark.timeout(60)


def _read_all(root: Path, **kwargs) -> None:
    source = LeRobotSpec(root, **kwargs).build(0, 0)
    try:
        for e in range(len(source.meta.episodes)):
            source.reader.read(e)
    finally:
        source.close()


def test_no_folder(tmp_path):
    with pytest.raises(LeRobotFormatError, match=f"{tmp_path / 'nope'}: no such dataset folder"):
        LeRobotSpec(tmp_path / "nope")


def test_not_a_dataset(tmp_path):
    with pytest.raises(LeRobotFormatError, match=r"meta/info.json: missing, so .* is not a LeRobot dataset"):
        LeRobotSpec(tmp_path)


def test_not_v3(fixture_copy):
    info_path = fixture_copy / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "codebase_version": "v2.1"}))
    with pytest.raises(
        LeRobotFormatError, match=r"info.json: codebase_version is 'v2.1'; only LeRobot format 'v3.0'"
    ):
        LeRobotSpec(fixture_copy)


def test_info_not_json(fixture_copy):
    (fixture_copy / "meta" / "info.json").write_text("{")
    with pytest.raises(LeRobotFormatError, match=r"info.json: not valid JSON"):
        LeRobotSpec(fixture_copy)


def test_truncated_data_file(fixture_copy):
    path = fixture_copy / "data" / "chunk-000" / "file-000.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        LeRobotFormatError, match=rf"{path}: not a readable parquet file \(truncated or damaged\?\)"
    ):
        _read_all(fixture_copy)


def test_a_truncated_data_file_after_the_first_is_named_too(tmp_path):
    """Only the first data file was read through the checked path; a later one gave pyarrow's bare error."""
    features = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)
    writer = DatasetWriter(tmp_path / "ds", features, 20)
    for episode in range(2):  # two groups: two data files
        writer.add(pattern_record(episode, image_size=None))
        writer.flush()
    path = tmp_path / "ds" / "data" / "chunk-000" / "file-001.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        LeRobotFormatError, match=rf"{path}: not a readable parquet file \(truncated or damaged\?\)"
    ):
        _read_all(tmp_path / "ds")


def test_a_depth_video_feature_is_left_out_and_named_when_asked_for(fixture_copy, caplog):
    """lerobot 0.6.1 writes depth videos: a depth camera refused the whole dataset, its state, actions and
    RGB cameras included. It is left out now, as string and audio features are."""
    from simstream.lerobot.spec import KeyMap

    info_path = fixture_copy / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    front = info["features"]["observation.images.front"]
    front["shape"] = [1, *front["shape"][1:]] if front["shape"][0] == 3 else [*front["shape"][:2], 1]
    front["info"]["is_depth_map"] = True
    info_path.write_text(json.dumps(info))
    field = KeyMap(None).field("observation.images.front")
    with caplog.at_level("WARNING", logger="simstream.lerobot.spec"):
        spec = LeRobotSpec(fixture_copy)
    assert field not in spec.fields() and "actions" in spec.fields()
    assert "'observation.images.front' (a video of shape [1, " in caplog.text
    _read_all(fixture_copy)
    with pytest.raises(
        ValueError,
        match=rf"fields_subset names \['{field}'\].*'{field}' cannot be streamed: a video of shape \[1, .* "
        r"not an RGB camera",
    ):
        LeRobotSpec(fixture_copy, fields_subset=[field])


def test_a_key_holding_a_slash_appends_and_replays(tmp_path):
    key_map = KeyMap({"sensor/state": "obs/state"})
    features = features_from_fields(PatternSpec().fields(), key_map, video=True)
    for episode in range(3):  # each writer reopens the dataset (repair reads the per-episode stats keys)
        with DatasetWriter(tmp_path / "ds", features, 20) as writer:
            writer.add(pattern_record(episode, image_size=None))
            writer.flush()
    assert writer.episodes_flushed == 3
    assert "obs/state" in LeRobotSpec(tmp_path / "ds", key_map={"sensor/state": "obs/state"}).fields()


def test_truncated_episodes_file(fixture_copy):
    path = fixture_copy / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(LeRobotFormatError, match=rf"{path}: not a readable parquet file"):
        LeRobotSpec(fixture_copy)


def test_missing_data_file(fixture_copy):
    path = fixture_copy / "data" / "chunk-000" / "file-000.parquet"
    path.unlink()
    with pytest.raises(LeRobotFormatError, match=rf"{path}: missing \(episode 0 refers to it\)"):
        LeRobotSpec(fixture_copy)


def test_missing_video_file(fixture_copy):
    path = fixture_copy / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    path.unlink()
    with pytest.raises(LeRobotFormatError, match=rf"{path}: missing \(the dataset's metadata refers to it\)"):
        LeRobotSpec(fixture_copy)  # before any producer starts
    LeRobotSpec(fixture_copy, fields_subset=("obs/state",))  # a replay without the camera needs no video


def test_an_empty_video_file_is_refused_before_anything_streams(fixture_copy):
    path = fixture_copy / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    path.write_bytes(b"")
    with pytest.raises(LeRobotFormatError, match=rf"{path}: empty \(the dataset's metadata refers to it\)"):
        LeRobotSpec(fixture_copy)


def _two_group_dataset(root: Path) -> Path:
    features = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)
    writer = DatasetWriter(root, features, 20)
    for episode in range(2):  # two groups: two data files
        writer.add(pattern_record(episode, image_size=None))
        writer.flush()
    writer.close()
    return root


def test_a_missing_data_file_of_a_later_episode_is_refused_before_anything_streams(tmp_path):
    """Only the first data file was looked at: a partial download failed when a producer first drew one
    of the missing file's episodes, deep into training."""
    root = _two_group_dataset(tmp_path / "ds")
    path = root / "data" / "chunk-000" / "file-001.parquet"
    path.unlink()
    with pytest.raises(
        LeRobotFormatError, match=rf"^{path}: missing \(the dataset's metadata refers to it\)$"
    ):
        LeRobotSpec(root)


def test_a_later_data_file_without_a_declared_column_is_refused_before_anything_streams(tmp_path):
    import pyarrow.parquet as pq

    root = _two_group_dataset(tmp_path / "ds")
    path = root / "data" / "chunk-000" / "file-001.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["action"]), path)
    with pytest.raises(
        LeRobotFormatError, match=rf"{path}: has no column\(s\) \['action'\] that meta/info.json declares"
    ):
        LeRobotSpec(root)


def _edit_feature(root: Path, key: str, **changes) -> None:
    """Change what ``meta/info.json`` declares of one feature."""
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"][key].update(changes)
    info_path.write_text(json.dumps(info))


@pytest.mark.parametrize("declared", ["int64", "bool", "uint8", "float16"])
def test_values_of_another_dtype_than_info_json_declares_are_refused(fixture_copy, declared):
    """They were cast without a word: float data declared int64 came back as 1001, 1001, 1001, ..."""
    _edit_feature(fixture_copy, "observation.state", dtype=declared)
    path = fixture_copy / "data" / "chunk-000" / "file-000.parquet"
    with pytest.raises(
        LeRobotFormatError,
        match=rf"{path}: column 'observation.state' holds float values; meta/info.json declares {declared}",
    ):
        LeRobotSpec(fixture_copy)


def test_float32_values_of_a_float64_feature_are_accepted_and_read_exactly(fixture_copy):
    _edit_feature(fixture_copy, "observation.state", dtype="float64")  # the file holds float32
    spec = LeRobotSpec(fixture_copy, fields_subset=("obs/state",))
    assert spec.fields()["obs/state"].dtype == torch.float64
    source = spec.build(0, 0)
    try:
        state = source.reader.read(0).frames["obs/state"]  # the buffer's rows cast it on the copy
    finally:
        source.close()
    original = LeRobotSpec(FIXTURE, fields_subset=("obs/state",)).build(0, 0)
    try:
        expected = original.reader.read(0).frames["obs/state"]
    finally:
        original.close()
    np.testing.assert_array_equal(state.astype(np.float64), expected.astype(np.float64))


def test_png_images_of_another_size_than_info_json_declares_are_refused(fixture_copy):
    """[3, 16, 64] has as many values as the 32x32 images: they were read scrambled."""
    _edit_feature(fixture_copy, "observation.images.top", shape=[3, 16, 64])
    path = fixture_copy / "data" / "chunk-000" / "file-000.parquet"
    with pytest.raises(
        LeRobotFormatError,
        match=rf"{path}: column 'observation.images.top' holds 32x32 images; meta/info.json says 16x64",
    ):
        _read_all(fixture_copy)


@pytest.mark.parametrize("column", ["episode_index", "dataset_to_index", "data/chunk_index"])
def test_an_episodes_file_with_an_empty_value_is_refused_naming_the_column(fixture_copy, column):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = fixture_copy / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    values[1] = None
    table = table.set_column(table.schema.get_field_index(column), column, pa.array(values, pa.int64()))
    pq.write_table(table, path)
    with pytest.raises(
        LeRobotFormatError, match=rf"^{path}: column '{column}' is empty \(null\) for 1 episode\(s\)$"
    ):
        LeRobotSpec(fixture_copy)


@pytest.mark.parametrize(
    ("column", "fragment"),
    [
        ("task_index", "column 'task_index' is empty (null) for some frames"),
        ("index", "column 'index' is empty (null) for some frames"),
        ("observation.state", "column 'observation.state' holds empty (null) values"),
    ],
)
def test_a_data_file_with_an_empty_value_is_refused_naming_the_column(fixture_copy, column, fragment):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = fixture_copy / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    position = table.schema.get_field_index(column)
    values = table.column(column).to_pylist()
    values[3] = None
    table = table.set_column(
        position, table.schema.field(position), pa.array(values, table.schema.field(position).type)
    )
    pq.write_table(table, path)
    with pytest.raises(LeRobotFormatError, match=re.escape(f"{path}: {fragment}")):
        _read_all(fixture_copy)


def test_a_list_column_whose_frames_hold_different_numbers_of_values_is_refused(fixture_copy):
    """22 values in one frame and 24 in the next fit two frames of 23 when flattened: each value then sat
    in the wrong frame."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = fixture_copy / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    state = table.column("observation.state").to_pylist()
    state[0], state[1] = state[0][:22], [*state[1], 99.0]
    position = table.schema.get_field_index("observation.state")
    kind = pa.list_(pa.float32())
    table = table.set_column(position, pa.field("observation.state", kind), pa.array(state, kind))
    pq.write_table(table, path)
    with pytest.raises(
        LeRobotFormatError,
        match=re.escape(
            f"{path}: column 'observation.state' holds 22 values in frame 0 of a row group; meta/info.json "
            "declares shape [23] (23 per frame)"
        ),
    ):
        _read_all(fixture_copy, fields_subset=("obs/state",))


def test_a_video_file_without_a_video_stream_is_refused_naming_it(fixture_copy):
    import av

    path = fixture_copy / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    with av.open(str(path), "w", format="mp4") as container:  # sound only
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for k in range(4):
            frame.pts = k * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with pytest.raises(LeRobotFormatError, match=rf"^{path}: holds no video stream$"):
        _read_all(fixture_copy)


def _mark_success(root: Path, flags: list[bool]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    pq.write_table(pq.read_table(path).append_column("success", pa.array(flags)), path)


def test_a_dataset_whose_every_episode_failed_is_refused_before_anything_starts(fixture_copy):
    _mark_success(fixture_copy, [False, False, False])
    with pytest.raises(
        ValueError, match=rf"LeRobotSpec.root: every episode of {fixture_copy} is recorded with success=False"
    ):
        LeRobotSpec(fixture_copy)


def test_the_default_row_capacity_is_the_longest_episode_streamed(fixture_copy):
    from simstream.lerobot.dataset import read_dataset_meta

    lengths = [int(ep["length"]) for ep in read_dataset_meta(fixture_copy).episodes]
    longest = int(np.argmax(lengths))
    _mark_success(fixture_copy, [k != longest for k in range(len(lengths))])
    expected = max(n for k, n in enumerate(lengths) if k != longest)
    assert expected < max(lengths)
    assert LeRobotSpec(fixture_copy).max_episode_steps == expected


def test_truncated_video_file(fixture_copy):
    path = fixture_copy / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(LeRobotFormatError, match=rf"{path}: "):
        _read_all(fixture_copy)


@pytest.mark.parametrize(
    "column",
    ["dataset_from_index", "length", "data/file_index", "videos/observation.images.front/from_timestamp"],
)
def test_an_episodes_file_without_a_column_episodes_need(fixture_copy, column):
    import pyarrow.parquet as pq

    path = fixture_copy / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    pq.write_table(pq.read_table(path).drop_columns([column]), path)
    with pytest.raises(
        LeRobotFormatError, match=rf"{path}: has no column\(s\) \['{column}'\] that every episode needs"
    ):
        LeRobotSpec(fixture_copy)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        ({"fps": "20"}, r"fps must be an int >= 1, got '20'"),
        ({"fps": 0}, r"fps must be an int >= 1, got 0"),
        ({"fps": 20.5}, r"fps must be an int >= 1, got 20.5"),
        ({"features": []}, r"features must map each key to a dict, got \[\]"),
        ({"features": {"observation.state": "float32"}}, r"features must map each key to a dict"),
    ],
)
def test_info_json_values_of_the_wrong_kind(fixture_copy, edit, fragment):
    info_path = fixture_copy / "meta" / "info.json"
    info_path.write_text(json.dumps({**json.loads(info_path.read_text()), **edit}))
    with pytest.raises(LeRobotFormatError, match=rf"{info_path}: {fragment}"):
        LeRobotSpec(fixture_copy)


@pytest.mark.parametrize("key_map", [["observation.state"], "observation.state=obs/s"])
def test_a_key_map_that_is_not_a_mapping_is_refused(key_map):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"key_map must be a mapping {{lerobot_key: field_name}} or None, got {type(key_map).__name__}"
        ),
    ):
        LeRobotSpec(FIXTURE, key_map=key_map)


def test_unknown_key_in_key_map():
    with pytest.raises(
        ValueError, match=r"key_map names LeRobot key\(s\) \['observation.nope'\] that .*info.json"
    ):
        LeRobotSpec(FIXTURE, key_map={"observation.nope": "obs/x"})


def test_key_map_renames_a_feature():
    spec = LeRobotSpec(FIXTURE, key_map={"observation.images.front": "obs/image"})
    assert "obs/image" in spec.fields() and "obs/images/front" not in spec.fields()


def test_fields_subset_names_a_missing_field():
    with pytest.raises(ValueError, match=r"LeRobotSpec.fields_subset names \['obs/objects'\], not fields of"):
        LeRobotSpec(FIXTURE, fields_subset=("obs/state", "obs/objects"))


def test_features_that_do_not_match_on_append(tmp_path):
    features = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)
    writer = DatasetWriter(tmp_path / "ds", features, 20)
    writer.add(pattern_record(0, image_size=None))
    writer.flush()
    other = features_from_fields(PatternSpec(image_size=32).fields(), KeyMap(), video=True)
    with pytest.raises(
        ValueError,
        match=r"meta/info.json: the dataset's features do not match the recording's "
        r"\('observation.image' only in the recording\); appending needs the same keys, dtypes and shapes$",
    ):
        DatasetWriter(tmp_path / "ds", other, 20)
    camera = features_from_fields(PatternSpec(image_size=32).fields(), KeyMap(), video=True)
    DatasetWriter(tmp_path / "camera", camera, 20).add(pattern_record(0, image_size=32))
    bigger = features_from_fields(PatternSpec(image_size=48).fields(), KeyMap(), video=True)
    with pytest.raises(
        ValueError,
        match=r"'observation.image' is video \[3, 32, 32\] in the dataset, video \[3, 48, 48\] in the",
    ):
        DatasetWriter(tmp_path / "camera", bigger, 20)
    with pytest.raises(ValueError, match=r"meta/info.json: fps is 20, the recording's is 30"):
        DatasetWriter(tmp_path / "ds", features, 30)


def test_a_field_of_shape_1_is_stored_as_lerobot_stores_shape_1_and_replays_with_its_shape(tmp_path):
    """LeRobot's reader casts every feature of shape [1] to one value per frame and cannot open a list of
    one: a field of shape (1,) is stored as a plain column, marked in info.json (a key LeRobot ignores), and
    replays as shape (1,), so a live source and its recording have the same fields (MixSpec needs it)."""
    import pyarrow.parquet as pq

    fields = {**PatternSpec().fields(), "rewards": Field((1,))}
    listed = features_from_fields(fields, KeyMap(), video=True)
    writer = DatasetWriter(tmp_path / "ds", listed, 20)
    for episode in range(2):
        writer.add(pattern_record(episode, image_size=None))
    writer.flush()
    schema = pq.read_schema(tmp_path / "ds" / "data" / "chunk-000" / "file-000.parquet")
    assert str(schema.field("rewards").type) == "float"
    assert json.loads(schema.metadata[b"huggingface"])["info"]["features"]["rewards"]["_type"] == "Value"
    info = json.loads((tmp_path / "ds" / "meta" / "info.json").read_text())
    assert info["features"]["rewards"] == {
        "dtype": "float32", "shape": [1], "names": None, "simstream.field_shape": [1]
    }  # fmt: skip
    spec = LeRobotSpec(tmp_path / "ds")
    assert spec.fields()["rewards"] == Field((1,))
    source = spec.build(0, 0)
    try:
        rewards = [source.reader.read(e).frames["rewards"] for e in range(2)]
    finally:
        source.close()
    for episode, values in enumerate(rewards):
        expected = pattern_record(episode, image_size=None).frames["rewards"].reshape(-1, 1)
        np.testing.assert_array_equal(np.asarray(values), expected)
    # a field of shape () is stored the same way but is another field: appending it is refused
    plain = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)
    refused = r"'rewards' is a field of shape \(1,\) in the dataset, \(\) in the recording"
    with pytest.raises(ValueError, match=refused):
        DatasetWriter(tmp_path / "ds", plain, 20)
    # without the mark (LeRobot's own [1] features), a plain column is a field of shape ()
    writer = DatasetWriter(tmp_path / "scalar", plain, 20)
    writer.add(pattern_record(0, image_size=None))
    writer.flush()
    assert LeRobotSpec(tmp_path / "scalar").fields()["rewards"] == Field(())
    legacy = r"'rewards' is a field of shape \(\) \(or \(1,\), recorded before simstream marked such fields"
    with pytest.raises(ValueError, match=legacy):  # onto it, a (1,) field is refused, saying why it may be
        DatasetWriter(tmp_path / "scalar", listed, 20)


def test_appending_keeps_the_datasets_robot_type_unless_the_recording_names_one(tmp_path):
    features = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)
    info = tmp_path / "ds" / "meta" / "info.json"
    for episode, robot_type, expected in ((0, "franka", "franka"), (1, None, "franka"), (2, "ur5", "ur5")):
        # the second is e.g. simstream record into the same folder
        with DatasetWriter(tmp_path / "ds", features, 20, robot_type=robot_type) as writer:
            writer.add(pattern_record(episode, image_size=None))
            writer.flush()
        assert json.loads(info.read_text())["robot_type"] == expected


@pytest.mark.parametrize(
    ("codec", "size", "rule"),
    [("h264", (15, 16), "even height and width"), ("h264", (16, 17), "even height and width"),
     ("av1", (3, 8), "height and width >= 4")],
)  # fmt: skip
def test_video_frames_the_codec_cannot_encode_are_refused_before_anything_is_written(
    tmp_path, codec, size, rule
):
    height, width = size
    features = features_from_fields({"obs/image": Field((3, height, width), torch.uint8)}, KeyMap(), True)
    with pytest.raises(
        ValueError,
        match=rf"field 'obs/image': {codec} video needs {rule}; its frames are {height}x{width}\. Record it "
        r"as PNG images \(video=False, --no-video\)",
    ):
        DatasetWriter(tmp_path / "ds", features, 20, video_codec=codec)
    assert not (tmp_path / "ds").exists()
    as_png = features_from_fields({"obs/image": Field((3, height, width), torch.uint8)}, KeyMap(), False)
    DatasetWriter(tmp_path / "ds", as_png, 20, video_codec=codec)  # PNG images have no such rule


def test_appending_to_a_dataset_not_written_by_simstream(fixture_copy):
    features = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)
    before = {p: p.read_bytes() for p in fixture_copy.rglob("*") if p.is_file()}
    with pytest.raises(LeRobotFormatError, match=r"meta/info.json: not a simstream recording; cannot append"):
        DatasetWriter(fixture_copy, features, 20)
    assert {p: p.read_bytes() for p in fixture_copy.rglob("*") if p.is_file()} == before  # nothing changed


@pytest.mark.parametrize(
    ("field", "fragment"),
    [
        (Field((2, 3)), r"field 'x' \(torch.float32, shape \(2, 3\)\) cannot be a LeRobot feature"),
        (Field((4,), torch.int16), r"field 'x' \(torch.int16, shape \(4,\)\) cannot be a LeRobot feature"),
        (Field((1, 8, 8), torch.uint8), r"field 'x' \(torch.uint8, shape \(1, 8, 8\)\) cannot be"),
    ],
)
def test_fields_lerobot_cannot_hold(field, fragment):
    with pytest.raises(ValueError, match=fragment):
        features_from_fields({"x": field}, KeyMap(), video=True)


def test_key_map_naming_a_field_the_source_lacks():
    with pytest.raises(
        ValueError, match=r"key_map names field\(s\) \['obs/nope'\] that the source does not have"
    ):
        features_from_fields(PatternSpec().fields(), KeyMap({"observation.x": "obs/nope"}), video=True)


@pytest.mark.parametrize(
    ("fields", "key_map", "fragment"),
    [
        ({"obs/state": Field((2,)), "actions": Field((2,))}, {"observation.state": "actions"},
         r"fields 'obs/state' and 'actions' would both be the LeRobot feature 'observation.state'"),
        ({"action": Field((2,)), "actions": Field((2,))}, {},
         r"fields 'action' and 'actions' would both be the LeRobot feature 'action'"),
        ({"obs/x": Field(()), "observation/x": Field(())}, {},
         r"fields 'obs/x' and 'observation/x' would both be the LeRobot feature 'observation.x'"),
    ],
)  # fmt: skip
def test_two_fields_with_one_key_are_refused(fields, key_map, fragment):
    with pytest.raises(ValueError, match=fragment + r" \(one column, one of them lost\)"):
        features_from_fields(fields, KeyMap(key_map), video=True)


@pytest.mark.parametrize(
    "name", ["timestamp", "index", "frame_index", "task_index", "segment_id", "subtask_index"]
)
def test_a_field_named_like_a_column_of_the_dataset_is_refused(name):
    with pytest.raises(ValueError, match=rf"field '{name}' would be the LeRobot feature '{name}', a column"):
        features_from_fields({"obs/state": Field((2,)), name: Field(())}, KeyMap(), video=True)
    features = features_from_fields(  # renamed, it is a feature like any other
        {"obs/state": Field((2,)), name: Field(())}, KeyMap({f"my.{name}": name}), video=True
    )
    assert [f.key for f in features] == ["observation.state", f"my.{name}"]


def test_two_features_that_would_be_one_field_are_refused():
    with pytest.raises(
        ValueError,
        match=r"info.json: features 'observation.images.top' and 'observation.images.front' would both be "
        r"the field 'obs/images/front'",
    ):
        LeRobotSpec(FIXTURE, key_map={"observation.images.top": "obs/images/front"})


def test_stats_aggregate_per_group_as_over_all_episodes():
    """The writer folds each group into running stats: the aggregation must be associative."""
    import numpy as np

    from simstream.lerobot.format import aggregate_stats, episode_stats

    rng = np.random.default_rng(0)
    episodes = [episode_stats(rng.normal(size=(int(rng.integers(5, 50)), 3)), False) for _ in range(7)]
    at_once = aggregate_stats(episodes)
    grouped = aggregate_stats([aggregate_stats(episodes[:3]), aggregate_stats(episodes[3:5]), *episodes[5:]])
    for name, value in at_once.items():
        np.testing.assert_allclose(value, grouped[name], err_msg=name)
    flat = np.concatenate([rng.normal(size=(4, 3))])
    single = episode_stats(flat, False)
    np.testing.assert_allclose(single["mean"], flat.mean(0))
    np.testing.assert_allclose(single["std"], flat.std(0))


def test_episodes_count_as_flushed_only_once_info_json_says_so(tmp_path, monkeypatch):
    """LeRobot's reader sizes a dataset from info.json: a group counted before info.json was replaced,
    then a SIGKILL, reported episodes LeRobot would not see (until simstream repaired the folder)."""
    import simstream.lerobot.writer as writer_module

    features = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)
    writer = DatasetWriter(tmp_path / "ds", features, 20)
    seen = []
    write_json = writer_module.write_json

    def observed(path, payload, **kwargs):
        if Path(path).name == "info.json":
            seen.append((writer.episodes_flushed, payload["total_episodes"]))
        return write_json(path, payload, **kwargs)

    monkeypatch.setattr(writer_module, "write_json", observed)
    for episode in range(2):
        writer.add(pattern_record(episode, image_size=None))
        writer.flush()
    assert seen == [(0, 1), (1, 2)] and writer.episodes_flushed == 2


def test_the_demo_refuses_a_dataset_whose_camera_has_another_size_than_its_image_size(tmp_path):
    """It trained on the dataset's 16x16 frames and evaluated the policy on 32x32 renders, without a word."""
    from types import SimpleNamespace

    from simstream.bc.recording import demo_source

    features = features_from_fields(PatternSpec(image_size=16).fields(), KeyMap(), video=False)
    with DatasetWriter(tmp_path / "ds", features, 20) as writer:
        writer.add(pattern_record(0, image_size=16))
        writer.flush()
    cfg = SimpleNamespace(dataset=tmp_path / "ds", image_size=32)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"DemoConfig.image_size is 32, but the camera 'obs/image' of the dataset {tmp_path / 'ds'} is "
            "16x16: pass --image-size 16"
        ),
    ):
        demo_source(cfg, PatternSpec(image_size=32))
    replay = demo_source(SimpleNamespace(dataset=tmp_path / "ds", image_size=16), PatternSpec(image_size=16))
    assert replay.fields() == PatternSpec(image_size=16).fields()


def test_an_episodes_column_of_floats_is_refused_as_not_integers(fixture_copy):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = fixture_copy / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    position = table.schema.get_field_index("length")
    lengths = pa.array([float(n) for n in table.column("length").to_pylist()], pa.float64())
    pq.write_table(table.set_column(position, "length", lengths), path)
    with pytest.raises(LeRobotFormatError, match=rf"^{path}: column 'length' holds double, not integers$"):
        LeRobotSpec(fixture_copy)


def test_an_integral_float_fps_is_read_as_an_int(fixture_copy):
    """Some converters write "fps": 30.0; it was refused as not an int."""
    info_path = fixture_copy / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "fps": float(info["fps"])}))
    spec = LeRobotSpec(fixture_copy)
    assert spec.fps == info["fps"] and type(spec.fps) is int


@pytest.mark.parametrize("indices", [[0, 0], [1, 2], [0, None]])
def test_tasks_whose_indices_do_not_number_their_rows_are_refused(fixture_copy, indices):
    """A duplicate index mapped texts silently; a gap gave a misleading "names no row" error later."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = fixture_copy / "meta" / "tasks.parquet"
    table = pa.table({"task_index": pa.array(indices, pa.int64()), "task": ["a", "b"]})
    pq.write_table(table, path)
    with pytest.raises(
        LeRobotFormatError,
        match=re.escape(f"{path}: task_index must number the 2 rows 0 to 1 once each, got {indices}"),
    ):
        LeRobotSpec(fixture_copy)


@pytest.mark.parametrize("pandas_metadata", [True, False])
def test_tasks_written_by_lerobot_0_4_with_the_text_as_an_unnamed_index_are_read(
    fixture_copy, pandas_metadata
):
    """lerobot 0.4.x stored the task text as the frame's unnamed index (column ``__index_level_0__``), as
    many v3.0 datasets on the Hub still have it; lerobot 0.6.1 reads it, and the replay refused it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from simstream.lerobot.dataset import read_dataset_meta

    path = fixture_copy / "meta" / "tasks.parquet"
    expected = read_dataset_meta(fixture_copy, stats=False).tasks
    order = list(reversed(range(len(expected))))  # rows in another order than their indices
    table = pa.table(
        {"task_index": pa.array(order, pa.int64()), "__index_level_0__": [expected[i] for i in order]}
    )
    if pandas_metadata:
        pandas = {"index_columns": ["__index_level_0__"], "columns": [], "pandas_version": "2.2.3"}
        table = table.replace_schema_metadata({b"pandas": json.dumps(pandas).encode()})
    pq.write_table(table, path)
    assert read_dataset_meta(fixture_copy, stats=False).tasks == expected
    _read_all(fixture_copy)


def _relayout(root: Path, data_path: str, video_path: str) -> None:
    """Move every data and video file to where the templates put them, and name the templates in
    info.json, as a converter with another file layout would have written the dataset."""
    from simstream.lerobot.dataset import read_dataset_meta

    meta = read_dataset_meta(root, stats=False)
    moves = {}
    for ep in meta.episodes:
        chunk, file = ep["data/chunk_index"], ep["data/file_index"]
        moves[meta.data_path(ep)] = root / data_path.format(chunk_index=chunk, file_index=file)
        for key in meta.video_keys:
            chunk, file = ep[f"videos/{key}/chunk_index"], ep[f"videos/{key}/file_index"]
            target = video_path.format(video_key=key, chunk_index=chunk, file_index=file)
            moves[meta.video_path(ep, key)] = root / target
    for old, new in moves.items():
        new.parent.mkdir(parents=True, exist_ok=True)
        old.rename(new)
    for folder in ("data", "videos"):  # every file moved: only empty folders are left
        assert not any(path.is_file() for path in (root / folder).rglob("*"))
        shutil.rmtree(root / folder, ignore_errors=True)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "data_path": data_path, "video_path": video_path}))


def test_a_dataset_of_another_file_layout_is_read_where_info_json_says(fixture_copy, tmp_path):
    """LeRobot finds every file through info.json's data_path and video_path templates; so does a replay
    (it assumed the default layout, and called the moved files missing)."""
    default = tmp_path / "default"
    shutil.copytree(fixture_copy, default)
    _relayout(fixture_copy, "parquet/{chunk_index}_{file_index}.parquet", "mp4/{video_key}-{file_index}.mp4")
    assert not (fixture_copy / "data").exists() and not (fixture_copy / "videos").exists()

    def read(root: Path) -> list:
        source = LeRobotSpec(root).build(0, 0)
        try:
            return [source.reader.read(e) for e in range(len(source.meta.episodes))]
        finally:
            source.close()

    moved, expected = read(fixture_copy), read(default)
    assert len(moved) == len(expected) > 0
    for got, want in zip(moved, expected):
        assert got.frames.keys() == want.frames.keys()
        for name in want.frames:
            np.testing.assert_array_equal(got.frames[name], want.frames[name])
        np.testing.assert_array_equal(got.task_index, want.task_index)


@pytest.mark.parametrize(
    ("field", "template", "fragment"),
    [
        ("data_path", 5, r"got 5 \(TypeError: int\)"),
        ("data_path", "data/{chunk:03d}/f.parquet", r"got 'data/\{chunk:03d\}/f.parquet' \(KeyError"),
        ("data_path", "data/{0}.parquet", r"\(IndexError"),
        ("data_path", "/data/{chunk_index}/{file_index}", r"got '/data/\{chunk_index\}/\{file_index\}'$"),
        ("data_path", " ", r"got ' '$"),
        ("video_path", None, r"of chunk_index and file_index \(and video_key\) such as 'videos/"),
    ],
)  # fmt: skip
def test_an_info_json_path_template_that_cannot_name_the_files_is_refused(
    fixture_copy, field, template, fragment
):
    info_path = fixture_copy / "meta" / "info.json"
    info_path.write_text(json.dumps({**json.loads(info_path.read_text()), field: template}))
    with pytest.raises(
        LeRobotFormatError, match=rf"{info_path}: {field} must be a relative path template.*{fragment}"
    ):
        LeRobotSpec(fixture_copy)


def test_a_recording_of_another_file_layout_is_neither_appended_to_nor_repaired(tmp_path):
    """The writer writes the default layout, and repair deletes every file no episode references in it:
    a recording whose info.json names another layout is refused before anything is written or deleted."""
    from simstream.lerobot.writer import repair

    root = tmp_path / "ds"
    features = features_from_fields(PatternSpec().fields(), KeyMap(), video=True)
    with DatasetWriter(root, features, 20) as writer:
        writer.add(pattern_record(0, image_size=None))
        writer.flush()
    _relayout(root, "parquet/{chunk_index}_{file_index}.parquet", "mp4/{video_key}-{file_index}.mp4")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    message = r"are not simstream's layout \('data/chunk-\{chunk_index:03d\}/file-\{file_index:03d\}.parquet'"
    with pytest.raises(LeRobotFormatError, match=message):
        DatasetWriter(root, features, 20)
    with pytest.raises(LeRobotFormatError, match=message):
        repair(root)
    assert sorted(p for p in root.rglob("*") if p.is_file()) == files
    assert len(LeRobotSpec(root).build(0, 0).reader.read(0).frames) > 0
