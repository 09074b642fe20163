"""The error channel transports failures as plain data and rebuilds what it can."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from simstream import OnlineDataWorkerError
from simstream.workers.channel import CHANNEL_BYTES, ErrorChannel, FailureRecord, cap_text, describe_exit
from tests.support.sources import OddInitError, UnpicklableError


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:
        return caught


def test_first_failure_wins_and_is_rebuilt_as_the_original_type():
    channel = ErrorChannel(mp.get_context("fork"))
    assert channel.read() is None and channel.error() is None
    assert channel.publish(_raised(KeyError("first")), "producer-0")
    assert not channel.publish(_raised(ValueError("second")), "producer-1")
    record = channel.read()
    assert record.worker == "producer-0" and record.type_name == "KeyError"
    assert "KeyError: 'first'" in record.traceback_text


def test_rebuilt_error_in_another_process_is_cached():
    channel = ErrorChannel(mp.get_context("fork"))
    channel.publish(_raised(KeyError("boom")), "w")
    clone = ErrorChannel.__new__(ErrorChannel)
    clone.__setstate__(channel.__getstate__())
    error = clone.error()
    assert isinstance(error, KeyError) and error is clone.error()


def test_unpicklable_and_unrebuildable_errors_keep_type_name_and_message():
    record = FailureRecord.from_exception(_raised(UnpicklableError("no pickle")), "w")
    assert record.payload is None
    error = record.rebuild()
    assert isinstance(error, OnlineDataWorkerError)
    assert str(error) == "Worker raised tests.support.sources.UnpicklableError: no pickle"
    odd = FailureRecord.from_exception(_raised(OddInitError(3, "x")), "w").rebuild()
    assert isinstance(odd, OnlineDataWorkerError) and "OddInitError: 3: x" in str(odd)


def test_huge_messages_and_tracebacks_fit_the_channel():
    error = _raised(RuntimeError("x" * 200_000))
    record = FailureRecord.from_exception(error, "w")
    data = record.encode()
    assert len(data) <= CHANNEL_BYTES
    decoded = FailureRecord.decode(data)
    assert decoded.message.startswith("xxx") and "characters cut" in decoded.message


@pytest.mark.parametrize(
    "character", ["x", "é", "中", "😀", "\udc80"], ids=["ascii", "latin", "cjk", "emoji", "surrogate"]
)
def test_messages_of_any_characters_fit_and_come_back_unchanged(character):
    """The caps count characters: JSON's escapes wrote an emoji as 12 bytes and such a record did not fit
    at all (nothing was published); a lone surrogate (from a decoding error) must travel too."""
    channel = ErrorChannel(mp.get_context("fork"))
    assert channel.publish(_raised(RuntimeError(character * 20_000)), "collector")
    record = channel.read()
    assert record.type_name == "RuntimeError" and record.message.startswith(character * 10)
    short = FailureRecord.from_exception(_raised(ValueError(character * 3)), "w")
    assert FailureRecord.decode(short.encode()).message == character * 3


def test_cap_text_keeps_head_and_tail():
    text = "HEAD" + "." * 1000 + "TAIL"
    capped = cap_text(text, 100)
    assert len(capped) <= 100 and capped.startswith("HEAD") and capped.endswith("TAIL")


@pytest.mark.parametrize(
    ("code", "text"),
    [(-9, "exit code -9, signal SIGKILL"), (3, "exit code 3"), (None, "exit code unknown")],
)
def test_describe_exit(code, text):
    assert describe_exit(code) == text
