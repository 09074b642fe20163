"""Sampling invariants over arbitrary episodes (Hypothesis), on real shared storage in-process."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simstream import DataUnavailableError, Episode, Field, Segment
from simstream.buffer.index import EligibilityIndex
from simstream.buffer.storage import TrajectoryStorage
from simstream.config import SourceLayout
from simstream.sampling.keys import select_keys
from simstream.sampling.sampler import WindowSampler
from tests.support.harness import Harness

STEPS = 16


@st.composite
def episodes(draw) -> Episode:
    length = draw(st.integers(0, STEPS))
    cuts = sorted(draw(st.sets(st.integers(1, max(length - 1, 1)), max_size=4))) if length > 1 else []
    bounds = [0, *[c for c in cuts if 0 < c < length], length] if length else []
    segments = []
    for lo, hi in itertools.pairwise(bounds):
        if draw(st.booleans()) or not segments:
            segments.append(Segment(lo, hi, draw(st.sampled_from([None, "a", "b"])), draw(st.booleans())))
    continuity = None
    if length and draw(st.booleans()):
        continuity = draw(st.lists(st.integers(-1, 2), min_size=length, max_size=length))
    return Episode(length=length, segments=segments, continuity=continuity)


def _expected_ok(episode: Episode, start: int, chunk: int, mode: str) -> bool:
    """The rule, written frame by frame (the slow, obvious way)."""
    length = episode.length
    if start + chunk > length:
        return False
    continuity = list(episode.continuity) if episode.continuity is not None else [0] * length
    seg = [-1] * length
    acc = [False] * length
    for k, s in enumerate(episode.segments or [Segment(0, length)]):
        for t in range(s.start, s.end):
            seg[t], acc[t] = k, s.accepted
    window = range(start, start + chunk)
    if len({continuity[t] for t in window}) != 1 or continuity[start] < 0:
        return False
    if mode == "segment":
        return len({seg[t] for t in window}) == 1 and seg[start] >= 0 and all(acc[t] for t in window)
    if mode == "boundary":
        crosses = any(seg[t] != seg[t + 1] for t in range(start, start + chunk - 1))
        return crosses and all(acc[t] for t in window)
    return True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(episodes(), min_size=1, max_size=4),
    chunk=st.integers(1, 8),
    mode=st.sampled_from(["episode", "segment", "boundary"]),
    seed=st.integers(0, 2**31),
)
def test_every_sampled_window_obeys_the_mode(rows, chunk, mode, seed):
    if mode == "boundary" and chunk < 2:
        chunk = 2
    harness = Harness(rows=len(rows), steps=STEPS)
    for row, episode in enumerate(rows):
        harness.publish(row, episode)
    eligible = {
        (row, start)
        for row, episode in enumerate(rows)
        for start in range(STEPS)
        if _expected_ok(episode, start, chunk, mode)
    }
    generator = torch.Generator().manual_seed(seed)
    if not eligible:
        with pytest.raises(DataUnavailableError, match="No unlocked valid chunk"):
            harness.sampler.sample_chunks(8, chunk, mode, generator)
        return
    batch = harness.sampler.sample_chunks(32, chunk, mode, generator)
    assert batch.batch_size == torch.Size([32, chunk])
    assert bool(batch["valid"].all())
    rows_seen = batch["obs"][:, :, 0]
    steps_seen = batch["obs"][:, :, 1]
    assert bool((rows_seen == rows_seen[:, :1]).all()), "a chunk mixes rows"
    assert bool((steps_seen[:, 1:] - steps_seen[:, :-1] == 1).all()), "a chunk is not consecutive"
    for row, start in zip(rows_seen[:, 0].long().tolist(), steps_seen[:, 0].long().tolist()):
        assert (row, start) in eligible
    # Every eligible row can be drawn: episode-uniform over rows with a window.
    eligible_rows = {row for row, _ in eligible}
    big = harness.sampler.sample_chunks(400, chunk, mode, generator)
    assert set(big["obs"][:, 0, 0].long().tolist()) == eligible_rows


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(episodes(), min_size=1, max_size=3),
    history=st.integers(1, 5),
    horizon=st.integers(1, 5),
    mode=st.sampled_from(["episode", "segment"]),
    seed=st.integers(0, 2**31),
)
def test_contexts_never_cross_invalid_continuity_or_segment(rows, history, horizon, mode, seed):
    harness = Harness(rows=len(rows), steps=STEPS)
    for row, episode in enumerate(rows):
        harness.publish(row, episode)
    anchors = {(row, t) for row, e in enumerate(rows) for t in range(STEPS) if _expected_ok(e, t, 1, mode)}
    generator = torch.Generator().manual_seed(seed)
    if not anchors:
        with pytest.raises(DataUnavailableError):
            harness.sampler.sample_contexts(4, history, horizon, mode, generator)
        return
    batch = harness.sampler.sample_contexts(16, history, horizon, mode, generator)
    now = history - 1
    assert batch.batch_size == torch.Size([16, history + horizon - 1])
    valid = batch["valid"]
    assert bool(valid[:, now].all()), "the anchor is always a real frame"
    assert torch.equal(batch["loss_mask"], valid & (torch.arange(valid.shape[1]) >= now))
    for i in range(16):
        row = int(batch["obs"][i, now, 0])
        t = int(batch["obs"][i, now, 1])
        assert (row, t) in anchors
        episode = rows[row]
        for j in range(valid.shape[1]):
            time_j = t + j - now
            if bool(valid[i, j]):
                assert int(batch["obs"][i, j, 1]) == time_j
                lo, hi = min(t, time_j), max(t, time_j)
                assert _expected_ok(episode, lo, hi - lo + 1, "segment" if mode == "segment" else "episode")
            else:
                assert float(batch["obs"][i, j].abs().sum()) == 0.0
                assert int(batch["task_index"][i, j]) == -1
                assert int(batch["subtask_index"][i, j]) == -1
        # the context is the whole contiguous run around the anchor, clipped to the window
        run = [j for j in range(valid.shape[1]) if bool(valid[i, j])]
        assert run == list(range(run[0], run[-1] + 1))


def test_same_generator_seed_gives_identical_batches():
    harness = Harness(rows=4, steps=STEPS)
    for row in range(4):
        harness.publish(row, Episode(length=10 + row))
    first = harness.sampler.sample_contexts(8, 3, 4, "episode", torch.Generator().manual_seed(5))
    second = harness.sampler.sample_contexts(8, 3, 4, "episode", torch.Generator().manual_seed(5))
    assert (first == second).all()
    chunks_a = harness.sampler.sample_chunks(8, 4, "episode", torch.Generator().manual_seed(9))
    chunks_b = harness.sampler.sample_chunks(8, 4, "episode", torch.Generator().manual_seed(9))
    assert (chunks_a == chunks_b).all()


def test_rows_being_written_are_never_sampled():
    harness = Harness(rows=3, steps=STEPS)
    for row in range(3):
        harness.publish(row, Episode(length=12))
    harness.writer.claim(1, 2)  # a producer starts rewriting row 1
    batch = harness.sampler.sample_chunks(200, 4, "episode", torch.Generator().manual_seed(0))
    assert set(batch["obs"][:, 0, 0].long().tolist()) == {0, 2}


def _finish(harness: Harness, start: int, end: int, length: int) -> None:
    """Write and publish claimed rows ``[start, end)``: episodes of ``length`` frames, obs = (row, t)."""
    view = harness.storage.rows_view(start, end, payload_only=True)
    for offset in range(end - start):
        view["obs"][offset, :length, 0] = float(start + offset)
        view["obs"][offset, :length, 1] = torch.arange(length, dtype=torch.float32)
        view["actions"][offset, :length, 0] = torch.arange(length, dtype=torch.float32)
    harness.writer.write(start, [Episode(length=length)] * (end - start), attempt=0)
    harness.writer.publish(start, end, 2, harness.next_episode)
    harness.next_episode += end - start


def test_a_row_claimed_again_after_it_settled_is_waited_for():
    """The wait gives up early only when every row kept one published version through the latest try: a row
    that settled (too short to serve) and was claimed since may come back serving the request."""
    harness = Harness(rows=4, steps=8)
    for row in range(4):
        harness.publish(row, Episode(length=2))  # too short for a chunk of 8
    harness.writer.claim(2, 4)  # a producer rewrites rows 2 and 3
    tries = []

    def check_ready():
        tries.append(1)
        if (
            len(tries) == 2
        ):  # rows 0 and 1 have settled; rows 2 and 3 come back short, then 0 and 1 are claimed
            _finish(harness, 2, 4, length=2)
            harness.writer.claim(0, 2)
        if len(tries) == 4:  # rows 0 and 1 come back long enough
            _finish(harness, 0, 2, length=8)

    batch = harness.sampler.sample_chunks(
        4, 8, "episode", torch.Generator().manual_seed(0), check_ready=check_ready, wait_s=60.0
    )
    assert len(tries) == 4
    assert set(batch["obs"][:, 0, 0].long().tolist()) <= {0, 1} and bool(batch["valid"].all())


def test_torn_rows_are_redrawn():
    """A row claimed between selection and the version check is replaced, never returned."""
    harness = Harness(rows=2, steps=STEPS)
    for row in range(2):
        harness.publish(row, Episode(length=12))
    gatherer = harness.sampler.gatherer
    original = gatherer.gather
    calls = []

    def gather_then_claim(frames, out=None, columns=None):
        result = original(frames, out, columns)
        if not calls:
            harness.writer.claim(0, 1)  # row 0 is rewritten while the copy is in flight
        calls.append(frames)
        return result

    gatherer.gather = gather_then_claim
    batch = harness.sampler.sample_chunks(64, 4, "episode", torch.Generator().manual_seed(1))
    assert len(calls) >= 2, "the torn items must be gathered again"
    assert set(batch["obs"][:, 0, 0].long().tolist()) == {1}
    assert bool(batch["valid"].all())


def test_batches_are_copies():
    harness = Harness(rows=1, steps=STEPS)
    harness.publish(0, Episode(length=8))
    batch = harness.sampler.sample_chunks(2, 4, "episode", None)
    batch["obs"].zero_()
    assert float(harness.storage.metadata("episode_step")[0, 3]) == 3
    assert float(harness.storage.rows_view()["obs"][0, 3, 1]) == 3.0


# -- keys= ------------------------------------------------------------------------------------------
def _leaf_paths(batch) -> set[tuple[str, ...]]:
    return {k if isinstance(k, tuple) else (k,) for k in batch.keys(include_nested=True, leaves_only=True)}


KEY_FORMS = {
    "obs": ["obs", ("obs",)],
    "actions": ["actions", ("actions",)],
    "task_index": ["task_index"],
    "episode_step": [("episode_step",)],
}


@settings(max_examples=40, deadline=None)
@given(
    names=st.lists(st.sampled_from(sorted(KEY_FORMS)), max_size=4),
    form=st.integers(0, 1),
    chunk=st.integers(1, 6),
    contexts=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_keys_copy_exactly_the_named_keys_of_the_same_draws(names, form, chunk, contexts, seed):
    """keys= changes what is copied, never what is drawn: same seed, same windows, fewer keys."""
    harness = Harness(rows=3, steps=STEPS)
    for row in range(3):
        harness.publish(row, Episode(length=10 + row))
    keys = [KEY_FORMS[name][form % len(KEY_FORMS[name])] for name in names]

    def sample(**kwargs):
        generator = torch.Generator().manual_seed(seed)
        if contexts:
            return harness.sampler.sample_contexts(8, chunk, 2, "episode", generator, **kwargs)
        return harness.sampler.sample_chunks(8, chunk, "episode", generator, **kwargs)

    full, selected = sample(), sample(keys=keys)
    expected = {(name,) for name in names} | {("valid",)} | ({("loss_mask",)} if contexts else set())
    assert _leaf_paths(selected) == expected
    for path in expected:
        assert torch.equal(selected.get(path), full.get(path)), path


def test_keys_accept_field_names_nested_tuples_and_groups():
    harness = Harness(rows=2, steps=STEPS)
    for row in range(2):
        harness.publish(row, Episode(length=12))
    sampler = harness.sampler
    assert _leaf_paths(sampler.sample_chunks(2, 3, "episode", None, keys="actions")) == {
        ("actions",),
        ("valid",),
    }
    assert _leaf_paths(sampler.sample_chunks(2, 3, "episode", None, keys=[])) == {("valid",)}
    contexts = sampler.sample_contexts(2, 2, 2, "episode", None, keys=["loss_mask", "obs"])
    assert _leaf_paths(contexts) == {("obs",), ("valid",), ("loss_mask",)}


def test_keys_select_nested_fields_by_name_tuple_or_group():
    layout = SourceLayout(1, STEPS, {"obs/state": Field((2,)), "obs/rgb": Field((3, 4, 4), torch.uint8)})
    storage = TrajectoryStorage(layout, 2, False)
    sampler = WindowSampler(storage, EligibilityIndex(2, STEPS))
    paths = sampler.gatherer.paths
    rgb, state, valid = paths.index(("obs", "rgb")), paths.index(("obs", "state")), paths.index(("valid",))
    assert select_keys(paths, "obs/rgb") == tuple(sorted((rgb, valid)))
    assert select_keys(paths, [("obs", "rgb")]) == tuple(sorted((rgb, valid)))
    assert select_keys(paths, ["obs"]) == tuple(sorted((rgb, state, valid)))
    assert select_keys(paths, None) is None


@pytest.mark.parametrize(
    ("keys", "error", "message"),
    [
        pytest.param(
            ["obs", "camera"],
            KeyError,
            r"no stored key 'camera'; the buffer holds 'obs', 'actions'",
            id="unknown",
        ),
        pytest.param(
            ("obs", "state"),
            ValueError,
            r"keys=\('obs', 'state'\) is ambiguous: pass \[\('obs', 'state'\)\] for the nested key "
            r"'obs/state', "
            r"or \['obs', 'state'\] for 2 keys",
            id="bare-tuple-of-strings",
        ),
        pytest.param(["obs/x"], KeyError, r"no stored key 'obs/x'.*'valid'", id="unknown-field-name"),
        pytest.param("loss_mask", KeyError, r"no stored key 'loss_mask'", id="loss-mask-of-chunks"),
        pytest.param([3], ValueError, r"keys: 3 is not a key; a key is a nonempty str", id="int"),
        pytest.param([["obs"]], ValueError, r"keys: \['obs'\] is not a key", id="list-entry"),
        pytest.param(["obs//x"], ValueError, r"keys: 'obs//x' is not a key", id="empty-part"),
        pytest.param({"obs"}, ValueError, r"keys must be None, a key or a list of keys .* got set", id="set"),
    ],
)
def test_bad_keys_are_refused_before_anything_is_copied(keys, error, message):
    harness = Harness(rows=1, steps=STEPS)
    harness.publish(0, Episode(length=8))
    out = harness.sampler.sample_chunks(2, 4, "episode", None)
    out.apply_(lambda leaf: leaf.zero_())
    with pytest.raises(error, match=message):
        harness.sampler.sample_chunks(2, 4, "episode", None, out=out, keys=keys)
    assert not any(bool(leaf.any()) for leaf in out.values(include_nested=True, leaves_only=True))


def test_a_bare_tuple_is_refused_even_after_the_list_of_its_names_was_resolved():
    """The resolved keys are cached by their names: the bare tuple found the list's entry and was read as
    two keys once a list call had come first."""
    harness = Harness(rows=1, steps=STEPS)
    harness.publish(0, Episode(length=8))
    harness.sampler.sample_chunks(2, 4, "episode", None, keys=["obs", "actions"])
    with pytest.raises(ValueError, match=r"keys=\('obs', 'actions'\) is ambiguous"):
        harness.sampler.sample_chunks(2, 4, "episode", None, keys=("obs", "actions"))


def test_out_on_another_device_is_refused_before_anything_is_written():
    """A batch moved to a device (``batch.to("cuda")``) is no ``out`` for a CPU buffer; ``meta`` stands in
    for a GPU here."""
    harness = Harness(rows=1, steps=STEPS)
    harness.publish(0, Episode(length=8))
    out = harness.sampler.sample_chunks(2, 4, "episode", None)
    moved = out.apply(lambda leaf: leaf.to("meta") if leaf.dtype is torch.float32 else leaf.zero_())
    with pytest.raises(
        ValueError,
        match=r"out\['obs'\] must be a contiguous torch.float32 tensor of shape "
        r"\(2, 4, 2\) on the CPU \(where the buffer is\), got torch.float32 \(2, 4, 2\) on meta",
    ):
        harness.sampler.sample_chunks(2, 4, "episode", None, out=moved)
    assert not bool(moved["valid"].any())  # nothing was written


def test_out_with_keys_checks_and_writes_only_the_named_keys():
    harness = Harness(rows=1, steps=STEPS)
    harness.publish(0, Episode(length=8))
    out = harness.sampler.sample_chunks(2, 4, "episode", None, keys=["actions"])
    out.set("obs", torch.zeros(2, 4, 5))  # a wrong shape on a key not copied is left alone
    result = harness.sampler.sample_chunks(2, 4, "episode", None, out=out, keys=["actions"])
    assert result is out and torch.equal(out["obs"], torch.zeros(2, 4, 5))
    assert bool(out["valid"].all())
    with pytest.raises(KeyError, match="out has no tensor at 'obs'"):
        harness.sampler.sample_chunks(2, 4, "episode", None, out=out.exclude("obs"), keys=["obs"])
    with pytest.raises(ValueError, match=r"out\['obs'\] must be a contiguous torch.float32 tensor"):
        harness.sampler.sample_chunks(2, 4, "episode", None, out=out, keys=["obs"])
