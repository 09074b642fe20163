"""What a replay streams from datasets other writers make: features of several dimensions and other dtypes;
what it cannot stream is listed, and named only by mistake; damaged metadata and videos are errors."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from simstream import Field, OnlineDataEngine, OnlineDataEngineCfg
from simstream.lerobot import LeRobotFormatError, LeRobotRecorder, LeRobotSpec
from simstream.lerobot.dataset import read_dataset_meta
from simstream.lerobot.format import features_from_fields
from simstream.lerobot.names import KeyMap
from simstream.lerobot.writer import DatasetWriter

from .sources import PatternSpec, pattern_record

pytestmark = pytest.mark.timeout(120)


def _dataset(root: Path, episodes: int = 3, image_size: int | None = None) -> Path:
    """``episodes`` PatternSource episodes in one group: one data file (and one h264 video)."""
    features = features_from_fields(PatternSpec(image_size=image_size).fields(), KeyMap(), video=True)
    with DatasetWriter(root, features, 20, video_codec="h264") as writer:
        for tag in range(episodes):
            writer.add(pattern_record(tag, image_size=image_size))
        writer.flush()
    return root


def _edit_info(root: Path, edit) -> Path:
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    edit(info["features"])
    path.write_text(json.dumps(info))
    return path


def _read_all(root: Path, **kwargs) -> list:
    source = LeRobotSpec(root, **kwargs).build(0, 0)
    try:
        return [source.reader.read(e) for e in range(len(source.meta.episodes))]
    finally:
        source.close()


@pytest.fixture
def many_kinds(tmp_path) -> Path:
    """A dataset with the columns other writers (lerobot itself) make: a [2, 3] float32 feature (a list of
    lists per frame), float16 and uint8 features, and a string feature."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = _dataset(tmp_path / "ds")
    path = root / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    index = table.column("index").to_numpy()
    grid = [[[float(i), i + 0.5, i + 0.25], [-float(i), 0.0, 1.0]] for i in index]
    half = np.stack([index / 4, -index / 4], axis=1).astype(np.float16)
    table = (
        table.append_column("observation.grid", pa.array(grid, type=pa.list_(pa.list_(pa.float32()))))
        .append_column("observation.half", pa.FixedSizeListArray.from_arrays(pa.array(half.reshape(-1)), 2))
        .append_column("observation.code", pa.array((index % 251).astype(np.uint8)))
        .append_column("observation.note", pa.array([f"frame {i}" for i in index]))
    )
    pq.write_table(table, path)

    def add(features):
        features["observation.grid"] = {"dtype": "float32", "shape": [2, 3], "names": None}
        features["observation.half"] = {"dtype": "float16", "shape": [2], "names": None}
        features["observation.code"] = {"dtype": "uint8", "shape": [1], "names": None}
        features["observation.note"] = {"dtype": "string", "shape": [1], "names": None}

    _edit_info(root, add)
    return root


