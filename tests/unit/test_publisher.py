"""Publishing several windows together: the same rows, ids, quotas and lifecycle records, in the same
order, as publishing them one by one; a window that fails its check is never visible, nor are the claimed
windows after it, while the windows before it are published as one by one would have."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from simstream import Episode, OnlineDataEngine, Segment
from simstream.engine.publisher import Closing, WindowPublisher
from simstream.engine.window import GeneratedWindow
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(60)

NUM_ENVS, STEPS, WINDOWS = 2, 12, 3
ROWS = NUM_ENVS * WINDOWS


def _engine(**overrides) -> OnlineDataEngine:
    spec = ScriptedSpec(num_envs=NUM_ENVS, max_episode_steps=STEPS)
    values = {
        "buffer_size": ROWS,
        "include_provenance": True,
        "episode_sample_budget": 3,
        "episode_sample_hard_limit": 5,
        "lifecycle_event_capacity": 4 * ROWS,
    }
    values.update(overrides)
    return OnlineDataEngine(make_cfg(spec, **values))  # never started: its shared objects only


def _windows(generation: int) -> list[GeneratedWindow]:
    """Varied reports: lengths, segments with and without text, continuity, flags, attempts."""
    windows = []
    for number in range(WINDOWS):
        episodes = []
        for env in range(NUM_ENVS):
            length = STEPS - (number + env + generation) % 5
            half = length // 2
            segments = [Segment(0, half, f"first {number}"), Segment(half, length, None, accepted=env == 0)]
            continuity = [0] * half + [1] * (length - half) if number == 1 else None
            episodes.append(
                Episode(
                    length,
                    instruction=f"task {env}",
                    segments=segments,
                    continuity=continuity,
                    terminated=env == 0,
                    truncated=env == 1,
                )
            )
        windows.append(GeneratedWindow(episodes, attempt=number % 2, failed_episodes=0))
    return windows


def _fill_payload(engine: OnlineDataEngine, start: int, end: int, unwritten_row=None) -> None:
    rows = engine._shared.storage.rows_view(start, end, payload_only=True)
    for key in ("obs", "actions", "rewards"):
        for offset in range(end - start):
            rows[key][offset] = float(start + offset + 1)
    if unwritten_row is not None:
        rows["actions"][unwritten_row - start, 0] = float("nan")


def _publish(engine, windows, generation: int, together: bool, unwritten_row=None) -> None:
    publisher = WindowPublisher(engine._shared, 0, lambda: False)
    try:
        if together:
            assert publisher.begin(0, ROWS, NUM_ENVS)
            _fill_payload(engine, 0, ROWS, unwritten_row)
            publisher.finish(0, ROWS, windows, generation)
        else:
            for number, window in enumerate(windows):
                start = number * NUM_ENVS
                assert publisher.begin(start, start + NUM_ENVS)
                _fill_payload(engine, start, start + NUM_ENVS, unwritten_row)
                publisher.finish(start, start + NUM_ENVS, [window], generation)
                publisher.abandon()
    finally:
        publisher.abandon()


def _state(engine: OnlineDataEngine) -> dict:
    shared = engine._shared
    records = engine._shared.events.drain()
    for record in records:
        assert record.pop("run_id") == engine.run_id
        record.pop("monotonic_ns")
    buffer = {
        key: value.clone()
        for key, value in shared.storage.rows_view().items(include_nested=True, leaves_only=True)
        if key not in ("ods_run_id", "ods_accepted_at_ns", "ods_published_at_monotonic_ns")
    }
    index = shared.index
    return {
        "records": records,
        "buffer": buffer,
        "index": {name: value.clone() for name, value in vars(index).items() if torch.is_tensor(value)},
        "quota": shared.quota.state_dict(),
        "language": [
            shared.language.resolve(torch.arange(shared.language.count(k)), kind=k)
            for k in ("task", "subtask")
        ],
    }


def test_windows_published_together_equal_windows_published_one_by_one():
    one_by_one, together = _engine(), _engine()
    for generation in (1, 2):  # the second generation evicts every episode of the first
        windows = _windows(generation)
        _publish(one_by_one, windows, generation, together=False)
        _publish(together, windows, generation, together=True)
        expected, actual = _state(one_by_one), _state(together)
        assert actual["records"] == expected["records"]
        kinds = [(r["kind"], r["slot"]) for r in actual["records"]]
        if generation == 2:  # per window: its evictions, then its publications
            assert kinds[:4] == [("evicted", 0), ("evicted", 1), ("published", 0), ("published", 1)]
        for part in ("buffer", "index"):
            for key, value in expected[part].items():
                torch.testing.assert_close(actual[part][key], value, rtol=0, atol=0, equal_nan=True)
        for key in ("rows", "meta"):
            assert torch.equal(actual["quota"][key], expected["quota"][key])
        assert actual["language"] == expected["language"]
    ids = together._shared.index.episode_id
    assert ids.tolist() == list(range(ROWS, 2 * ROWS))  # unique and increasing, in row order


def test_a_window_that_fails_its_check_is_never_visible_and_the_windows_before_it_are():
    engine = _engine()
    _publish(engine, _windows(1), 1, together=True)
    engine._shared.events.drain()
    shared = engine._shared
    ids_before = shared.index.episode_id.clone()
    quota_rows = shared.quota.state_dict()["rows"].clone()
    with pytest.raises(ValueError, match=r"buffer row 3 \(row 1 of the rollout\)"):
        _publish(engine, _windows(2), 2, together=True, unwritten_row=3)  # the middle window's last row
    index = shared.index
    # window 0 (rows 0, 1) is published with the next ids; windows 1 and 2 stay claimed (odd): skipped
    assert index.episode_id.tolist() == [ROWS, ROWS + 1] + [-1] * (ROWS - 2)
    assert index.stable_rows().tolist() == [True, True] + [False] * (ROWS - 2)
    assert shared.storage.metadata("valid")[:2].any(dim=1).all()
    assert not bool(shared.storage.metadata("valid")[2:].any())
    quota = shared.quota.state_dict()["rows"]
    assert not torch.equal(quota[:2], quota_rows[:2])  # the published rows' quota rows were renewed
    records = shared.events.drain()
    assert [(r["kind"], r["slot"]) for r in records] == [
        ("evicted", 0), ("evicted", 1), ("published", 0), ("published", 1),
        ("evicted", 2), ("evicted", 3), ("evicted", 4), ("evicted", 5),
    ]  # fmt: skip
    assert [r["episode_id"] for r in records if r["kind"] == "published"] == [ROWS, ROWS + 1]
    assert [r["episode_id"] for r in records if r["kind"] == "evicted"] == ids_before[:ROWS].tolist()
    assert shared.events.state_dict()["reserved"] == 0  # the rest of the reservation was given back
    assert shared.progress.snapshot()["successful_episodes"] == ROWS + 2


def test_a_failure_in_the_first_window_leaves_none_of_the_windows_visible():
    engine = _engine()
    _publish(engine, _windows(1), 1, together=True)
    engine._shared.events.drain()
    shared = engine._shared
    before_quota = shared.quota.state_dict()["rows"].clone()
    with pytest.raises(ValueError, match=r"buffer row 1 \(row 1 of the rollout\)"):
        _publish(engine, _windows(2), 2, together=True, unwritten_row=1)
    assert not bool(shared.index.stable_rows().any())  # every claimed row stays odd: samplers skip them all
    assert shared.index.episode_id.tolist() == [-1] * ROWS
    assert not bool(shared.storage.metadata("valid").any())
    assert torch.equal(shared.quota.state_dict()["rows"], before_quota)
    records = shared.events.drain()
    assert [(r["kind"], r["slot"]) for r in records] == [("evicted", row) for row in range(ROWS)]
    assert shared.events.state_dict()["reserved"] == 0


def _hold_the_log_lock(engine):
    """A thread that holds the lifecycle log's lock (as a drain in the owner does) until released."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with engine._shared.events._lock.held(None):
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(30)
    return thread, release


