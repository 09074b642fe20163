"""Error paths of the engine config, its source checks, ``Field``, ``SyntheticSpec``, ``OnlineDataset``'s
arguments and the engine methods that refuse before anything starts: each names the field and the rule."""

from __future__ import annotations

import multiprocessing as mp
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
import torch
from tensordict import TensorDict

from simstream import DataUnavailableError, Episode, Field, OnlineDataEngine, OnlineDataEngineCfg
from simstream.buffer.quota import EpisodeQuota
from simstream.data import OnlineDataset
from simstream.sampling.sampler import _MAX_TORN_ROUNDS
from simstream.sources import FIELD_DTYPES
from simstream.synthetic import SyntheticSpec
from tests.support.engines import make_cfg, stop_quietly
from tests.support.errors import assert_names_the_value
from tests.support.harness import Harness
from tests.support.sources import ScriptedSpec

_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class _FieldsSpec:
    """A spec whose ``fields()`` and recording attributes are given as they are (validation only)."""

    payload: Mapping[str, object] = field(default_factory=lambda: {"obs": Field((3,))})
    num_envs: int = 2
    max_episode_steps: int = 20
    action_semantics: str | None = None
    action_contracts: tuple[str, ...] | None = None

    def fields(self) -> Mapping[str, object]:
        return dict(self.payload)

    def build(self, worker_index: int, seed: int):  # pragma: no cover - never built
        raise AssertionError("validation never builds the source")


def _cfg(**overrides) -> OnlineDataEngineCfg:
    values = {"source": ScriptedSpec(num_envs=2, max_episode_steps=20), "buffer_size": 4}
    values.update(overrides)
    return OnlineDataEngineCfg(**values)


