"""Recorder -> dataset -> replay, with a real engine: payload, segments and language come back exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.buffer.writer import derive_row_metadata
from simstream.language import SharedLanguageRegistry
from simstream.lerobot import LeRobotRecorder, LeRobotSpec
from simstream.lerobot.dataset import read_dataset_meta
from simstream.lerobot.writer import DatasetWriter

from .sources import TASKS, PatternSpec, expected_segments, pattern

pytestmark = pytest.mark.timeout(180)


def _record(
    root,
    *,
    image_size=None,
    video=True,
    episodes=10,
    on_full="wait",
    num_workers=2,
    video_codec="av1",
    empty_every=0,
):
    spec = PatternSpec(image_size=image_size, empty_every=empty_every)
    cfg = OnlineDataEngineCfg(source=spec, buffer_size=4, num_workers=num_workers, refill_policy="manual")
    engine = OnlineDataEngine(cfg)
    recorder = LeRobotRecorder(
        engine,
        root,
        video=video,
        max_episodes=episodes,
        flush_every=3,
        on_full=on_full,
        video_codec=video_codec,
    )
    with recorder, engine:
        while not recorder.wait_flushed(episodes, timeout_s=0.5):
            recorder.check()
            engine.check_health()
            engine.request_refill()
        skipped = recorder.episodes_skipped
    return recorder, skipped


def _tag_of(frames) -> int:
    return int(frames["obs/state"][0, 0])


@pytest.fixture(scope="module")
def lowdim(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowdim") / "ds"
    recorder, _ = _record(root, episodes=10)
    return root, recorder


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's nice value is its own on Linux")
@pytest.mark.parametrize("steps", [0, 7])
def test_the_writer_thread_alone_runs_at_a_lower_priority(tmp_path, steps):
    engine = OnlineDataEngine(
        OnlineDataEngineCfg(source=PatternSpec(), buffer_size=4, num_workers=1, refill_policy="manual")
    )
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    recorder = LeRobotRecorder(engine, tmp_path / "ds", flush_every=1, writer_niceness=steps)
    with recorder, engine:
        while not recorder.wait_flushed(1, timeout_s=0.5):  # the writer thread has written a group
            recorder.check()
            engine.check_health()
            engine.request_refill()
        threads = {t.name: t.native_id for t in threading.enumerate() if t.name.startswith("lerobot-")}
        niceness = {name: os.getpriority(os.PRIO_PROCESS, tid) for name, tid in threads.items()}
    assert niceness == {"lerobot-writer": min(19, own + steps), "lerobot-recorder": own}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


_NICENESS_OF_THREADS = """
import os, sys, threading, time
from pathlib import Path
from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.lerobot import LeRobotRecorder
from tests.lerobot.sources import PatternSpec

if __name__ == "__main__":
    cfg = OnlineDataEngineCfg(source=PatternSpec(image_size=16), buffer_size=4, num_workers=1,
                              refill_policy="manual")
    engine = OnlineDataEngine(cfg)
    recorder = LeRobotRecorder(engine, Path(sys.argv[1]), flush_every=1, writer_niceness=7)
    with recorder, engine:
        while not recorder.wait_flushed(2, timeout_s=0.5):
            recorder.check()
            engine.check_health()
            engine.request_refill()
        writer = os.getpriority(os.PRIO_PROCESS, recorder._writer_thread.native_id)
        # closed first: the video encoder's threads, started by the writer, rightly share its priority
        # while they encode, and end with it (a bounded poll: they exit on their own after close())
        recorder.close()
        deadline = time.monotonic() + 20
        while True:
            others = set()
            for tid in os.listdir("/proc/self/task"):
                try:
                    others.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
                except ProcessLookupError:  # a thread that ended meanwhile
                    pass
            if len(others) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        print(writer, sorted(others))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's nice value is its own on Linux")