def test_closing_while_a_publication_waits_for_the_log_leaves_the_window_unpublished_not_unlogged():
    """The publication takes the log's lock before its rows become visible: closing during that wait
    leaves the window claimed and invisible, with its evictions logged. Before, the rows became visible
    and their ``published`` records were lost."""
    engine = _engine()
    _publish(engine, _windows(1), 1, together=True)
    engine._shared.events.drain()
    closing = [False]
    publisher = WindowPublisher(engine._shared, 0, lambda: closing[0])
    assert publisher.begin(0, NUM_ENVS)
    _fill_payload(engine, 0, NUM_ENVS)
    thread, release = _hold_the_log_lock(engine)
    try:
        closing[0] = True
        with pytest.raises(Closing):
            publisher.finish(0, NUM_ENVS, _windows(2)[:1], 2)
        publisher.abandon()
    finally:
        release.set()
        thread.join(30)
    index = engine._shared.index
    assert index.episode_id[:NUM_ENVS].tolist() == [-1, -1] and bool(
        (index.version[:NUM_ENVS] % 2 == 1).all()
    )
    records = [(r["kind"], r["slot"], r["episode_id"]) for r in engine._shared.events.drain()]
    assert records == [("evicted", 0, 0), ("evicted", 1, 1)]  # claimed, so evicted; never published


