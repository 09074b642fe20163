"""LeRobotRecorder refuses bad settings before it writes anything."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.lerobot import LeRobotRecorder
from simstream.synthetic import SyntheticSpec

from .sources import PatternSpec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def engine():
    return OnlineDataEngine(OnlineDataEngineCfg(source=PatternSpec(), buffer_size=2, num_workers=1))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"fps": 0}, "LeRobotRecorder.fps must be an int >= 1, got 0"),
        ({"on_full": "drop"}, "LeRobotRecorder.on_full must be 'wait' or 'skip', got 'drop'"),
        ({"max_episodes": 0}, "LeRobotRecorder.max_episodes must be an int >= 1 or None, got 0"),
        ({"flush_every": 0}, "LeRobotRecorder.flush_every must be an int >= 1, got 0"),
        ({"flush_interval_s": 0}, "LeRobotRecorder.flush_interval_s must be a number in (0, 3600], got 0"),
        (
            {"flush_interval_s": float("nan")},
            "LeRobotRecorder.flush_interval_s must be a number in (0, 3600]",
        ),
        ({"flush_interval_s": True}, "LeRobotRecorder.flush_interval_s must be a number in (0, 3600]"),
        ({"writer_niceness": -1}, "LeRobotRecorder.writer_niceness must be an int in [0, 19], got -1"),
        ({"writer_niceness": 20}, "LeRobotRecorder.writer_niceness must be an int in [0, 19], got 20"),
        ({"writer_niceness": 5.0}, "LeRobotRecorder.writer_niceness must be an int in [0, 19], got 5.0"),
        ({"writer_niceness": True}, "LeRobotRecorder.writer_niceness must be an int in [0, 19], got True"),
        # accepted as truthy before: "no" recorded videos, "False" only successes
        ({"video": "no"}, "LeRobotRecorder.video must be True or False, got 'no'"),
        ({"only_success": "False"}, "LeRobotRecorder.only_success must be True or False, got 'False'"),
        ({"robot_type": ""}, "LeRobotRecorder.robot_type must be None or a nonempty string, got ''"),
        ({"robot_type": 7}, "LeRobotRecorder.robot_type must be None or a nonempty string, got 7"),
    ],
)
def test_bad_settings(engine, tmp_path, kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        LeRobotRecorder(engine, tmp_path / "ds", **kwargs)
    assert not (tmp_path / "ds").exists()


def _record_in_a_child(engine, root, answers) -> None:
    try:
        LeRobotRecorder(engine, root)
    except RuntimeError as error:
        answers.send(str(error))
    else:
        answers.send("no error")


def test_only_the_owner_may_record(engine, tmp_path):
    """A recorder's liveness is its owner's: a producer waiting on it notices the owner's death. One started
    in another process (a DataLoader worker, a forked child) and killed there left the producers waiting
    on it for ever."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    answers, answer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_record_in_a_child, args=(engine, tmp_path / "ds", answer))
    child.start()
    try:
        assert answers.poll(30.0)
        message = answers.recv()
    finally:
        child.join(30.0)
    assert message == (
        f"LeRobotRecorder: only the engine's owner process ({os.getpid()}) may record; this is process "
        f"{child.pid}, where the engine was pickled or forked into"
    )
    assert child.exitcode == 0 and not (tmp_path / "ds").exists()


def test_source_without_fps(tmp_path):
    engine = OnlineDataEngine(
        OnlineDataEngineCfg(source=SyntheticSpec(num_envs=1), buffer_size=2, num_workers=1)
    )
    with pytest.raises(
        ValueError, match=r"LeRobotRecorder\.fps: the source spec SyntheticSpec has no fps attribute"
    ):
        LeRobotRecorder(engine, tmp_path / "ds")
    LeRobotRecorder(engine, tmp_path / "ds", fps=50)  # explicit fps: accepted


