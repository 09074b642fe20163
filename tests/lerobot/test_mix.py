"""MixSpec: proportions within statistical bounds, the source_index key, and every refusal."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simstream import Episode, Field, OnlineDataEngine, OnlineDataEngineCfg
from simstream.sources import SOURCE_INDEX, MixSpec
from simstream.synthetic import SyntheticSpec

from .sources import PatternSpec

pytestmark = pytest.mark.timeout(120)


@dataclasses.dataclass(frozen=True)
class PolicyPatternSpec(PatternSpec):
    action_semantics: str = "policy_request"
    action_contracts: tuple[str, ...] = ("joint_position_delta",)


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=4).filter(lambda w: sum(w) > 0.1),
    seed=st.integers(0, 2**32),
)
def test_windows_follow_the_weights(weights, seed):
    spec = MixSpec(tuple(PatternSpec() for _ in weights), weights)
    source = spec.build(0, seed)
    n = 4000
    counts = [0] * len(weights)
    for _ in range(n):
        counts[source.choose()] += 1
    total = sum(weights)
    for k, w in enumerate(weights):
        p = w / total
        # each tail of the count at least 1e-9 likely: at most ~1e-6 false failures per run of 100 examples,
        # exact for small n * p too, where a normal bound would fail about once in 10^4 runs
        assert min(_binomial_tails(n, p, counts[k])) >= 1e-9, (k, counts, weights)
        if w == 0:
            assert counts[k] == 0


@functools.cache
def _log_choose(n: int) -> np.ndarray:
    return np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(n + 1)])


def _binomial_tails(n: int, p: float, count: int) -> tuple[float, float]:
    """``P(X <= count)`` and ``P(X >= count)`` for ``X ~ Binomial(n, p)``."""
    if p <= 0.0 or p >= 1.0:
        certain = 0 if p <= 0.0 else n
        return (1.0 if count >= certain else 0.0), (1.0 if count <= certain else 0.0)
    k = np.arange(n + 1)
    pmf = np.exp(_log_choose(n) + k * math.log(p) + (n - k) * math.log1p(-p))
    return float(pmf[: count + 1].sum()), float(pmf[count:].sum())


def test_every_frame_carries_its_source_index_through_the_engine():
    a, b = PatternSpec(), PatternSpec(max_episode_steps=20)
    spec = MixSpec((a, b), (1, 3))
    assert spec.fields()[SOURCE_INDEX] == Field((), torch.int64) and spec.fps == 20
    cfg = OnlineDataEngineCfg(source=spec, buffer_size=16, num_workers=1, refill_policy="manual")
    with OnlineDataEngine(cfg) as engine:
        index = engine.shared_buffer[SOURCE_INDEX]
        valid = engine.shared_buffer["valid"]
        rows = index[:, 0]
        assert set(rows.tolist()) <= {0, 1} and 1 in rows.tolist()
        for row in range(16):  # one value per row, on every valid frame
            assert torch.all(index[row][valid[row]] == rows[row])
        batch = engine.sample_batch(8, 4, keys=[SOURCE_INDEX, "actions"])
        assert batch[SOURCE_INDEX].shape == (8, 4)


def test_a_windows_retries_stay_with_the_source_drawn_for_it(monkeypatch):
    """A window whose episode failed is tried again from the same source, so the sources' failure rates do
    not tilt the published shares; the next window is drawn afresh."""
    spec = MixSpec((PatternSpec(), PatternSpec()), (1, 1))
    source = spec.build(0, 0)
    draws = iter([1, 0])
    monkeypatch.setattr(source, "choose", lambda: next(draws))
    rows = _rows(spec)
    for attempt in range(3):  # the first try of window 1 and two retries
        assert source.rollout(rows, attempt=attempt, should_stop=lambda: False) is not None
        assert bool((rows[SOURCE_INDEX] == 1).all())
    assert source.draws == [0, 1] and list(source.sources) == [1]
    source.rollout(rows, attempt=0, should_stop=lambda: False)  # the next window: drawn again
    assert bool((rows[SOURCE_INDEX] == 0).all()) and source.draws == [1, 1]


@dataclasses.dataclass(frozen=True)
class _OverreportingSpec(PatternSpec):
    """Writes its ``max_episode_steps`` frames and reports ``reported`` of them."""

    reported: int = 8

    def build(self, worker_index: int, seed: int):
        return _OverreportingSource(self)


class _OverreportingSource:
    def __init__(self, spec: _OverreportingSpec) -> None:
        self.spec = spec

    def rollout(self, rows, *, attempt, should_stop):
        for key in rows.keys(include_nested=True, leaves_only=True):
            rows[key][:, : self.spec.max_episode_steps] = 7
        return [Episode(self.spec.reported, terminated=True)] * self.spec.num_envs

    def close(self) -> None:
        pass


@pytest.mark.parametrize("through_the_engine", [False, True])
def test_an_episode_longer_than_its_own_source_s_rows_is_refused(through_the_engine):
    """The engine checks a mix's episodes against the longest source's rows; a source of 5 steps that
    reported 8 had 3 frames it never wrote published as valid (zeros, or an older episode's)."""
    spec = MixSpec((PatternSpec(max_episode_steps=10), _OverreportingSpec(max_episode_steps=5)), (0, 1))
    message = "MixSpec.specs[1] (_OverreportingSpec): Episode.length of row 0 must be an int in [0, 5], got 8"
    if not through_the_engine:
        rows = _rows(spec)
        with pytest.raises(ValueError) as raised:
            spec.build(0, 0).rollout(rows, attempt=0, should_stop=lambda: False)
        assert str(raised.value) == message
        assert bool((rows[SOURCE_INDEX] == 0).all()), "a refused window is not stamped"
        return
    engine = OnlineDataEngine(OnlineDataEngineCfg(source=spec, buffer_size=2, num_workers=1))
    with pytest.raises(ValueError) as raised:
        engine.start()
    assert str(raised.value) == message
    # within its own rows, the same source is published
    fits = MixSpec(
        (PatternSpec(max_episode_steps=10), _OverreportingSpec(max_episode_steps=5, reported=5)), (0, 1)
    )
    with OnlineDataEngine(OnlineDataEngineCfg(source=fits, buffer_size=2, num_workers=1)) as engine:
        assert engine.shared_buffer["valid"].sum(dim=1).tolist() == [5, 5]


def test_the_sources_common_action_semantics_reach_the_engine_check():
    policy = MixSpec((PolicyPatternSpec(), PolicyPatternSpec()), (1, 1))
    assert policy.action_semantics == "policy_request"
    assert policy.action_contracts == ("joint_position_delta",)
    plain = MixSpec((PatternSpec(),), (1,))
    assert plain.action_semantics is None and plain.action_contracts is None
    # a source that declares nothing (a recorded dataset) mixes with one that does, which decides
    mixed = MixSpec((PatternSpec(), PolicyPatternSpec()), (1, 1))
    assert mixed.action_semantics == "policy_request" and mixed.action_contracts == ("joint_position_delta",)
    message = "action_semantics is 'expert_controller_command' but the source records 'policy_request'"
    with pytest.raises(ValueError, match=message):
        OnlineDataEngineCfg(source=policy, buffer_size=4).validate()


def _rows(spec: MixSpec):
    from tensordict import TensorDict

    tree: dict = {}
    for name, field in spec.fields().items():
        *parents, leaf = name.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = torch.zeros((spec.num_envs, spec.max_episode_steps, *field.shape), dtype=field.dtype)
    return TensorDict(tree, batch_size=[spec.num_envs, spec.max_episode_steps])


def test_numpy_weights_are_numbers_like_any_other():
    spec = MixSpec((PatternSpec(), PatternSpec()), np.array([3, 1]))
    assert spec.weights == (3.0, 1.0) and all(type(w) is float for w in spec.weights)
    assert MixSpec((PatternSpec(),), (np.float32(0.5),)).weights == (0.5,)


@pytest.mark.parametrize(
    ("specs", "weights", "fragment"),
    [
        ((), (), "MixSpec.specs must hold at least one source spec"),
        ((PatternSpec(),), (1, 2), r"MixSpec.weights must hold one weight per spec \(1\), got 2"),
        ((PatternSpec(),), (-1,), r"MixSpec.weights\[0\] must be a finite number >= 0, got -1"),
        ((PatternSpec(),), (float("nan"),), r"MixSpec.weights\[0\] must be a finite number >= 0"),
        ((PatternSpec(),), (True,), r"MixSpec.weights\[0\] must be a finite number >= 0, got True"),
        ((PatternSpec(),), (np.bool_(True),), r"MixSpec.weights\[0\] must be a finite number >= 0"),
        ((PatternSpec(),), ("1",), r"MixSpec.weights\[0\] must be a finite number >= 0, got '1'"),
        ((PatternSpec(),), (10**400,), r"MixSpec.weights\[0\] must be a finite number >= 0, got 1000"),
        (
            (PatternSpec(), PatternSpec()),
            (0, 0),
            r"MixSpec.weights must sum to a finite number > 0, got \[0, 0\] \(sum 0.0\)",
        ),
        (
            (PatternSpec(), PatternSpec()),
            (1e308, 1e308),
            r"MixSpec.weights must sum to a finite number > 0, got \[1e\+308, 1e\+308\] \(sum inf\)",
        ),
        (PatternSpec(), (1,), "MixSpec.specs must be a sequence \\(one entry per source\\), got PatternSpec"),
        ((PatternSpec(),), 1.0, "MixSpec.weights must be a sequence \\(one entry per source\\), got float"),
        (
            (PatternSpec(), "pick_place"),
            (1, 1),
            r"MixSpec.specs\[1\] must be a SourceSpec \(fields\(\), build\(\), num_envs, "
            r"max_episode_steps\); str lacks \['fields', 'build', 'num_envs', 'max_episode_steps'\]",
        ),
        (
            (PolicyPatternSpec(), dataclasses.replace(PolicyPatternSpec(), action_semantics="other")),
            (1, 1),
            r"MixSpec.specs record different action_semantics: \[\"'other'\", \"'policy_request'\"\]",
        ),
        (
            (PatternSpec(), PatternSpec(image_size=16)),
            (1, 1),
            r"MixSpec.specs\[1\] has other fields than specs\[0\]: 'obs/image': \(3, 16, 16\) uint8 against "
            r"absent \(every source",
        ),
        (
            (PatternSpec(), PatternSpec(num_envs=2)),
            (1, 1),
            r"MixSpec.specs\[1\].num_envs is 2, specs\[0\].num_envs is 1",
        ),
        (
            (SyntheticSpec(), PatternSpec()),
            (1, 1),
            r"MixSpec.specs\[1\] has other fields than specs\[0\]",
        ),
    ],
    ids=[
        "empty",
        "count",
        "negative",
        "nan",
        "bool",
        "numpy-bool",
        "string",
        "int-beyond-float",
        "all-zero",
        "overflowing-sum",
        "one-spec",
        "one-weight",
        "not-a-spec",
        "action-semantics",
        "fields",
        "num-envs",
        "other-source",
    ],
)
def test_refusals(specs, weights, fragment):
    with pytest.raises(ValueError, match=fragment):
        MixSpec(specs, weights)
