"""The episode writer's row states: claim, write and the frames past an episode's end."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from simstream import Episode, Segment
from simstream.buffer.index import compute_row_tables, segment_row_tables
from tests.support.harness import Harness


def test_claim_resets_metadata_and_write_poisons_only_past_the_end():
    harness = Harness(rows=2, steps=16)
    harness.publish(0, Episode(length=16))
    obs = harness.storage.rows_view()["obs"]
    before = obs[0].clone()

    harness.writer.claim(0, 1)
    valid = harness.storage.metadata("valid")
    assert not bool(valid[0].any()) and bool((harness.storage.metadata("episode_step")[0] == -1).all())
    assert torch.equal(obs[0], before)  # payload is the source's to overwrite: claim leaves it

    obs[0, :5, 0] = 42.0
    harness.writer.write(0, [Episode(length=5)], attempt=0)
    assert torch.equal(obs[0, :5, 0], torch.full((5,), 42.0))
    assert bool(obs[0, 5:].isnan().all())  # nothing of the older, longer episode survives
    assert int(valid[0].sum()) == 5
    assert bool(obs[1].isnan().all())  # a row nobody wrote stays unwritten


def test_a_full_length_episode_is_not_poisoned():
    harness = Harness(rows=1, steps=8)
    harness.publish(0, Episode(length=8))
    assert torch.equal(harness.storage.rows_view()["actions"][0, :, 0], torch.arange(8.0))


@st.composite
def _segment_layouts(draw) -> tuple[int, list[tuple[int, int, bool]]]:
    """A row length and sorted, disjoint, non-empty segments inside it, with gaps or touching."""
    length = draw(st.integers(0, 40))
    cuts = sorted(draw(st.sets(st.integers(0, length), max_size=10)))
    segments = [
        (lo, hi, draw(st.booleans()))
        for lo, hi in itertools.pairwise(cuts)
        if draw(st.booleans())  # drop some: gaps between segments
    ]
    return length, segments


@given(_segment_layouts())
def test_segment_tables_equal_the_tables_scanned_from_metadata(layout):
    length, segments = layout
    segment_id = np.full(length, -1, dtype=np.int64)
    accepted = np.zeros(length, dtype=bool)
    for k, (lo, hi, ok) in enumerate(segments):
        segment_id[lo:hi], accepted[lo:hi] = k, ok
    scanned = compute_row_tables(np.zeros(length, dtype=np.int64), segment_id, accepted)
    derived = segment_row_tables(length, segments)
    for mode in range(2):
        np.testing.assert_array_equal(derived.runs[mode], scanned.runs[mode])
        assert derived.runs[mode].dtype == scanned.runs[mode].dtype and derived.runs[mode].shape[1:] == (2,)
    np.testing.assert_array_equal(derived.boundaries, scanned.boundaries)
    assert derived.boundaries.shape[1:] == (3,) and derived.valid_frames == scanned.valid_frames == length


def test_touching_accepted_segments_give_change_points_inside_their_run():
    segments = [(0, 4, True), (4, 9, True), (9, 12, False), (12, 15, True), (15, 20, True)]
    tables = segment_row_tables(20, segments)
    assert tables.runs[0].tolist() == [[0, 20]]
    assert tables.runs[1].tolist() == [[0, 4], [4, 9], [12, 15], [15, 20]]
    assert tables.boundaries.tolist() == [[4, 0, 9], [15, 12, 20]]


def test_the_writer_indexes_an_episode_without_continuity_like_one_with_explicit_zeros():
    segments = [Segment(0, 3), Segment(3, 7, accepted=False), Segment(8, 12), Segment(12, 16)]
    implicit, explicit = Harness(rows=1, steps=16), Harness(rows=1, steps=16)
    implicit.publish(0, Episode(length=16, segments=segments))
    explicit.publish(0, Episode(length=16, segments=segments, continuity=[0] * 16))
    for name in ("num_runs", "run_lo", "run_hi", "longest_run", "point", "num_points", "longest_point_run"):
        assert torch.equal(getattr(implicit.index, name), getattr(explicit.index, name)), name
    assert int(implicit.index.num_points[0]) == 1  # the change at frame 12


def test_step_counters_of_an_episode_longer_than_the_cached_steps():
    harness = Harness(rows=1, steps=5000)
    harness.publish(0, Episode(length=5000, segments=[Segment(0, 4500), Segment(4500, 5000)]))
    steps = torch.arange(5000)
    assert torch.equal(harness.storage.metadata("episode_step")[0], steps)
    assert torch.equal(harness.storage.metadata("segment_step")[0], torch.cat([steps[:4500], steps[:500]]))
