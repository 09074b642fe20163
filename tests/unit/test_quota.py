"""EpisodeQuota: publication rules, all-or-nothing debits, the hard limit and quota-aware row draws."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simstream import Episode
from simstream.buffer import quota as quota_module
from simstream.buffer.quota import EpisodeQuota

pytestmark = pytest.mark.timeout(60)

JOIN_TIMEOUT_S = 60.0
INT64_MAX = 2**63 - 1
PUBLISH_ERROR = r"^Sampling quota publication requires fresh monotonic episode identities$"
BUDGET_ERROR = r"^Sampling quota reservation exceeded its source budget$"
FORK = mp.get_context("fork")


def _quota(num_rows: int = 4, budget: int = 2, hard_limit: int = 3) -> EpisodeQuota:
    return EpisodeQuota(num_rows, budget, hard_limit, run_id=9, ctx=FORK)


def _published(num_rows: int = 4, budget: int = 2, hard_limit: int = 3) -> EpisodeQuota:
    quota = _quota(num_rows, budget, hard_limit)
    quota.publish(torch.arange(num_rows), torch.arange(num_rows), generation=1)
    return quota


def _t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_rows": 0}, "num_rows"),
        ({"num_rows": True}, "num_rows"),
        ({"budget": 0}, "budget"),
        ({"budget": 2.0}, "budget"),
        ({"hard_limit": 2**63}, "hard_limit"),
        ({"budget": 4, "hard_limit": 3}, "budget"),
        ({"run_id": "x"}, "run_id"),
    ],
    ids=[
        "rows-zero",
        "rows-bool",
        "budget-zero",
        "budget-float",
        "limit-too-big",
        "budget-over-limit",
        "run",
    ],
)
def test_constructor_validation(kwargs, field):
    args = {"num_rows": 4, "budget": 2, "hard_limit": 3, "run_id": 1, **kwargs}
    with pytest.raises(ValueError, match=rf"^EpisodeQuota\.{field} must be"):
        EpisodeQuota(**args, ctx=FORK)


def test_initial_state():
    before = time.monotonic_ns()
    quota = EpisodeQuota(3, 2, 2, run_id=5)
    assert before <= quota.clock_origin_monotonic_ns <= time.monotonic_ns()
    assert quota.snapshot(None) == [] and quota.total_delivered() == 0
    assert quota.max_published_episode_id == -1
    assert quota.remaining(torch.arange(3)).tolist() == [0, 0, 0]
    assert quota.unlocked_remaining(torch.ones(3, dtype=torch.bool)) == 0


def test_publish_sets_rows_and_high_water():
    quota = _quota()
    quota.publish(_t(1, 3), _t(10, 12), generation=2)
    assert quota.max_published_episode_id == 12
    assert quota.snapshot(torch.tensor([False, True, False, False])) == [
        {
            "run_id": 9,
            "episode_id": 10,
            "generation": 2,
            "slot": 1,
            "assigned": 2,
            "delivered": 0,
            "remaining": 2,
            "locked": True,
        },
        {
            "run_id": 9,
            "episode_id": 12,
            "generation": 2,
            "slot": 3,
            "assigned": 2,
            "delivered": 0,
            "remaining": 2,
            "locked": False,
        },
    ]


@pytest.mark.parametrize(
    ("rows", "episode_ids", "generation"),
    [
        (_t(), _t(), 1),
        (_t(4), _t(5), 1),
        (_t(-1), _t(5), 1),
        (_t(0, 1), _t(6, 6), 1),
        (_t(0, 1), _t(7, 6), 1),
        (_t(0), _t(3), 1),
        (_t(0), _t(5), 1),
        (_t(0), _t(6), 0),
        (_t(0), _t(6), True),
        (_t(0, 0), _t(6, 7), 1),
        (_t(0, 1), _t(6), 1),
        (torch.tensor([0.0]), _t(6), 1),
        ([0], _t(6), 1),
    ],
    ids=[
        "empty",
        "row-too-big",
        "row-negative",
        "ids-equal",
        "ids-decreasing",
        "id-below-high-water",
        "id-equal-high-water",
        "generation-zero",
        "generation-bool",
        "duplicate-rows",
        "length-mismatch",
        "float-rows",
        "list-rows",
    ],
)
def test_publish_rejects_stale_or_malformed_identities(rows, episode_ids, generation):
    quota = _quota()
    quota.publish(_t(2), _t(5), generation=1)
    before = quota.state_dict()
    with pytest.raises(ValueError, match=PUBLISH_ERROR):
        quota.publish(rows, episode_ids, generation)
    after = quota.state_dict()
    assert torch.equal(before["rows"], after["rows"]) and torch.equal(before["meta"], after["meta"])


def test_republished_row_gets_a_fresh_quota_and_lifetime_keeps_counting():
    quota = _published(budget=2)
    quota.debit(_t(0, 0, 1))
    assert quota.remaining(_t(0, 1)).tolist() == [0, 1]
    quota.publish(_t(0), _t(4), generation=2)
    assert quota.remaining(_t(0, 1)).tolist() == [2, 1]
    assert quota.total_delivered() == 3
    assert quota.snapshot()[0]["episode_id"] == 4


def test_debit_charges_duplicates_per_occurrence():
    quota = _published(budget=3, hard_limit=3)
    quota.debit(_t(2, 0, 2, 2))
    assert quota.remaining(torch.arange(4)).tolist() == [2, 3, 0, 3]
    assert quota.total_delivered() == 4
    quota.debit(_t())
    assert quota.total_delivered() == 4


@pytest.mark.parametrize(
    "rows", [_t(1, 1, 1), _t(3, 0, 0, 0), _t(0, 3, 3, 3, 3)], ids=["one-row", "mixed", "with-valid-prefix"]
)
def test_debit_is_all_or_nothing(rows):
    quota = _published(budget=2, hard_limit=3)
    quota.debit(_t(0))
    with pytest.raises(RuntimeError, match=BUDGET_ERROR):
        quota.debit(rows)
    assert quota.remaining(torch.arange(4)).tolist() == [1, 2, 2, 2]
    assert quota.total_delivered() == 1


def test_debit_of_an_unpublished_row_exceeds_its_budget():
    quota = _quota()
    quota.publish(_t(0), _t(0), generation=1)
    with pytest.raises(RuntimeError, match=BUDGET_ERROR):
        quota.debit(_t(0, 1))
    assert quota.total_delivered() == 0


@pytest.mark.parametrize("rows", [_t(4), _t(-1), torch.tensor([0.0]), _t(0).reshape(1, 1)], ids=repr)
def test_debit_rejects_bad_rows(rows):
    with pytest.raises(ValueError, match=r"^EpisodeQuota\.debit rows must"):
        _published().debit(rows)


def test_hard_limit_caps_an_assignment_above_it():
    quota = _published(budget=3, hard_limit=3)
    state = quota.state_dict()
    state["rows"][1, 2] = 10  # an assignment above the ceiling, as a restored older config could hold
    quota.load_state_dict(state)
    assert quota.remaining(_t(1)).tolist() == [3]
    with pytest.raises(RuntimeError, match=BUDGET_ERROR):
        quota.debit(_t(1, 1, 1, 1))
    quota.debit(_t(1, 1, 1))
    assert quota.remaining(_t(1)).tolist() == [0]
    assert quota.snapshot()[1]["remaining"] == 0


def test_lifetime_counter_overflow():
    quota = _published(budget=3, hard_limit=3)
    state = quota.state_dict()
    state["meta"][1] = INT64_MAX - 1
    quota.load_state_dict(state)
    with pytest.raises(OverflowError, match=r"^Lifetime sampling delivery counter would overflow int64$"):
        quota.debit(_t(0, 1))
    assert quota.remaining(_t(0, 1)).tolist() == [3, 3]
    quota.debit(_t(0))
    assert quota.total_delivered() == INT64_MAX


def test_unlocked_remaining_counts_published_rows_in_the_mask():
    quota = _quota(num_rows=5, budget=3, hard_limit=3)
    quota.publish(_t(0, 1, 2), _t(0, 1, 2), generation=1)
    quota.debit(_t(1, 1))
    mask = torch.tensor([True, True, False, True, True])
    assert quota.unlocked_remaining(mask) == 3 + 1
    assert quota.unlocked_remaining(torch.zeros(5, dtype=torch.bool)) == 0


def test_draw_rows_prefers_no_row_and_respects_spent_rows():
    quota = _published(num_rows=4, budget=3000, hard_limit=3000)
    quota.debit(torch.full((2999,), 3))
    rows = quota.draw_rows(torch.arange(4), 3000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(rows, minlength=4).tolist()
    assert counts[3] <= 1
    assert all(900 <= c <= 1100 for c in counts[:3]), counts


def test_draw_rows_needs_enough_quota():
    quota = _published(budget=2)
    with pytest.raises(ValueError, match=r"batch_size=9 exceeds the candidates' remaining quota 8"):
        quota.draw_rows(torch.arange(4), 9)
    assert quota.draw_rows(torch.arange(4), 8).sort().values.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert quota.draw_rows(_t(), 0).tolist() == []


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    budget=st.integers(1, 6),
    debits=st.lists(st.integers(0, 11), max_size=30),
    candidates=st.lists(st.integers(0, 11), min_size=1, max_size=20),
    fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
    rounds=st.sampled_from([0, 1, quota_module._MAX_DRAW_ROUNDS]),
)
def test_draw_rows_invariants(budget, debits, candidates, fraction, seed, rounds):
    quota = _quota(num_rows=12, budget=budget, hard_limit=budget)
    quota.publish(torch.arange(10), torch.arange(10), generation=1)  # rows 10 and 11 stay unpublished
    for row in debits:
        if row < 10 and int(quota.remaining(_t(row))) > 0:
            quota.debit(_t(row))
    candidate_rows = torch.tensor(candidates)
    remaining = quota.remaining(torch.arange(12)).clamp(min=0)
    supply = int(remaining[candidate_rows.unique()].sum())
    batch_size = int(supply * fraction)
    original = quota_module._MAX_DRAW_ROUNDS
    quota_module._MAX_DRAW_ROUNDS = rounds
    try:
        rows = quota.draw_rows(candidate_rows, batch_size, generator=torch.Generator().manual_seed(seed))
        again = quota.draw_rows(candidate_rows, batch_size, generator=torch.Generator().manual_seed(seed))
    finally:
        quota_module._MAX_DRAW_ROUNDS = original
    assert rows.dtype == torch.int64 and rows.shape == (batch_size,)
    assert torch.equal(rows, again), "the same seed must give the same rows"
    assert set(rows.tolist()) <= set(candidates)
    assert bool((torch.bincount(rows, minlength=12) <= remaining).all())
    quota.debit(rows)  # a draw is always chargeable


def _child_debits(quota, rows) -> None:
    with quota.lock:
        quota.debit(rows)
        quota.publish(_t(3), _t(50), generation=2)


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_debits_and_publications_are_visible_across_processes(method):
    ctx = mp.get_context(method)
    quota = EpisodeQuota(4, 3, 3, run_id=1, ctx=ctx)
    quota.publish(torch.arange(3), torch.arange(3), generation=1)
    child = ctx.Process(target=_child_debits, args=(quota, _t(0, 0, 2)))
    child.start()
    child.join(JOIN_TIMEOUT_S)
    if child.is_alive():
        child.kill()
        child.join(JOIN_TIMEOUT_S)
    assert child.exitcode == 0
    assert quota.remaining(torch.arange(4)).tolist() == [1, 3, 2, 3]
    assert quota.total_delivered() == 3 and quota.max_published_episode_id == 50
    with pytest.raises(ValueError, match=PUBLISH_ERROR):
        quota.publish(_t(1), _t(50), generation=2)


@pytest.mark.parametrize("candidates", [_t(0, 4), _t(-1, 2)], ids=["too-big", "negative"])
def test_draw_rows_rejects_out_of_range_candidates(candidates):
    with pytest.raises(ValueError, match=r"^EpisodeQuota\.draw_rows candidate_rows must lie in \[0, 4\)$"):
        _published().draw_rows(candidates, 1)


def test_the_largest_budgets_neither_wrap_the_sums_nor_refuse_a_batch():
    """A budget of 2**63 - 1 (the config allows it) on two rows: their summed quota exceeds int64, which
    made every quota-checked batch fail with a negative remaining count."""
    from tests.support.harness import Harness

    big = 2**63 - 1
    quota = EpisodeQuota(2, big, big, run_id=0, ctx=FORK)
    harness = Harness(rows=2, steps=8, quota=quota)
    harness.publish(0, Episode(length=8))
    harness.publish(1, Episode(length=8))
    quota.publish(torch.tensor([0, 1]), torch.tensor([0, 1]), generation=1)
    assert quota.unlocked_remaining(torch.ones(2, dtype=torch.bool)) == 2 * big
    assert set(quota.draw_rows(torch.tensor([0, 1]), 4).tolist()) <= {0, 1}  # a set: a list compares by order
    batch = harness.sampler.sample_chunks(4, 2, "episode", None)
    assert batch["valid"].all()
    assert quota.unlocked_remaining(torch.ones(2, dtype=torch.bool)) == 2 * big - 4
