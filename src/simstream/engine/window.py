"""Generate one window: the source's rollout with retries and the check of its report.

This half of a producer knows the source and nothing of shared memory, so the same code runs in a local
producer process (``rows`` are claimed rows of the shared buffer) and in a Ray actor (``rows`` are the
actor's own memory, returned by value). Publishing a window is :mod:`simstream.engine.publisher`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._seeding import derived_seed
from ..sources import Episode, validate_episodes

__all__ = ["GeneratedWindow", "derive_worker_seed", "generate_window", "window_starts"]

logger = logging.getLogger(__name__)


def derive_worker_seed(seed: int, worker_index: int, incarnation: int = 0) -> int:
    """Independent, reproducible seed for worker ``worker_index`` of an engine seeded with ``seed``.

    ``incarnation`` counts restarts of that worker (Ray backend): a restarted producer gets a new seed,
    so it does not replay the episodes its predecessor already published. Incarnation 0 is what local
    producers use (the same seed as a Ray producer that was never restarted).
    """
    if incarnation == 0:
        return derived_seed(seed, worker_index)
    return derived_seed(seed, worker_index, incarnation)


def window_starts(row_start: int, row_end: int, num_envs: int) -> list[int]:
    """First row of each window covering ``[row_start, row_end)``; the last one may overlap."""
    count = math.ceil((row_end - row_start) / num_envs)
    return [min(row_start + k * num_envs, row_end - num_envs) for k in range(count)]


@dataclass(frozen=True)
class GeneratedWindow:
    """A window whose every episode succeeded: the checked reports and the attempt that made them."""

    episodes: list[Episode]
    attempt: int
    failed_episodes: int
    """Episodes of earlier, failed attempts of this window (counted, never published)."""


def generate_window(
    source,
    rows,
    *,
    number: int,
    max_steps: int,
    attempts: int,
    should_stop: Callable[[], bool],
    reset: Callable[[], None],
    on_failed: Callable[[int], None] | None = None,
) -> GeneratedWindow | None:
    """Roll out one window into ``rows`` until every episode succeeds, at most ``attempts`` times.

    Args:
        source: The worker's :class:`~simstream.EpisodeSource`.
        rows: Payload TensorDict ``[num_envs, T]`` the source writes (already reset for attempt 0).
        number: Index of the window in its generation (for messages).
        max_steps: Row capacity ``T``.
        attempts: ``max_generation_attempts``.
        should_stop: The source's stop check; also ends the retries.
        reset: Called before every retry: the rows back to the unwritten state.
        on_failed: Called with the window's row count after every attempt with a failed episode (the
            engine counts them as they happen).

    Returns:
        The window, or ``None`` when stopped (an interrupted rollout is not a failure).

    Raises:
        ValueError: the report breaks the protocol (names the row), or is ``None`` while
            ``should_stop()`` is false.
        RuntimeError: every attempt reported a failed episode.
    """
    num_rows = int(rows.batch_size[0])
    failed = 0
    for attempt in range(attempts):
        if attempt:
            reset()
        report = source.rollout(rows, attempt=attempt, should_stop=should_stop)
        if report is None:
            if should_stop():
                return None
            raise ValueError(
                f"EpisodeSource.rollout returned None for rollout {number + 1} although should_stop() is "
                "False: None means 'interrupted by should_stop'; a finished rollout returns one Episode "
                "per row"
            )
        episodes = validate_episodes(report, num_rows, max_steps)
        if all(episode.success for episode in episodes):
            return GeneratedWindow(episodes, attempt, failed)
        failed += num_rows
        if on_failed is not None:
            on_failed(num_rows)
        if should_stop():
            return None
        logger.warning("window %d attempt %d had a failed episode; retrying", number + 1, attempt + 1)
    raise RuntimeError(
        f"Failed to generate rollout {number + 1} after {attempts} attempts. Every attempt reported "
        "an episode with success=False (a window is published only when all succeed): check the "
        "source, e.g. whether max_episode_steps leaves its expert time to finish, or raise "
        "max_generation_attempts."
    )


def reported_frames(episodes: Sequence[Episode]) -> int:
    return sum(episode.length for episode in episodes)
