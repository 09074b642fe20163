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


def test_a_refill_asked_for_but_not_begun_is_waited_for_and_serves_the_request():
    """Every row published and unchanged, nothing eligible: it gave up at once even when a refill was
    asked for that no producer had claimed a row of yet, so a DataUnavailableError came just before the
    data. While ``rewrite_pending()`` holds, the request waits, and the rows published meanwhile serve it;
    once nothing is pending it gives up at once again."""
    from simstream import Episode, Segment
    from simstream.errors import DataUnavailableError as Unavailable
    from tests.support.harness import Harness

    harness = Harness(rows=2, steps=16)
    for row in range(2):
        harness.publish(row, Episode(8))  # one segment each: no boundary window
    looks: list[int] = []

    def pending() -> bool:  # by the third look the producer has rewritten row 1, its generation not done
        looks.append(len(looks))
        if len(looks) == 3:
            harness.publish(1, Episode(8, segments=[Segment(0, 4, "reach"), Segment(4, 8, "place")]))
        return True

    batch = harness.sampler.sample_chunks(2, 2, "boundary", None, wait_s=60.0, rewrite_pending=pending)
    assert len(looks) == 3
    assert batch["obs"][:, :, 0].eq(1.0).all()  # from the rewritten row
    assert batch["segment_id"][:, 0].ne(batch["segment_id"][:, 1]).all()  # across its boundary
    with pytest.raises(Unavailable, match="satisfies sampling_mode='segment' and chunk_size=9"):
        # nothing pending: at once, whatever the bound (the test's timeout is far below it)
        harness.sampler.sample_chunks(1, 9, "segment", None, wait_s=1e6, rewrite_pending=lambda: False)


def test_a_sample_right_after_request_refill_waits_for_the_generation_it_names():
    """The engine's ``rewrite_pending``: a generation requested and not complete. Asking for its episodes
    at once waits for them (it raised DataUnavailableError when no row was claimed yet)."""
    cfg = make_cfg(
        ScriptedSpec(num_envs=2, rollout_s=0.05),
        buffer_size=4,
        refill_policy="manual",
        include_provenance=True,
        sample_wait_timeout=60.0,
    )
    with OnlineDataEngine(cfg) as engine:
        for _ in range(3):
            generation = engine.request_refill()
            batch = engine.sample_batch_with_context(4, 2, 2, generations=(generation,))
            anchors = batch["ods_generation"][:, 1]  # the anchor frame (history_length=2)
            assert anchors.eq(generation).all()
            engine.wait_for_generation(generation, timeout=60)
        engine.check_health()


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_log_with_room_for_every_writer_is_not_reported_as_pausing_them(backend):
    """The owner reads whether a writer waits, not a guess at how much the next one reserves: the Ray
    ingest's guess (publish_windows windows of records, 24 here) called a log with 6 free of 12 full, for
    producers whose largest window group needs 4, and sampling then stopped waiting for their refill."""
    from simstream.ray import RayBackend

    cfg = make_cfg(
        ScriptedSpec(num_envs=2),
        buffer_size=6,
        num_workers=3,
        refill_policy="manual",
        lifecycle_event_capacity=12,
        backend=RayBackend() if backend == "ray" else None,
    )
    engine = OnlineDataEngine(cfg)  # not started: the log's state is set by hand
    events = engine._shared.events
    assert events.reserve(6, should_stop=lambda: False)  # 6 of 12 slots taken
    assert engine._log_full() == ""
    assert not events.reserve(7, should_stop=lambda: engine._log_full() != "", poll_s=0.001)
    assert engine._log_full() == ""  # the reservation that found no room gave up


def test_producers_paused_on_a_full_lifecycle_log_are_not_waited_for_and_the_error_says_why():
    """Only the owner's drain_lifecycle_events() frees the log, and the owner is the one sampling: waiting
    for the refill would last the whole sample_wait_timeout (1e6 s here, far past the test's timeout)."""
    cfg = make_cfg(
        ScriptedSpec(num_envs=2),
        buffer_size=4,
        refill_policy="manual",
        include_provenance=True,
        lifecycle_event_capacity=8,
        sample_wait_timeout=1e6,
    )
    with OnlineDataEngine(cfg) as engine:
        engine.drain_lifecycle_events()
        engine.wait_for_generation(engine.request_refill(), timeout=60)  # its records fill the log
        generation = engine.request_refill()
        with pytest.raises(
            DataUnavailableError,
            match=rf"among episodes of generations \[{generation}\]\); the lifecycle log holds 8 of its 8 "
            r"records .* producers wait for drain_lifecycle_events\(\)",
        ):
            engine.sample_batch_with_context(4, 2, 2, generations=(generation,))
        engine.drain_lifecycle_events()
        batch = engine.sample_batch_with_context(4, 2, 2, generations=(generation,))
        assert batch["ods_generation"][:, 1].eq(generation).all()
        engine.check_health()
