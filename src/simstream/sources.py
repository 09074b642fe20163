"""The episode-source protocol: how a simulator plus expert plugs into the engine.

The engine never knows which simulator runs. The owner holds a cheap, picklable :class:`SourceSpec`; every
producer worker calls :meth:`SourceSpec.build` once to create its own :class:`EpisodeSource`, then asks it
for rollouts. A rollout writes payload frames into a view of the shared buffer and reports one
:class:`Episode` per row; the engine checks the reports with :func:`validate_episodes` and derives every
metadata key from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from ._seeding import derived_seed
from ._validation import finite_number

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = [
    "SOURCE_INDEX",
    "Episode",
    "EpisodeSource",
    "Field",
    "MixSource",
    "MixSpec",
    "Segment",
    "SourceSpec",
    "validate_episodes",
]


@dataclass(frozen=True)
class Field:
    """One per-frame payload tensor of a source: its shape (without the frame axes) and dtype."""

    shape: tuple[int, ...] = ()
    """Per-frame shape; ``()`` is a scalar per frame."""
    dtype: torch.dtype = torch.float32
    """Element type stored in the shared buffer."""

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or any(type(n) is not int or n < 1 for n in self.shape):
            raise ValueError(f"Field.shape must be a tuple of positive ints, got {self.shape!r}")
        if self.dtype not in FIELD_DTYPES:
            # others failed inside the engine's constructor: sub-byte and quantised types cannot be filled
            # ("not implemented"), float8 and complex have no unwritten-value check
            names = ", ".join(str(dtype) for dtype in FIELD_DTYPES)
            raise ValueError(f"Field.dtype must be one of {names}, got {self.dtype!r}")


FIELD_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,  # e.g. depth images
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)  # fmt: skip
"""The element types a :class:`Field` may have: what the shared buffer stores, samples and checks."""


@dataclass(frozen=True)
class Segment:
    """A semantic sub-task inside one episode: frames ``[start, end)``, ``0 <= start <= end <= length``.

    An empty segment (``start == end``) is skipped: it covers no frame and its text is never interned. Frames
    get the segment's position in ``Episode.segments`` as ``segment_id``, so a segment after a skipped one
    keeps its own position (the reference numbers semantic segments the same way).
    """

    start: int
    """First frame, inclusive."""
    end: int
    """Last frame, exclusive."""
    instruction: str | None = None
    """Subtask text; ``None`` inherits the episode's instruction."""
    accepted: bool = True
    """``False``: the frames stay valid but never serve segment or boundary sampling."""


@dataclass
class Episode:
    """What a source reports for one buffer row after a rollout."""

    length: int
    """Frames written: ``rows[row, :length]``."""
    success: bool = True
    """The window is published only when every episode in it succeeded."""
    instruction: str | None = None
    """Task text; ``None`` is stored as ``"unknown_task"``."""
    segments: Sequence[Segment] = ()
    """Sub-tasks in frame order; ``()`` means one accepted segment ``[0, length)``."""
    continuity: Sequence[int] | None = None
    """Per-frame causal region id (``len == length``); ``None``: all 0; ``-1``: never used as context."""
    terminated: bool = False
    """Termination flag of the last frame."""
    truncated: bool = False
    """Truncation flag of the last frame."""


@runtime_checkable
class EpisodeSource(Protocol):
    """Lives in one producer worker and fills buffer rows with episodes."""

    def rollout(
        self, rows: TensorDict, *, attempt: int, should_stop: Callable[[], bool]
    ) -> Sequence[Episode] | None:
        """Write frames ``t < length`` of each row of ``rows`` (``[num_envs, T]``, payload keys only).

        Args:
            rows: A view of the shared buffer, already invalidated; write payload frames in place.
            attempt: How many times this window was tried before (0 on the first try).
            should_stop: Poll it in long loops; once it returns ``True`` return ``None``.

        Returns:
            One :class:`Episode` per row, or ``None`` when the rollout was interrupted by ``should_stop``.
        """
        ...

    def close(self) -> None:
        """Flush and release; an exception raised here makes the engine's ``stop()`` fail."""
        ...


@runtime_checkable
class SourceSpec(Protocol):
    """A picklable, cheap description of a source; the engine's owner holds it."""

    num_envs: int
    """Rows written by one rollout."""
    max_episode_steps: int
    """The row capacity T; a source must truncate its episodes at T, never clip them."""

    def fields(self) -> Mapping[str, Field]:
        """Payload names (``"obs/state"`` is the nested key ``("obs", "state")``) and their layout."""
        ...

    def build(self, worker_index: int, seed: int) -> EpisodeSource:
        """Create the worker-local source; runs inside the producer worker process."""
        ...