def test_features_of_several_dimensions_and_other_dtypes_are_streamed(many_kinds):
    spec = LeRobotSpec(many_kinds)
    fields = spec.fields()
    assert fields["obs/grid"] == Field((2, 3), torch.float32)
    assert fields["obs/half"] == Field((2,), torch.float16)
    assert fields["obs/code"] == Field((), torch.uint8)
    assert "obs/note" not in fields
    assert spec.skipped_features == {"observation.note": "a string feature, which is not a tensor"}
    meta = read_dataset_meta(many_kinds)
    for ep, read in zip(meta.episodes, _read_all(many_kinds)):
        index = np.arange(ep["dataset_from_index"], ep["dataset_to_index"])
        first = np.stack([index, index + 0.5, index + 0.25], 1)
        second = np.stack([-index, 0 * index, 1 + 0 * index], 1)
        expected = np.stack([first, second], 1)
        np.testing.assert_array_equal(read.frames["obs/grid"], expected.astype(np.float32))
        np.testing.assert_array_equal(
            read.frames["obs/half"], np.stack([index / 4, -index / 4], 1).astype(np.float16)
        )
        np.testing.assert_array_equal(read.frames["obs/code"], (index % 251).astype(np.uint8))
    cfg = OnlineDataEngineCfg(source=spec, buffer_size=2, num_workers=1)
    with OnlineDataEngine(cfg) as engine:
        batch = engine.sample_batch(8, 4)
    grid = batch["obs", "grid"]
    assert grid.dtype == torch.float32 and grid.shape == (8, 4, 2, 3)
    assert bool((grid[..., 0, 1] - grid[..., 0, 0] == 0.5).all())
    assert bool((grid[..., 1, 0] == -grid[..., 0, 0]).all())
    assert batch["obs", "half"].dtype == torch.float16 and batch["obs", "code"].dtype == torch.uint8


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"key_map": {"observation.note": "obs/text"}}, "key_map names 'observation.note' of {info}, which a "
         "replay cannot stream: a string feature, which is not a tensor"),
        ({"key_map": {"timestamp": "obs/time"}}, "key_map names 'timestamp', one of the dataset's "
         "bookkeeping columns of {info}, not a payload feature"),
        ({"fields_subset": ["obs/state", "obs/note"]}, "LeRobotSpec.fields_subset names ['obs/note'], not "
         "fields of {root}"),
        ({"fields_subset": ["obs/note"]}, "'obs/note' cannot be streamed: a string feature"),
        ({"fields_subset": "obs/state"}, "LeRobotSpec.fields_subset must be a non-empty list of field names "
         "or None, got 'obs/state'"),
        ({"fields_subset": []}, "LeRobotSpec.fields_subset must be a non-empty list of field names"),
    ],
)  # fmt: skip
def test_naming_a_feature_a_replay_cannot_stream_is_an_error_saying_why(many_kinds, kwargs, fragment):
    info = many_kinds / "meta" / "info.json"
    with pytest.raises(ValueError, match=re.escape(fragment.format(info=info, root=many_kinds))):
        LeRobotSpec(many_kinds, **kwargs)


def test_unreadable_features_are_listed_in_a_warning(many_kinds, caplog):
    LeRobotSpec(many_kinds)
    assert f"LeRobotSpec: {many_kinds}: not streamed: 'observation.note' (a string feature" in caplog.text


def test_a_feature_without_a_shape(tmp_path):
    root = _dataset(tmp_path / "ds", episodes=1)
    info = _edit_info(root, lambda f: f["observation.state"].update(shape=None))
    with pytest.raises(
        LeRobotFormatError, match=rf"{info}: feature 'observation.state' \(float32\) needs a shape"
    ):
        LeRobotSpec(root)


@pytest.mark.parametrize("declared", [[5], [2, 3]])
def test_values_that_do_not_fit_the_declared_shape(tmp_path, declared):
    root = _dataset(tmp_path / "ds", episodes=1)
    _edit_info(root, lambda f: f["observation.state"].update(shape=declared))
    data = root / "data" / "chunk-000" / "file-000.parquet"
    with pytest.raises(
        LeRobotFormatError,
        match=re.escape(f"{data}: column 'observation.state' holds 4 values per frame; meta/info.json "
                        f"declares shape {declared}"),
    ):  # fmt: skip
        _read_all(root)


@pytest.mark.parametrize("change", [1, -1])
def test_an_episode_length_that_is_not_its_span(tmp_path, change):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = _dataset(tmp_path / "ds")
    path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    lengths = table.column("length").to_numpy().copy()
    lengths[1] += change
    pq.write_table(
        table.set_column(table.schema.get_field_index("length"), "length", pa.array(lengths)), path
    )
    span = 13  # episode 1 of PatternSource: 12 + 1 frames
    with pytest.raises(
        LeRobotFormatError, match=rf"episode 1 has length {span + change} but spans frames 12 to 25 \(13\)"
    ):
        LeRobotSpec(root)


def test_a_task_index_with_no_task(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = _dataset(tmp_path / "ds", episodes=1)
    data = root / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(data)
    column = table.schema.get_field_index("task_index")
    pq.write_table(table.set_column(column, "task_index", pa.array(np.full(table.num_rows, 7))), data)
    with pytest.raises(
        LeRobotFormatError,
        match=rf"{data}: task_index 7 of episode 0 names no row of meta/tasks.parquet \(1 rows\)",
    ):
        _read_all(root)


def test_a_video_missing_a_frame_in_the_middle(tmp_path):
    """Every decoded frame landed in its slot, but one slot got none: uninitialised pixels were served."""
    import av

    root = _dataset(tmp_path / "ds", episodes=1, image_size=16)
    path = root / "videos" / "observation.image" / "chunk-000" / "file-000.mp4"
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=20, options={"preset": "ultrafast"})
        stream.width = stream.height = 16
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, 20)
        for pts in (t for t in range(12) if t != 3):
            frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), 20 * pts, np.uint8), "rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, 20)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with pytest.raises(
        LeRobotFormatError,
        match=rf"{path}: holds 11 of the 12 frames of episode 0 \(truncated\?\); frame 3 and 0 more have no",
    ):
        _read_all(root)


