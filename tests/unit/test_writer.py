"""The episode writer's row states: claim, write and the frames past an episode's end."""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simstream import Episode, Field, Segment
from simstream.buffer.index import compute_row_tables, segment_row_tables
from simstream.buffer.storage import TrajectoryStorage
from simstream.buffer.writer import EpisodeWriter, derive_row_metadata, derive_rows_metadata
from simstream.config import METADATA_KEYS, SourceLayout
from simstream.sources import validate_episodes
from tests.support.harness import Harness


def test_claim_resets_metadata_and_write_poisons_only_past_the_end():
    harness = Harness(rows=2, steps=16)
    harness.writer.check_unwritten_frames = False
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


def test_with_the_check_claim_and_each_retry_poison_the_float_payload_only():
    layout = SourceLayout(1, 4, {"obs": Field((2,)), "image": Field((3,), torch.uint8)})
    storage = TrajectoryStorage(layout, 2, include_provenance=False)
    harness = Harness(rows=2, steps=4)
    writer = EpisodeWriter(storage, harness.index, harness.language, run_id=0)
    rows = storage.rows_view()
    rows["obs"][:], rows["image"][:] = 1.0, 7
    writer.claim(0, 1)
    assert bool(rows["obs"][0].isnan().all()) and bool((rows["obs"][1] == 1.0).all())  # only the claimed row
    assert bool((rows["image"] == 7).all())  # images cross the memory bus once per episode, not twice
    rows["obs"][0] = 2.0  # a failed attempt's frames
    writer.reset_metadata(0, 1)  # before the next attempt
    assert bool(rows["obs"][0].isnan().all())


def test_a_full_length_episode_is_not_poisoned():
    harness = Harness(rows=1, steps=8)
    harness.publish(0, Episode(length=8))
    assert torch.equal(harness.storage.rows_view()["actions"][0, :, 0], torch.arange(8.0))


@st.composite
def _segment_layouts(draw) -> tuple[int, list[tuple[int, int, bool]]]:
    """A row length and segments as ``validate_episodes`` accepts them: sorted, disjoint, non-empty ones
    with gaps or touching, and empty ones anywhere in the list at any frame in ``[0, length]``."""
    length = draw(st.integers(0, 40))
    cuts = sorted(draw(st.sets(st.integers(0, length), max_size=10)))
    segments = [
        (lo, hi, draw(st.booleans()))
        for lo, hi in itertools.pairwise(cuts)
        if draw(st.booleans())  # drop some: gaps between segments
    ]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, length))
        segments.insert(draw(st.integers(0, len(segments))), (at, at, draw(st.booleans())))
    return length, segments


@given(_segment_layouts())
def test_segment_tables_equal_the_tables_scanned_from_metadata(layout):
    length, segments = layout
    episode = Episode(length, segments=[Segment(lo, hi, None, ok) for lo, hi, ok in segments])
    assert validate_episodes([episode], 1, 40) == [episode]
    segment_id = np.full(length, -1, dtype=np.int64)
    accepted = np.zeros(length, dtype=bool)
    for k, (lo, hi, ok) in enumerate(segments):  # ids are list positions; an empty segment marks no frame
        segment_id[lo:hi], accepted[lo:hi] = k, ok
    scanned = compute_row_tables(np.zeros(length, dtype=np.int64), segment_id, accepted)
    derived = segment_row_tables(length, segments)
    for mode in range(2):
        np.testing.assert_array_equal(derived.runs[mode], scanned.runs[mode])
        assert derived.runs[mode].dtype == scanned.runs[mode].dtype and derived.runs[mode].shape[1:] == (2,)
    np.testing.assert_array_equal(derived.boundaries, scanned.boundaries)
    assert derived.boundaries.shape[1:] == (3,) and derived.valid_frames == scanned.valid_frames == length