def test_a_publication_waiting_for_the_quota_lock_does_not_hold_the_log():
    """Locks are taken publication, quota, log: a producer waiting for a sampler's quota lock must not hold
    the log's lock, or the owner's drain (and every producer's reservation) would wait for that batch."""
    engine = _engine()
    shared = engine._shared
    held, release = threading.Event(), threading.Event()

    def sampler() -> None:  # holds the quota lock as a sampler does while it copies a batch
        with shared.quota.lock.held(None):
            held.set()
            release.wait(60)

    def producer() -> None:
        _publish(engine, _windows(1)[:1] * WINDOWS, 1, together=True)

    holder = threading.Thread(target=sampler)
    holder.start()
    assert held.wait(30)
    publishing = threading.Thread(target=producer)
    publishing.start()
    try:
        deadline = time.monotonic() + 30
        while not shared.publish_lock.is_held_here() and time.monotonic() < deadline:
            threading.Event().wait(0.005)  # a bounded poll: the producer reaches its publication
        assert shared.publish_lock.is_held_here()
        waited = time.monotonic() + 2.0

        def bounded() -> None:
            if time.monotonic() > waited:
                raise AssertionError("the drain waited for the log while the producer waited for the quota")

        assert shared.events.drain(bounded) == []  # nothing published yet; the lock was free
    finally:
        release.set()
        holder.join(30)
        publishing.join(30)
    assert len(shared.events.drain()) == ROWS  # then the publication went through


@pytest.mark.parametrize("ending", ["closing", "settle-lock-timeout"])
def test_a_claim_abandoned_on_closing_logs_no_eviction(ending):
    """Evictions are logged once the claim succeeded: a claim that waits for a recorder and is abandoned
    (the engine closes, or skip mode's settle lock times out: its holder was stopped) evicts nothing, and
    the log says nothing about it (a timeout logged both rows as evicted while they stayed published)."""
    engine = _engine()
    _publish(engine, _windows(1), 1, together=True)
    engine._shared.events.drain()
    closing = [False]
    publisher = WindowPublisher(engine._shared, 0, lambda: closing[0])
    gate = engine._shared.record_gate
    gate.attach("wait")  # a recorder that copied nothing: the claim waits for it
    original = gate.before_claim

    def before_claim(start, end, episode_id, check=None):
        if ending == "settle-lock-timeout":  # what RecordGate._settling raises
            raise TimeoutError("The record gate's settle lock: its holder was stopped for 30 s")
        closing[0] = True  # the engine closes while the claim waits
        return original(start, end, episode_id, check)

    gate.before_claim = before_claim
    with pytest.raises(Closing if ending == "closing" else TimeoutError):
        publisher.begin(0, NUM_ENVS)
    publisher.abandon()
    assert engine._shared.index.episode_id[:NUM_ENVS].tolist() == [0, 1]  # still published
    assert engine._shared.events.drain() == []
    assert engine._shared.events.free_slots() == engine._shared.events.capacity  # reservation given back