def test_start_twice(engine, tmp_path):
    recorder = LeRobotRecorder(engine, tmp_path / "ds").start()
    try:
        with pytest.raises(RuntimeError, match=r"LeRobotRecorder.start\(\) was already called"):
            recorder.start()
    finally:
        recorder.close()


def test_a_mix_of_sources_with_different_rates_needs_an_explicit_fps(tmp_path):
    from simstream.sources import MixSpec

    mix = MixSpec([PatternSpec(fps=20), PatternSpec(fps=30)], [1.0, 1.0])
    engine = OnlineDataEngine(OnlineDataEngineCfg(source=mix, buffer_size=2, num_workers=1))
    with pytest.raises(
        ValueError,
        match=re.escape("the source spec MixSpec gives fps=None (a MixSpec does when its sources'"),
    ):
        LeRobotRecorder(engine, tmp_path / "ds")
    LeRobotRecorder(engine, tmp_path / "ds", fps=20).close()


_NEVER_CLOSED = """
import sys
from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.lerobot import LeRobotRecorder
from tests.lerobot.sources import PatternSpec

if __name__ == "__main__":
    engine = OnlineDataEngine(
        OnlineDataEngineCfg(source=PatternSpec(), buffer_size=8, num_workers=1, refill_policy="manual")
    )
    recorder = LeRobotRecorder(engine, sys.argv[1], video=False).start()
    engine.start()  # publishes its first generation: 8 episodes
    print("published", engine.get_stats()["successful_episodes"], flush=True)
    if sys.argv[2] == "crash":
        raise RuntimeError("the script crashed")
"""


@pytest.mark.parametrize("ending", ["return", "crash"])
def test_a_script_that_never_closes_its_recorder_still_commits_what_it_recorded(tmp_path, ending):
    """The recorder's threads are daemons: at exit, episodes copied but not flushed (flush_every=32,
    every 2 s) were lost without a word. An exit hook stops the engine, then closes the recorder."""
    import subprocess
    import sys

    from simstream.lerobot.dataset import read_dataset_meta

    script = tmp_path / "never_closed.py"
    script.write_text(_NEVER_CLOSED)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("PYOPENGL_PLATFORM", None)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ds"), ending],
        capture_output=True, text=True, timeout=120, env=env, cwd=root,
    )  # fmt: skip
    assert "published 8" in done.stdout, done.stderr[-3000:]
    assert done.returncode == (1 if ending == "crash" else 0), done.stderr[-3000:]
    assert ("RuntimeError: the script crashed" in done.stderr) == (ending == "crash")
    assert "at exit failed" not in done.stderr
    assert len(read_dataset_meta(tmp_path / "ds").episodes) == 8


def test_episodes_published_just_before_the_engine_fails_are_still_recorded(tmp_path, monkeypatch):
    """The copy thread read the engine's failure after a scan that found nothing, then returned: episodes
    published between that scan and the failure were never copied. Here the first scan is made to miss
    the first generation's episodes, as one that ran just before they were published would, and the
    engine fails right after it."""
    from simstream.lerobot.dataset import read_dataset_meta

    engine = OnlineDataEngine(
        OnlineDataEngineCfg(source=PatternSpec(), buffer_size=4, num_workers=1, refill_policy="manual")
    )
    recorder = LeRobotRecorder(engine, tmp_path / "ds", video=False)
    scan, scans = recorder._copy_published, []

    def scan_that_missed_them() -> int:
        scans.append(len(scans))
        if len(scans) == 1:
            engine._shared.channel.publish(RuntimeError("a producer failed"), "producer-0")
            return 0
        return scan()

    monkeypatch.setattr(recorder, "_copy_published", scan_that_missed_them)
    engine.start()  # the first generation: 4 episodes, published before the recorder looks
    recorder.start()
    recorder._thread.join(30)
    assert not recorder._thread.is_alive()  # it ended on the failure
    with pytest.raises(RuntimeError, match="a producer failed"):
        engine.stop()
    recorder.close()
    assert len(scans) >= 2
    assert len(read_dataset_meta(tmp_path / "ds").episodes) == 4