def test_segment_runs_break_at_a_continuity_break_whatever_the_segment_ids():
    """Segment ids count empty segments too, so they may exceed the row's length: a continuity break
    between segment 0 (region 1) and segment 3 (region 0) is still two runs, not one across the break.
    With ids as large as int64 allows, nothing wraps."""
    tables = compute_row_tables(np.array([1, 0]), np.array([0, 3]), np.array([True, True]))
    assert tables.runs[0].tolist() == [[0, 1], [1, 2]] and tables.runs[1].tolist() == [[0, 1], [1, 2]]
    huge = 2**62
    tables = compute_row_tables(np.array([0, huge, huge]), np.array([0, 0, 0]), np.ones(3, dtype=bool))
    assert tables.runs[1].tolist() == [[0, 1], [1, 3]]
    # and through the writer: the episode validate_episodes accepts, sampled in segment mode
    harness = Harness(rows=1, steps=4)
    segments = [Segment(0, 1), Segment(1, 1), Segment(1, 1), Segment(1, 2)]
    harness.publish(0, Episode(length=2, segments=segments, continuity=[1, 0]))
    index = harness.index
    count = int(index.num_runs[1, 0])
    runs = torch.stack([index.run_lo[1, 0, :count], index.run_hi[1, 0, :count]], dim=1)
    assert runs.tolist() == [[0, 1], [1, 2]]


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


def test_an_empty_segment_marks_no_frame_keeps_its_id_and_never_interns_its_text():
    harness = Harness(rows=1, steps=12)
    segments = [Segment(0, 4, "reach"), Segment(4, 4, "never said"), Segment(4, 9, "grasp"), Segment(12, 12)]
    harness.publish(0, Episode(length=12, instruction="pick", segments=segments))
    segment_id = harness.storage.metadata("segment_id")[0]
    assert segment_id.tolist() == [0] * 4 + [2] * 5 + [-1] * 3  # ids are positions in Episode.segments
    starts, ends = harness.storage.metadata("segment_start")[0], harness.storage.metadata("segment_end")[0]
    assert torch.nonzero(starts).flatten().tolist() == [0, 4]
    assert torch.nonzero(ends).flatten().tolist() == [3, 8]
    subtasks = harness.language.resolve(harness.storage.metadata("subtask_index")[0], kind="subtask")
    assert subtasks == ["reach"] * 4 + ["grasp"] * 5 + ["pick"] * 3
    assert harness.language.count("subtask") == 3  # "never said" took no registry space
    assert int(harness.index.num_points[0]) == 1  # the change from id 0 to id 2 at frame 4 is a boundary
    assert harness.index.point[:, 0, 0].tolist() == [4, 0, 9]


def test_a_reported_frame_left_unwritten_is_rejected_naming_row_key_and_frame():
    harness = Harness(rows=3, steps=16)
    harness.writer.claim(1, 3)
    view = harness.storage.rows_view(1, 3, payload_only=True)
    view["obs"][:, :10] = 1.0
    view["actions"][:, :10] = 1.0
    view["actions"][1, 6:10] = float("nan")  # row 2 (offset 1) leaves frames 6.. of "actions" unwritten
    with pytest.raises(
        ValueError,
        match=r"Episode of buffer row 2 \(row 1 of the rollout\) reports length=10 but its payload 'actions' "
        r"holds NaN, the value of unwritten frames, first at frame 6: .*check_unwritten_frames=False",
    ):
        harness.writer.write(1, [Episode(10), Episode(10)], attempt=0)
    # nothing of the window was written: metadata unwritten, no run tables, rows still claimed (odd)
    assert not bool(harness.storage.metadata("valid")[1:3].any())
    assert harness.index.num_runs[:, 1:3].tolist() == [[0, 0], [0, 0]]
    assert harness.index.version[1:3].tolist() == [1, 1]


