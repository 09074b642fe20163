"""The shared config checks: every message names the owner, the field, the accepted range and the value."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from simstream._validation import require, require_choice, require_int, require_number


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        pytest.param(0, {"low": 0, "low_open": True}, "C.f must be a finite number > 0, got 0", id="open"),
        pytest.param(-1, {"low": 0}, "C.f must be a finite number >= 0, got -1", id="closed-low"),
        pytest.param(3, {"high": 2, "high_open": True}, "C.f must be a finite number < 2, got 3", id="high"),
        pytest.param(1.5, {"low": 0, "high": 1}, "C.f must be a number in [0, 1], got 1.5", id="closed"),
        pytest.param(
            2e6, {"low": 0, "high": 1e6, "low_open": True}, "C.f must be a number in (0, 1e6], got 2000000.0",
            id="exponent-bound",
        ),
        pytest.param(math.nan, {"low": 0, "high": 1}, "C.f must be a number in [0, 1], got nan", id="nan"),
        pytest.param(math.inf, {"low": 0}, "C.f must be a finite number >= 0, got inf", id="inf"),
        pytest.param(True, {}, "C.f must be a finite number, got True", id="bool"),
        pytest.param(10**400, {}, f"C.f must be a finite number, got {10**400!r}", id="int-beyond-float"),
        pytest.param("1", {}, "C.f must be a finite number, got '1'", id="text"),
        pytest.param(
            -1.0, {"low": 0, "optional": True}, "C.f must be None or a finite number >= 0, got -1.0",
            id="optional",
        ),
        pytest.param(
            0.7, {"high": 0.5, "consequence": "Why it matters."},
            "C.f must be a finite number <= 0.5, got 0.7. Why it matters.", id="consequence",
        ),
    ],
)  # fmt: skip
def test_require_number_rejects_naming_field_range_and_value(value, kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        require_number("C", "f", value, **kwargs)


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [(0.5, {"low": 0, "high": 1}), (1, {"low": 0, "high": 1}), (np.float32(0.25), {"low": 0}),
     (None, {"optional": True}), (-3, {})],
)  # fmt: skip
def test_require_number_accepts_the_range_it_names(value, kwargs):
    require_number("C", "f", value, **kwargs)


def test_require_choice_lists_the_choices():
    require_choice("C", "mode", "sync", ("async", "sync", "serial"))
    with pytest.raises(ValueError, match=r"^C\.mode must be one of 'async', 'sync', 'serial', got 'x'$"):
        require_choice("C", "mode", "x", ("async", "sync", "serial"))
    with pytest.raises(ValueError, match=r"^C\.overflow must be 'block' or 'drop_oldest', got 'x'$"):
        require_choice("C", "overflow", "x", ("block", "drop_oldest"))


def test_require_and_require_int():
    require(True, "C", "f", "anything", 1)
    with pytest.raises(ValueError, match=r"^C\.f must be a gym id, got ''$"):
        require(False, "C", "f", "a gym id", "")
    with pytest.raises(ValueError, match=r"^C\.n must be an int in \[1, 4\], got 5$"):
        require_int("C", "n", 5, 1, 4)
    with pytest.raises(ValueError, match=r"^C\.n must be an int >= 1, got True$"):
        require_int("C", "n", True, 1)


def test_require_writable_probes_where_the_path_would_go_and_leaves_nothing(tmp_path):
    from simstream._validation import require_writable

    require_writable("Args", "out", tmp_path / "new" / "nested", folder=True)
    require_writable("Args", "out", tmp_path / "new" / "file.json")
    assert list(tmp_path.iterdir()) == []  # the probe folder was removed; nothing was created
    existing = tmp_path / "file.json"
    existing.write_text("kept")
    require_writable("Args", "out", existing)
    assert existing.read_text() == "kept"
    with pytest.raises(ValueError, match=r"^Args\.out must be a folder, got '.*file\.json'$"):
        require_writable("Args", "out", existing, folder=True)
    with pytest.raises(ValueError, match=r"^Args\.out must be a file, got '.*'$"):
        require_writable("Args", "out", tmp_path)
    with pytest.raises(
        ValueError, match=r"Args\.out cannot be written: '.*file\.json' is a file, not a folder"
    ):
        require_writable("Args", "out", existing / "inside.json")
    with pytest.raises(
        ValueError, match=r"cannot be written: '/proc/x/y' \(creating a folder in '/proc' failed: "
    ):
        require_writable("Args", "out", "/proc/x/y", folder=True)