def _exact_int(value: object) -> bool:
    return type(value) is int


def _text(value: object) -> bool:
    """A report's text: a ``str`` that UTF-8 can encode (a lone surrogate, e.g. from bytes decoded with
    ``surrogateescape``, cannot be stored in the language registry)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _flag(value: object) -> bool:
    """A report's flag: ``bool``, or NumPy's (what ``x > y`` of NumPy numbers gives)."""
    return isinstance(value, (bool, np.bool_))


_INT64_MAX = 2**63 - 1


def validate_episodes(episodes: object, num_rows: int, capacity: int) -> list[Episode]:
    """Check a rollout's report against the rules of the protocol.

    Args:
        episodes: What ``EpisodeSource.rollout`` returned (``None`` handled by the caller).
        num_rows: Rows in the window (the spec's ``num_envs``).
        capacity: Row capacity ``T``.

    Returns:
        The episodes as a list.

    Raises:
        ValueError: naming the row and the rule it breaks: wrong count, length outside ``[0, T]``,
            segments outside ``0 <= start <= end <= length``, non-empty segments unordered or
            overlapping, or a continuity list of the wrong length or with ids below ``-1``.

    Empty segments (``start == end``) are accepted, as the reference engine accepts them, and skipped:
    they cover no frame, take no part in the order and overlap checks, and their text is never interned.
    """
    if isinstance(episodes, (str, bytes)) or not isinstance(episodes, Sequence):
        raise ValueError(
            f"EpisodeSource.rollout must return a sequence of {num_rows} Episode objects or None, "
            f"got {type(episodes).__name__}"
        )
    if len(episodes) != num_rows:
        raise ValueError(
            f"EpisodeSource.rollout returned {len(episodes)} episodes for a window of {num_rows} rows; "
            "it must report exactly one Episode per row"
        )
    for row, episode in enumerate(episodes):
        if not isinstance(episode, Episode):
            raise ValueError(f"Episode report for row {row} must be an Episode, got {episode!r}")
        length = episode.length
        if not _exact_int(length) or not 0 <= length <= capacity:
            raise ValueError(f"Episode.length of row {row} must be an int in [0, {capacity}], got {length!r}")
        if episode.instruction is not None and not _text(episode.instruction):
            raise ValueError(
                f"Episode.instruction of row {row} must be str (valid Unicode: UTF-8 encodable) or None, "
                f"got {episode.instruction!r:.80}"
            )
        for name in ("success", "terminated", "truncated"):
            if not _flag(getattr(episode, name)):
                raise ValueError(
                    f"Episode.{name} of row {row} must be a bool, got {getattr(episode, name)!r}"
                )
        segments = episode.segments
        if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
            # a generator would be used up here, and the writer would then see no segments
            raise ValueError(
                f"Episode.segments of row {row} must be a sequence (tuple or list) of Segment objects, "
                f"got {type(segments).__name__}"
            )
        previous_end = 0
        for k, segment in enumerate(segments):
            if not isinstance(segment, Segment):
                raise ValueError(f"Episode.segments[{k}] of row {row} must be a Segment, got {segment!r}")
            start, end = segment.start, segment.end
            if not (_exact_int(start) and _exact_int(end)):
                raise ValueError(
                    f"Segment bounds of row {row} must be ints, got start={start!r} and end={end!r} "
                    f"(segment {k})"
                )
            if not _flag(segment.accepted):
                raise ValueError(f"Segment.accepted of row {row} must be a bool, got {segment.accepted!r}")
            if not 0 <= start <= end <= length:
                raise ValueError(
                    f"Segment [{start}, {end}) of row {row} is outside the row: segments must satisfy "
                    f"0 <= start <= end <= length={length}"
                )
            if segment.instruction is not None and not _text(segment.instruction):
                raise ValueError(
                    f"Segment.instruction of row {row} must be str (valid Unicode: UTF-8 encodable) or "
                    f"None, got {segment.instruction!r:.80} (segment {k})"
                )
            if start == end:
                continue  # empty: covers no frame, so it can neither overlap nor break the order
            if start < previous_end:
                raise ValueError(
                    f"Segments of row {row} overlap or are out of order at segment {k} "
                    f"[{start}, {end}); segments must be sorted and disjoint"
                )
            previous_end = end
        if episode.continuity is not None:
            if not hasattr(episode.continuity, "__len__") or isinstance(episode.continuity, (str, bytes)):
                raise ValueError(  # an iterator would be used up here and leave the writer nothing
                    f"Episode.continuity of row {row} must be a sequence or an array of ids, "
                    f"got {type(episode.continuity).__name__}"
                )
            continuity = list(episode.continuity)
            if len(continuity) != length:
                raise ValueError(
                    f"Episode.continuity of row {row} has {len(continuity)} ids for length {length}; "
                    "it must hold one id per frame"
                )
            if any(
                not isinstance(c, Integral) or isinstance(c, bool) or not -1 <= c <= _INT64_MAX
                for c in continuity
            ):
                raise ValueError(
                    f"Episode.continuity of row {row} must hold ints in [-1, 2**63 - 1] (-1: never used as "
                    "context)"
                )
    return list(episodes)


SOURCE_INDEX = "source_index"
"""The field :class:`MixSpec` adds: per frame, the position in ``specs`` of the source that wrote it."""


@dataclass(frozen=True)
class MixSpec:
    """Fill the buffer from several sources with the same fields, in the given proportions (co-training).

    Each window of ``num_envs`` rows comes from source ``k`` with probability ``weights[k] / sum(weights)``,
    drawn by a generator seeded per producer worker, so over ``n`` published windows the share of source
    ``k`` is ``weights[k] / sum(weights)`` within binomial error. A window's retries (after a failed
    episode) stay with the source drawn for it, so a source that fails more often is not published less.
    Every frame carries ``source_index`` (int64, the position ``k``) so a trainer can weigh or filter by it.
    Sources are built lazily in the worker, on their first draw.

    Examples:
        >>> from simstream.synthetic import SyntheticSpec
        >>> a, b = SyntheticSpec(num_envs=2), SyntheticSpec(num_envs=2, min_length=10)
        >>> sorted(MixSpec((a, b), (3, 1)).fields())[-1]
        'source_index'
    """

    specs: Sequence[SourceSpec]
    """The sources; all have the same fields (names, shapes, dtypes) and ``num_envs``."""
    weights: Sequence[float]
    """Non-negative proportions, one per source, not all zero."""

    def __post_init__(self) -> None:
        for name in ("specs", "weights"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
                raise ValueError(
                    f"MixSpec.{name} must be a sequence (one entry per source), got {type(value).__name__}"
                )
        specs, weights = tuple(self.specs), tuple(self.weights)
        if not specs:
            raise ValueError("MixSpec.specs must hold at least one source spec, got none")
        for k, spec in enumerate(specs):
            needed = ("fields", "build", "num_envs", "max_episode_steps")
            missing = [name for name in needed if not hasattr(spec, name)]
            if missing:
                raise ValueError(
                    f"MixSpec.specs[{k}] must be a SourceSpec (fields(), build(), num_envs, "
                    f"max_episode_steps); {type(spec).__name__} lacks {missing}"
                )
        if len(weights) != len(specs):
            raise ValueError(
                f"MixSpec.weights must hold one weight per spec ({len(specs)}), got {len(weights)}"
            )
        for k, w in enumerate(weights):
            if not finite_number(w) or w < 0:
                raise ValueError(f"MixSpec.weights[{k}] must be a finite number >= 0, got {w!r}")
        total = sum(float(w) for w in weights)  # inf when the weights overflow together
        if not 0 < total < float("inf"):
            raise ValueError(
                f"MixSpec.weights must sum to a finite number > 0, got {list(weights)} (sum {total})"
            )
        for name in ("action_semantics", "action_contracts"):  # what the engine checks its config against
            declared = {repr(getattr(spec, name)) for spec in specs if getattr(spec, name, None) is not None}
            if len(declared) > 1:  # a source that declares none (a recorded dataset) agrees with any
                raise ValueError(
                    f"MixSpec.specs record different {name}: {sorted(declared)}; every source must record "
                    "its actions the same way"
                )
        first = dict(specs[0].fields())
        if SOURCE_INDEX in first:
            raise ValueError(f"MixSpec.specs[0] already has a field {SOURCE_INDEX!r}; MixSpec adds it")
        for k, spec in enumerate(specs[1:], start=1):
            fields = dict(spec.fields())
            if fields != first:
                differing = sorted(
                    name for name in set(fields) | set(first) if fields.get(name) != first.get(name)
                )
                details = "; ".join(
                    f"{name!r}: {_described(fields.get(name))} against {_described(first.get(name))}"
                    for name in differing
                )
                raise ValueError(
                    f"MixSpec.specs[{k}] has other fields than specs[0]: {details} (every source must have "
                    "the same names, shapes and dtypes; LeRobotSpec(fields_subset=...) selects)"
                )
            if spec.num_envs != specs[0].num_envs:
                raise ValueError(
                    f"MixSpec.specs[{k}].num_envs is {spec.num_envs}, specs[0].num_envs is "
                    f"{specs[0].num_envs}: every source must write windows of the same size"
                )
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "weights", tuple(float(w) for w in weights))

    @property
    def num_envs(self) -> int:
        return self.specs[0].num_envs

    @property
    def action_semantics(self) -> str | None:
        """The ``action_semantics`` the sources declare (``None`` when none does)."""
        return self._declared("action_semantics")

    @property
    def action_contracts(self) -> tuple[str, ...] | None:
        """The ``action_contracts`` the sources declare (``None`` when none does)."""
        return self._declared("action_contracts")

    def _declared(self, name: str):
        return next((v for v in (getattr(spec, name, None) for spec in self.specs) if v is not None), None)

    @property
    def max_episode_steps(self) -> int:
        """The longest row any source needs (each source truncates at its own capacity)."""
        return max(spec.max_episode_steps for spec in self.specs)

    @property
    def fps(self) -> int | None:
        """The sources' common ``fps`` (``None`` when they differ or have none)."""
        rates = {getattr(spec, "fps", None) for spec in self.specs}
        return rates.pop() if len(rates) == 1 else None

    def fields(self) -> dict[str, Field]:
        fields = dict(self.specs[0].fields())
        fields[SOURCE_INDEX] = Field((), torch.int64)
        return fields

    def build(self, worker_index: int, seed: int) -> MixSource:
        return MixSource(self, worker_index, seed)