# ------------------------------------------------------------------------------------ engine config
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"include_provenance": 1}, "OnlineDataEngineCfg.include_provenance must be a bool, got 1"),
        ({"include_provenance": None}, "OnlineDataEngineCfg.include_provenance must be a bool, got None"),
        ({"seed": -1}, f"OnlineDataEngineCfg.seed must be an int in [0, {_INT64_MAX}], got -1"),
        ({"seed": 2**63}, f"OnlineDataEngineCfg.seed must be an int in [0, {_INT64_MAX}], got {2**63}"),
        ({"seed": 1.0}, f"OnlineDataEngineCfg.seed must be an int in [0, {_INT64_MAX}], got 1.0"),
        ({"sample_wait_timeout": 0}, "sample_wait_timeout must be finite and greater than zero, got 0"),
        ({"sample_wait_timeout": 2e6}, "sample_wait_timeout must be at most 1e+06 seconds (about 11 days)"),
        ({"refill_threshold": 1.5}, "OnlineDataEngineCfg.refill_threshold must be an int "),
        ({"max_generation_attempts": True}, "max_generation_attempts must be at least 1, got True"),
        (
            {"source": ScriptedSpec(num_envs=0)},
            "OnlineDataEngineCfg.source.num_envs must be an int ",
        ),
        (
            {"source": ScriptedSpec(num_envs=True)},
            "OnlineDataEngineCfg.source.num_envs must be an int ",
        ),
        (
            {"source": ScriptedSpec(max_episode_steps=0)},
            "OnlineDataEngineCfg.source.max_episode_steps must be an int in [1, 2147483647], got 0",
        ),
        (
            {"source": _FieldsSpec(), "action_dim": 3},
            "OnlineDataEngineCfg.action_dim=3 but the source has no 'actions' field",
        ),
        (
            {
                "source": _FieldsSpec(
                    payload={"actions": Field((2,))},
                    action_semantics="policy_request",
                    action_contracts=("joint_targets",),
                ),
                "action_semantics": "policy_request",
                "action_dim": 2,
                "action_contracts": ("ee_delta",),
            },
            "OnlineDataEngineCfg.action_contracts ('ee_delta',) do not match the source's ('joint_targets',)",
        ),
        (
            {"source": _FieldsSpec(action_semantics="policy_request")},
            "OnlineDataEngineCfg.action_semantics is 'expert_controller_command' but the source records "
            "'policy_request'",
        ),
    ],
    ids=lambda v: str(v)[:40],
)
def test_engine_config_names_the_bad_field(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        _cfg(**overrides).validate()
    if "source" not in overrides:  # a source is not shown; its bad setting is
        assert_names_the_value(error, overrides)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({}, "SourceSpec.fields() must name at least one payload field"),
        ({"": Field()}, "SourceSpec field names must be nonempty 'a/b' paths, got ''"),
        ({"obs//x": Field()}, "SourceSpec field names must be nonempty 'a/b' paths, got 'obs//x'"),
        ({"obs/": Field()}, "SourceSpec field names must be nonempty 'a/b' paths, got 'obs/'"),
        ({3: Field()}, "SourceSpec field names must be nonempty 'a/b' paths, got 3"),
        ({"obs": (3,)}, "SourceSpec field 'obs' must be a Field, got (3,)"),
        ({"obs": torch.float32}, "SourceSpec field 'obs' must be a Field, got torch.float32"),
        ({"loss_mask": Field()}, "SourceSpec field 'loss_mask' collides with the engine's metadata key"),
        (
            {"ods_generation/x": Field()},
            "SourceSpec field 'ods_generation/x' collides with the engine's metadata key",
        ),
        ({"obs": Field(), "obs/a/b": Field()}, "SourceSpec field 'obs' is both a leaf and the parent of"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_source_fields_name_the_bad_field(payload, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _cfg(source=_FieldsSpec(payload=payload)).validate()


def test_a_bad_source_allocates_nothing_and_fails_in_the_engine_constructor_too():
    with pytest.raises(ValueError, match=re.escape("SourceSpec field 'obs' must be a Field, got 'x'")):
        OnlineDataEngine(_cfg(source=_FieldsSpec(payload={"obs": "x"})))


# ------------------------------------------------------------------------------------------- Field
_DTYPES = ", ".join(map(str, FIELD_DTYPES))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shape": [3]}, "Field.shape must be a tuple of positive ints, got [3]"),
        ({"shape": (2.0,)}, "Field.shape must be a tuple of positive ints, got (2.0,)"),
        ({"shape": (True,)}, "Field.shape must be a tuple of positive ints, got (True,)"),
        ({"shape": (3, -1)}, "Field.shape must be a tuple of positive ints, got (3, -1)"),
        ({"shape": 3}, "Field.shape must be a tuple of positive ints, got 3"),
        ({"dtype": "float32"}, f"Field.dtype must be one of {_DTYPES}, got 'float32'"),
        ({"dtype": float}, f"Field.dtype must be one of {_DTYPES}, got <class 'float'>"),
        ({"dtype": None}, f"Field.dtype must be one of {_DTYPES}, got None"),
        # dtypes the buffer cannot hold: an engine with one failed in its constructor ("fill_cpu not
        # implemented", or an internal assertion of torch's)
        ({"dtype": torch.int4}, f"Field.dtype must be one of {_DTYPES}, got torch.int4"),
        ({"dtype": torch.qint8}, f"Field.dtype must be one of {_DTYPES}, got torch.qint8"),
        ({"dtype": torch.complex64}, f"Field.dtype must be one of {_DTYPES}, got torch.complex64"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_field_names_the_bad_setting(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Field(**kwargs)


@pytest.mark.parametrize("dtype", FIELD_DTYPES, ids=str)
def test_an_engine_holds_and_serves_a_field_of_every_allowed_dtype(dtype):
    """Every dtype Field accepts makes a buffer whose rows a producer fills and a batch returns."""
    spec = ScriptedSpec(extra_fields={"extra": Field((2,), dtype)})  # frame t holds t
    with OnlineDataEngine(make_cfg(spec, buffer_size=2, num_workers=1, refill_policy="manual")) as engine:
        batch = engine.sample_batch(4, 3, keys=["extra", "episode_step"])
        assert batch["extra"].dtype == dtype and batch["extra"].shape == (4, 3, 2)
        expected = batch["episode_step"].to(dtype).unsqueeze(-1).expand(4, 3, 2)
        assert torch.equal(batch["extra"], expected)


# ------------------------------------------------------------------------------------ SyntheticSpec
_SMALL = {"num_envs": 1, "max_episode_steps": 10, "min_length": 5, "num_segments": 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_envs": 0}, "SyntheticSpec.num_envs must be an int "),
        ({"num_envs": 1.0}, "SyntheticSpec.num_envs must be an int "),
        ({"max_episode_steps": 0, "min_length": 1}, "SyntheticSpec.max_episode_steps must be an int >= 1"),
        ({"min_length": 0}, "SyntheticSpec.min_length must be an int "),
        ({"state_dim": 0}, "SyntheticSpec.state_dim must be an int "),
        ({"qpos_dim": 0}, "SyntheticSpec.qpos_dim must be an int "),
        ({"action_dim": False}, "SyntheticSpec.action_dim must be an int "),
        ({"min_length": 11}, "SyntheticSpec.min_length must be <= max_episode_steps (10), got 11"),
        ({"num_segments": 0}, "SyntheticSpec.num_segments must be an int in [1, 5], got 0"),
        ({"num_segments": 6}, "SyntheticSpec.num_segments must be an int in [1, 5], got 6"),
        ({"num_segments": 2.0}, "SyntheticSpec.num_segments must be an int in [1, 5], got 2.0"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_synthetic_spec_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        SyntheticSpec(**{**_SMALL, **kwargs})
    assert_names_the_value(error, kwargs)


# ---------------------------------------------------------------------------- OnlineDataset arguments
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be None or an int >= 1, got 0."),
        ({"batch_size": 2.0}, ValueError, "batch_size must be None or an int >= 1, got 2.0."),
        ({"batch_size": True}, ValueError, "batch_size must be None or an int >= 1, got True."),
        ({"item_block": 0}, ValueError, "item_block must be an int >= 1, got 0."),
        ({"item_block": 4.0}, ValueError, "item_block must be an int >= 1, got 4.0."),
        ({"worker_slots": True}, ValueError, "worker_slots must be an int in [0, 64], got True."),
        ({"seed": -1}, ValueError, "seed must be None or an int in [0, 2**63 - 1], got -1."),
        ({"seed": 2**63}, ValueError, f"seed must be None or an int in [0, 2**63 - 1], got {2**63}."),
        (
            {"sampling_mode": "frames"},
            ValueError,
            "sampling_mode must be 'episode', 'segment', or 'boundary'",
        ),
        ({"chunk_size": 0}, ValueError, "chunk_size must be ≥ 1, got 0."),
        ({"chunk_size": 2.0}, TypeError, "chunk_size must be an int or a ChunkSizeSampler, got float."),
        ({"chunk_size": True}, TypeError, "chunk_size must be an int or a ChunkSizeSampler, got bool."),
    ],
    ids=lambda v: str(v)[:40],
)
def test_online_dataset_names_the_bad_argument(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        OnlineDataset(None, **{"chunk_size": 2, **kwargs})


def test_online_dataset_takes_a_numpy_chunk_size_as_sample_batch_does():
    import numpy as np

    cfg = make_cfg(ScriptedSpec(), buffer_size=2, num_workers=1, refill_policy="manual")
    with OnlineDataEngine(cfg) as engine:
        dataset = OnlineDataset(engine, chunk_size=np.int64(4), batch_size=3, seed=0)
        batch = next(iter(dataset))
    assert type(dataset.chunk_size) is int and tuple(batch["actions"].shape[:2]) == (3, 4)
    with pytest.raises(ValueError, match=re.escape("chunk_size must be ≥ 1, got 0.")):
        OnlineDataset(None, chunk_size=np.int32(0))


@pytest.mark.parametrize(
    ("num_workers", "message"),
    [(-1, "num_workers must be an int >= 0, got -1."), (1.0, "num_workers must be an int >= 0, got 1.0.")],
)
def test_loader_names_a_bad_worker_count(num_workers, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        OnlineDataset(None, chunk_size=2, batch_size=4).loader(num_workers=num_workers)


# ------------------------------------------------------------- engine calls refused before any start
@pytest.mark.parametrize("cfg", ["cfg", None, {"buffer_size": 4}], ids=["str", "None", "dict"])
def test_the_engine_refuses_what_is_not_a_config(cfg):
    with pytest.raises(TypeError, match="OnlineDataEngine expects an OnlineDataEngineCfg, got "):
        OnlineDataEngine(cfg)


def test_calls_on_an_engine_that_was_never_started_are_refused():
    engine = OnlineDataEngine(make_cfg(refill_policy="manual"))
    try:
        with pytest.raises(
            RuntimeError,
            match=re.escape("OnlineDataEngine.sample_batch() requires state READY; current state"),
        ):
            engine.sample_batch(1, 2)
        with pytest.raises(
            RuntimeError,
            match=re.escape("OnlineDataEngine.request_refill() requires state READY; current state"),
        ):
            engine.request_refill()
        with pytest.raises(ValueError, match="Online batch has no task_index/subtask_index language fields"):
            engine.resolve_language(TensorDict({"actions": torch.zeros(2, 3)}, batch_size=[2]))
        with pytest.raises(ValueError, match="Online batch has no task_index/subtask_index language fields"):
            engine.resolve_language(TensorDict({"task_index": torch.zeros(2, dtype=torch.long)}, [2]))
    finally:
        stop_quietly(engine)


# ------------------------------------------------------- sampler: rows rewritten in every torn round
def _always_rewriting(harness: Harness) -> None:
    """Every copy of the sampler sees its rows republished meanwhile (a producer faster than the copy)."""
    gatherer = harness.sampler.gatherer
    original = gatherer.gather

    def gather_then_rewrite(frames, out=None, columns=None):
        result = original(frames, out, columns)
        for row in range(2):
            harness.publish(row, Episode(length=12))
        return result

    gatherer.gather = gather_then_rewrite


def test_sampling_gives_up_when_producers_rewrite_the_selected_rows_every_round():
    harness = Harness(rows=2, steps=16)
    for row in range(2):
        harness.publish(row, Episode(length=12))
    _always_rewriting(harness)
    with pytest.raises(
        DataUnavailableError,
        match=re.escape(
            "[OnlineDataEngine] No unlocked valid chunk satisfies sampling_mode='episode' and chunk_size=4. "
            f"Producers rewrote the selected rows {_MAX_TORN_ROUNDS} times in a row."
        ),
    ):
        harness.sampler.sample_chunks(8, 4, "episode", torch.Generator().manual_seed(0))


def test_sampling_with_quotas_gives_up_when_producers_rewrite_the_selected_rows_every_round():
    quota = EpisodeQuota(2, 1000, 1000, run_id=0, ctx=mp.get_context("fork"))
    harness = Harness(rows=2, steps=16, quota=quota)
    for row in range(2):
        harness.publish(row, Episode(length=12))
    quota.publish(torch.tensor([0, 1]), torch.tensor([0, 1]), generation=1)
    _always_rewriting(harness)
    with pytest.raises(
        DataUnavailableError,
        match=re.escape(f"Producers rewrote the selected rows {_MAX_TORN_ROUNDS} times in a row."),
    ):
        harness.sampler.sample_chunks(8, 4, "episode", torch.Generator().manual_seed(0))
    assert quota.total_delivered() == 0  # nothing was charged
