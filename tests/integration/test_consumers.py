"""Consumers in other processes: fork, spawn and forkserver children, and DataLoader workers."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from simstream import OnlineDataEngine
from simstream.data import ChunkSizeSampler, OnlineDataset, UniformChunkSampler
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(120)


def _consume(engine, queue) -> None:
    try:
        batch = engine.sample_batch(8, 4)
        steps = batch["obs"][..., 1]
        consecutive = bool((steps[:, 1:] - steps[:, :-1] == 1).all())
        language = engine.resolve_language(batch[:1, :1])
        new_text = engine.language_registry.intern("child instruction", kind="subtask")
        try:
            engine.stop()
            stop_message = "no error"
        except RuntimeError as error:
            stop_message = str(error)
        queue.put(
            {
                "valid": bool(batch["valid"].all()),
                "consecutive": consecutive,
                "language": language,
                "child_index": new_text,
                "stop": stop_message,
                "simulator_imported": "mujoco" in sys.modules,
                "stats": engine.get_stats()["sampled_chunks"],
            }
        )
    except BaseException as error:
        queue.put({"error": repr(error)})


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_consumer_process_samples_resolves_language_and_cannot_stop(method):
    with OnlineDataEngine(make_cfg(ScriptedSpec(instruction="pour the tea"))) as engine:
        ctx = mp.get_context(method)
        queue = ctx.Queue()
        child = ctx.Process(target=_consume, args=(engine, queue))
        child.start()
        result = queue.get(timeout=60)
        child.join(30)
        assert child.exitcode == 0
        assert "error" not in result, result
        assert result["valid"] and result["consecutive"]
        assert result["language"] == {"task": [["pour the tea"]], "subtask": [["pour the tea"]]}
        assert "may only be called by owner process" in result["stop"]
        if method != "fork":  # a forked child inherits whatever the parent imported
            assert result["simulator_imported"] is False
        assert result["stats"] >= 8  # the child's samples count in the shared counters
        # interned by the child, resolved by the owner
        assert engine.language_registry.resolve(torch.tensor(result["child_index"]), kind="subtask") == (
            "child instruction"
        )
        engine.check_health()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_stream_batches(context):
    with OnlineDataEngine(
        make_cfg(ScriptedSpec(lengths=(20, 9)), buffer_size=6, refill_threshold=1)
    ) as engine:
        dataset = OnlineDataset(engine, chunk_size=UniformChunkSampler(2, 6, seed=3), batch_size=16, seed=11)
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=2,
            multiprocessing_context=context,
            collate_fn=OnlineDataset.passthrough_collate_fn,
            timeout=60,
        )
        seen = []
        for step, batch in enumerate(loader):
            assert batch.batch_size[0] == 16 and 2 <= batch.batch_size[1] <= 6
            assert bool(batch["valid"].all())
            steps = batch["obs"][..., 1]
            assert bool((steps[:, 1:] - steps[:, :-1] == 1).all())
            seen.append(batch)
            if step == 7:
                break
        del loader
        assert engine.get_stats()["requested_generation"] >= 2  # workers' samples triggered refills


def test_dataloader_item_mode_collates_chunks():
    with OnlineDataEngine(make_cfg()) as engine:
        dataset = OnlineDataset(engine, chunk_size=5, transform=lambda td: td.select("obs", "valid"))
        loader = DataLoader(
            dataset, batch_size=12, num_workers=2, collate_fn=OnlineDataset.collate_fn, timeout=60
        )
        batch = next(iter(loader))
        assert batch.batch_size == torch.Size([12, 5])
        assert set(batch.keys()) == {"obs", "valid"}
        assert bool(batch["valid"].all())


def _as_pair(chunk):
    return {"obs": chunk["obs"], "t": chunk["obs"][:, 1]}, chunk["actions"]


def test_item_mode_collates_what_a_transform_returns_as_torch_does():
    """A transform returning a dict and a tuple of tensors: batched by torch's default_collate (torch.stack
    of the items failed with "expected Tensor as element 0 in argument 0, but got tuple")."""
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        dataset = OnlineDataset(engine, chunk_size=5, transform=_as_pair, seed=3)
        for workers in (0, 2):
            loader = dataset.loader(num_workers=workers, batch_size=4, timeout=60 if workers else 0)
            features, actions = next(iter(loader))
            assert features["obs"].shape == (4, 5, 3) and actions.shape == (4, 5, 2)
            steps = features["t"]
            assert torch.equal(steps, features["obs"][:, :, 1])
            assert torch.equal(steps - steps[:, :1], torch.arange(5.0).expand(4, 5))  # consecutive frames
            assert torch.equal(actions[:, :, 0], features["obs"][:, :, 0])  # each pair from one chunk
            del loader


def test_in_process_dataset_is_reproducible_with_a_seed():
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        first = next(iter(OnlineDataset(engine, chunk_size=3, batch_size=8, seed=4)))
        second = next(iter(OnlineDataset(engine, chunk_size=3, batch_size=8, seed=4)))
        assert (first == second).all()


def test_in_process_dataset_without_a_seed_draws_a_fresh_stream_per_iterator():
    with OnlineDataEngine(make_cfg(refill_policy="manual", buffer_size=8)) as engine:
        dataset = OnlineDataset(engine, chunk_size=3, batch_size=64)
        torch.manual_seed(11)
        first, second = next(iter(dataset)), next(iter(dataset))  # two epochs
        other = next(iter(OnlineDataset(engine, chunk_size=3, batch_size=64)))  # e.g. a validation stream
        assert not torch.equal(first["obs"], second["obs"])
        assert not torch.equal(second["obs"], other["obs"])
        torch.manual_seed(11)  # the global seed still makes the run reproducible
        assert torch.equal(next(iter(dataset))["obs"], first["obs"])


def test_torch_manual_seed_makes_an_unseeded_chunk_size_sampler_reproducible_and_keeps_a_seeded_ones_draws():
    """An unseeded sampler kept its own OS-seeded generator in the main process: chunk sizes changed from
    run to run although torch.manual_seed fixed everything else."""

    def sizes(sampler) -> list[int]:
        torch.manual_seed(5)
        batches = iter(OnlineDataset(engine, chunk_size=sampler, batch_size=2))
        return [next(batches).batch_size[1] for _ in range(12)]

    with OnlineDataEngine(make_cfg(refill_policy="manual", buffer_size=8)) as engine:
        first, second = sizes(UniformChunkSampler(1, 6)), sizes(UniformChunkSampler(1, 6))
        assert first == second and len(set(first)) > 1
        own = UniformChunkSampler(1, 6, seed=9)
        expected = UniformChunkSampler(1, 6, seed=9)
        assert sizes(own) == [expected() for _ in range(12)]


def test_dataset_argument_errors():
    with pytest.raises(TypeError, match="chunk_size must be an int or a ChunkSizeSampler, got str"):
        OnlineDataset(None, chunk_size="4")
    with pytest.raises(ValueError, match="chunk_size must be ≥ 1, got 0"):
        OnlineDataset(None, chunk_size=0)
    with pytest.raises(ValueError, match="sampling_mode must be"):
        OnlineDataset(None, chunk_size=2, sampling_mode="frame")
    # a seed failed only when iterated (str + int, or manual_seed of a float)
    for seed in ("7", 1.5, -1, 2**63, True):
        with pytest.raises(
            ValueError, match=rf"^seed must be None or an int in \[0, 2\*\*63 - 1\], got {seed!r}\.$"
        ):
            OnlineDataset(None, chunk_size=2, seed=seed)


class _ChoiceSampler(ChunkSizeSampler):
    """Written against the reference's abstract class, which had no ``__init__``: none is called here."""

    def __init__(self, sizes) -> None:
        self.sizes = sizes

    def __call__(self):
        return self.sizes[0]

    def __repr__(self) -> str:
        return f"_ChoiceSampler({self.sizes})"


