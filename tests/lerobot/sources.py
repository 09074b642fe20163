"""A picklable test source whose every frame identifies itself, with language and segments.

Episode ``n`` of worker ``w`` (tag ``1000 * w + n``) has ``length = 12 + n % 7`` frames; frame ``t`` holds
``obs/state = [tag, t, t / 10, -tag]``, ``actions = [t, -t]``, ``rewards = t / 100`` and, with
``image_size``, a smooth camera pattern (``pattern(tag, t)``). Segments: ``[0, 4)`` "reach", an empty
one at 4, ``[4, 9)`` "grasp" not accepted, ``[9, length)`` with no text (the episode's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from simstream import Episode, Field, Segment

TASKS = ("pick up the red cube", "stack the blue cube")


def pattern(tag: int, t: int, size: int) -> np.ndarray:
    """A smooth uint8 [3, size, size] frame (video-friendly)."""
    yy, xx = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    base = (2 * yy + 3 * xx + 4 * t + 20 * (tag % 7)) % 256
    return np.stack([base, (base + 85) % 256, (base + 170) % 256]).astype(np.uint8)


def expected_segments(length: int) -> list[Segment]:
    return [
        Segment(0, 4, "reach"),
        Segment(4, 4, "never seen"),
        Segment(4, 9, "grasp", accepted=False),
        Segment(9, length, None),
    ]


@dataclass(frozen=True)
class PatternSpec:
    num_envs: int = 1
    max_episode_steps: int = 20
    image_size: int | None = None
    fps: int = 20
    empty_every: int = 0
    """Every ``empty_every``-th episode of a producer has no frame (length 0); 0: none."""
    truncated_every: int = 0
    """Every ``truncated_every``-th episode of a producer ends truncated, not terminated; 0: none."""
    fail_after: int = 0
    """A producer's rollouts after its first ``fail_after`` raise ``RuntimeError``; 0: none does."""
    close_fails: bool = False
    """``close()`` raises ``OSError`` (a source that could not flush what it holds)."""

    def fields(self) -> dict[str, Field]:
        fields = {"obs/state": Field((4,)), "actions": Field((2,)), "rewards": Field(())}
        if self.image_size:
            fields["obs/image"] = Field((3, self.image_size, self.image_size), torch.uint8)
        return fields

    def build(self, worker_index: int, seed: int) -> PatternSource:
        return PatternSource(self, worker_index)


class PatternSource:
    def __init__(self, spec: PatternSpec, worker_index: int) -> None:
        self.spec, self.worker_index, self.count = spec, worker_index, 0

    def rollout(self, rows, *, attempt: int, should_stop) -> list[Episode] | None:
        if self.spec.fail_after and self.count >= self.spec.fail_after * self.spec.num_envs:
            raise RuntimeError(f"pattern source failed after {self.count} episodes")
        episodes = []
        for row in range(self.spec.num_envs):
            tag = 1000 * self.worker_index + self.count
            length = 12 + self.count % 7
            if self.spec.empty_every and self.count % self.spec.empty_every == self.spec.empty_every - 1:
                length = 0
            self.count += 1
            t = torch.arange(length, dtype=torch.float32)
            state = torch.stack([torch.full_like(t, tag), t, t / 10, torch.full_like(t, -tag)], dim=1)
            rows["obs", "state"][row, :length] = state
            rows["actions"][row, :length] = torch.stack([t, -t], dim=1)
            rows["rewards"][row, :length] = t / 100
            if self.spec.image_size:
                images = np.stack([pattern(tag, k, self.spec.image_size) for k in range(length)])
                rows["obs", "image"][row, :length] = torch.from_numpy(images)
            segments = expected_segments(length) if length else []
            every = self.spec.truncated_every
            truncated = bool(every) and (self.count - 1) % every == every - 1
            episodes.append(
                Episode(length, True, TASKS[tag % 2], segments, terminated=not truncated, truncated=truncated)
            )
        return episodes

    def close(self) -> None:
        if self.spec.close_fails:
            raise OSError("the pattern source could not flush while closing")


def pattern_record(tag: int, image_size: int | None = 32):
    """The ``EpisodeRecord`` a recorder makes of PatternSource's episode ``tag`` (for writer-only tests)."""
    from simstream.lerobot.writer import EpisodeRecord

    length = 12 + tag % 7
    t = np.arange(length, dtype=np.float32)
    frames = {
        "obs/state": np.stack([t * 0 + tag, t, t / 10, t * 0 - tag], 1).astype(np.float32),
        "actions": np.stack([t, -t], 1).astype(np.float32),
        "rewards": (t / 100).astype(np.float32),
    }
    if image_size:
        frames["obs/image"] = np.stack([pattern(tag, k, image_size) for k in range(length)])
    segment_id = np.array([0] * 4 + [2] * 5 + [3] * (length - 9))
    subtasks = ["reach"] * 4 + ["grasp"] * 5 + [TASKS[tag % 2]] * (length - 9)
    return EpisodeRecord(
        frames, TASKS[tag % 2], subtasks, segment_id, [True, True, False, True], True, True, False
    )
