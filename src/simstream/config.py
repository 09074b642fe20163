"""User-facing configuration of the online data engine.

``OnlineDataEngineCfg`` keeps the reference engine's field names and its exact error messages. As in the
reference, building the dataclass never raises: :meth:`OnlineDataEngineCfg.validate` runs first thing in
``OnlineDataEngine.__init__``, before any memory is allocated or process started, so a bad value never
leaves anything half-built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from ._validation import require_int
from .ray.backend import RayBackend
from .sources import Field, SourceSpec

__all__ = ["METADATA_KEYS", "PROVENANCE_KEYS", "OnlineDataEngineCfg", "SourceLayout"]

INT64_MAX = 2**63 - 1
MAX_TIMEOUT_S = 1e6
"""Longest accepted timeout: process joins wait with ``poll(2)``, whose millisecond argument is an int32."""
MAX_ROWS = 2**31 - 1
"""Largest ``buffer_size`` and row capacity T: run tables hold frame positions as int32, and with both
bounded every flat frame index ``row * T + t`` fits an int64."""
MAX_LANGUAGE_BYTES = 2**31 - 1
"""Largest ``language_buffer_bytes``: every process that resolves text parses the registry in full."""
MAX_EVENT_RECORDS = 2**31 - 1
"""Largest ``lifecycle_event_capacity``."""
MAX_LOCAL_WORKERS = 1024
"""Most producer processes on this machine (local backend): each is a process with its own simulator,
file descriptors in the owner, and rows of its own; 100,000 passed every check and went on to fork."""
MAX_RAY_WORKERS = 4096
"""Most producers as Ray actors, across a cluster."""

METADATA_KEYS: dict[str, torch.dtype] = {
    "valid": torch.bool,
    "episode_step": torch.int64,
    "segment_id": torch.int64,
    "segment_step": torch.int64,
    "segment_start": torch.bool,
    "segment_end": torch.bool,
    "segment_accepted": torch.bool,
    "segment_attempt_id": torch.int64,
    "continuity_id": torch.int64,
    "terminated": torch.bool,
    "truncated": torch.bool,
    "task_index": torch.int64,
    "subtask_index": torch.int64,
}
"""Per-frame keys the engine derives from each :class:`~simstream.Episode` (never written by sources)."""

PROVENANCE_KEYS: tuple[str, ...] = (
    "ods_run_id",
    "ods_episode_id",
    "ods_generation",
    "ods_frame_index",
    "ods_accepted_at_ns",
    "ods_published_at_monotonic_ns",
)
"""Per-frame int64 keys added with ``include_provenance=True``; ``-1`` on every invalid frame."""


@dataclass(frozen=True)
class SourceLayout:
    """What the engine needs to know of a source, read once in the owner and checked."""

    num_envs: int
    max_episode_steps: int
    fields: Mapping[str, Field]


@dataclass(frozen=True)
class OnlineDataEngineCfg:
    """Configuration of :class:`~simstream.OnlineDataEngine` (field names follow the reference engine)."""

    source: SourceSpec | None = None
    """Picklable episode-source spec; every producer worker builds its own source from it."""
    buffer_size: int = 16
    """Episode rows (slots) in the shared buffer; at least ``num_workers * source.num_envs``, at most
    ``2**31 - 1``, and the whole buffer must fit the free space of ``/dev/shm``."""
    max_episode_steps: int | None = None
    """Row capacity T; ``None`` takes the source's. When set it must equal the source's value."""
    buffer_device: str = "cpu"
    """Device of the shared buffer; only ``"cpu"`` shared memory is supported."""
    refill_threshold: int = 50
    """``sample_threshold`` policy: request a refill after ``refill_threshold * buffer_size`` chunks."""
    max_generation_attempts: int = 3
    """Tries per write window before the producer fails the engine."""
    initialization_timeout: float = 300.0
    """Seconds ``start()`` waits for the first complete generation, in ``(0, 1e6]``."""
    language_buffer_bytes: int = 1048576
    """Capacity (UTF-8 bytes) of the append-only shared language registry, in ``[1, 2**31 - 1]``."""
    action_dim: int | None = None
    """Expected width of the source's ``actions`` field; ``None`` skips the check."""
    refill_policy: Literal["sample_threshold", "manual"] = "sample_threshold"
    """``sample_threshold``: automatic refills; ``manual``: only ``request_refill()``."""
    include_provenance: bool = False
    """Add the six ``ods_*`` int64 per-frame keys (run, episode, generation, frame, timestamps)."""
    episode_sample_budget: int | None = None
    """Chunks each freshly published episode may deliver; set together with the hard limit."""
    episode_sample_hard_limit: int | None = None
    """Ceiling for the budget, enforced at every debit."""
    lifecycle_event_capacity: int = 0
    """Records in the bounded ``published``/``evicted`` log; 0 disables it, else in
    ``[2 * buffer_size, 2**31 - 1]``."""
    action_semantics: Literal["expert_controller_command", "policy_request"] = "expert_controller_command"
    """Meaning of the stored actions."""
    action_contracts: tuple[str, ...] | None = None
    """Ordered action contract IDs (``policy_request`` only)."""
    shutdown_timeout: float = 5.0
    """Seconds ``stop()`` waits for a graceful worker exit before terminate/kill, in ``(0, 1e6]`` (with the
    Ray backend, the sources' ``close()`` gets this long and the ingest process 5 s more to leave Ray)."""
    sample_wait_timeout: float = 60.0
    """Seconds a ``sample_batch`` that finds no eligible window waits while producers are rewriting rows
    that may hold one, or a requested refill is about to, in ``(0, 1e6]``; it checks the producers before
    every retry and gives up at once when no rewrite, under way or requested, can help. Raise it for
    sources whose rollout of one window takes longer."""
    num_workers: int = 1
    """Producer processes, in ``[1, 1024]`` (Ray actors: ``[1, 4096]``); each owns a disjoint range of rows
    and writes in parallel."""
    seed: int = 0
    """Base seed; worker ``i`` builds its source with a seed derived from ``(seed, i)``."""
    check_unwritten_frames: bool = True
    """Fail the engine with a ``ValueError`` naming row, key and frame when a source reports ``length``
    frames but a float payload still holds NaN (the unwritten value) in ``[0, length)``, instead of
    publishing them as valid. Costs a NaN fill of the float payload when rows are claimed (so a frame left
    unwritten is NaN even in a reused row) and one ``isnan`` pass over each episode's reported float frames
    (BENCHMARKS.md); turn it off only for sources whose data may legitimately hold NaN."""

    backend: RayBackend | None = None
    """Where producers run: ``None`` (default) starts ``num_workers`` local processes;
    :class:`simstream.ray.RayBackend` runs them as Ray actors anywhere in a Ray cluster, feeding this
    process's shared buffer (``docs/scale-out.md``)."""

    def validate(self) -> SourceLayout:
        """Check every field, in the reference engine's order, then the source.

        Returns:
            The source's checked layout.

        Raises:
            ValueError: naming the field and its accepted range.
        """
        self._validate_recording()
        self._validate_sampling_budget()
        if self.refill_policy not in ("sample_threshold", "manual"):
            # the reference engine's message, then what was given
            raise ValueError(
                f"refill_policy must be 'sample_threshold' or 'manual', got {self.refill_policy!r}"
            )
        if self.action_dim is not None and (type(self.action_dim) is not int or self.action_dim < 1):
            raise ValueError(f"action_dim must be a positive integer or None, got {self.action_dim!r}")
        require_int("OnlineDataEngineCfg", "buffer_size", self.buffer_size, 1)
        _require_at_most("buffer_size", self.buffer_size, MAX_ROWS, f"an int in [1, {MAX_ROWS}]")
        capacity = self.lifecycle_event_capacity
        if type(capacity) is not int or (capacity != 0 and capacity < 2 * self.buffer_size):
            raise ValueError(
                "lifecycle_event_capacity must be zero or at least 2 * buffer_size, got "
                f"{capacity!r} with buffer_size={self.buffer_size!r}"
            )
        _require_at_most(
            "lifecycle_event_capacity",
            capacity,
            MAX_EVENT_RECORDS,
            f"0 or an int in [2 * buffer_size = {2 * self.buffer_size}, {MAX_EVENT_RECORDS}]",
        )
        if type(self.max_generation_attempts) is not int or self.max_generation_attempts < 1:
            raise ValueError(
                f"max_generation_attempts must be at least 1, got {self.max_generation_attempts}."
            )
        if type(self.language_buffer_bytes) is not int or self.language_buffer_bytes < 1:
            raise ValueError(
                "language_buffer_bytes must be a positive integer (an int in "
                f"[1, {MAX_LANGUAGE_BYTES}]), got {self.language_buffer_bytes!r}"
            )
        _require_at_most(
            "language_buffer_bytes",
            self.language_buffer_bytes,
            MAX_LANGUAGE_BYTES,
            f"an int in [1, {MAX_LANGUAGE_BYTES}]",
        )
        for name in ("initialization_timeout", "shutdown_timeout", "sample_wait_timeout"):
            value = getattr(self, name)
            if not _finite_positive(value):
                raise ValueError(f"{name} must be finite and greater than zero, got {value}.")
            if value > MAX_TIMEOUT_S:
                raise ValueError(
                    f"{name} must be at most {MAX_TIMEOUT_S:.0e} seconds (about 11 days), got {value}."
                )
        require_int("OnlineDataEngineCfg", "refill_threshold", self.refill_threshold, 0)
        most = MAX_LOCAL_WORKERS if self.backend is None else MAX_RAY_WORKERS
        require_int("OnlineDataEngineCfg", "num_workers", self.num_workers, 1, most)
        require_int("OnlineDataEngineCfg", "seed", self.seed, 0, INT64_MAX)
        for name in ("include_provenance", "check_unwritten_frames"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"OnlineDataEngineCfg.{name} must be a bool, got {getattr(self, name)!r}")
        if str(self.buffer_device) != "cpu":
            raise ValueError(
                "OnlineDataEngineCfg.buffer_device must be 'cpu' (the buffer lives in CPU shared memory), "
                f"got {self.buffer_device!r}"
            )
        if self.backend is not None:
            if not isinstance(self.backend, RayBackend):
                raise ValueError(
                    "OnlineDataEngineCfg.backend must be None (local processes) or a "
                    f"simstream.ray.RayBackend, got {self.backend!r}"
                )
            self.backend.validate()
        layout = self._validate_source()
        if capacity:
            initial = self.initial_fill_records(layout.num_envs)
            if capacity < initial:
                raise ValueError(
                    "lifecycle_event_capacity cannot hold initial-fill events: got "
                    f"{capacity}, the first generation writes {initial} records; use 0 or at least {initial}"
                )
        return layout

    def worker_row_ranges(self, num_envs: int) -> list[tuple[int, int]]:
        """Disjoint ``[start, end)`` row ranges, one per producer worker, as even as possible."""
        base, extra = divmod(self.buffer_size, self.num_workers)
        ranges, start = [], 0
        for worker in range(self.num_workers):
            end = start + base + (1 if worker < extra else 0)
            ranges.append((start, end))
            start = end
        return ranges

    def initial_fill_records(self, num_envs: int) -> int:
        """Lifecycle records the first generation writes: published plus same-generation evictions."""
        total = 0
        for start, end in self.worker_row_ranges(num_envs):
            rows = end - start
            written = math.ceil(rows / num_envs) * num_envs
            total += 2 * written - rows
        return total

    def _validate_recording(self) -> None:
        semantics, contracts = self.action_semantics, self.action_contracts
        if semantics not in ("expert_controller_command", "policy_request"):
            raise ValueError(
                "Unknown ODS action_semantics. OnlineDataEngineCfg.action_semantics must be "
                f"'expert_controller_command' or 'policy_request', got {semantics!r}"
            )
        if semantics == "policy_request":
            if self.action_dim is None or not contracts:
                raise ValueError(
                    "policy_request ODS requires action_dim and ordered action_contracts. Got "
                    f"action_dim={self.action_dim!r}, action_contracts={contracts!r}"
                )
            if not isinstance(contracts, tuple) or any(
                not isinstance(c, str) or not c.strip() for c in contracts
            ):
                raise ValueError(
                    f"action_contracts must be a tuple of nonempty contract IDs. Got {contracts!r}"
                )
        elif contracts is not None:
            raise ValueError(
                "action_contracts are only valid for policy_request recording. Got "
                f"action_contracts={contracts!r} with action_semantics={semantics!r}"
            )

    def _validate_sampling_budget(self) -> None:
        budget, limit = self.episode_sample_budget, self.episode_sample_hard_limit
        if budget is None and limit is None:
            return
        if any(type(v) is not int or not 0 < v <= INT64_MAX for v in (budget, limit)):
            raise ValueError(
                "episode_sample_budget and episode_sample_hard_limit must both be positive "
                f"signed-int64 integers (ints in [1, {INT64_MAX}]); got episode_sample_budget={budget!r}, "
                f"episode_sample_hard_limit={limit!r}"
            )
        if budget > limit:
            raise ValueError(
                "episode_sample_budget must not exceed episode_sample_hard_limit; got "
                f"episode_sample_budget={budget}, episode_sample_hard_limit={limit}"
            )
        if str(self.buffer_device) != "cpu":  # not torch.device(): a bad string would raise RuntimeError
            raise ValueError(
                f"Per-episode sampling quotas require buffer_device='cpu', got {self.buffer_device!r}"
            )

    def _validate_source(self) -> SourceLayout:
        source = self.source
        if source is None or not all(
            hasattr(source, name) for name in ("num_envs", "max_episode_steps", "fields", "build")
        ):
            raise ValueError(
                "OnlineDataEngineCfg.source must be a SourceSpec (num_envs, max_episode_steps, "
                f"fields(), build()), got {source!r}"
            )
        num_envs, steps = source.num_envs, source.max_episode_steps
        require_int("OnlineDataEngineCfg", "source.num_envs", num_envs, 1)
        require_int("OnlineDataEngineCfg", "source.max_episode_steps", steps, 1, MAX_ROWS)
        if self.max_episode_steps is not None and self.max_episode_steps != steps:
            raise ValueError(
                f"OnlineDataEngineCfg.max_episode_steps must be None or equal the source's "
                f"max_episode_steps ({steps}), got {self.max_episode_steps!r}"
            )
        fields = dict(source.fields())
        _validate_fields(fields)
        self._validate_actions(source, fields)
        if num_envs > self.buffer_size:
            raise ValueError(
                f"OnlineDataEngineCfg.buffer_size must be >= the source's num_envs {num_envs} (the rows one "
                f"rollout writes), got {self.buffer_size}"
            )
        if self.num_workers * num_envs > self.buffer_size:
            raise ValueError(
                f"OnlineDataEngineCfg.buffer_size must be at least num_workers * num_envs = "
                f"{self.num_workers} * {num_envs} = {self.num_workers * num_envs} so that every worker "
                f"owns a full window, got {self.buffer_size}"
            )
        return SourceLayout(num_envs=num_envs, max_episode_steps=steps, fields=fields)

    def _validate_actions(self, source: SourceSpec, fields: dict[str, Field]) -> None:
        if self.action_dim is not None:
            actions = fields.get("actions")
            if actions is None:
                raise ValueError(
                    f"OnlineDataEngineCfg.action_dim={self.action_dim} but the source has no 'actions' field"
                )
            width = actions.shape[-1] if actions.shape else 1
            if width != self.action_dim:
                raise ValueError(
                    f"OnlineDataEngineCfg.action_dim must match the source's actions width {width}, "
                    f"got {self.action_dim}"
                )
        semantics = getattr(source, "action_semantics", None)
        if semantics is not None and semantics != self.action_semantics:
            raise ValueError(
                f"OnlineDataEngineCfg.action_semantics is {self.action_semantics!r} but the source "
                f"records {semantics!r}"
            )
        contracts = getattr(source, "action_contracts", None)
        if contracts is not None and tuple(contracts) != self.action_contracts:
            raise ValueError(
                f"OnlineDataEngineCfg.action_contracts {self.action_contracts!r} do not match the "
                f"source's {tuple(contracts)!r}"
            )


