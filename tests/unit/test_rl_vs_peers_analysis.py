"""The pure analysis of benchmarks/rl_vs_peers.py on hand-made curves (no SB3, no runs)."""

from __future__ import annotations

import doctest
import importlib.util
import math
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "rl_vs_peers.py"
_spec = importlib.util.spec_from_file_location("rl_vs_peers", PATH)
peers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = peers  # dataclasses look their module up while the file runs
_spec.loader.exec_module(peers)

# (wall_s, env_frames, return)
RISING = [(2.0, 1_000, -5.0), (4.0, 2_000, 10.0), (6.0, 3_000, 30.0), (8.0, 4_000, 25.0), (10.0, 5_000, 40.0)]


def test_doctests_pass():
    assert doctest.testmod(peers).failed == 0


def test_time_to_reach_is_the_first_crossing():
    assert peers.time_to_reach(RISING, 10.0) == 4.0  # reaching counts (>=)
    assert peers.time_to_reach(RISING, 26.0) == 6.0  # the first point at or above, not the last
    assert peers.time_to_reach(RISING, -100.0) == 2.0
    assert peers.time_to_reach(RISING, 41.0) == math.inf
    assert peers.time_to_reach([], 1.0) == math.inf
    assert math.isnan(peers.time_to_reach(RISING, math.nan))  # no SB3 result: n/a, not "never"


def test_return_at_frames_reads_the_last_point_not_past_them():
    assert peers.return_at_frames(RISING, 3_000) == 30.0
    assert peers.return_at_frames(RISING, 3_999) == 30.0
    assert peers.return_at_frames(RISING, 10**9) == 40.0
    assert math.isnan(peers.return_at_frames(RISING, 999))


def test_return_at_time_and_final():
    assert peers.return_at_time(RISING, 5.0) == 10.0
    assert math.isnan(peers.return_at_time(RISING, 1.0))
    assert peers.final_return(RISING) == 40.0
    assert peers.final_frames(RISING) == 5_000
    assert math.isnan(peers.final_return([]))


def test_per_frame_ratio_compares_at_sync_frames():
    sync = [(5.0, 1_000, 10.0), (10.0, 3_500, 32.0)]
    assert peers.per_frame_ratio(RISING, sync) == pytest.approx(30.0 / 32.0)
    assert math.isnan(peers.per_frame_ratio(RISING, [(10.0, 3_500, -3.0)]))  # ratio of a negative: n/a
    assert math.isnan(peers.per_frame_ratio(RISING, []))


def test_time_ratio_and_verdicts_with_never_reached():
    assert peers.time_ratio(3.0, 4.0) == 0.75
    assert peers.time_ratio(3.0, math.inf) == 0.0
    assert peers.time_ratio(math.inf, 4.0) == math.inf
    assert peers.verdict(0.85, 0.85) == "met"
    assert peers.verdict(math.inf, 0.85) == "SHORT"
    assert peers.verdict(math.nan, 0.85) == "n/a"
    assert peers.verdict(0.89, 0.90, higher_is_better=True) == "SHORT"


def test_median_never_hides_a_missing_run():
    assert peers.median([1.0, 3.0, 2.0]) == 2.0
    assert peers.median([1.0, math.inf]) == math.inf  # one seed never reached: not reached
    assert math.isnan(peers.median([1.0, math.nan]))
    assert math.isnan(peers.median([]))
