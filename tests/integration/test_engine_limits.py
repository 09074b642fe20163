"""What a running engine refuses and accepts at its edges: frames a source left unwritten, empty segments,
context lengths past the row. Real producer processes and DataLoader workers on real shared memory."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from simstream import OnlineDataEngine, OnlineDataEngineState
from simstream.data import OnlineDataset
from tests.support.engines import make_cfg, stop_quietly
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(120)

# buffer 4, num_envs 2, one worker: rollouts 0 and 1 are the first generation; with fault="unwritten" the
# last row of each faulty rollout leaves frames 17..19 of "actions" unwritten (length 20)
_UNWRITTEN = (
    r"Episode of buffer row {row} \(row 1 of the rollout\) reports length=20 but its payload 'actions' holds "
    r"NaN, the value of unwritten frames, first at frame 17: a source must write every frame t < length"
)


def _row_claimed(engine: OnlineDataEngine, row: int) -> bool:
    return int(engine._shared.index.version[row]) % 2 == 1


def test_a_reported_frame_left_unwritten_fails_start_and_nothing_of_the_window_is_published():
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(fault="unwritten")))
    try:
        with pytest.raises(ValueError, match=_UNWRITTEN.format(row=1)):
            engine.start()
        assert engine.state is OnlineDataEngineState.FAILED
        assert _row_claimed(engine, 0) and _row_claimed(engine, 1)  # never became visible
        assert not bool(engine.shared_buffer["valid"].any())
    finally:
        stop_quietly(engine)


def test_a_reused_row_with_frames_left_unwritten_is_caught_too():
    # generation 1 writes every row in full; generation 2 leaves frames of row 1 unwritten, where the older
    # episode's frames would otherwise pass for the new one's
    engine = OnlineDataEngine(
        make_cfg(ScriptedSpec(fault="unwritten", fault_after=2), refill_policy="manual")
    )
    try:
        engine.start()
        assert not bool(engine.sample_batch(64, 20)["actions"].isnan().any())
        generation = engine.request_refill()
        with pytest.raises(ValueError, match=_UNWRITTEN.format(row=1)):
            engine.wait_for_generation(generation, timeout=60)
        assert _row_claimed(engine, 1)
        with pytest.raises(ValueError, match=_UNWRITTEN.format(row=1)):
            engine.sample_batch(1, 1)
    finally:
        stop_quietly(engine)


def test_dataloader_workers_raise_the_producer_error_and_never_see_a_poisoned_frame():
    spec = ScriptedSpec(fault="unwritten", fault_after=2)
    engine = OnlineDataEngine(make_cfg(spec, refill_threshold=1))  # every batch of 8 requests a refill
    engine.start()
    try:
        loader = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=1).loader(num_workers=2, timeout=60)
        batches, message = iter(loader), None
        for _ in range(100_000):  # a bound: the producer's first refill fails
            try:
                batch = next(batches)
            except ValueError as error:
                message = str(error)
                break
            assert bool(batch["valid"].all()) and not bool(batch["actions"].isnan().any())
        # the raised error's traceback is a reference cycle through the DataLoader iterator: collect it,
        # so that the iterator's __del__ shuts its workers down
        del batches, loader
        gc.collect()
        assert message is not None, "the producer's error never reached the DataLoader"
        assert re.search(_UNWRITTEN.format(row=1), message), message
        with pytest.raises(ValueError, match=_UNWRITTEN.format(row=1)):
            engine.check_health()  # the owner sees the same error
        with pytest.raises(ValueError, match=_UNWRITTEN.format(row=1)):
            engine.stop()  # the first stop reports the failure
    finally:
        stop_quietly(engine)


def test_with_the_check_turned_off_the_frames_are_published_as_the_source_left_them():
    cfg = make_cfg(ScriptedSpec(fault="unwritten"), refill_policy="manual", check_unwritten_frames=False)
    with OnlineDataEngine(cfg) as engine:
        rows = engine.shared_buffer
        assert bool(rows["valid"][:, :20].all())
        assert bool(rows["actions"][1, 17:].isnan().all()) and not bool(rows["actions"][1, :17].isnan().any())


def test_empty_segments_are_skipped_by_a_running_engine():
    segments = (
        (0, 6, "reach", True),
        (6, 6, "never said", True),
        (6, 14, "grasp", True),
        (14, 14, "also never said", False),
        (14, 20, None, True),
    )
    cfg = make_cfg(ScriptedSpec(segments=segments, instruction="stack"), buffer_size=4, num_workers=2)
    with OnlineDataEngine(cfg) as engine:
        generator = torch.Generator().manual_seed(0)
        chunks = engine.sample_batch(256, 4, "segment", generator=generator)
        segment_id = chunks["segment_id"]
        assert bool((segment_id == segment_id[:, :1]).all())
        assert set(segment_id.unique().tolist()) == {0, 2, 4}  # ids are positions in Episode.segments
        crossing = engine.sample_batch(256, 2, "boundary", generator=generator)["segment_id"]
        assert {tuple(pair) for pair in crossing.tolist()} == {(0, 2), (2, 4)}
        registry = engine.language_registry
        subtasks = {
            registry.resolve(torch.tensor(k), kind="subtask") for k in range(registry.count("subtask"))
        }
        assert subtasks == {"stack", "reach", "grasp"}  # empty segments' texts took no registry space
        assert engine.resolve_language(chunks[:1, :1])["subtask"][0][0] in {"reach", "grasp", "stack"}


def test_context_lengths_past_the_row_are_refused_before_anything_is_allocated():
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        with pytest.raises(ValueError, match=r"history_length must be an int in \[1, max_episode_steps=20\]"):
            engine.sample_batch_with_context(1, 10**13, 2)  # a MemoryError before
        with pytest.raises(
            ValueError, match=r"prediction_horizon must be an int in \[1, max_episode_steps=20\]"
        ):
            engine.sample_batch_with_context(1, 2, 21)
        batch = engine.sample_batch_with_context(2, 20, 20)
        assert batch.batch_size == torch.Size([2, 39])
        assert engine.get_stats()["sampled_chunks"] == 2  # the refused calls sampled nothing
