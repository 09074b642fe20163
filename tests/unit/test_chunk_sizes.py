"""Chunk-size samplers: validation and distribution bounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simstream.data import GMMChunkSampler, UniformChunkSampler


def test_uniform_validation_and_repr():
    with pytest.raises(ValueError, match="low must be an int ≥ 1, got 0"):
        UniformChunkSampler(0, 3)
    with pytest.raises(ValueError, match=r"high must be an int ≥ low \(4\), got 2"):
        UniformChunkSampler(4, 2)
    assert repr(UniformChunkSampler(2, 5)) == "UniformChunkSampler(low=2, high=5)"


@given(low=st.integers(1, 20), span=st.integers(0, 20), seed=st.integers(0, 1000))
def test_uniform_stays_in_bounds_and_is_seeded(low, span, seed):
    a, b = UniformChunkSampler(low, low + span, seed=seed), UniformChunkSampler(low, low + span, seed=seed)
    draws = [a() for _ in range(20)]
    assert draws == [b() for _ in range(20)]
    assert all(low <= d <= low + span for d in draws)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"means": [], "stds": []}, "means must not be empty"),
        ({"means": [4], "stds": [1, 2]}, "stds must have 1 entries"),
        ({"means": [4], "stds": [0]}, "every std must be finite and > 0"),
        ({"means": [4], "stds": [float("nan")]}, "every std must be finite and > 0"),
        ({"means": [float("inf")], "stds": [1]}, "every mean must be finite"),
        ({"means": [4, 8], "stds": [1, 1], "weights": [float("nan"), 1]}, "every weight must be finite"),
        ({"means": [4], "stds": [1], "weights": [1, 1]}, "weights must have 1 entries"),
        ({"means": [4], "stds": [1], "weights": [-1]}, "every weight must be finite and ≥ 0"),
        ({"means": [4], "stds": [1], "weights": [0]}, "weights must sum to a positive value"),
        ({"means": [4], "stds": [1], "low": 0}, "low must be None or an int ≥ 1"),
        ({"means": [4], "stds": [1], "low": 1.5}, r"low must be None or an int ≥ 1, got 1\.5"),
        ({"means": [4], "stds": [1], "high": 0}, "high must be None or an int ≥ 1"),
        ({"means": [4], "stds": [1], "low": 5, "high": 3}, r"high must be ≥ low \(5\)"),
        ({"means": ["4"], "stds": [1]}, r"every mean must be finite \(a number, not a bool\), got \['4'\]"),
        ({"means": [True], "stds": [1]}, r"every mean must be finite \(a number, not a bool\), got \[True\]"),
        ({"means": [4], "stds": [None]}, r"every std must be finite and > 0 \(a number, not a bool\)"),
        ({"means": [4, 8], "stds": [1, 1], "weights": [True, False]}, "every weight must be finite and ≥ 0"),
        ({"means": [4, 8], "stds": [1, 1], "weights": [10**400, 1]}, "every weight must be finite and ≥ 0"),
        ({"means": [4], "stds": [1], "seed": 1.5}, r"seed must be None or an int, got 1\.5"),
        ({"means": [4], "stds": [1], "seed": True}, r"seed must be None or an int, got True"),
    ],
)
def test_gmm_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GMMChunkSampler(**kwargs)


@given(seed=st.integers(0, 10_000))
def test_gmm_respects_bounds(seed):
    sampler = GMMChunkSampler([2, 30], [5, 5], weights=[1, 3], low=2, high=24, seed=seed)
    assert all(2 <= sampler() <= 24 for _ in range(50))


def test_weights_too_large_to_sum_keep_their_proportions():
    sampler = GMMChunkSampler([4, 8], [1, 1], weights=[1e308, 3e307], seed=0)
    assert sampler.weights == pytest.approx([1 / 1.3, 0.3 / 1.3])


def test_means_and_stds_near_the_float_range_still_draw_a_size_within_the_bounds():
    sampler = GMMChunkSampler([1e308], [1e308], high=10, seed=0)
    assert all(1 <= sampler() <= 10 for _ in range(200))


def test_seeds_of_integral_types_are_ints_and_others_are_refused():
    import numpy as np

    a, b = UniformChunkSampler(1, 100, seed=np.int64(3)), UniformChunkSampler(1, 100, seed=3)
    assert [a() for _ in range(10)] == [b() for _ in range(10)]
    with pytest.raises(ValueError, match=r"^seed must be None or an int, got '3'\.$"):
        a.seed("3")