class MixSource:
    """Draws the source of each window, builds sources on first use, stamps ``source_index``."""

    def __init__(self, spec: MixSpec, worker_index: int, seed: int) -> None:
        self.spec = spec
        self.worker_index = worker_index
        self.seed = seed
        weights = np.asarray(spec.weights)
        self.probabilities = weights / weights.sum()
        self.rng = np.random.default_rng([seed, 0x4D4958])
        self.sources: dict[int, EpisodeSource] = {}
        self.draws = [0] * len(spec.specs)
        """Windows drawn per source (retries of a window are not drawn again)."""
        self._current: int | None = None
        """The source of the window being tried: its retries (``attempt > 0``) stay with it."""

    def choose(self) -> int:
        """The source of the next window."""
        return int(self.rng.choice(len(self.probabilities), p=self.probabilities))

    def rollout(
        self, rows: TensorDict, *, attempt: int, should_stop: Callable[[], bool]
    ) -> Sequence[Episode] | None:
        if attempt > 0 and self._current is not None:
            k = self._current
        else:
            k = self._current = self.choose()
            self.draws[k] += 1
        spec = self.spec.specs[k]
        if k not in self.sources:
            child_seed = derived_seed(self.seed, k)
            self.sources[k] = spec.build(self.worker_index, child_seed)
        steps = spec.max_episode_steps
        payload = rows.exclude(SOURCE_INDEX)[:, :steps]
        report = self.sources[k].rollout(payload, attempt=attempt, should_stop=should_stop)
        if report is None:
            return None
        # against this source's own capacity: the engine checks the mix's, the longest of any source, and
        # frames past this one's were never written
        try:
            report = validate_episodes(report, int(rows.batch_size[0]), steps)
        except ValueError as error:
            raise ValueError(f"MixSpec.specs[{k}] ({type(spec).__name__}): {error}") from None
        rows.get(SOURCE_INDEX).fill_(k)
        return report

    def close(self) -> None:
        errors = []
        for source in self.sources.values():
            try:
                source.close()
            except Exception as error:  # close every source; report the first failure
                errors.append(error)
        if errors:
            raise errors[0]


def _described(field: Field | None) -> str:
    """A field's shape and dtype, for a message comparing two sources."""
    return "absent" if field is None else f"{tuple(field.shape)} {str(field.dtype).removeprefix('torch.')}"
