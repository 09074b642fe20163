"""Config validation: every field, the reference's exact messages, and nothing allocated on failure."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simstream import Field, OnlineDataEngine, OnlineDataEngineCfg
from tests.support.sources import ScriptedSpec

SPEC = ScriptedSpec(num_envs=2, max_episode_steps=20)


def _cfg(**overrides) -> OnlineDataEngineCfg:
    values = {"source": SPEC, "buffer_size": 4}
    values.update(overrides)
    return OnlineDataEngineCfg(**values)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"action_semantics": "joy"}, "Unknown ODS action_semantics"),
        ({"action_semantics": "policy_request"}, "policy_request ODS requires action_dim"),
        (
            {"action_semantics": "policy_request", "action_dim": 2, "action_contracts": ("a", " ")},
            "action_contracts must be a tuple of nonempty contract IDs",
        ),
        ({"action_contracts": ("a",)}, "action_contracts are only valid for policy_request recording"),
        ({"episode_sample_budget": 1}, "must both be positive signed-int64 integers"),
        ({"episode_sample_budget": True, "episode_sample_hard_limit": 2}, "must both be positive"),
        (
            {"episode_sample_budget": 3, "episode_sample_hard_limit": 2},
            "episode_sample_budget must not exceed episode_sample_hard_limit",
        ),
        ({"refill_policy": "always"}, "refill_policy must be 'sample_threshold' or 'manual', got 'always'"),
        ({"action_dim": 0}, "action_dim must be a positive integer or None, got 0"),
        (
            {"lifecycle_event_capacity": 7},
            "lifecycle_event_capacity must be zero or at least 2 \\* buffer_size, got 7 with buffer_size=",
        ),
        ({"max_generation_attempts": 0}, "max_generation_attempts must be at least 1, got 0."),
        ({"language_buffer_bytes": 0}, "language_buffer_bytes must be a positive integer"),
        ({"language_buffer_bytes": 1.5}, "language_buffer_bytes must be a positive integer"),
        ({"initialization_timeout": math.nan}, "initialization_timeout must be finite and greater than zero"),
        ({"shutdown_timeout": math.inf}, "shutdown_timeout must be finite and greater than zero, got inf."),
        # process joins poll(2) in int32 milliseconds: a larger timeout could never stop the engine
        ({"shutdown_timeout": 1e7}, r"shutdown_timeout must be at most 1e\+06 seconds \(about 11 days\)"),
        ({"initialization_timeout": 2e6}, r"initialization_timeout must be at most 1e\+06 seconds"),
        ({"buffer_size": 0}, r"OnlineDataEngineCfg.buffer_size must be an int >= 1, got 0"),
        # huge sizes fail naming the field, not in torch's allocator (2**40) or with a TypeError (2**63)
        (
            {"buffer_size": 2**40},
            r"OnlineDataEngineCfg.buffer_size must be an int in \[1, 2147483647\], got 1099511627776",
        ),
        ({"buffer_size": 2**63}, r"OnlineDataEngineCfg.buffer_size must be an int in \[1, 2147483647\]"),
        (
            {"language_buffer_bytes": 2**31},
            r"OnlineDataEngineCfg.language_buffer_bytes must be an int in \[1, 2147483647\], got 2147483648",
        ),
        (
            {"lifecycle_event_capacity": 2**31},
            r"OnlineDataEngineCfg.lifecycle_event_capacity must be 0 or an int in \[2 \* buffer_size = 8, "
            r"2147483647\], got 2147483648",
        ),
        (
            {"source": ScriptedSpec(max_episode_steps=2**31)},
            r"OnlineDataEngineCfg.source.max_episode_steps must be an int in \[1, 2147483647\], "
            r"got 2147483648",
        ),
        ({"check_unwritten_frames": 1}, "OnlineDataEngineCfg.check_unwritten_frames must be a bool, got 1"),
        ({"num_workers": 0}, r"OnlineDataEngineCfg.num_workers must be an int in \[1, 1024\], got 0"),
        (  # passed every check and went on to fork 100,000 producers
            {"num_workers": 100_000, "buffer_size": 200_000},
            r"OnlineDataEngineCfg.num_workers must be an int in \[1, 1024\], got 100000",
        ),
        ({"refill_threshold": -1}, r"OnlineDataEngineCfg.refill_threshold must be an int >= 0, got -1"),
        ({"buffer_device": "cuda"}, "OnlineDataEngineCfg.buffer_device must be 'cpu'"),
        ({"buffer_device": "gpu0"}, "OnlineDataEngineCfg.buffer_device must be 'cpu'"),
        (
            {"episode_sample_budget": 1, "episode_sample_hard_limit": 2, "buffer_device": "gpu0"},
            "Per-episode sampling quotas require buffer_device='cpu'",
        ),
        ({"source": None}, "OnlineDataEngineCfg.source must be a SourceSpec"),
        ({"max_episode_steps": 30}, "must be None or equal the source's max_episode_steps \\(20\\)"),
        (
            {"buffer_size": 1},
            r"buffer_size must be >= the source.s num_envs 2 \(the rows one rollout writes\), got 1",
        ),
        ({"buffer_size": 3, "num_workers": 2}, "buffer_size must be at least num_workers \\* num_envs"),
        ({"action_dim": 5}, "action_dim must match the source's actions width 2, got 5"),
        (
            {"source": ScriptedSpec(num_envs=4), "buffer_size": 5, "lifecycle_event_capacity": 10},
            "lifecycle_event_capacity cannot hold initial-fill events",
        ),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_values_are_rejected_before_anything_starts(overrides, message):
    with pytest.raises(ValueError, match=message):
        OnlineDataEngine(_cfg(**overrides))


def test_source_fields_are_checked():
    with pytest.raises(ValueError, match="collides with the engine's metadata key"):
        OnlineDataEngine(_cfg(source=ScriptedSpec(extra_fields={"valid": Field()})))
    with pytest.raises(ValueError, match="is both a leaf and the parent"):
        OnlineDataEngine(_cfg(source=ScriptedSpec(extra_fields={"obs/x": Field()})))
    with pytest.raises(ValueError, match=r"Field.shape must be a tuple of positive ints"):
        Field(shape=(0,))


def test_unpicklable_source_is_rejected():
    class LocalSpec(ScriptedSpec):  # a local class cannot be pickled
        pass

    with pytest.raises(ValueError, match=r"OnlineDataEngineCfg.source must be picklable"):
        OnlineDataEngine(_cfg(source=LocalSpec()))


def test_initial_fill_records_match_the_reference_formula():
    # buffer 5 / num_envs 4: windows [0,4) and [1,5): 8 published + 3 same-generation evictions
    cfg = _cfg(source=ScriptedSpec(num_envs=4), buffer_size=5)
    assert cfg.initial_fill_records(4) == 11
    assert cfg.worker_row_ranges(4) == [(0, 5)]
    assert _cfg(buffer_size=7, num_workers=2).worker_row_ranges(2) == [(0, 4), (4, 7)]


@settings(max_examples=80, deadline=None)
@given(
    buffer_size=st.integers(-2, 40),
    workers=st.integers(-1, 4),
    threshold=st.integers(-3, 5),
    attempts=st.integers(-1, 3),
    timeout=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 5)),
)
def test_validation_accepts_exactly_the_documented_ranges(buffer_size, workers, threshold, attempts, timeout):
    cfg = _cfg(
        buffer_size=buffer_size,
        num_workers=workers,
        refill_threshold=threshold,
        max_generation_attempts=attempts,
        shutdown_timeout=timeout,
    )
    ok = (
        buffer_size >= 1
        and workers >= 1
        and threshold >= 0
        and attempts >= 1
        and math.isfinite(timeout)
        and 0 < timeout <= 1e6
        and buffer_size >= 2 * workers
    )
    if ok:
        layout = cfg.validate()
        assert layout.num_envs == 2 and layout.max_episode_steps == 20
    else:
        with pytest.raises(ValueError):
            cfg.validate()


_MAX = 2**31 - 1


@settings(max_examples=60, deadline=None)
@given(
    buffer_size=st.one_of(st.integers(2, 64), st.integers(_MAX - 2, _MAX + 2), st.integers(2**62, 2**64)),
    language=st.one_of(st.integers(-1, 64), st.integers(_MAX - 2, _MAX + 2), st.integers(2**62, 2**64)),
    events=st.one_of(
        st.just(0), st.integers(1, 200), st.integers(_MAX - 2, _MAX + 2), st.integers(2**62, 2**64)
    ),
)
def test_size_fields_are_bounded_with_a_message_naming_field_and_range(buffer_size, language, events):
    cfg = _cfg(buffer_size=buffer_size, language_buffer_bytes=language, lifecycle_event_capacity=events)
    problems = []
    if buffer_size > _MAX:
        problems.append(rf"buffer_size must be an int in \[1, {_MAX}\], got {buffer_size}")
    elif events != 0 and events < 2 * buffer_size:
        problems.append("lifecycle_event_capacity must be zero or at least 2 \\* buffer_size")
    elif events > _MAX:
        problems.append(
            rf"lifecycle_event_capacity must be 0 or an int in \[2 \* buffer_size = {2 * buffer_size}"
        )
    elif language < 1:
        problems.append("language_buffer_bytes must be a positive integer")
    elif language > _MAX:
        problems.append(rf"language_buffer_bytes must be an int in \[1, {_MAX}\], got {language}")
    elif events and events < cfg.initial_fill_records(2):
        problems.append("lifecycle_event_capacity cannot hold initial-fill events")
    if problems:
        with pytest.raises(ValueError, match=problems[0]):
            cfg.validate()
    else:
        assert cfg.validate().max_episode_steps == 20