def test_no_other_thread_of_the_process_inherits_the_writers_priority(tmp_path):
    """pyarrow, imported first by the writer thread after its priority dropped, started its allocator's
    background thread (which serves the whole process) at nice 10."""
    script = tmp_path / "niceness.py"
    script.write_text(_NICENESS_OF_THREADS)
    root = Path(__file__).resolve().parents[2]  # the tests package is importable from there
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ds")], capture_output=True, text=True, timeout=120,
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        done.stdout.split("\n")[-2]
        == f"{min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)} [{os.getpriority(os.PRIO_PROCESS, 0)}]"
    )


def test_recorder_writes_every_published_episode_once(lowdim):
    root, recorder = lowdim
    assert recorder.episodes_flushed == 10 and recorder.episodes_skipped == 0
    meta = read_dataset_meta(root)
    assert meta.info["total_episodes"] == len(meta.episodes) == 10
    assert meta.info["fps"] == 20 and meta.info["codebase_version"] == "v3.0"
    assert meta.info["total_frames"] == sum(e["length"] for e in meta.episodes)
    assert meta.info["features"]["observation.state"] == {"dtype": "float32", "shape": [4], "names": None}
    assert meta.info["features"]["action"]["shape"] == [2]
    assert meta.info["features"]["rewards"]["shape"] == [1]
    assert sorted(meta.tasks) == sorted(TASKS) or set(meta.tasks) <= set(TASKS)
    stats = json.loads((root / "meta" / "stats.json").read_text())
    assert stats["observation.state"]["count"] == [meta.info["total_frames"]]
    spec = LeRobotSpec(root)
    source = spec.build(0, 0)
    tags = set()
    try:
        for e, ep in enumerate(meta.episodes):
            read = source.reader.read(e)
            tag, length = _tag_of(read.frames), ep["length"]
            tags.add(tag)
            assert length == 12 + (tag % 1000) % 7 and ep["success"] and ep["terminated"]
            t = np.arange(length, dtype=np.float32)
            np.testing.assert_array_equal(
                read.frames["obs/state"], np.stack([t * 0 + tag, t, t / 10, t * 0 - tag], 1)
            )
            np.testing.assert_array_equal(read.frames["actions"], np.stack([t, -t], 1))
            np.testing.assert_array_equal(read.frames["rewards"], t / 100)
            episode = source._episode(e, read, length)
            assert episode.instruction == TASKS[tag % 2]
            restored = [(s.start, s.end, s.instruction, s.accepted) for s in episode.segments]
            wanted = [
                (0, 4, "reach", True),
                (4, 4, None, True),
                (4, 9, "grasp", False),
                (9, length, TASKS[tag % 2], True),
            ]
            assert restored == wanted
    finally:
        source.close()
    assert len(tags) == 10  # no episode twice


def test_replayed_segments_derive_the_same_metadata(lowdim):
    """What the engine stores for a replayed episode equals what it stored for the original."""
    root, _ = lowdim
    source = LeRobotSpec(root).build(0, 0)
    registry = SharedLanguageRegistry(1 << 16)
    try:
        read = source.reader.read(0)
        length, tag = len(read.task_index), _tag_of(read.frames)
        from simstream import Episode

        original = Episode(length, True, TASKS[tag % 2], expected_segments(length), terminated=True)
        replayed = source._episode(0, read, length)
        a, b = derive_row_metadata(original, 0, registry), derive_row_metadata(replayed, 0, registry)
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    finally:
        source.close()


def test_replay_through_the_engine_restores_language_per_frame(lowdim):
    root, _ = lowdim
    cfg = OnlineDataEngineCfg(source=LeRobotSpec(root), buffer_size=4, num_workers=1, refill_policy="manual")
    with OnlineDataEngine(cfg) as engine:
        batch = engine.sample_batch(32, 3, sampling_mode="segment")
        language = engine.resolve_language(batch)
        state = batch["obs", "state"]
        for item in range(32):
            tag, t0 = int(state[item, 0, 0]), int(state[item, 0, 1])
            subtask = language["subtask"][item][0]
            want = "reach" if t0 < 4 else TASKS[tag % 2]  # "grasp" is not accepted: never in segment mode
            assert t0 < 4 or t0 >= 9
            assert subtask == want and language["task"][item][0] == TASKS[tag % 2]