def _write_h264(path: Path, frames: int, size: int = 16) -> None:
    """A 20-fps video of ``frames`` grey frames ``0, 1, ...`` over whatever ``path`` held."""
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=20, options={"preset": "ultrafast"})
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, 20)
        for pts in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), pts, np.uint8), "rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, 20)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def test_a_video_shorter_than_its_episodes_is_refused_when_the_spec_is_made(tmp_path):
    """Its header says it ends before the last episode's last frame: refused before anything streams, not
    when a producer first draws that episode."""
    root = _dataset(tmp_path / "ds", episodes=2, image_size=16)
    first, second = (int(ep["length"]) for ep in read_dataset_meta(root).episodes)
    path = root / "videos" / "observation.image" / "chunk-000" / "file-000.mp4"
    _write_h264(path, first + second - 1)  # the second episode's last frame is missing
    with pytest.raises(
        LeRobotFormatError,
        match=rf"{path}: ends at {(first + second - 1) / 20:.6f} s, but episode 1 needs it up to "
        rf"{(first + second) / 20:.6f} s \(from_timestamp {first / 20:g} s \+ {second} frames at 20 fps\): "
        "the video is shorter than the episodes that refer to it",
    ):
        LeRobotSpec(root)
    _write_h264(path, first + second)
    assert [len(e.task_index) for e in _read_all(root)] == [first, second]  # long enough: replayed


def _record(root: Path, spec: PatternSpec, episodes: int, **kwargs) -> LeRobotRecorder:
    engine = OnlineDataEngine(
        OnlineDataEngineCfg(source=spec, buffer_size=4, num_workers=1, refill_policy="manual")
    )
    recorder = LeRobotRecorder(engine, root, max_episodes=episodes, flush_every=2, **kwargs)
    with recorder, engine:
        while not recorder.wait_flushed(episodes, timeout_s=0.5):
            recorder.check()
            engine.check_health()
            engine.request_refill()
    return recorder


def test_published_episodes_that_ended_truncated_are_recorded_as_successes_and_replayed(tmp_path):
    """The engine publishes only the episodes its source accepted; one cut at its step limit is one of them.
    It was recorded with success=False, and a replay skipped it."""
    spec = PatternSpec(truncated_every=2)
    _record(tmp_path / "all", spec, episodes=6)
    meta = read_dataset_meta(tmp_path / "all")
    assert [ep["success"] for ep in meta.episodes] == [True] * 6
    truncated = [ep["truncated"] for ep in meta.episodes]
    assert any(truncated) and not all(truncated)
    assert all(ep["terminated"] != ep["truncated"] for ep in meta.episodes)
    source = LeRobotSpec(tmp_path / "all").build(0, 0)
    try:
        assert source.episodes.tolist() == list(range(6))  # every recorded episode streams
    finally:
        source.close()
    recorder = _record(tmp_path / "finished", spec, episodes=4, only_success=True)
    meta = read_dataset_meta(tmp_path / "finished")
    assert len(meta.episodes) == 4 and not any(ep["truncated"] for ep in meta.episodes)
    assert recorder.episodes_filtered >= 3  # every other episode; the 4th kept is the 7th or later


