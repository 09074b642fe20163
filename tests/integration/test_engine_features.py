"""Provenance, per-episode quotas, the lifecycle log, language and contexts through real workers."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from simstream import DataBudgetExhaustedError, DataUnavailableError, OnlineDataEngine, OnlineDataEngineState
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(120)

SEGMENTED = ScriptedSpec(
    num_envs=2,
    max_episode_steps=20,
    lengths=(20, 14),
    segments=((0, 6, "reach the cup", True), (6, 10, None, False), (10, 20, "lift the cup", True)),
    continuity=(0,) * 12 + (1,) * 8,
    instruction="serve tea",
)


@pytest.mark.parametrize("workers", [1, 2])
def test_provenance_is_stamped_on_valid_frames_only(workers):
    cfg = make_cfg(SEGMENTED, buffer_size=4, num_workers=workers, include_provenance=True)
    with OnlineDataEngine(cfg) as engine:
        buffer = engine.shared_buffer
        valid = buffer["valid"]
        assert bool((buffer["ods_run_id"][valid] == engine.run_id).all())
        assert bool((buffer["ods_run_id"][~valid] == -1).all())
        assert torch.equal(buffer["ods_frame_index"][valid], buffer["episode_step"][valid])
        assert sorted(buffer["ods_episode_id"][:, 0].tolist()) == [0, 1, 2, 3]
        assert bool((buffer["ods_generation"][valid] == 1).all())
        published = buffer["ods_published_at_monotonic_ns"][:, 0]
        assert bool((published > 0).all())
        batch = engine.sample_batch(32, 3)
        assert bool((batch["ods_run_id"] == engine.run_id).all())
        assert bool((batch["ods_frame_index"][:, 1:] - batch["ods_frame_index"][:, :-1] == 1).all())


def test_segment_metadata_and_language_are_derived_from_the_report():
    with OnlineDataEngine(make_cfg(SEGMENTED, buffer_size=2)) as engine:
        row = engine.shared_buffer[0]  # length 20
        assert row["segment_id"][:20].tolist() == [0] * 6 + [1] * 4 + [2] * 10
        assert row["segment_step"][:8].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
        assert row["segment_accepted"][:20].tolist() == [True] * 6 + [False] * 4 + [True] * 10
        assert row["segment_start"][:20].nonzero().squeeze(1).tolist() == [0, 6, 10]
        assert row["segment_end"][:20].nonzero().squeeze(1).tolist() == [5, 9, 19]
        assert row["continuity_id"][:20].tolist() == [0] * 12 + [1] * 8
        assert bool(row["terminated"][19]) and not bool(row["terminated"][:19].any())
        text = engine.resolve_language(engine.shared_buffer[:1, :20])
        assert text["task"][0] == ["serve tea"] * 20
        # the unnamed segment inherits the task text
        assert text["subtask"][0] == ["reach the cup"] * 6 + ["serve tea"] * 4 + ["lift the cup"] * 10
        # segment windows stay in one accepted segment; boundary windows cross accepted segments only
        segment = engine.sample_batch(64, 3, "segment")
        assert bool((segment["segment_id"] == segment["segment_id"][:, :1]).all())
        assert bool(segment["segment_accepted"].all())
        # the only segment changes border the unaccepted segment: no boundary window exists
        with pytest.raises(Exception, match="No unlocked valid chunk satisfies sampling_mode='boundary'"):
            engine.sample_batch(1, 2, "boundary")
        # no mode crosses the continuity change at frame 12
        episode = engine.sample_batch(128, 4)
        assert bool((episode["continuity_id"] == episode["continuity_id"][:, :1]).all())


def test_boundary_windows_cross_accepted_segments():
    spec = ScriptedSpec(lengths=(20,), segments=((0, 6, "a", True), (6, 9, "b", True), (9, 20, "c", True)))
    with OnlineDataEngine(make_cfg(spec, buffer_size=2)) as engine:
        boundary = engine.sample_batch(256, 4, "boundary")
        segments = boundary["segment_id"]
        assert bool((segments[:, 1:] != segments[:, :-1]).any(1).all())
        starts = set(boundary["episode_step"][:, 0].tolist())
        assert starts == {3, 4, 5, 6, 7, 8}  # every start whose window crosses 5|6 or 8|9


def test_segment_context_is_clipped_to_the_anchor_segment():
    with OnlineDataEngine(make_cfg(SEGMENTED, buffer_size=2)) as engine:
        batch = engine.sample_batch_with_context(64, 4, 5, sampling_mode="segment")
        now = 3
        valid = batch["valid"]
        anchor_segment = batch["segment_id"][:, now : now + 1]
        assert bool((batch["segment_id"][valid] == anchor_segment.expand_as(valid)[valid]).all())
        assert bool(batch["segment_accepted"][valid].all())
        assert bool((batch["task_index"][~valid] == -1).all())
        assert torch.equal(batch["loss_mask"], valid & (torch.arange(8) >= now))


def test_generation_filter_restricts_context_anchors():
    cfg = make_cfg(buffer_size=4, include_provenance=True, refill_policy="manual")
    with OnlineDataEngine(cfg) as engine:
        engine.wait_for_generation(engine.request_refill(), timeout=30)
        batch = engine.sample_batch_with_context(32, 2, 2, generations=(2,))
        assert bool((batch["ods_generation"][batch["valid"]] == 2).all())
        with pytest.raises(Exception, match="No unlocked valid chunk"):
            engine.sample_batch_with_context(4, 2, 2, generations=(1,))


def test_generation_filter_holds_while_producers_republish_rows():
    """Rows republished between building the row filter and noting their versions are drawn again."""
    spec = ScriptedSpec(num_envs=2, max_episode_steps=20, lengths=(20,))
    cfg = make_cfg(spec, buffer_size=8, num_workers=2, include_provenance=True, refill_threshold=0)
    with OnlineDataEngine(cfg) as engine:  # refill_threshold=0: producers rewrite rows back to back
        served = 0
        for _ in range(300):
            generation = engine.get_stats()["completed_generation"]
            try:
                batch = engine.sample_batch_with_context(64, 2, 2, generations=(generation,))
            except DataUnavailableError:  # every row of that generation was rewritten meanwhile
                continue
            anchors = batch["ods_generation"][:, 1]  # position H - 1 = 1 is the anchor, always valid
            assert bool((anchors == generation).all()), anchors.unique().tolist()
            served += 1
        assert served > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_quota_charges_whole_batches_and_refreshes_with_new_episodes(workers):
    cfg = make_cfg(
        buffer_size=4,
        num_workers=workers,
        episode_sample_budget=3,
        episode_sample_hard_limit=5,
        refill_policy="manual",
    )
    with OnlineDataEngine(cfg) as engine:
        snapshot = engine.get_sampling_budget_snapshot()
        assert snapshot["enabled"] and snapshot["unlocked_remaining_chunks"] == 12
        assert len(snapshot["rows"]) == 4 and all(r["assigned"] == 3 for r in snapshot["rows"])
        engine.sample_batch(10, 2)
        assert engine.get_flow_status()["unlocked_remaining_chunks"] == 2
        with pytest.raises(DataBudgetExhaustedError, match=r"complete batch of 3 chunks; remaining=2\."):
            engine.sample_batch(3, 2)
        assert engine.get_flow_status()["total_delivered_chunks"] == 10  # nothing charged
        engine.sample_batch_with_context(2, 2, 2)
        assert engine.get_flow_status()["unlocked_remaining_chunks"] == 0
        delivered = {r["slot"]: r["delivered"] for r in engine.get_sampling_budget_snapshot()["rows"]}
        assert all(d == 3 for d in delivered.values())
        engine.wait_for_generation(engine.request_refill(), timeout=30)
        fresh = engine.get_sampling_budget_snapshot()
        assert fresh["unlocked_remaining_chunks"] == 12 and fresh["total_delivered_chunks"] == 12
        assert min(r["episode_id"] for r in fresh["rows"]) == 4


def test_quota_sampling_writes_into_out_and_checks_it_first():
    cfg = make_cfg(buffer_size=4, episode_sample_budget=50, episode_sample_hard_limit=50)
    with OnlineDataEngine(cfg) as engine:
        first = engine.sample_batch(8, 3)
        out = first.clone().zero_()
        batch = engine.sample_batch(8, 3, out=out)
        assert batch is out and bool(out["valid"].all())
        steps = out["obs"][..., 1]
        assert bool((steps[:, 1:] - steps[:, :-1] == 1).all())
        delivered = engine.get_flow_status()["total_delivered_chunks"]
        with pytest.raises(KeyError, match="out has no tensor at 'valid'"):
            engine.sample_batch(8, 3, out=out.exclude("valid"))
        wrong = out.clone()
        wrong.set("episode_step", wrong.get("episode_step").float())
        with pytest.raises(ValueError, match=r"out\['episode_step'\] must be a contiguous torch.int64"):
            engine.sample_batch(8, 3, out=wrong)
        assert engine.get_flow_status()["total_delivered_chunks"] == delivered  # nothing charged


def test_lifecycle_log_orders_published_and_evicted_records_across_a_refill():
    spec = ScriptedSpec(num_envs=2, lengths=(20, 5))
    cfg = make_cfg(spec, buffer_size=4, lifecycle_event_capacity=8, refill_policy="manual")
    with OnlineDataEngine(cfg) as engine:
        first = engine.drain_lifecycle_events()
        assert [(e["kind"], e["slot"], e["episode_id"]) for e in first] == [
            ("published", 0, 0),
            ("published", 1, 1),
            ("published", 2, 2),
            ("published", 3, 3),
        ]
        assert [e["sequence"] for e in first] == [0, 1, 2, 3]
        assert first[1]["valid_frames"] == 5 and first[1]["valid_frame_indices"] == [0, 1, 2, 3, 4]
        assert engine.drain_lifecycle_events() == []
        engine.wait_for_generation(engine.request_refill(), timeout=30)
        second = engine.drain_lifecycle_events()
        assert [(e["kind"], e["slot"], e["episode_id"]) for e in second] == [
            ("evicted", 0, 0),
            ("evicted", 1, 1),
            ("published", 0, 4),
            ("published", 1, 5),
            ("evicted", 2, 2),
            ("evicted", 3, 3),
            ("published", 2, 6),
            ("published", 3, 7),
        ]
        assert all(e["generation"] == 2 for e in second if e["kind"] == "published")
        assert all(e["run_id"] == engine.run_id for e in second)


@pytest.mark.parametrize("workers", [1, 2])
def test_full_lifecycle_log_back_pressures_producers_but_not_sampling(workers):
    """Each window of 2 rows needs 4 records (2 evicted, 2 published) and only 4 are free.

    With 2 workers both see those 4 free at once: each reserves its window's records before writing, so
    one of them waits for the owner to drain instead of failing the engine with a full log.
    """
    cfg = make_cfg(buffer_size=4, num_workers=workers, lifecycle_event_capacity=8, refill_policy="manual")
    with OnlineDataEngine(cfg) as engine:
        generation = engine.request_refill()  # the log still holds the 4 undrained records of generation 1
        with pytest.raises(TimeoutError, match=f"ODS generation {generation} was not published"):
            engine.wait_for_generation(generation, timeout=0.5)
        engine.sample_batch(8, 2)  # sampling keeps working meanwhile
        assert engine.state is OnlineDataEngineState.READY
        deadline = time.monotonic() + 30  # a slow producer may not have appended any record yet
        while engine._shared.events.pending() <= 4 and time.monotonic() < deadline:
            threading.Event().wait(0.01)  # a bounded poll: the log has no event for "appended"
        records = engine.drain_lifecycle_events()  # 4 old + (part of) the first window's records
        assert 4 < len(records) <= 8
        engine.wait_for_generation(generation, timeout=30)
        records += engine.drain_lifecycle_events()
        assert engine.state is OnlineDataEngineState.READY
        assert [e["sequence"] for e in records] == list(range(12))
        fresh = [e for e in records if e["kind"] == "published" and e["generation"] == 2]
        assert sorted(e["slot"] for e in fresh) == [0, 1, 2, 3]
        assert sorted(e["slot"] for e in records if e["kind"] == "evicted") == [0, 1, 2, 3]


def test_a_generation_that_waits_for_a_drain_says_so_when_it_times_out():
    """A refill paused on a full log names the log, its fill and the way out, not just the timeout."""
    cfg = make_cfg(buffer_size=4, lifecycle_event_capacity=8, refill_policy="manual")
    with OnlineDataEngine(cfg) as engine:
        generation = engine.request_refill()  # 4 records of generation 1 plus the first window's 4 fill it
        deadline = time.monotonic() + 30
        while not engine._shared.events.waiting_for_room() and time.monotonic() < deadline:
            threading.Event().wait(0.01)  # a bounded poll: the log has no event for "a producer waits"
        message = (
            f"ODS generation {generation} was not published in 0.2s; the lifecycle log holds 8 of its 8 "
            "records (0 more reserved) and a producer waits for room for 4: producers wait for "
            "drain_lifecycle_events()"
        )
        with pytest.raises(TimeoutError, match=re.escape(message)):
            engine.wait_for_generation(generation, timeout=0.2)
        engine.drain_lifecycle_events()
        engine.wait_for_generation(generation, timeout=30)


def test_a_generation_that_waits_for_a_recorder_says_so_when_it_times_out():
    """Producers wait for a recorder in 'wait' mode before overwriting what it has not copied: the
    timeout named nothing but itself."""
    cfg = make_cfg(buffer_size=4, refill_policy="manual")
    with OnlineDataEngine(cfg) as engine:
        gate = engine._shared.record_gate
        gate.attach("wait")  # a recorder that copies nothing (stopped): the 4 episodes of generation 1
        try:
            generation = engine.request_refill()
            message = (
                f"ODS generation {generation} was not published in 0.3s; a LeRobotRecorder "
                "(on_full='wait') has not copied 4 published episode(s), and producers wait for it before "
                "overwriting them"
            )
            with pytest.raises(TimeoutError, match=re.escape(message)):
                engine.wait_for_generation(generation, timeout=0.3)
        finally:
            gate.detach()  # the recorder goes: the producers overwrite
        engine.wait_for_generation(generation, timeout=30)
        assert gate.uncopied(engine._shared.index.episode_id) == 0  # detached: nothing is waited for


def test_stop_completes_during_back_pressure():
    cfg = make_cfg(buffer_size=4, lifecycle_event_capacity=8, refill_policy="manual", shutdown_timeout=5.0)
    engine = OnlineDataEngine(cfg)
    engine.start()
    engine.request_refill()
    done = threading.Event()

    def stop() -> None:
        engine.stop()
        done.set()

    threading.Thread(target=stop).start()
    assert done.wait(10), "stop() must not wait for the log to be drained"
    assert engine.state is OnlineDataEngineState.STOPPED
    assert engine._supervisor is None  # workers joined and released before stop() returned


def test_language_registry_overflow_fails_the_engine_naming_the_setting():
    engine = OnlineDataEngine(make_cfg(language_buffer_bytes=16))
    with pytest.raises(OverflowError, match="exhausted language_buffer_bytes=16; increase the capacity"):
        engine.start()
    assert engine.state is OnlineDataEngineState.FAILED