def test_png_images_round_trip_exactly(tmp_path):
    _record(tmp_path / "png", image_size=32, video=False, episodes=4, num_workers=1)
    meta = read_dataset_meta(tmp_path / "png")
    assert meta.info["features"]["observation.image"]["dtype"] == "image"
    assert not (tmp_path / "png" / "videos").exists()
    source = LeRobotSpec(tmp_path / "png").build(0, 0)
    try:
        for e in range(4):
            read = source.reader.read(e)
            tag = _tag_of(read.frames)
            want = np.stack([pattern(tag, t, 32) for t in range(len(read.task_index))])
            np.testing.assert_array_equal(read.frames["obs/image"], want)
    finally:
        source.close()


@pytest.mark.parametrize("codec", ["av1", "h264"])
def test_video_round_trips_within_tolerance(tmp_path, codec):
    _record(tmp_path / "vid", image_size=32, episodes=4, num_workers=1, video_codec=codec)
    meta = read_dataset_meta(tmp_path / "vid")
    assert meta.info["features"]["observation.image"]["info"]["video.codec"] == codec
    source = LeRobotSpec(tmp_path / "vid").build(0, 0)
    errors = []
    try:
        for e in range(4):
            read = source.reader.read(e)
            tag = _tag_of(read.frames)
            want = np.stack([pattern(tag, t, 32) for t in range(len(read.task_index))])
            errors.append(np.abs(read.frames["obs/image"].astype(int) - want).ravel())
    finally:
        source.close()
    errors = np.concatenate(errors)
    # stated tolerance: AV1 CRF 30 or H.264 CRF 23 on a smooth (mod-256 wrapping) pattern, mean <= 8/255
    assert errors.mean() <= 8 and np.median(errors) <= 4


def test_a_reader_keeps_a_few_video_files_open_however_many_the_dataset_has(tmp_path):
    """One video file per camera per flushed group: a long recording holds thousands, more file descriptors
    than a process may have. The reader keeps the 4 videos and 8 data files it used last open."""
    import os

    from simstream.lerobot.format import features_from_fields
    from simstream.lerobot.names import KeyMap

    from .sources import pattern_record

    features = features_from_fields(PatternSpec(image_size=16).fields(), KeyMap(), video=True)
    writer = DatasetWriter(tmp_path / "ds", features, 20, video_codec="h264")
    for tag in range(10):
        writer.add(pattern_record(tag, image_size=16))
        writer.flush()  # a group, and a video file, per episode
    assert len(list((tmp_path / "ds" / "videos").rglob("*.mp4"))) == 10
    source = LeRobotSpec(tmp_path / "ds").build(0, 0)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        for e in [*range(10), 0, 9]:  # the first file again, after it was closed
            assert _tag_of(source.reader.read(e).frames) == e
            assert len(source.reader._containers) <= 4 and len(source.reader._files) <= 8
        assert len(os.listdir("/proc/self/fd")) <= fds + 4 + 8
    finally:
        source.close()
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_appending_keeps_the_datasets_codec_and_a_bad_codec_is_refused(tmp_path):
    _record(tmp_path / "vid", image_size=32, episodes=2, num_workers=1, video_codec="h264")
    recorder, _ = _record(tmp_path / "vid", image_size=32, episodes=2, num_workers=1, video_codec="av1")
    assert recorder.writer.video_codec == "h264"
    meta = read_dataset_meta(tmp_path / "vid")
    assert meta.info["features"]["observation.image"]["info"]["video.codec"] == "h264"
    assert meta.info["total_episodes"] == 4
    with pytest.raises(ValueError, match=r"video_codec must be one of \['av1', 'h264'\], got 'vp9'"):
        DatasetWriter(tmp_path / "other", [], 20, video_codec="vp9")


