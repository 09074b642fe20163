"""Shared-memory sizes known before allocation, checked against the free space of /dev/shm."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import simstream.engine.engine as engine_module
from simstream import Field, OnlineDataEngine, OnlineDataEngineCfg
from simstream.buffer.gate import RecordGate
from simstream.buffer.index import EligibilityIndex
from simstream.buffer.storage import TrajectoryStorage
from simstream.config import SourceLayout
from simstream.engine.sizing import (
    SHM_PATH,
    SharedRegion,
    check_context_lengths,
    check_shared_memory,
    free_shared_bytes,
    require_fits,
    shared_regions,
)
from tests.support.sources import ScriptedSpec

needs_shm = pytest.mark.skipif(free_shared_bytes() is None, reason=f"no {SHM_PATH} on this system")


def _allocated(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize(
    ("fields", "rows", "steps", "provenance"),
    [
        pytest.param({"obs": Field((3,))}, 4, 20, False, id="low-dim"),
        pytest.param(
            {"obs/state": Field((7,)), "rgb": Field((3, 8, 8), torch.uint8), "h": Field((), torch.bfloat16)},
            3,
            11,
            True,
            id="image, bfloat16, provenance",
        ),
    ],
)
def test_the_computed_sizes_are_what_storage_and_index_allocate(fields, rows, steps, provenance):
    layout = SourceLayout(1, steps, fields)
    storage = TrajectoryStorage(layout, rows, provenance)
    assert TrajectoryStorage.shared_bytes(layout, rows, provenance) == _allocated(storage.flat.values())
    index = EligibilityIndex(rows, steps)
    tensors = [value for value in vars(index).values() if isinstance(value, torch.Tensor)]
    assert all(t.is_shared() for t in tensors)
    assert EligibilityIndex.shared_bytes(rows, steps) == _allocated(tensors)
    gate = RecordGate(rows)
    assert RecordGate.shared_bytes(rows) == _allocated(
        [gate.recorded, gate.skipped, gate.waited_ns, gate.mode]
    )


def test_every_region_is_listed_with_the_field_that_sizes_it():
    spec = ScriptedSpec(num_envs=2, max_episode_steps=20)
    cfg = OnlineDataEngineCfg(
        source=spec,
        buffer_size=4,
        language_buffer_bytes=10_000,
        lifecycle_event_capacity=16,
        episode_sample_budget=2,
        episode_sample_hard_limit=2,
    )
    regions = {region.name: region for region in shared_regions(cfg, cfg.validate())}
    assert set(regions) == {
        "trajectory buffer",
        "eligibility index",
        "language registry",
        "error channel",
        "producer progress",
        "record gate",
        "lifecycle log",
        "quota table",
    }
    assert regions["language registry"].field == "language_buffer_bytes"
    assert regions["language registry"].nbytes >= 10_000
    assert regions["lifecycle log"].nbytes >= 16 * (7 * 8 + 2 * 20)
    assert all(region.nbytes % 4096 == 0 and region.nbytes > 0 for region in regions.values())


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2**70), min_size=1, max_size=6),
    free=st.integers(0, 2**71),
)
def test_regions_are_refused_exactly_when_together_they_exceed_the_free_bytes(sizes, free):
    regions = [SharedRegion(f"region {k}", f"field_{k}", k, size) for k, size in enumerate(sizes)]
    if sum(sizes) <= free:
        require_fits(regions, free)
        return
    largest = max(range(len(sizes)), key=sizes.__getitem__)
    with pytest.raises(ValueError) as caught:
        require_fits(regions, free)
    message = str(caught.value)
    assert message.startswith(f"OnlineDataEngineCfg.field_{largest}={largest} needs {sizes[largest]} bytes")
    assert f"the engine needs {sum(sizes)} bytes" in message
    assert f"but /dev/shm has {free} bytes" in message
    assert f"Lower field_{largest}, or make /dev/shm larger" in message


def test_a_fixed_size_region_is_named_without_a_field():
    with pytest.raises(ValueError, match=r"^The engine's error channel needs 65536 bytes \(64\.0 KiB\) of "):
        require_fits([SharedRegion("error channel", "", None, 65536), SharedRegion("x", "f", 1, 1)], 100)


@needs_shm
def test_a_buffer_larger_than_the_free_shared_memory_is_refused_before_anything_is_allocated(monkeypatch):
    free = free_shared_bytes()
    # one frame alone is larger than what /dev/shm has free: the buffer can never fit
    huge = Field((free // 4 + 1,))
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(extra_fields={"huge": huge}), buffer_size=4)

    def never(*args, **kwargs):
        raise AssertionError("shared memory was allocated before the size check")

    for name in ("TrajectoryStorage", "EligibilityIndex", "SharedLanguageRegistry", "ErrorChannel"):
        monkeypatch.setattr(engine_module, name, never)
    with pytest.raises(ValueError) as caught:
        OnlineDataEngine(cfg)
    message = str(caught.value)
    match = re.match(
        r"OnlineDataEngineCfg\.buffer_size=4 needs (\d+) bytes .*of shared memory for the trajectory buffer "
        r"\(4 rows x 20 frames, plus the padding frame, x \d+ bytes per frame\); .* the engine needs (\d+) "
        r"bytes .*but /dev/shm has (\d+) bytes .*free\. Lower buffer_size, or make /dev/shm larger",
        message,
    )
    assert match is not None, message
    buffer_bytes, total, free_now = (int(group) for group in match.groups())
    assert buffer_bytes >= 81 * (free // 4 + 1) * 4 and total > buffer_bytes and total > free_now


@needs_shm
def test_a_language_registry_larger_than_the_free_shared_memory_is_refused():
    free = free_shared_bytes()
    if free >= 2**31 - 1:
        # language_buffer_bytes is bounded by validation below this machine's free space; the arithmetic
        # of the refusal is the same for every region (see the property test above)
        regions = shared_regions(OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4), _layout())
        regions = [
            r if r.field != "language_buffer_bytes" else SharedRegion(r.name, r.field, free, free)
            for r in regions
        ]
        with pytest.raises(ValueError, match=rf"^OnlineDataEngineCfg\.language_buffer_bytes={free} needs "):
            require_fits(regions, free)
        return
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4, language_buffer_bytes=free + 1)
    with pytest.raises(ValueError, match=rf"^OnlineDataEngineCfg\.language_buffer_bytes={free + 1} needs "):
        check_shared_memory(cfg, cfg.validate())


@needs_shm
def test_an_ordinary_config_passes():
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=64, lifecycle_event_capacity=256)
    check_shared_memory(cfg, cfg.validate())


def test_a_missing_shared_memory_folder_skips_the_check(tmp_path):
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(extra_fields={"huge": Field((2**40,))}), buffer_size=4)
    check_shared_memory(cfg, cfg.validate(), path=str(tmp_path / "absent"))


@pytest.mark.parametrize(
    ("history", "horizon", "message"),
    [
        (
            0,
            2,
            r"^Context lengths must be positive integers: history_length must be an int in \[1, "
            r"max_episode_steps=20\], got 0$",
        ),
        (
            2,
            True,
            r"^Context lengths must be positive integers: prediction_horizon must be an int in \[1, "
            r"max_episode_steps=20\], got True$",
        ),
        (2, -5, r"^Context lengths must be positive integers: prediction_horizon .* got -5$"),
        (2.0, 2, r"^Context lengths must be positive integers: history_length .* got 2.0$"),
        (10**13, 2, r"^history_length must be an int in \[1, max_episode_steps=20\], got 10000000000000: "),
        (2, 21, r"^prediction_horizon must be an int in \[1, max_episode_steps=20\], got 21: "),
    ],
)
def test_context_lengths_are_bounded_by_the_row(history, horizon, message):
    with pytest.raises(ValueError, match=message):
        check_context_lengths(history, horizon, 20)


def test_context_lengths_up_to_the_row_pass():
    assert check_context_lengths(20, 20, 20) == (20, 20)
    assert check_context_lengths(1, 1, 20) == (1, 1)
    lengths = check_context_lengths(np.int64(3), np.uint8(2), 20)  # NumPy ints, as for batch_size
    assert lengths == (3, 2) and all(type(n) is int for n in lengths)


def _layout() -> SourceLayout:
    return OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4).validate()


def test_the_node_id_area_is_counted_with_the_producer_progress():
    """The Ray node ids live beside the progress counters: the sizing counts the bytes progress keeps."""

    def regions(workers: int) -> dict[str, SharedRegion]:
        cfg = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4, num_workers=workers)
        return {region.name: region for region in shared_regions(cfg, _layout())}

    one, three = regions(1), regions(3)
    assert one["record gate"].nbytes == 4096 and one["record gate"].field == "buffer_size"
    assert three["producer progress"].nbytes >= 8 * (128 + 16 * 3) + 64 * 3


def test_building_the_storage_takes_its_size_in_memory_not_twice_that():
    """Each key is allocated shared and filled in place; filling private memory first and then sharing it
    copied the whole buffer, so a buffer over half the machine's memory could not be built."""
    script = (
        "import resource\n"
        "from simstream import Field\n"
        "from simstream.buffer.storage import TrajectoryStorage\n"
        "from simstream.config import SourceLayout\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "layout = SourceLayout(1, 1000, {'obs': Field((256,))})\n"
        "storage = TrajectoryStorage(layout, 256, include_provenance=False)\n"
        "size = TrajectoryStorage.shared_bytes(layout, 256, False)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024 / size)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 1.3  # about 1.0 (the buffer's own pages); 2.0 with the private copy


@needs_shm
def test_a_failed_engine_dropped_without_stop_is_collected_before_a_refusal(monkeypatch):
    """Its exception's traceback holds it in a cycle, with its segments, until the cyclic collector runs:
    a new engine that fits only once they are gone is built, not refused (a retry after a failed start)."""
    import gc
    import os

    from simstream.engine import sizing
    from tests.support.engines import make_cfg

    before = set(os.listdir(SHM_PATH))
    gc.disable()  # as between two full collections of a busy process
    try:
        failed = OnlineDataEngine(make_cfg(spec=ScriptedSpec(fault="build_raise"), num_workers=1))
        segments = set(os.listdir(SHM_PATH)) - before
        assert segments
        with pytest.raises(ValueError):
            failed.start()
        del failed
        assert segments <= set(os.listdir(SHM_PATH))  # held by the cycle
        cfg = make_cfg(num_workers=1)
        needed = sum(region.nbytes for region in shared_regions(cfg, cfg.validate()))
        # /dev/shm as full as it would be: the new engine fits only once the old segments are freed
        monkeypatch.setattr(
            sizing,
            "free_shared_bytes",
            lambda path=SHM_PATH: needed - 1 if segments & set(os.listdir(path)) else needed,
        )
        engine = OnlineDataEngine(cfg)
        assert not segments & set(os.listdir(SHM_PATH))
        del engine
    finally:
        gc.enable()


def test_a_batch_fits_up_to_this_machine_s_memory_and_the_error_names_the_largest_that_does(monkeypatch):
    from simstream.sampling import gather

    monkeypatch.setattr(gather, "physical_memory", lambda: 10 * 2**30)
    gather.require_batch_fits(10, 2**30, "StreamArgs.batch_size=10")  # exactly the memory: fits
    with pytest.raises(
        ValueError,
        match=re.escape(
            "DemoConfig.batch_size=11 needs 11.0 GiB for one batch of contexts, more than this machine's "
            "10.0 GiB of memory: it can be at most 10 here"
        ),
    ):
        gather.require_batch_fits(11, 2**30, "DemoConfig.batch_size=11", batch="batch of contexts")
    with pytest.raises(
        ValueError, match=r"batch_size can be at most 5 here \(or copy fewer keys with keys=\)\.$"
    ):
        gather.require_batch_fits(
            6, 2**31, "batch_size=6", limit="batch_size", hint=" (or copy fewer keys with keys=)."
        )


def test_frame_bytes_is_one_frame_of_every_key_the_storage_allocates():
    layout = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4).validate()
    for provenance in (False, True):
        frames = 3 * layout.max_episode_steps + 1
        total = TrajectoryStorage.shared_bytes(layout, 3, provenance)
        assert total == frames * TrajectoryStorage.frame_bytes(layout, provenance)
    assert TrajectoryStorage.frame_bytes(layout, True) == TrajectoryStorage.frame_bytes(layout, False) + 6 * 8