def test_windows_must_be_whole():
    engine = _engine(lifecycle_event_capacity=0)
    publisher = WindowPublisher(engine._shared, 0, lambda: False)
    with pytest.raises(ValueError, match="whole windows"):
        publisher.begin(0, 5, NUM_ENVS)


def test_the_column_append_checks_shapes_and_kinds():
    log = _engine()._shared.events
    valid = np.ones((1, STEPS), dtype=bool)
    scalars = np.zeros((1, 5), dtype=np.int64)
    with pytest.raises(ValueError, match="kinds"):
        log.append_columns(np.array([2]), scalars, valid, valid)
    with pytest.raises(ValueError, match="columns"):
        log.append_columns(np.array([0]), scalars[:, :4], valid, valid)
    with pytest.raises(ValueError, match="kinds"):  # a list is checked like an array
        log.append_columns([5], scalars, valid, valid)
    assert log.pending() == 0
    assert log.append_columns([0], scalars, valid, valid) == [0]


@pytest.mark.parametrize("per_call", [3, 1])
def test_the_ray_ingest_publishes_held_windows_like_one_by_one(per_call):
    """Windows at rows 0, 2 and 3 (2 rows each over [0, 5); the last overlaps), in one call of 3 or in
    3 calls of 1 held until the generation's last window arrives: one group of rows [0, 4) and a group
    of its own for [3, 5); the result is one-by-one's."""
    ingest = pytest.importorskip("simstream.ray.ingest")  # imports ray; starts nothing
    from simstream.ray import RayBackend
    from simstream.ray.actor import WindowPayload

    overrides = {"buffer_size": 5, "lifecycle_event_capacity": 20}
    local = _engine(**overrides)
    via_ray = _engine(**overrides, backend=RayBackend(windows_per_call=per_call))
    producers = ingest.RayProducers(via_ray._shared, via_ray.cfg, NUM_ENVS, b"", None)
    producer = producers._producers[0]
    assert producer.starts == [0, 2, 3]
    publisher = WindowPublisher(local._shared, 0, lambda: False)
    for generation in (1, 2):
        windows = _windows(generation)
        payloads = []
        for number, (start, window) in enumerate(zip(producer.starts, windows)):
            used = max(episode.length for episode in window.episodes)
            frames = {
                key: np.full((NUM_ENVS, used, *shape), 10.0 * number + generation, dtype=np.float32)
                for key, shape in (("obs", (3,)), ("actions", (2,)), ("rewards", ()))
            }
            payloads.append(WindowPayload(window, frames))
            assert publisher.begin(start, start + NUM_ENVS)
            rows = local._shared.storage.rows_view(start, start + NUM_ENVS, payload_only=True)
            for key, values in frames.items():
                rows[key][:, :used] = torch.from_numpy(values)
            publisher.finish(start, start + NUM_ENVS, [window], generation)
            publisher.abandon()
        calls = [payloads] if per_call == 3 else [[payload] for payload in payloads]
        ids_before = via_ray._shared.index.episode_id.clone()
        for number, call in enumerate(calls):
            assert via_ray._shared.progress.worker_completed(0) == generation - 1
            assert torch.equal(via_ray._shared.index.episode_id, ids_before)  # held windows are invisible
            producers._hold(producer, ingest._Item(number * per_call, len(call), generation), call, 0.0)
        assert via_ray._shared.progress.worker_completed(0) == generation
        expected, actual = _state(local), _state(via_ray)
        assert actual["records"] == expected["records"]
        if generation == 1:  # the last window evicts the episode the one before it put in row 3
            kinds = [(r["kind"], r["slot"]) for r in actual["records"]]
            assert kinds[4:] == [("evicted", 3), ("published", 3), ("published", 4)]
        for part in ("buffer", "index"):
            for key, value in expected[part].items():
                torch.testing.assert_close(actual[part][key], value, rtol=0, atol=0, equal_nan=True)
        assert actual["language"] == expected["language"]


