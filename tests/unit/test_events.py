"""LifecycleEventLog: ordering, sequence numbers, capacity, back-pressure and cross-process use."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from simstream.buffer.events import LifecycleEventLog

pytestmark = pytest.mark.timeout(60)

JOIN_TIMEOUT_S = 60.0
STEPS = 6


def _record(kind: str = "published", slot: int = 0, episode_id: int = 0, valid=(0, 1, 2), anchors=(1, 2)):
    valid_mask = torch.zeros(STEPS, dtype=torch.bool)
    valid_mask[list(valid)] = True
    anchor_mask = torch.zeros(STEPS, dtype=torch.bool)
    anchor_mask[list(anchors)] = True
    return {
        "kind": kind,
        "run_id": 77,
        "episode_id": episode_id,
        "generation": 1,
        "slot": slot,
        "monotonic_ns": 1_000 + episode_id,
        "valid_mask": valid_mask,
        "anchor_mask": anchor_mask,
    }


@pytest.fixture
def log() -> LifecycleEventLog:
    return LifecycleEventLog(capacity=4, max_steps=STEPS, ctx=mp.get_context("fork"))


@pytest.mark.parametrize("name", ["capacity", "max_steps"])
@pytest.mark.parametrize("value", [0, -2, True, 2.0, None], ids=repr)
def test_rejects_bad_sizes(name, value):
    sizes = {"capacity": 4, "max_steps": STEPS, name: value}
    with pytest.raises(ValueError, match=rf"^LifecycleEventLog\.{name} must be an int >= 1, got "):
        LifecycleEventLog(**sizes)


def test_append_then_drain_in_order(log):
    assert log.pending() == 0 and log.free_slots() == 4 and log.drain() == []
    first = log.append([_record("evicted", slot=1, episode_id=0), _record(slot=1, episode_id=2)])
    second = log.append([_record(slot=2, episode_id=3, valid=(), anchors=())])
    assert (first, second) == ([0, 1], [2])
    assert log.pending() == 3 and log.free_slots() == 1
    records = log.drain()
    assert [r["sequence"] for r in records] == [0, 1, 2]
    assert [r["kind"] for r in records] == ["evicted", "published", "published"]
    assert records[0] == {
        "kind": "evicted",
        "sequence": 0,
        "run_id": 77,
        "episode_id": 0,
        "generation": 1,
        "slot": 1,
        "monotonic_ns": 1_000,
        "valid_frame_indices": [0, 1, 2],
        "eligible_anchor_indices": [1, 2],
        "valid_frames": 3,
        "eligible_anchors": 2,
    }
    assert records[2]["valid_frame_indices"] == [] and records[2]["eligible_anchors"] == 0
    assert log.drain() == [], "a second drain returns nothing"
    assert log.pending() == 0 and log.free_slots() == 4


def test_drained_records_are_plain_python(log):
    log.append([_record()])
    (record,) = log.drain()
    assert all(type(record[key]) is int for key in ("sequence", "run_id", "slot", "monotonic_ns"))
    assert all(type(t) is int for t in record["valid_frame_indices"])
    log.append([_record(slot=3, valid=(5,), anchors=(5,))])
    assert record["slot"] == 0 and record["valid_frame_indices"] == [0, 1, 2]


def test_anchors_are_limited_to_valid_frames(log):
    log.append([_record(valid=(0, 1), anchors=(1, 4))])
    (record,) = log.drain()
    assert record["eligible_anchor_indices"] == [1] and record["eligible_anchors"] == 1


def test_sequences_continue_across_ring_wraparound(log):
    for round_ in range(5):
        sequences = log.append([_record(episode_id=3 * round_ + i) for i in range(3)])
        assert sequences == [3 * round_, 3 * round_ + 1, 3 * round_ + 2]
        records = log.drain()
        assert [r["sequence"] for r in records] == sequences
        assert [r["episode_id"] for r in records] == sequences
    assert log.state_dict() == {"next_sequence": 15, "pending": 0, "reserved": 0}


def test_full_log_rejects_the_whole_append(log):
    log.append([_record(episode_id=i) for i in range(3)])
    with pytest.raises(RuntimeError, match=r"^ODS lifecycle event capacity exhausted$"):
        log.append([_record(episode_id=10), _record(episode_id=11)])
    assert log.pending() == 3
    assert log.append([_record(episode_id=12)]) == [3]
    with pytest.raises(RuntimeError, match=r"^ODS lifecycle event capacity exhausted$"):
        log.append([_record(episode_id=13)])
    assert [r["episode_id"] for r in log.drain()] == [0, 1, 2, 12]
    assert log.append([]) == []


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "retired"},
        {"slot": 1.0},
        {"episode_id": True},
        {"monotonic_ns": 2**63},
        {"valid_mask": torch.zeros(STEPS + 1, dtype=torch.bool)},
        {"anchor_mask": [True] * STEPS},
    ],
    ids=["kind", "float-slot", "bool-episode", "int64-overflow", "mask-shape", "mask-type"],
)
def test_malformed_records_write_nothing(log, change):
    with pytest.raises(ValueError, match=r"^lifecycle record 1 "):
        log.append([_record(), {**_record(), **change}])
    assert log.pending() == 0


def test_reserve_returns_at_once_when_free_and_takes_the_space(log):
    log.append([_record()])
    assert log.reserve(2, should_stop=lambda: pytest.fail("must not poll"))
    assert log.reserve(0, should_stop=lambda: True)
    assert log.free_slots() == 1 and log.pending() == 1
    assert log.state_dict() == {"next_sequence": 1, "pending": 1, "reserved": 2}
    with pytest.raises(RuntimeError, match=r"^ODS lifecycle event capacity exhausted$"):
        log.append([_record(), _record()])  # the reserved space is not anybody's to take
    assert log.append([_record(episode_id=1), _record(episode_id=2)], reserved=True) == [1, 2]
    assert log.state_dict() == {"next_sequence": 3, "pending": 3, "reserved": 0}


def test_append_into_a_reservation_too_small_writes_nothing(log):
    assert log.reserve(1, should_stop=lambda: False)
    with pytest.raises(RuntimeError, match="appending 2 records into a reservation of 1"):
        log.append([_record(), _record()], reserved=True)
    assert log.pending() == 0 and log.state_dict()["reserved"] == 1


def test_release_gives_reserved_space_back(log):
    assert log.reserve(4, should_stop=lambda: False)
    assert log.free_slots() == 0
    log.release(3)
    assert log.free_slots() == 3
    log.release(10)  # never below zero
    assert log.free_slots() == 4 and log.state_dict()["reserved"] == 0
    assert log.reserve(2, should_stop=lambda: False)
    for count in (-1, 1.0):  # a negative count would have added to the reservation
        with pytest.raises(ValueError, match=r"release count must be an int >= 0, got"):
            log.release(count)
    assert log.state_dict()["reserved"] == 2


@pytest.mark.parametrize("count", [-1, 5, 1.0], ids=repr)
def test_reserve_rejects_impossible_counts(log, count):
    with pytest.raises(ValueError, match=r"reserve count must be an int in \[0, 4\]"):
        log.reserve(count, should_stop=lambda: False)


def test_should_stop_interrupts_the_wait(log):
    log.append([_record(episode_id=i) for i in range(4)])
    calls = []

    def should_stop() -> bool:
        calls.append(None)
        return len(calls) >= 3

    assert log.reserve(1, should_stop, poll_s=0.001) is False
    assert len(calls) == 3
    assert log.pending() == 4 and log.state_dict()["reserved"] == 0


def test_a_reservation_waiting_for_room_says_how_much_it_wants_while_it_waits(log):
    """What the owner reads to tell its own drain is what producers wait for: the slots wanted while a
    reservation waits, 0 once a drain made room, once it returned, and once it was stopped."""
    log.append([_record(episode_id=i) for i in range(3)])  # 1 of 4 slots free
    assert log.waiting_for_room() == 0  # full enough, but nobody waits
    seen = []

    def should_stop() -> bool:
        seen.append(log.waiting_for_room())
        if len(seen) == 2:
            log.drain()
            seen.append(log.waiting_for_room())  # room made: no longer paused, though not woken yet
        return False

    assert log.reserve(3, should_stop, poll_s=0.001)
    assert seen == [3, 3, 0]
    log.append([_record(episode_id=9)])  # the log is full again, and nobody waits
    assert log.free_slots() == 0 and log.waiting_for_room() == 0
    stops = []
    assert not log.reserve(2, lambda: stops.append(log.waiting_for_room()) or len(stops) >= 2, poll_s=0.001)
    assert stops == [2, 2] and log.waiting_for_room() == 0  # the stopped reservation no longer waits


def _producer(log, ready, stopping) -> None:
    assert log.free_slots() == 0
    ready.set()
    if not log.reserve(2, should_stop=stopping.is_set, poll_s=0.05):
        raise SystemExit(2)
    log.append([_record("evicted", slot=3, episode_id=100)], reserved=True)
    log.append([_record(slot=3, episode_id=101)], reserved=True)


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_a_drain_in_another_process_unblocks_a_waiting_producer(method):
    ctx = mp.get_context(method)
    log = LifecycleEventLog(capacity=3, max_steps=STEPS, ctx=ctx)
    log.append([_record(episode_id=i) for i in range(3)])
    ready, stopping = ctx.Event(), ctx.Event()
    producer = ctx.Process(target=_producer, args=(log, ready, stopping))
    producer.start()
    try:
        assert ready.wait(JOIN_TIMEOUT_S), "producer did not start in time"
        assert [r["sequence"] for r in log.drain()] == [0, 1, 2]
        producer.join(JOIN_TIMEOUT_S)
        assert producer.exitcode == 0
        records = log.drain()
        assert [(r["sequence"], r["kind"], r["episode_id"]) for r in records] == [
            (3, "evicted", 100),
            (4, "published", 101),
        ]
        assert records[1]["valid_frame_indices"] == [0, 1, 2]
    finally:
        stopping.set()
        producer.join(JOIN_TIMEOUT_S)
        if producer.is_alive():
            producer.kill()
            producer.join(JOIN_TIMEOUT_S)


def _appender(log, base: int, count: int) -> None:
    for i in range(count):
        log.append([_record(slot=base, episode_id=base * 1000 + i)])


def test_concurrent_producers_get_distinct_ordered_sequences():
    ctx = mp.get_context("fork")
    log = LifecycleEventLog(capacity=200, max_steps=STEPS, ctx=ctx)
    producers = [ctx.Process(target=_appender, args=(log, base, 50)) for base in (1, 2, 3)]
    for producer in producers:
        producer.start()
    for producer in producers:
        producer.join(JOIN_TIMEOUT_S)
    assert [p.exitcode for p in producers] == [0, 0, 0]
    records = log.drain()
    assert [r["sequence"] for r in records] == list(range(150))
    for base in (1, 2, 3):
        mine = [r["episode_id"] for r in records if r["slot"] == base]
        assert mine == [base * 1000 + i for i in range(50)], "each producer's records keep their order"


def _reserving_producer(log, slot: int, reserved, waiting, go, stopping) -> None:
    def should_stop() -> bool:  # called only while the log has no room for this producer
        waiting.set()
        return stopping.is_set()

    if not log.reserve(2, should_stop, poll_s=0.05):
        raise SystemExit(2)
    reserved.put(slot)
    if not go.wait(JOIN_TIMEOUT_S):
        raise SystemExit(3)
    log.append([_record("evicted", slot=slot, episode_id=slot)], reserved=True)
    log.append([_record(slot=slot, episode_id=100 + slot)], reserved=True)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_two_producers_never_share_the_space_they_reserved(method):
    """Two producers want 2 slots each from a log with 3 free: one waits until the owner drains.

    Both see the space free at once; with a check-then-append the later append found the log full and
    failed the engine.
    """
    ctx = mp.get_context(method)
    log = LifecycleEventLog(capacity=4, max_steps=STEPS, ctx=ctx)
    log.append([_record(episode_id=99)])
    reserved, stopping = ctx.Queue(), ctx.Event()
    waiting, go = [ctx.Event(), ctx.Event()], [ctx.Event(), ctx.Event()]
    producers = [
        ctx.Process(target=_reserving_producer, args=(log, slot, reserved, waiting[slot], go[slot], stopping))
        for slot in (0, 1)
    ]
    for producer in producers:
        producer.start()
    try:
        first = reserved.get(timeout=JOIN_TIMEOUT_S)
        second = 1 - first
        assert waiting[second].wait(JOIN_TIMEOUT_S), "the other producer should wait for space"
        assert log.state_dict() == {"next_sequence": 1, "pending": 1, "reserved": 2}
        go[first].set()
        producers[first].join(JOIN_TIMEOUT_S)
        assert producers[first].exitcode == 0
        assert [r["slot"] for r in log.drain()] == [0, first, first]  # wakes the waiting producer
        assert reserved.get(timeout=JOIN_TIMEOUT_S) == second
        go[second].set()
        producers[second].join(JOIN_TIMEOUT_S)
        assert producers[second].exitcode == 0
        assert [(r["kind"], r["slot"]) for r in log.drain()] == [("evicted", second), ("published", second)]
        assert log.state_dict() == {"next_sequence": 5, "pending": 0, "reserved": 0}
    finally:
        stopping.set()
        for event in go:
            event.set()
        for producer in producers:
            producer.join(JOIN_TIMEOUT_S)
            if producer.is_alive():
                producer.kill()
                producer.join(JOIN_TIMEOUT_S)
        reserved.close()
        reserved.join_thread()