def _validate_fields(fields: dict[str, Field]) -> None:
    if not fields:
        raise ValueError("SourceSpec.fields() must name at least one payload field")
    reserved = set(METADATA_KEYS) | set(PROVENANCE_KEYS) | {"loss_mask"}
    paths = set()
    for name, spec in fields.items():
        parts = tuple(name.split("/")) if isinstance(name, str) else ()
        if not parts or any(not p for p in parts):
            raise ValueError(f"SourceSpec field names must be nonempty 'a/b' paths, got {name!r}")
        if not isinstance(spec, Field):
            raise ValueError(f"SourceSpec field {name!r} must be a Field, got {spec!r}")
        if parts[0] in reserved:
            raise ValueError(f"SourceSpec field {name!r} collides with the engine's metadata key")
        paths.add(parts)
    for parts in paths:
        for cut in range(1, len(parts)):
            if parts[:cut] in paths:
                raise ValueError(
                    f"SourceSpec field {'/'.join(parts[:cut])!r} is both a leaf and the parent of "
                    f"{'/'.join(parts)!r}"
                )


def _require_at_most(name: str, value: int, high: int, accepted: str) -> None:
    """The upper bound of a size field whose type and lower bound were checked (reference messages)."""
    if value > high:
        raise ValueError(f"OnlineDataEngineCfg.{name} must be {accepted}, got {value!r}")


def _finite_positive(value: object) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
