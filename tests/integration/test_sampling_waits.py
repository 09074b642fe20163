"""Sampling while producers rewrite every row: a temporary lack of windows waits, a producer's error wins.

Issue 16, item 7. ``buffer_size == num_workers * num_envs`` gives each producer exactly one window, so
with ``refill_threshold=0`` (a refill after every batch) there are moments when every row is claimed.
"""

from __future__ import annotations

import itertools
import math
import time

import pytest

from simstream import DataUnavailableError, OnlineDataEngine, OnlineDataEngineCfg
from simstream.data import OnlineDataset
from tests.support.engines import make_cfg, stop_quietly
from tests.support.sources import ScriptedSpec, assert_whole_chunks

pytestmark = pytest.mark.timeout(180)


def test_dataloader_workers_sample_while_producers_rewrite_every_row():
    cfg = make_cfg(ScriptedSpec(num_envs=2), buffer_size=4, num_workers=2, refill_threshold=0)
    with OnlineDataEngine(cfg) as engine:
        loader = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=1).loader(num_workers=2)
        served = 0
        for batch in itertools.islice(loader, 2000):  # on the old sampler: DataUnavailableError within ~200
            assert_whole_chunks(batch)
            served += 1
        assert served == 2000
        engine.check_health()


@pytest.mark.parametrize("workers", [1, 2])
def test_producer_failing_while_its_rows_are_claimed_reaches_the_dataloader(workers):
    """The rollout raises after the claim: the iteration shows the source's KeyError, never unavailability."""
    spec = ScriptedSpec(num_envs=2, fault="raise", fault_after=20)
    cfg = make_cfg(spec, buffer_size=2 * workers, num_workers=workers, refill_threshold=0)
    engine = OnlineDataEngine(cfg)
    try:
        engine.start()
        batches = iter(OnlineDataset(engine, chunk_size=4, batch_size=8, seed=1).loader(num_workers=2))
        try:
            with pytest.raises(KeyError, match="scripted failure in rollout"):
                for _ in range(100_000):
                    next(batches)
        finally:
            batches._shutdown_workers()  # the raised error keeps the iterator alive
    finally:
        stop_quietly(engine)


def test_producer_killed_while_its_rows_are_claimed_is_reported_to_the_sampler():
    """Every row is claimed when the producer dies: the owner's sample waits for the death report."""
    spec = ScriptedSpec(num_envs=2, fault="sigkill", fault_after=1)
    cfg = make_cfg(spec, buffer_size=2, refill_policy="manual", sample_wait_timeout=1e6)
    engine = OnlineDataEngine(cfg)
    try:
        engine.start()
        engine.request_refill()  # the producer claims both rows, then kills itself
        with pytest.raises(RuntimeError, match="simulation worker exited unexpectedly"):
            for _ in range(1_000_000):
                engine.sample_batch(4, 2)
    finally:
        stop_quietly(engine)


def test_nothing_eligible_and_nothing_being_written_raises_at_once():
    """Idle producers and no eligible window: no wait, even with an unbounded timeout."""
    cfg = make_cfg(
        ScriptedSpec(num_envs=2),
        buffer_size=4,
        refill_policy="manual",
        include_provenance=True,
        sample_wait_timeout=1e6,
    )
    with OnlineDataEngine(cfg) as engine:
        with pytest.raises(DataUnavailableError, match="satisfies sampling_mode='boundary' and chunk_size=2"):
            engine.sample_batch(1, 2, "boundary")  # one segment per episode: no boundary
        with pytest.raises(
            DataUnavailableError,
            match=r"satisfies sampling_mode='episode' and chunk_size=1 \(the anchor frame of a context of "
            r"history_length=2 and prediction_horizon=2, among episodes of generations \[5\]\)",
        ):
            engine.sample_batch_with_context(4, 2, 2, generations=(5,))  # never requested
        engine.check_health()


def test_rows_that_stay_claimed_end_the_wait_at_the_bound():
    """A producer stalled inside its rollout keeps every row claimed: DataUnavailableError after the bound."""
    spec = ScriptedSpec(num_envs=2, fault="stall", fault_after=1)
    cfg = make_cfg(spec, buffer_size=2, refill_policy="manual", sample_wait_timeout=0.2)
    with OnlineDataEngine(cfg) as engine:
        engine.request_refill()
        deadline = time.monotonic() + 60
        while engine.get_stats()["valid_frames"]:  # until the producer has claimed its rows
            assert time.monotonic() < deadline, "the producer never claimed its rows"
            engine.check_health()
        with pytest.raises(
            DataUnavailableError, match="No unlocked valid chunk satisfies sampling_mode='episode'"
        ):
            engine.sample_batch(4, 2)
        engine.check_health()  # nothing failed: producers keep running


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "sample_wait_timeout must be finite and greater than zero, got 0."),
        (math.nan, "sample_wait_timeout must be finite and greater than zero, got nan."),
        (True, "sample_wait_timeout must be finite and greater than zero, got True."),
        (2e6, r"sample_wait_timeout must be at most 1e\+06 seconds \(about 11 days\), got 2000000.0."),
    ],
)
def test_sample_wait_timeout_is_checked_like_the_other_timeouts(value, message):
    with pytest.raises(ValueError, match=message):
        OnlineDataEngineCfg(source=ScriptedSpec(), sample_wait_timeout=value).validate()
