"""Derived seeds: reproducible, in range, and distinct for distinct parts (no word-splitting collisions)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simstream._seeding import derived_seed
from simstream.engine.window import derive_worker_seed
from simstream.tasks.source import episode_seed

parts = st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**20), st.integers(0, 2**20))


def test_seeds_past_32_bits_do_not_replay_another_producers_stream():
    """NumPy splits 2**32 + 7 into the words (7, 1): hashed raw, (2**32 + 7, 0) and (7, 1) gave one seed."""
    assert derive_worker_seed(2**32 + 7, 0) != derive_worker_seed(7, 1)
    assert episode_seed(2**32 + 1, 0, 0) != episode_seed(1, 1, 0)
    assert derived_seed(2**32, 0) != derived_seed(0, 1)


@given(a=parts, b=parts)
def test_distinct_parts_give_distinct_seeds(a, b):
    if a != b:
        assert derived_seed(*a) != derived_seed(*b)
        assert derive_worker_seed(a[0], a[1], a[2]) != derive_worker_seed(b[0], b[1], b[2])


@given(p=parts)
def test_seeds_are_reproducible_and_in_range(p):
    seed = derived_seed(*p)
    assert seed == derived_seed(*p) and 0 <= seed < 2**63
    assert 0 <= derived_seed(*p, bits=64) < 2**64 and derived_seed(*p, bits=64) >> 1 == seed
    assert derive_worker_seed(p[0], p[1]) == derived_seed(p[0], p[1])
    assert episode_seed(*p) == derived_seed(*p, bits=64)


@pytest.mark.parametrize("incarnation", [1, 2, 7])
def test_a_restarted_producer_gets_a_new_seed(incarnation):
    assert derive_worker_seed(5, 1, incarnation) != derive_worker_seed(5, 1)
    assert derive_worker_seed(5, 1, incarnation) != derive_worker_seed(5, 1, incarnation + 1)
