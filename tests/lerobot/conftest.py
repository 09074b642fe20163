"""Fixtures of the LeRobot tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .test_names_and_fixture import FIXTURE


@pytest.fixture
def fixture_copy(tmp_path) -> Path:
    """A copy of the dataset lerobot 0.6.1 wrote (``tests/lerobot/fixture``), free to damage."""
    root = tmp_path / "ds"
    shutil.copytree(FIXTURE, root)
    return root
