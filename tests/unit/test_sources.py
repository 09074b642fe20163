"""The episode-report rules: each broken rule is named with its row."""

from __future__ import annotations

import re

import numpy as np
import pytest

from simstream import Episode, Segment
from simstream.sources import validate_episodes


@pytest.mark.parametrize(
    ("episodes", "message"),
    [
        ([Episode(3)], "returned 1 episodes for a window of 2 rows"),
        ("no", "must return a sequence of 2 Episode objects or None"),
        ([Episode(3), Episode(11)], r"Episode.length of row 1 must be an int in \[0, 10\], got 11"),
        ([Episode(-1), Episode(1)], r"Episode.length of row 0 must be an int in \[0, 10\], got -1"),
        ([Episode(3), Episode(2.0)], "Episode.length of row 1"),
        ([Episode(3), Episode(5, segments=[Segment(2, 6)])], r"Segment \[2, 6\) of row 1 is outside the row"),
        ([Episode(5, segments=[Segment(0, 3), Segment(2, 5)]), Episode(1)], "Segments of row 0 overlap"),
        (
            [Episode(5, segments=[Segment(3, 2)]), Episode(1)],
            r"Segment \[3, 2\) of row 0 is outside the row: "
            r"segments must satisfy 0 <= start <= end <= length=5",
        ),
        ([Episode(5), Episode(5, segments=[Segment(6, 6)])], r"Segment \[6, 6\) of row 1 is outside the row"),
        ([Episode(5, segments=[Segment(-1, -1)]), Episode(1)], r"Segment \[-1, -1\) of row 0 is outside"),
        (
            [Episode(5, segments=[Segment(2, 2), Segment(1, 3), Segment(2, 4)]), Episode(1)],
            "Segments of row 0 overlap",
        ),
        ([Episode(3, continuity=[0, 0]), Episode(1)], "Episode.continuity of row 0 has 2 ids for length 3"),
        (
            [Episode(2, continuity=[0, -2]), Episode(1)],
            re.escape("Episode.continuity of row 0 must hold ints in [-1, 2**63 - 1]"),
        ),
        ([Episode(2, continuity=[0, 2**63]), Episode(1)], re.escape("must hold ints in [-1, 2**63 - 1]")),
        (
            [Episode(2), Episode(2, continuity=iter([0, 0]))],
            "Episode.continuity of row 1 must be a sequence or an array of ids, got list_iterator",
        ),
        ([Episode(2), "x"], "Episode report for row 1 must be an Episode"),
        (
            [Episode(2), Episode(3, segments=(Segment(0, k) for k in (3,)))],
            r"Episode.segments of row 1 must be a sequence \(tuple or list\) of Segment objects, "
            "got generator",
        ),
        (
            [Episode(2, segments=None), Episode(1)],
            "Episode.segments of row 0 must be a sequence .* got NoneType",
        ),
        ([Episode(2, segments=Segment(0, 2)), Episode(1)], "Episode.segments of row 0 .* got Segment"),
        ([Episode(2), Episode(2, segments=[(0, 2)])], r"Episode.segments\[0\] of row 1 must be a Segment"),
        (
            [Episode(5, segments=[Segment(np.int64(0), np.int64(5))]), Episode(1)],
            r"Segment bounds of row 0 must be ints, got start=np.int64\(0\) and end=np.int64\(5\)",
        ),
        ([Episode(2, success="False"), Episode(1)], "Episode.success of row 0 must be a bool, got 'False'"),
        ([Episode(2), Episode(1, terminated=1)], "Episode.terminated of row 1 must be a bool, got 1"),
        ([Episode(2, truncated=None), Episode(1)], "Episode.truncated of row 0 must be a bool, got None"),
        (
            [Episode(2, segments=[Segment(0, 2, accepted="no")]), Episode(1)],
            "Segment.accepted of row 0 must be a bool, got 'no'",
        ),
        (
            [Episode(2), Episode(1, instruction=b"stack".decode("utf-8", "surrogateescape") + "\udc80")],
            re.escape(
                "Episode.instruction of row 1 must be str (valid Unicode: UTF-8 encodable) or None, got "
            ),
        ),
        ([Episode(2, instruction=3), Episode(1)], "Episode.instruction of row 0 must be str .* got 3"),
        (
            [Episode(2, segments=[Segment(0, 1), Segment(1, 2, "bad \udc80")]), Episode(1)],
            r"Segment.instruction of row 0 must be str \(valid Unicode: UTF-8 encodable\) or None, got "
            r"'bad \\udc80' \(segment 1\)",
        ),
    ],
)
def test_broken_reports_name_the_row_and_rule(episodes, message):
    with pytest.raises(ValueError, match=message):
        validate_episodes(episodes, num_rows=2, capacity=10)


def test_good_report_passes():
    episodes = [Episode(10, segments=[Segment(0, 4, "a"), Segment(4, 10)]), Episode(0)]
    assert validate_episodes(episodes, 2, 10) == episodes
    # NumPy's flags (what comparisons of NumPy numbers give) and an array of continuity ids are fine
    flags = [Episode(3, success=np.bool_(True), continuity=np.array([0, 0, 2**62])), Episode(0)]
    assert validate_episodes(flags, 2, 10) == flags


@pytest.mark.parametrize(
    "segments",
    [
        pytest.param([Segment(3, 3)], id="alone"),
        pytest.param([Segment(0, 0), Segment(0, 5)], id="before the first"),
        pytest.param([Segment(0, 3), Segment(3, 3), Segment(3, 5)], id="between touching ones"),
        pytest.param([Segment(0, 5), Segment(5, 5)], id="at the end"),
        # the reference checks overlap on the frames a span covers: an empty span covers none
        pytest.param([Segment(0, 4), Segment(2, 2), Segment(4, 5)], id="inside an earlier one"),
        pytest.param([Segment(3, 5), Segment(1, 1, "never said")], id="before an earlier one"),
    ],
)
def test_empty_segments_are_accepted_anywhere_inside_the_row(segments):
    episodes = [Episode(5, segments=segments), Episode(0, segments=[Segment(0, 0)])]
    assert validate_episodes(episodes, 2, 10) == episodes
