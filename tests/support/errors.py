"""Assertions shared by the error-path tests."""

from __future__ import annotations

from pathlib import Path

import pytest


def assert_names_the_value(error: pytest.ExceptionInfo, kwargs: dict) -> None:
    """A one-setting case's message ends its rule with ``got <the value>`` (a path shows as its string)."""
    if len(kwargs) == 1:
        value = next(iter(kwargs.values()))
        shown = repr(str(value)) if isinstance(value, Path) else repr(value)
        assert f"got {shown}" in str(error.value), str(error.value)
