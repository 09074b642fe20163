"""``keys=``: batches copy only the named keys, in the owner and in ``DataLoader`` workers (issue 16, 12)."""

from __future__ import annotations

import pytest
import torch

from simstream import OnlineDataEngine
from simstream.data import OnlineDataset
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(120)

CAMERAS = ScriptedSpec(num_envs=2, image=True)  # obs, actions, rewards, obs_image/rgb u8[3, 8, 8]


def _paths(batch) -> set[tuple[str, ...]]:
    return {k if isinstance(k, tuple) else (k,) for k in batch.keys(include_nested=True, leaves_only=True)}


def test_sample_batch_copies_only_the_named_keys():
    with OnlineDataEngine(make_cfg(CAMERAS, buffer_size=4)) as engine:
        generator = torch.Generator().manual_seed(3)
        full = engine.sample_batch(8, 4, generator=generator)
        for keys in (["obs_image/rgb"], [("obs_image", "rgb")], "obs_image", [("obs_image",)]):
            generator.manual_seed(3)
            batch = engine.sample_batch(8, 4, generator=generator, keys=keys)
            assert _paths(batch) == {("obs_image", "rgb"), ("valid",)}
            assert torch.equal(batch["obs_image", "rgb"], full["obs_image", "rgb"])  # the same draws
            assert bool(batch["valid"].all())
        contexts = engine.sample_batch_with_context(8, 3, 2, keys=["actions"])
        assert _paths(contexts) == {("actions",), ("valid",), ("loss_mask",)}
        assert torch.equal(contexts["loss_mask"], contexts["valid"] & (torch.arange(4) >= 2))
        for keys in ("loss_mask", ["loss_mask"], [("loss_mask",)], [("actions",), ("loss_mask",)]):
            contexts = engine.sample_batch_with_context(8, 3, 2, keys=keys)  # ("loss_mask",) was a KeyError
            named = {("actions",)} if isinstance(keys, list) and ("actions",) in keys else set()
            assert _paths(contexts) == {*named, ("valid",), ("loss_mask",)}
        reused = engine.sample_batch(8, 4, keys=["actions"])
        assert engine.sample_batch(8, 4, out=reused, keys=["actions"]) is reused


def test_unknown_keys_are_refused_with_the_buffer_keys():
    with OnlineDataEngine(make_cfg(CAMERAS, buffer_size=4)) as engine:
        with pytest.raises(
            KeyError, match=r"keys: no stored key 'obs/rgb'; the buffer holds 'obs', 'actions'"
        ):
            engine.sample_batch(2, 2, keys=["obs/rgb"])
        with pytest.raises(KeyError, match=r"keys: no stored key 'camera'.*'obs_image/rgb'"):
            engine.sample_batch_with_context(2, 2, 2, keys=["actions", "camera"])
        with pytest.raises(ValueError, match=r"keys: 7 is not a key"):
            engine.sample_batch(2, 2, keys=[7])
        with pytest.raises(KeyError, match=r"keys: no stored key 'camera'"):
            OnlineDataset(engine, chunk_size=2, batch_size=4, keys=["camera"])
        assert engine.get_stats()["sampled_chunks"] == 0  # nothing was sampled
        engine.check_health()


@pytest.mark.parametrize("item_mode", [False, True])
def test_dataloader_workers_send_only_the_named_keys(item_mode):
    with OnlineDataEngine(make_cfg(CAMERAS, buffer_size=4, refill_threshold=1)) as engine:
        dataset = OnlineDataset(
            engine, chunk_size=3, batch_size=None if item_mode else 8, seed=5, keys=["obs_image/rgb", "obs"]
        )
        loader = dataset.loader(num_workers=2, batch_size=8 if item_mode else None)
        for seen, batch in enumerate(loader, 1):
            assert batch.batch_size == torch.Size([8, 3])
            assert _paths(batch) == {("obs",), ("obs_image", "rgb"), ("valid",)}
            assert bool(batch["valid"].all())
            steps = batch["obs"][..., 1]
            assert bool((steps[:, 1:] - steps[:, :-1] == 1).all())
            if seen == 6:
                break