def test_skip_mode_counts_what_producers_overwrote(tmp_path):
    """With on_full="skip" an unrecorded episode a producer overwrites is counted, never silent."""
    from simstream.buffer.gate import RecordGate

    gate = RecordGate(4)
    episode_id = torch.tensor([5, 6, -1, 7])
    gate.attach("skip")
    gate.mark_recorded(0, 5)
    gate.before_claim(0, 4, episode_id)
    assert gate.skipped.tolist() == [0, 1, 0, 1] and gate.total_skipped() == 2
    assert gate.recorded.tolist() == [5, 6, -1, 7]  # settled: a late copy of 6 or 7 is discarded
    gate.attach("wait")
    episode_id = torch.tensor([5, 8, -1, 9])  # published since into the rows claimed above
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            gate.mark_recorded(1, 8)
            gate.mark_recorded(3, 9)

    gate.before_claim(0, 4, episode_id, check)  # returns once the recorder marked the rows
    assert len(calls) == 3

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    with pytest.raises(Stop):
        gate.before_claim(0, 4, torch.tensor([9, 9, 9, 9]), stop)
    gate.detach()
    gate.before_claim(0, 4, torch.tensor([9, 9, 9, 9]), stop)  # detached: never waits
    with pytest.raises(ValueError, match="RecordGate mode must be 'wait' or 'skip', got 'drop'"):
        gate.attach("drop")


def test_skip_mode_accounts_for_every_published_episode_once(tmp_path):
    """Producers overwrite rows the recorder has not copied: every episode they published ends recorded
    or skipped, never both (a copy that a claim overtakes is discarded) and never neither."""
    cfg = OnlineDataEngineCfg(source=PatternSpec(), buffer_size=4, num_workers=2, refill_policy="manual")
    engine = OnlineDataEngine(cfg)
    recorder = LeRobotRecorder(engine, tmp_path / "ds", on_full="skip", flush_every=4)
    with recorder, engine:  # the engine stops first; closing the recorder copies what is still published
        for _ in range(40):  # manual refills: the producers are idle once a generation completes
            engine.wait_for_generation(engine.request_refill(), timeout=60)
        published = engine.get_stats()["successful_episodes"]
    assert published >= 160
    assert recorder.episodes_skipped > 0, "the producers never overtook the recorder: nothing was tested"
    assert recorder.episodes_recorded + recorder.episodes_skipped == published
    tags = [_tag_of(e.frames) for e in _episodes(tmp_path / "ds")]
    assert len(tags) == len(set(tags)) == recorder.episodes_flushed == recorder.episodes_recorded


def _episodes(root):
    source = LeRobotSpec(root).build(0, 0)
    try:
        return [source.reader.read(e) for e in range(len(source.reader.meta.episodes))]
    finally:
        source.close()


def test_episodes_without_frames_are_counted_and_never_wedge_the_producers(tmp_path):
    """A source may publish an episode of length 0; the recorder marks its row copied (so the producer can
    claim it again) and counts it, and the dataset holds every other episode."""
    recorder, skipped = _record(tmp_path / "ds", episodes=8, num_workers=1, empty_every=3)
    assert skipped == 0
    assert recorder.episodes_empty >= 3  # every third episode of the one producer, 8 recorded around them
    meta = read_dataset_meta(tmp_path / "ds")
    lengths = [int(episode["length"]) for episode in meta.episodes]
    assert len(lengths) == 8 and min(lengths) >= 12
    source = LeRobotSpec(tmp_path / "ds").build(0, 0)
    try:
        tags = [_tag_of(source.reader.read(e).frames) for e in range(len(lengths))]
    finally:
        source.close()
    assert tags == [tag for tag in range(12) if tag % 3 != 2][:8]  # in order, none lost, none empty


