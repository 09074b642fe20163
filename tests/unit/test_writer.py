"""The episode writer's row states: claim, write and the frames past an episode's end."""

from __future__ import annotations

import torch

from simstream import Episode
from tests.support.harness import Harness


def test_claim_resets_metadata_and_write_poisons_only_past_the_end():
    harness = Harness(rows=2, steps=16)
    harness.publish(0, Episode(length=16))
    obs = harness.storage.rows_view()["obs"]
    before = obs[0].clone()

    harness.writer.claim(0, 1)
    valid = harness.storage.metadata("valid")
    assert not bool(valid[0].any()) and bool((harness.storage.metadata("episode_step")[0] == -1).all())
    assert torch.equal(obs[0], before)  # payload is the source's to overwrite: claim leaves it

    obs[0, :5, 0] = 42.0
    harness.writer.write(0, [Episode(length=5)], attempt=0)
    assert torch.equal(obs[0, :5, 0], torch.full((5,), 42.0))
    assert bool(obs[0, 5:].isnan().all())  # nothing of the older, longer episode survives
    assert int(valid[0].sum()) == 5
    assert bool(obs[1].isnan().all())  # a row nobody wrote stays unwritten


def test_a_full_length_episode_is_not_poisoned():
    harness = Harness(rows=1, steps=8)
    harness.publish(0, Episode(length=8))
    assert torch.equal(harness.storage.rows_view()["actions"][0, :, 0], torch.arange(8.0))