def test_nan_past_the_reported_length_and_in_non_float_keys_is_not_checked():
    layout = SourceLayout(
        1, 8, {"obs": Field((2,)), "count": Field((), torch.int64), "half": Field((), torch.bfloat16)}
    )
    storage = TrajectoryStorage(layout, 2, include_provenance=False)
    writer = EpisodeWriter(storage, Harness(rows=2, steps=8).index, Harness().language, run_id=0)
    view = storage.rows_view(0, 2, payload_only=True)
    view["obs"][:, :5] = 0.0
    view["half"][:, :5] = 0.0
    writer.write(0, [Episode(5), Episode(0)], attempt=0)  # frames 5.. and all of row 1 hold NaN: not reported
    view["half"][0, 3] = float("nan")  # bfloat16 (no NumPy dtype) is checked through torch
    with pytest.raises(ValueError, match=r"buffer row 0 .* payload 'half' holds NaN.*first at frame 3"):
        writer.write(0, [Episode(5), Episode(0)], attempt=0)


def test_the_check_can_be_turned_off_for_sources_whose_data_holds_nan():
    harness = Harness(rows=1, steps=8)
    harness.writer = EpisodeWriter(
        harness.storage, harness.index, harness.language, run_id=0, check_unwritten_frames=False
    )
    harness.writer.claim(0, 1)
    harness.storage.rows_view(0, 1, payload_only=True)["actions"][0, :8] = 1.0  # "obs" stays NaN
    harness.writer.write(0, [Episode(8)], attempt=0)
    assert bool(harness.storage.metadata("valid")[0].all())


@pytest.mark.parametrize("rows", [1, 4])  # row by row, and the vectorised pass of several rows
def test_a_blank_instruction_is_stored_as_unknown_task_like_none(rows):
    harness = Harness(rows=rows, steps=8)
    harness.writer.check_unwritten_frames = False
    harness.writer.claim(0, rows)
    episodes = [Episode(3, instruction=" \t ") for _ in range(rows)]
    harness.writer.write(0, episodes, attempt=0)
    task = harness.storage.metadata("task_index")[:, 0]
    assert harness.language.resolve(task, kind="task") == ["unknown_task"] * rows


def _reference_row(episode: Episode, attempt: int, language, steps: int) -> dict[str, np.ndarray]:
    """The per-row derivation written out frame by frame (the oracle of the vectorised one)."""
    length = episode.length
    row = {
        name: np.full(steps, False if name in _BOOLS else -1, dtype=bool if name in _BOOLS else np.int64)
        for name in METADATA_KEYS
    }
    if not length:
        return row
    text = episode.instruction if episode.instruction and episode.instruction.strip() else "unknown_task"
    row["valid"][:length] = True
    row["episode_step"][:length] = np.arange(length)
    row["segment_attempt_id"][:length] = attempt
    row["task_index"][:length] = language.intern(text, kind="task")
    row["subtask_index"][:length] = language.intern(text, kind="subtask")
    row["continuity_id"][:length] = 0 if episode.continuity is None else list(episode.continuity)
    segments = list(episode.segments) or [Segment(0, length)]
    for k, segment in enumerate(segments):
        lo, hi = segment.start, segment.end
        if lo == hi:
            continue
        row["segment_id"][lo:hi] = k
        row["segment_step"][lo:hi] = np.arange(hi - lo)
        row["segment_accepted"][lo:hi] = segment.accepted
        row["segment_start"][lo] = row["segment_end"][hi - 1] = True
        if segment.instruction is not None and segment.instruction.strip():
            row["subtask_index"][lo:hi] = language.intern(segment.instruction, kind="subtask")
    row["terminated"][length - 1], row["truncated"][length - 1] = episode.terminated, episode.truncated
    row["segment_end"][length - 1] |= episode.terminated or episode.truncated
    return row


_BOOLS = {name for name, dtype in METADATA_KEYS.items() if dtype == torch.bool}


@st.composite
def _episodes(draw) -> Episode:
    length, segments = draw(_segment_layouts())
    texts = st.sampled_from([None, "", "reach", "grasp", "lift"])
    continuity = None
    if draw(st.booleans()):
        continuity = sorted(draw(st.lists(st.integers(-1, 2), min_size=length, max_size=length)))
    return Episode(
        length,
        instruction=draw(texts),
        segments=[Segment(lo, hi, draw(texts), ok) for lo, hi, ok in segments],
        continuity=continuity,
        terminated=draw(st.booleans()),
        truncated=draw(st.booleans()),
    )