@pytest.mark.parametrize("cache_bytes", [256 * 2**20, 1])
def test_episodes_read_from_row_groups_in_any_order(tmp_path, monkeypatch, cache_bytes):
    """LeRobot's data files hold many episodes in many row groups: a read decodes only the groups that
    hold its episode (an episode may straddle two), and keeps decoded groups up to a byte bound."""
    import pyarrow.parquet as pq

    from simstream.lerobot import dataset

    monkeypatch.setattr(dataset, "_CACHE_BYTES", cache_bytes)
    root = _dataset(tmp_path / "ds", episodes=12)
    data = root / "data" / "chunk-000" / "file-000.parquet"
    pq.write_table(pq.read_table(data), data, row_group_size=7)  # 7 does not divide any episode length
    assert pq.ParquetFile(data).metadata.num_row_groups > 12
    source = LeRobotSpec(root).build(0, 0)
    try:
        for tag in np.random.default_rng(0).permutation(12).tolist():
            read = source.reader.read(tag)
            length = 12 + tag % 7
            t = np.arange(length, dtype=np.float32)
            np.testing.assert_array_equal(
                read.frames["obs/state"], np.stack([t * 0 + tag, t, t / 10, -tag + t * 0], 1)
            )
            np.testing.assert_array_equal(read.frames["actions"], np.stack([t, -t], 1))
            assert len(read.task_index) == length
            assert source.reader._cached_bytes <= max(
                cache_bytes, max(size for _, size in source.reader._groups.values())
            )
        if cache_bytes == 1:
            assert len(source.reader._groups) == 1  # the last read's groups only
    finally:
        source.close()
    assert source.reader._files == {} and source.reader._cached_bytes == 0


def test_frames_past_the_row_capacity_are_not_read(tmp_path):
    root = _dataset(tmp_path / "ds", episodes=2, image_size=16)
    spec = LeRobotSpec(root, max_episode_steps=5)
    source = spec.build(0, 0)
    try:
        read = source.reader.read(1, limit=5)
        assert read.frames["obs/image"].shape == (5, 3, 16, 16) and len(read.task_index) == 5
        np.testing.assert_array_equal(read.frames["actions"][:, 0], np.arange(5, dtype=np.float32))
    finally:
        source.close()
    cfg = OnlineDataEngineCfg(source=spec, buffer_size=2, num_workers=1)
    with OnlineDataEngine(cfg) as engine:
        batch = engine.sample_batch(4, 5)
        assert bool(batch["valid"].all()) and bool((batch["actions"][:, :, 0] == torch.arange(5.0)).all())
        stats = engine.get_stats()
    assert stats["successful_episodes"] >= 2


def _replace_grid(root: Path, grid_of_row) -> Path:
    """Rewrite ``observation.grid`` of ``many_kinds``'s data file with ``grid_of_row(index)`` per frame."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    kind = pa.list_(pa.list_(pa.float32()))
    grid = pa.array([grid_of_row(int(i)) for i in table.column("index").to_numpy()], kind)
    position = table.schema.get_field_index("observation.grid")
    pq.write_table(table.set_column(position, pa.field("observation.grid", kind), grid), path)
    return path


@pytest.mark.parametrize(
    ("grid_of_row", "fragment"),
    [
        (lambda i: [[i] * 3, [i] * 3] if i != 4 else [[i] * 2, [i] * 4], "a list of 2 values at dimension 1"),
        (lambda i: [[i, i], [i, i], [i, i]], "a list of 3 values at dimension 0"),
    ],
    ids=["ragged", "transposed"],
)  # fmt: skip
def test_a_feature_of_two_dimensions_whose_inner_lists_break_its_shape_is_refused(
    many_kinds, grid_of_row, fragment
):
    """Six values per frame, as ``[2, 3]`` declares, but not as two lists of three: flattened, the values
    were read into the wrong places without a word."""
    path = _replace_grid(many_kinds, grid_of_row)
    with pytest.raises(
        LeRobotFormatError,
        match=re.escape(
            f"{path}: column 'observation.grid' holds {fragment} of a frame; meta/info.json declares shape "
            "[2, 3]"
        ),
    ):
        _read_all(many_kinds, fields_subset=("obs/grid",))


def test_a_feature_of_two_dimensions_in_fixed_size_lists_is_read(many_kinds):
    """Fixed-size lists of fixed-size lists (another writer's choice) pass the per-dimension check."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = many_kinds / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    index = table.column("index").to_numpy()
    values = np.stack([index, index + 1, index + 2, -index, -index, -index], 1).astype(np.float32)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3)
    grid = pa.FixedSizeListArray.from_arrays(inner, 2)
    position = table.schema.get_field_index("observation.grid")
    pq.write_table(table.set_column(position, pa.field("observation.grid", grid.type), grid), path)
    meta = read_dataset_meta(many_kinds)
    for ep, read in zip(meta.episodes, _read_all(many_kinds, fields_subset=("obs/grid",))):
        rows = slice(ep["dataset_from_index"], ep["dataset_to_index"])
        np.testing.assert_array_equal(read.frames["obs/grid"], values[rows].reshape(-1, 2, 3))