def test_a_recorder_counts_only_its_own_skips(tmp_path):
    cfg = OnlineDataEngineCfg(source=PatternSpec(), buffer_size=4, num_workers=1, refill_policy="manual")
    engine = OnlineDataEngine(cfg)
    engine._shared.record_gate.skipped[1] = 5  # what an earlier recorder in skip mode left counted
    recorder = LeRobotRecorder(engine, tmp_path / "ds", on_full="skip")
    with recorder, engine:
        assert recorder.episodes_skipped == 0


def test_a_recorder_counts_only_the_waits_for_itself(tmp_path):
    cfg = OnlineDataEngineCfg(source=PatternSpec(), buffer_size=4, num_workers=1, refill_policy="manual")
    engine = OnlineDataEngine(cfg)
    engine._shared.record_gate.waited_ns[2] = 7 * 10**9  # producers waited 7 s for an earlier recorder
    recorder = LeRobotRecorder(engine, tmp_path / "ds")
    with recorder, engine:
        assert recorder.producer_wait_s == 0.0
        engine._shared.record_gate.waited_ns[0] += 250_000_000  # a producer's claim waits 0.25 s
        assert recorder.producer_wait_s == pytest.approx(0.25)


def test_episode_writer_claim_passes_through_the_gate():
    """The hook sits in EpisodeWriter.claim: every claim path (local producers, the Ray ingest) gets it."""
    from simstream import Episode
    from simstream.buffer.gate import RecordGate
    from tests.support.harness import Harness

    harness = Harness(rows=2, steps=8)
    harness.writer.record_gate = gate = RecordGate(2)
    harness.publish(0, Episode(length=8))  # published, never recorded
    gate.attach("skip")
    harness.writer.claim(0, 1)
    assert gate.total_skipped() == 1 and int(harness.index.version[0]) % 2 == 1  # counted, then claimed

    harness.writer.publish(0, 1, generation=2, episode_start=5)
    gate.attach("wait")

    class Closing(Exception):
        pass

    def closing():
        raise Closing

    with pytest.raises(Closing):  # unrecorded: the claim waits, and the caller's check ends the wait
        harness.writer.claim(0, 1, check=closing)
    assert int(harness.index.version[0]) % 2 == 0  # nothing claimed
    gate.mark_recorded(0, 5)
    harness.writer.claim(0, 1, check=closing)  # recorded: claims at once
    assert int(harness.index.version[0]) % 2 == 1


def test_a_failing_writer_is_raised_and_never_wedges_the_producers(tmp_path):
    """The writer thread's failure (here a full disk, injected: it cannot be caused on demand) reaches
    check() and close() as itself, detaches the gate, and the producers keep publishing."""
    spec = PatternSpec()
    cfg = OnlineDataEngineCfg(source=spec, buffer_size=4, num_workers=2, refill_policy="manual")
    engine = OnlineDataEngine(cfg)
    recorder = LeRobotRecorder(engine, tmp_path / "ds", flush_every=2)

    def full_disk() -> int:
        raise OSError(28, "No space left on device (injected)")

    recorder.writer.flush = full_disk
    with engine:
        recorder.start()
        assert recorder.wait_flushed(1, timeout_s=30.0)  # the wait ends at the failure
        assert recorder.episodes_flushed == 0
        with pytest.raises(OSError, match=r"No space left on device \(injected\)"):
            recorder.check()
        assert not engine._shared.record_gate.attached
        for _ in range(3):  # rows holding unrecorded episodes are claimed again: nobody waits
            engine.wait_for_generation(engine.request_refill(), timeout=30.0)
        with pytest.raises(OSError, match=r"No space left on device \(injected\)"):
            recorder.close(timeout_s=30.0)
    assert recorder.episodes_flushed == 0