@pytest.mark.parametrize(("seed", "workers"), [(None, 0), (3, 0), (None, 1)])
def test_a_custom_chunk_sampler_need_not_call_the_base_init(seed, workers):
    """Reseeding it (with a seed, or in every worker) raised AttributeError: no ``_rng``."""
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        dataset = OnlineDataset(engine, chunk_size=_ChoiceSampler([3]), batch_size=4, seed=seed)
        context = {"multiprocessing_context": "fork"} if workers else {}
        iterator = iter(dataset.loader(num_workers=workers, **context))
        try:
            assert next(iterator).batch_size == torch.Size([4, 3])
        finally:
            if workers:
                iterator._shutdown_workers()


@pytest.mark.parametrize("batch_size", [4, None])
@pytest.mark.parametrize("size", [4.0, 0, 10_000, True])
def test_a_chunk_size_a_custom_sampler_draws_is_checked_naming_it(size, batch_size):
    """In batch-mode workers a float was a TypeError from allocating the batch, before any check."""
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        steps = engine.max_episode_steps
        dataset = OnlineDataset(engine, chunk_size=_ChoiceSampler([size]), batch_size=batch_size, seed=1)
        iterator = iter(dataset.loader(batch_size=None if batch_size else 2, num_workers=1))
        try:
            with pytest.raises(ValueError) as caught:
                next(iterator)
        finally:
            iterator._shutdown_workers()
    message = (
        f"OnlineDataset.chunk_size: _ChoiceSampler([{size!r}]) drew {size!r}; a chunk size must be an int in "
        f"[1, {steps}] (the engine's max_episode_steps)"
    )
    assert message in str(caught.value)