@given(st.lists(st.tuples(_episodes(), st.integers(0, 3)), min_size=1, max_size=6))
def test_rows_derived_together_equal_each_row_derived_alone(rows):
    episodes, attempts = [episode for episode, _ in rows], [attempt for _, attempt in rows]
    together, alone = Harness(rows=1, steps=40), Harness(rows=1, steps=40)
    derived = derive_rows_metadata(episodes, attempts, together.language, 40)
    for offset, (episode, attempt) in enumerate(rows):
        expected = _reference_row(episode, attempt, alone.language, 40)
        row = derive_row_metadata(episode, attempt, alone.language)  # the one-row path
        for name in METADATA_KEYS:
            np.testing.assert_array_equal(derived[name][offset], expected[name], err_msg=f"{offset} {name}")
            one = np.broadcast_to(row[name], (episode.length,))
            np.testing.assert_array_equal(one, expected[name][: episode.length], err_msg=f"{offset} {name}")
    for kind in ("task", "subtask"):  # texts interned in the same order: the same ids
        assert together.language.count(kind) == alone.language.count(kind)
        ids = torch.arange(alone.language.count(kind))
        assert together.language.resolve(ids, kind=kind) == alone.language.resolve(ids, kind=kind)


@given(st.lists(_segment_layouts(), min_size=1, max_size=6))
def test_tables_written_for_many_rows_at_once_equal_each_rows_segment_tables(layouts):
    together, alone = Harness(rows=len(layouts), steps=40), Harness(rows=len(layouts), steps=40)
    episodes = [
        Episode(length, segments=[Segment(lo, hi, None, ok) for lo, hi, ok in segments])
        for length, segments in layouts
    ]
    together.writer.check_unwritten_frames = False
    together.writer.claim(0, len(layouts))
    with mock.patch("simstream.buffer.writer._MANY_ROWS", 1):  # the vectorised pass, even for one row
        together.writer.write(0, episodes, attempt=0)
    alone.index.begin_write(0, len(layouts))
    for row, (length, segments) in enumerate(layouts):
        segments = segments or ([(0, length, True)] if length else [])  # none reported: the whole episode
        alone.index.write_tables(row, segment_row_tables(length, segments))
    for name in (
        "valid_frames",
        "num_runs",
        "run_lo",
        "run_hi",
        "longest_run",
        "point",
        "num_points",
        "longest_point_run",
    ):
        assert torch.equal(getattr(together.index, name), getattr(alone.index, name)), name


def test_tables_written_again_for_a_row_leave_nothing_of_the_first_layout():
    """A row's second tables (no accepted segment, no boundary) left the first's longest runs behind, which
    kept the row eligible for segment and boundary chunks it cannot serve."""
    harness = Harness(rows=1, steps=40)
    harness.index.begin_write(0, 1)
    harness.index.write_tables(0, segment_row_tables(20, [(0, 8, True), (8, 20, True)]))
    assert int(harness.index.longest_run[1, 0]) == 12 and int(harness.index.longest_point_run[0]) > 0
    harness.index.write_tables(0, segment_row_tables(20, [(0, 20, False)]))
    assert int(harness.index.num_runs[1, 0]) == 0 and int(harness.index.longest_run[1, 0]) == 0
    assert int(harness.index.num_points[0]) == 0 and int(harness.index.longest_point_run[0]) == 0


def test_a_claim_of_rows_left_odd_keeps_them_odd():
    """``begin_write`` added 1: rows an abandoned claim left odd became even (sampleable) while their
    tables were reset. No path claims such rows again today; the version stays odd either way."""
    harness = Harness(rows=2, steps=8)
    harness.index.begin_write(0, 2)
    odd = harness.index.version.tolist()
    assert all(v % 2 == 1 for v in odd)
    harness.index.begin_write(0, 1)
    assert harness.index.version.tolist() == [odd[0] + 2, odd[1]]
