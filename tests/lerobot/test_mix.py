"""MixSpec: proportions within statistical bounds, the source_index key, and every refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simstream import Field, OnlineDataEngine, OnlineDataEngineCfg
from simstream.sources import SOURCE_INDEX, MixSpec
from simstream.synthetic import SyntheticSpec

from .sources import PatternSpec

pytestmark = pytest.mark.timeout(120)


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
        bound = 5 * math.sqrt(n * p * (1 - p)) + 1  # five binomial standard deviations
        assert abs(counts[k] - n * p) <= bound, (k, counts, weights)
        if w == 0:
            assert counts[k] == 0


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
        ((PatternSpec(), PatternSpec()), (0, 0), r"MixSpec.weights must not all be 0, got \[0, 0\]"),
        (
            (PatternSpec(), PatternSpec(image_size=16)),
            (1, 1),
            r"MixSpec.specs\[1\] has other fields than specs\[0\]: \['obs/image'\] differ",
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
        "all-zero",
        "fields",
        "num-envs",
        "other-source",
    ],
)
def test_refusals(specs, weights, fragment):
    with pytest.raises(ValueError, match=fragment):
        MixSpec(specs, weights)
