"""Selection stays O(batch): rejection from all rows serves a request without the scan of every row
whenever eligible rows (with quota left, of the wanted generations) are not rare, and its draws keep the
distribution: uniform over those rows, none drawn past its quota."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from simstream import DataBudgetExhaustedError, Episode
from simstream.buffer.quota import EpisodeQuota
from simstream.sampling import sampler as sampler_module
from simstream.sampling import windows
from tests.support.harness import Harness

STEPS = 16


def _buffer(rows: int, eligible: int, *, budget: int | None = None, generation_of=lambda row: 1) -> Harness:
    """Rows ``[0, eligible)`` hold 16-frame episodes, the others 2-frame ones (too short for chunks of 4)."""
    quota = (
        None if budget is None else EpisodeQuota(rows, budget, budget, run_id=0, ctx=mp.get_context("fork"))
    )
    harness = Harness(rows=rows, steps=STEPS, quota=quota)
    for row in range(rows):
        generation = generation_of(row)
        harness.publish(row, Episode(length=STEPS if row < eligible else 2), generation)
        if quota is not None:
            quota.publish(torch.tensor([row]), torch.tensor([row]), generation)
    return harness


@pytest.fixture
def no_scan(monkeypatch):
    """Fail if the scan of every row runs."""

    def scan(*args, **kwargs):
        raise AssertionError("the O(buffer_size) candidate scan ran")

    monkeypatch.setattr(windows, "candidate_rows", scan)  # every scan goes through windows.eligible_rows


def _rows_of(batch) -> np.ndarray:
    return batch["obs"][:, 0, 0].numpy().astype(np.int64)


@pytest.mark.parametrize("eligible_share", [1.0, 0.25])
def test_without_quotas_no_scan_runs_unless_eligible_rows_are_rare(no_scan, eligible_share):
    rows = 4096
    harness = _buffer(rows, int(rows * eligible_share))
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = harness.sampler.sample_chunks(32, 4, "episode", generator)
        assert bool((_rows_of(batch) < rows * eligible_share).all())


def test_a_generation_filter_is_tested_per_drawn_row(no_scan):
    harness = _buffer(2048, 2048, generation_of=lambda row: 1 + row % 2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        batch = harness.sampler.sample_contexts(32, 2, 1, "episode", generator, generations=(2,))
        anchors = batch["obs"][:, 1, 0].numpy().astype(np.int64)  # the last history frame is the anchor
        assert bool((anchors % 2 == 1).all()), anchors


def test_with_quotas_no_scan_runs_and_each_draw_is_charged_once(no_scan):
    rows = 2048
    harness = _buffer(rows, rows, budget=1000)
    generator = torch.Generator().manual_seed(2)
    drawn = np.zeros(rows, np.int64)
    for _ in range(20):
        np.add.at(drawn, _rows_of(harness.sampler.sample_chunks(64, 4, "episode", generator)), 1)
    delivered = 1000 - harness.sampler.quota.remaining(torch.arange(rows)).numpy()
    np.testing.assert_array_equal(delivered, drawn)
    assert drawn.sum() == 20 * 64


def test_with_quotas_draws_are_uniform_over_eligible_rows_with_quota_left():
    rows, eligible = 512, 256
    harness = _buffer(rows, eligible, budget=10**6)
    quota = harness.sampler.quota
    quota.debit(torch.arange(64).repeat_interleave(10**6))  # rows 0..63: spent
    generator = torch.Generator().manual_seed(3)
    counts = np.zeros(rows, np.int64)
    batches = 300
    for _ in range(batches):
        np.add.at(counts, _rows_of(harness.sampler.sample_chunks(64, 4, "episode", generator)), 1)
    assert counts[:64].sum() == 0 and counts[eligible:].sum() == 0
    served = counts[64:eligible]
    expected = batches * 64 / served.size  # 100 per row
    assert served.min() > expected - 5 * expected**0.5 and served.max() < expected + 5 * expected**0.5
    chi2 = float(((served - expected) ** 2 / expected).sum())  # 191 degrees of freedom: mean 191, sd 19.5
    assert chi2 < 191 + 5 * 19.5, chi2


def test_a_row_is_never_drawn_past_its_quota_and_exhaustion_is_exact():
    rows = 512
    harness = _buffer(rows, rows, budget=1)
    generator = torch.Generator().manual_seed(4)
    seen = []
    for _ in range(8):  # 512 deliveries: every row exactly once, the last batches through the exact scan
        batch_rows = _rows_of(harness.sampler.sample_chunks(64, 4, "episode", generator))
        assert np.unique(batch_rows).size == 64
        seen.extend(batch_rows.tolist())
    assert sorted(seen) == list(range(rows))
    with pytest.raises(DataBudgetExhaustedError, match="complete batch of 1 chunks; remaining=0"):
        harness.sampler.sample_chunks(1, 4, "episode", generator)


def test_rank_and_occurrence_helpers():
    values = np.array([5, 3, 5, 5, 3, 9])
    np.testing.assert_array_equal(sampler_module._rank_within_value(values), [0, 0, 1, 2, 1, 0])
    np.testing.assert_array_equal(sampler_module._occurrences(values, np.array([5, 4, 9, 3])), [3, 0, 1, 2])
    np.testing.assert_array_equal(sampler_module._occurrences(np.empty(0, np.int64), np.array([1])), [0])


def test_with_quotas_a_batch_that_needs_several_rounds_keeps_the_distribution():
    """Two eligible rows of four: row 0 with one delivery left, row 1 with 100; batches of 2. Every draw is
    uniform over the rows with quota left, a draw past a row's quota is drawn again: P(both from row 1) is
    1/2 (first draw row 1) x 1/2 (second draw row 1) = 1/4. Rejection from all rows gives up on some calls
    here; restarting them from scratch made 0.275 of the batches so."""
    harness = _buffer(4, 2, budget=100)
    quota = harness.sampler.quota
    quota.debit(torch.zeros(99, dtype=torch.int64))
    state = quota.state_dict()
    generator = torch.Generator().manual_seed(5)
    calls, both = 4000, 0
    for _ in range(calls):
        quota.load_state_dict(state)
        both += bool((_rows_of(harness.sampler.sample_chunks(2, 4, "episode", generator)) == 1).all())
    sd = (0.25 * 0.75 / calls) ** 0.5  # 0.0068
    assert abs(both / calls - 0.25) < 4 * sd, both / calls
