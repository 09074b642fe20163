"""Per-episode stats: the fast paths give LeRobot's values, and a written dataset carries them."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from simstream.lerobot.format import (
    QUANTILES,
    columns_stats,
    episode_stats,
    features_from_fields,
    image_stats,
)
from simstream.lerobot.names import KeyMap
from simstream.lerobot.writer import DatasetWriter

from .sources import PatternSpec, pattern_record


def _lerobot_quantile(column: np.ndarray, q: float) -> float:
    """LeRobot 0.6.1's estimate, step by step as ``RunningQuantileStats`` (``compute_stats.py``) does it:
    a 5000-bin histogram from ``min - 1e-10`` to ``max + 1e-10``, the bin where the cumulative count
    reaches ``q * n``, linear interpolation inside it (a single value: the mean)."""
    if len(column) < 2:
        return float(column.mean())
    edges = np.linspace(column.min() - 1e-10, column.max() + 1e-10, 5000 + 1)
    histogram, _ = np.histogram(column, bins=edges)
    cumulative = np.cumsum(histogram)
    target = q * len(column)
    index = np.searchsorted(cumulative, target)
    if index == 0:
        return float(edges[0])
    before, inside = cumulative[index - 1], cumulative[index] - cumulative[index - 1]
    if inside == 0:
        return float(edges[index])
    return float(edges[index] + (target - before) / inside * (edges[index + 1] - edges[index]))


def _reference(flat: np.ndarray, axis: int) -> dict[str, np.ndarray]:
    """The definitions: NumPy's reductions, and LeRobot's quantile estimate, along ``axis``."""
    out = {
        "min": flat.min(axis),
        "max": flat.max(axis),
        "mean": flat.mean(axis),
        "std": flat.std(axis),
    }
    columns = np.moveaxis(flat, axis, -1).reshape(-1, flat.shape[axis])
    for q in QUANTILES:
        out[f"q{round(q * 100):02d}"] = np.array([_lerobot_quantile(column, q) for column in columns])
    return out


def _image_reference(frames: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot's image stats of the sample the recorder takes (every n // 32-th frame, half resolution)."""
    step = max(1, len(frames) // 32)
    sample = frames[::step, :, ::2, ::2].astype(np.float64)  # LeRobot's pixel units, scaled after
    stats = _reference(sample.transpose(1, 0, 2, 3).reshape(3, -1), axis=1)
    return {name: value / 255.0 for name, value in stats.items()}


@settings(max_examples=60, deadline=None)
@given(
    frames=hnp.arrays(
        np.uint8,
        st.tuples(st.integers(1, 80), st.just(3), st.integers(1, 9), st.integers(1, 9)),
        elements=st.integers(0, 255),
    )
)
def test_image_stats_from_histograms_equal_lerobots_of_the_same_sample(frames):
    got = image_stats(frames)
    for name, value in _image_reference(frames).items():
        assert got[name].shape == (3, 1, 1), name
        np.testing.assert_allclose(got[name].ravel(), value, rtol=0, atol=1e-12, err_msg=name)
    assert got["count"].tolist() == [len(frames)]


def test_image_stats_of_a_known_frame():
    frames = np.zeros((1, 3, 2, 2), np.uint8)
    frames[0, 0] = 255  # red channel saturated; green 0; blue 51 (0.2)
    frames[0, 2] = 51
    stats = image_stats(frames)  # the sample is the one top-left pixel per channel
    np.testing.assert_allclose(stats["mean"].ravel(), [1.0, 0.0, 0.2])
    np.testing.assert_allclose(stats["q50"].ravel(), [1.0, 0.0, 0.2])
    np.testing.assert_allclose(stats["std"].ravel(), [0.0, 0.0, 0.0], atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 50),
    widths=st.lists(st.integers(0, 5), min_size=1, max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_columns_stats_equal_each_column_alone(length, widths, seed):
    rng = np.random.default_rng(seed)
    columns = {
        f"c{k}": rng.normal(size=(length, width)).astype(np.float32) if width else rng.normal(size=length)
        for k, width in enumerate(widths)
    }
    together = columns_stats(columns)
    assert list(together) == list(columns)
    for key, values in columns.items():
        expected = _reference(values.reshape(length, -1).astype(np.float64), axis=0)
        for name, value in expected.items():
            np.testing.assert_allclose(together[key][name], value, rtol=1e-12, atol=1e-12, err_msg=name)
        assert together[key]["count"].tolist() == [length]
        alone = episode_stats(values, False)
        for name in expected:
            np.testing.assert_allclose(alone[name], together[key][name], rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    column=st.lists(st.integers(-3, 3) | st.sampled_from([0.5, 1e6, -1e-7]), min_size=1, max_size=90),
)
def test_quantiles_of_columns_with_ties_and_values_on_bin_edges_are_lerobots(column):
    values = np.asarray(column, dtype=np.float64)
    got = columns_stats({"c": values})["c"]
    for name, value in _reference(values.reshape(-1, 1), axis=0).items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-9, err_msg=name)


def test_quantiles_follow_lerobot_not_order_statistics():
    """A sparse 0/1 reward column: LeRobot's q99 is the rare 1 (np.quantile interpolates to 0.24); a
    12-frame frame_index: LeRobot's q01 is 0 (np.quantile: 0.11)."""
    rewards = np.zeros(77)
    rewards[-1] = 1.0
    stats = columns_stats({"rewards": rewards, "frame_index": np.arange(77) % 12})
    assert stats["rewards"]["q99"][0] == pytest.approx(1.0, abs=1e-3)
    assert stats["rewards"]["q50"][0] == pytest.approx(0.0, abs=1e-9)
    assert np.quantile(rewards, 0.99) == pytest.approx(0.24)
    ramp = columns_stats({"frame_index": np.arange(12)})["frame_index"]
    assert ramp["q01"][0] == pytest.approx(0.0, abs=1e-9)
    assert ramp["q50"][0] == pytest.approx(5.0, abs=1e-2) and ramp["q99"][0] == pytest.approx(11.0, abs=1e-2)


def test_a_written_group_carries_each_episodes_stats(tmp_path):
    """The episodes file's per-episode stats are those of the episode's own frames, cameras included."""
    records = [pattern_record(tag, image_size=16) for tag in (3, 11, 20)]
    features = features_from_fields(dict(PatternSpec(image_size=16).fields()), KeyMap(None), True)
    writer = DatasetWriter(tmp_path / "ds", features, 20, video_codec="h264")
    for record in records:
        writer.add(record)
    assert writer.flush() == 3
    episodes = pq.read_table(tmp_path / "ds" / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    rows = episodes.to_pylist()
    for row, record in zip(rows, records):
        state = record.frames["obs/state"].astype(np.float64)
        np.testing.assert_allclose(row["stats/observation.state/mean"], state.mean(0))
        np.testing.assert_allclose(row["stats/observation.state/q99"], _reference(state, axis=0)["q99"])
        assert row["stats/observation.state/count"] == [record.length]
        image = _image_reference(record.frames["obs/image"])
        np.testing.assert_allclose(np.ravel(row["stats/observation.image/q10"]), image["q10"], atol=1e-12)
        np.testing.assert_allclose(np.ravel(row["stats/observation.image/max"]), image["max"], atol=1e-12)
        np.testing.assert_allclose(row["stats/frame_index/max"], [record.length - 1])
    columns = [name for name in episodes.column_names if name.startswith("stats/")]
    keys = list(dict.fromkeys(name.split("/")[1] for name in columns))
    assert keys[:4] == ["observation.state", "action", "rewards", "observation.image"]  # features first