def _ray_ingest(buffer_size: int = 5, **backend):
    """An unstarted ingest over the windows of 2 rows that ``buffer_size`` rows hold (5: rows 0, 2, 3),
    and one payload per window."""
    ingest = pytest.importorskip("simstream.ray.ingest")  # imports ray; starts nothing
    from simstream.ray import RayBackend
    from simstream.ray.actor import WindowPayload

    engine = _engine(
        buffer_size=buffer_size, lifecycle_event_capacity=4 * buffer_size, backend=RayBackend(**backend)
    )
    producers = ingest.RayProducers(engine._shared, engine.cfg, NUM_ENVS, b"", None)
    windows = _windows(1) + _windows(2)
    payloads = []
    for number, window in enumerate(windows[: len(producers._producers[0].starts)]):
        used = max(episode.length for episode in window.episodes)
        frames = {
            key: np.full((NUM_ENVS, used, *shape), float(number), dtype=np.float32)
            for key, shape in (("obs", (3,)), ("actions", (2,)), ("rewards", ()))
        }
        payloads.append(WindowPayload(window, frames))
    return ingest, engine, producers, producers._producers[0], payloads


def _published_rows(engine) -> list[int]:
    return torch.nonzero(engine._shared.index.episode_id >= 0).flatten().tolist()


def test_a_full_group_of_held_windows_is_published_at_once():
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_windows=2, publish_delay_s=10.0)
    producers._hold(producer, ingest._Item(0, 1, 1), payloads[:1], time.monotonic())
    assert _published_rows(engine) == []
    producers._hold(producer, ingest._Item(1, 1, 1), payloads[1:2], time.monotonic())
    assert _published_rows(engine) == [0, 1, 2, 3]  # two windows: the group is full
    assert engine._shared.progress.worker_completed(0) == 0
    producers._hold(producer, ingest._Item(2, 1, 1), payloads[2:], time.monotonic())
    assert _published_rows(engine) == [0, 1, 2, 3, 4]
    assert engine._shared.progress.worker_completed(0) == 1  # the generation's last window: at once


def test_held_windows_are_published_once_their_delay_passed():
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=0.5)
    now = time.monotonic()
    producers._hold(producer, ingest._Item(0, 1, 1), payloads[:1], now)
    assert 0 < producers._wait_slice(now) <= 0.5  # the ingest's next wait ends when the window is due
    producers._publish_overdue()
    assert _published_rows(engine) == []
    producer.held_since = now - 0.5  # as if it had arrived half a second ago
    assert producers._wait_slice(now) == 0
    producers._publish_overdue()
    assert _published_rows(engine) == [0, 1]
    assert producers._wait_slice(now) == ingest._SLICE_S  # nothing held


def test_without_a_delay_every_call_is_published_as_it_arrives():
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=0)
    producers._hold(producer, ingest._Item(0, 1, 1), payloads[:1], time.monotonic())
    assert _published_rows(engine) == [0, 1]


def test_a_failing_call_publishes_the_windows_held_before_it_then_fails_with_its_cause(monkeypatch):
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=10.0)
    from ray.exceptions import RayTaskError

    producers._hold(producer, ingest._Item(0, 1, 1), payloads[:1], time.monotonic())
    failing = object()
    producer.calls.append(ingest._Stream(None, 1, 3, 1, item=failing))  # its item 1 is ready

    def get(ref, timeout=None):
        assert ref is failing
        raise RayTaskError("generate", "Traceback (most recent call last): ...", ValueError("source broke"))

    monkeypatch.setattr(ingest.ray, "get", get)
    with pytest.raises(ingest.Closing):
        producers._receive(producer, failing)
    assert _published_rows(engine) == [0, 1]  # window 0 arrived whole: visible, as a local producer's
    error = engine._shared.channel.error()
    assert type(error) is ValueError and str(error) == "source broke"


