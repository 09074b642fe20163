"""LeRobotRecorder refuses bad settings before it writes anything."""

from __future__ import annotations

import re

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
    ],
)
def test_bad_settings(engine, tmp_path, kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        LeRobotRecorder(engine, tmp_path / "ds", **kwargs)
    assert not (tmp_path / "ds").exists()


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
