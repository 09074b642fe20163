"""In-process harness: real storage, index, writer and sampler without worker processes."""

from __future__ import annotations

import multiprocessing as mp

import torch

from simstream import Episode, Field
from simstream.buffer.index import EligibilityIndex
from simstream.buffer.storage import TrajectoryStorage
from simstream.buffer.writer import EpisodeWriter
from simstream.config import SourceLayout
from simstream.language import SharedLanguageRegistry
from simstream.sampling.sampler import WindowSampler


class Harness:
    """A buffer of ``rows`` x ``steps`` whose rows tests fill with ``publish``."""

    def __init__(self, rows: int = 8, steps: int = 16, provenance: bool = False, quota=None) -> None:
        layout = SourceLayout(1, steps, {"obs": Field((2,)), "actions": Field((1,))})
        self.storage = TrajectoryStorage(layout, rows, provenance)
        self.index = EligibilityIndex(rows, steps)
        self.language = SharedLanguageRegistry(1 << 14, context=mp.get_context("fork"))
        self.writer = EpisodeWriter(self.storage, self.index, self.language, run_id=7)
        self.sampler = WindowSampler(self.storage, self.index, quota)
        self.next_episode = 0
        self.steps = steps

    def publish(self, row: int, episode: Episode, generation: int = 1) -> None:
        """Write ``episode`` into ``row``: obs = (row, t), actions = t."""
        self.writer.claim(row, row + 1)
        view = self.storage.rows_view(row, row + 1, payload_only=True)
        length = episode.length
        view["obs"][0, :length, 0] = float(row)
        view["obs"][0, :length, 1] = torch.arange(length, dtype=torch.float32)
        view["actions"][0, :length, 0] = torch.arange(length, dtype=torch.float32)
        self.writer.write(row, [episode], attempt=0)
        self.writer.publish(row, row + 1, generation, self.next_episode)
        self.next_episode += 1