def test_a_held_window_with_an_unwritten_frame_fails_the_engine_after_the_windows_before_it():
    """The ingest's group of held windows publishes the ones before a window that fails its check, as a
    local producer publishing one by one would have, and fails with the check's own error."""
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=10.0)
    payloads[1].frames["actions"][0, 1, 0] = np.nan  # window 1: rows 2 and 3
    producers._hold(producer, ingest._Item(0, 1, 1), payloads[:1], time.monotonic())
    producers._hold(producer, ingest._Item(1, 1, 1), payloads[1:2], time.monotonic())
    assert _published_rows(engine) == []  # both held
    with pytest.raises(ingest.Closing):
        producers._hold(producer, ingest._Item(2, 1, 1), payloads[2:], time.monotonic())
    assert _published_rows(engine) == [0, 1]
    error = engine._shared.channel.error()
    assert type(error) is ValueError
    assert "buffer row 2 (row 0 of the rollout)" in str(error) and "'actions'" in str(error)
    assert "first at frame 1" in str(error)
    assert engine._shared.progress.worker_completed(0) == 0


def test_a_stream_that_ends_before_its_last_window_fails_the_engine_naming_it():
    """Only a stopped actor ends its stream early; while the engine runs, that is a failure, not a wait
    for windows that never come."""
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=10.0)
    from simstream.ray import RayProducerError

    producers._hold(producer, ingest._Item(0, 1, 1), payloads[:1], time.monotonic())
    producer.calls.append(ingest._Stream(iter(()), 1, 3, 1))  # ends with windows 1 and 2 to come
    with pytest.raises(ingest.Closing):
        producers._receive(producer, producer.calls[0].head)
    assert _published_rows(engine) == [0, 1]  # held before: visible
    error = engine._shared.channel.error()
    assert type(error) is RayProducerError
    assert "producer-0" in str(error) and "its stream of generation 1 ended before window 2" in str(error)


def test_an_item_whose_copy_left_the_node_is_waited_on_again_and_a_last_item_ends_its_stream(monkeypatch):
    """``ray.get`` of a ready item may time out (its copy moved); the item taken from the stream is kept
    and waited on directly. The generation's last window ends the stream without waiting for its end."""
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=0)
    from ray.exceptions import GetTimeoutError

    item = object()
    stream = ingest._Stream(iter([item]), 2, 3, 1)  # window 2, the generation's last
    producer.calls.append(stream)
    results = [GetTimeoutError("its copy moved"), payloads[2:]]

    def get(ref, timeout=None):
        assert ref is item
        result = results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(ingest.ray, "get", get)
    producers._receive(producer, stream.head)
    assert stream.head is item and _published_rows(engine) == []
    producers._receive(producer, stream.head)
    assert _published_rows(engine) == [3, 4] and not producer.calls
    assert engine._shared.progress.worker_completed(0) == 1


def test_a_lost_actor_publishes_the_windows_held_and_asks_again_from_the_first_in_flight():
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=10.0)
    producers._hold(producer, ingest._Item(0, 1, 1), payloads[:1], time.monotonic())
    producer.calls.append(ingest._Stream(object(), 1, 3, 1))
    producer.next_number = 2
    producers._lost(producer, RuntimeError("the node is gone"))
    assert _published_rows(engine) == [0, 1]
    assert (producer.restarts, producer.next_generation, producer.next_number) == (1, 1, 1)
    assert not producer.held and not producer.calls


def test_a_group_never_grows_past_publish_windows_across_calls(monkeypatch):
    """Calls of 2 windows with ``publish_windows=3``: the second call does not join the first's group."""
    ingest, engine, producers, producer, payloads = _ray_ingest(
        buffer_size=8, windows_per_call=2, publish_windows=3, publish_delay_s=10.0
    )
    assert producer.starts == [0, 2, 4, 6]
    groups = []
    publish = producers._publish

    def spy(producer, number, generation, group):
        groups.append((number, len(group)))
        publish(producer, number, generation, group)

    monkeypatch.setattr(producers, "_publish", spy)
    producers._hold(producer, ingest._Item(0, 2, 1), payloads[:2], time.monotonic())
    assert groups == []
    producers._hold(producer, ingest._Item(2, 2, 1), payloads[2:], time.monotonic())
    assert groups == [(0, 2), (2, 2)]
    assert _published_rows(engine) == list(range(8))


