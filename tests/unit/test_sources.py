"""The episode-report rules: each broken rule is named with its row."""

from __future__ import annotations

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
        ([Episode(2, continuity=[0, -2]), Episode(1)], "Episode.continuity of row 0 must hold ints >= -1"),
        ([Episode(2), "x"], "Episode report for row 1 must be an Episode"),
    ],
)
def test_broken_reports_name_the_row_and_rule(episodes, message):
    with pytest.raises(ValueError, match=message):
        validate_episodes(episodes, num_rows=2, capacity=10)


def test_good_report_passes():
    episodes = [Episode(10, segments=[Segment(0, 4, "a"), Segment(4, 10)]), Episode(0)]
    assert validate_episodes(episodes, 2, 10) == episodes


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