def test_a_call_past_its_timeout_publishes_the_windows_held_then_fails_naming_the_producer(monkeypatch):
    ingest, engine, producers, producer, payloads = _ray_ingest(
        publish_delay_s=10.0, call_timeout_s=5.0, windows_per_call=2
    )
    from simstream.ray import RayProducerError

    finished = set()
    monkeypatch.setattr(
        ingest.ray, "wait", lambda refs, timeout, fetch_local=True: ([r for r in refs if r in finished], [])
    )
    producers._hold(producer, ingest._Item(0, 1, 1), payloads[:1], time.monotonic())
    head = object()
    producer.calls.append(ingest._Stream(head, 1, 3, 1))  # an item of 2 windows: 10 s before it is a hang
    producer.head_since = time.monotonic() - 6.0
    producers._check_timeout(producer, time.monotonic())
    producer.head_since = time.monotonic() - 11.0
    finished.add(head)
    producers._check_timeout(producer, time.monotonic())  # finished, only not received: no hang
    finished.clear()
    with pytest.raises(ingest.Closing):
        producers._check_timeout(producer, time.monotonic())
    assert _published_rows(engine) == [0, 1]
    error = engine._shared.channel.error()
    assert type(error) is RayProducerError
    assert (
        "producer-0" in str(error)
        and "a call of 2 windows did not finish within 10 s (RayBackend.call_timeout_s=5.0 s per window)"
        in str(error)
        and "timed out" in str(error)
    )


def test_production_time_counts_from_the_generation_s_first_call_to_its_last_window():
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=10.0)
    producer.began_ns[1] = time.monotonic_ns() - 250_000_000  # generation 1's first call: 0.25 s ago
    for number in range(3):
        producers._hold(producer, ingest._Item(number, 1, 1), payloads[number : number + 1], 0.0)
    production_ns = engine._shared.progress.snapshot()["production_ns"]
    assert 250_000_000 <= production_ns < 60_000_000_000
    assert producer.began_ns == {}


def test_closing_between_the_groups_of_held_windows_leaves_the_published_ones_a_prefix(monkeypatch):
    ingest, engine, producers, producer, payloads = _ray_ingest(publish_delay_s=10.0)
    publisher = producers._publishers[0]
    begin, calls = publisher.begin, []

    def closing_on_the_second_group(start, end, window_rows=None):
        calls.append((start, end))
        return begin(start, end, window_rows) if len(calls) == 1 else False

    monkeypatch.setattr(publisher, "begin", closing_on_the_second_group)
    producers._hold(producer, ingest._Item(0, 2, 1), payloads[:2], time.monotonic())
    with pytest.raises(ingest.Closing):
        producers._hold(producer, ingest._Item(2, 1, 1), payloads[2:], time.monotonic())
    assert calls == [(0, 4), (3, 5)]  # windows 0-1 together; the last window overlaps: a group of its own
    assert _published_rows(engine) == [0, 1, 2, 3]
    assert engine._shared.progress.worker_completed(0) == 0  # the generation did not complete
    assert engine._shared.channel.error() is None  # closing is not a failure


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.uint8, torch.bfloat16, torch.float8_e4m3fn, torch.float64]
)
def test_the_ray_payload_view_shares_memory_and_keeps_every_bit(dtype):
    actor = pytest.importorskip("simstream.ray.actor")  # imports ray; starts nothing
    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype)
    view = actor.numpy_view(tensor)
    assert view.shape == (2, 3, 4) and view.itemsize == tensor.element_size()
    target = torch.zeros_like(tensor)
    np.copyto(actor.numpy_view(target), view)  # what the ingest does with what the actor returned
    assert torch.equal(target.view(torch.uint8), tensor.view(torch.uint8))
    view[0, 0, 0] = view[1, 2, 3]
    assert torch.equal(tensor[0, 0, :1].view(torch.uint8), tensor[1, 2, 3:].view(torch.uint8))  # shared
