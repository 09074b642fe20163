"""Sizes of what the engine allocates, known from its config before anything is allocated.

``OnlineDataEngine.__init__`` calls :func:`check_shared_memory` right after ``cfg.validate()``: every
shared region's size follows from the config alone, so a config whose regions do not fit the free space of
``/dev/shm`` fails with a ``ValueError`` naming the field, the bytes needed and the bytes free, before any
memory is allocated or process started. Without the check such a config ends in a SIGBUS (a
``multiprocessing`` array falls back to a temporary file that cannot be backed) or in torch's allocation
error halfway through the constructor. Sizes are exact Python ints, so absurd values cannot overflow on
the way. :func:`check_context_lengths` bounds the per-call size fields of ``sample_batch_with_context``.
"""

from __future__ import annotations

import gc
import mmap
import numbers
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..buffer.gate import RecordGate
from ..buffer.index import EligibilityIndex
from ..buffer.storage import TrajectoryStorage
from ..workers.channel import CHANNEL_BYTES
from .progress import _NODE_ID_BYTES

if TYPE_CHECKING:
    from ..config import OnlineDataEngineCfg, SourceLayout

__all__ = [
    "SHM_PATH",
    "SharedRegion",
    "check_context_lengths",
    "check_shared_memory",
    "free_shared_bytes",
    "require_fits",
    "shared_regions",
]

SHM_PATH = "/dev/shm"
"""Where torch's shared tensors and ``multiprocessing``'s shared arrays live on Linux."""
_PROGRESS_SLOTS, _PROGRESS_SLOTS_PER_WORKER = 128, 16
"""Upper bounds on the int64 slots of the producer progress: engine-wide and consumer counters, and each
producer's own."""
_CHANNEL_EXTRA = 16 * 1024
"""Upper bound on the error channel's shared state beside its record slot (header, notes)."""
_EVENT_RECORD_SCALARS = 7
"""int64 fields of one lifecycle record (kind, sequence, run, episode, generation, slot, time)."""
_QUOTA_COLUMNS, _QUOTA_META = 4, 2
"""int64 columns of the per-row quota table, and its shared totals."""


@dataclass(frozen=True)
class SharedRegion:
    """One shared allocation of an engine: what it is, the config field that sizes it, and its bytes."""

    name: str
    field: str
    """The ``OnlineDataEngineCfg`` field that sizes it; ``""`` for a region of fixed size."""
    value: object
    """That field's value."""
    nbytes: int
    detail: str = ""
    """How ``nbytes`` follows from the config, for the error message."""


def shared_regions(cfg: OnlineDataEngineCfg, layout: SourceLayout) -> list[SharedRegion]:
    """Every shared region an engine with ``cfg`` allocates, each rounded up to whole pages.

    The large regions are exact; the small ones (error channel, progress counters) are upper bounds, and
    synchronisation objects (locks, doorbells) are left out: a page or so each.
    """
    rows, steps = cfg.buffer_size, layout.max_episode_steps
    storage = TrajectoryStorage.shared_bytes(layout, rows, cfg.include_provenance)
    per_frame = storage // (rows * steps + 1)
    regions = [
        SharedRegion(
            "trajectory buffer",
            "buffer_size",
            rows,
            storage,
            f"{rows} rows x {steps} frames, plus the padding frame, x {per_frame} bytes per frame",
        ),
        SharedRegion(
            "eligibility index", "buffer_size", rows, EligibilityIndex.shared_bytes(rows, steps), "run tables"
        ),
        SharedRegion(
            "language registry",
            "language_buffer_bytes",
            cfg.language_buffer_bytes,
            cfg.language_buffer_bytes + 8,
        ),
        SharedRegion("error channel", "", None, CHANNEL_BYTES + _CHANNEL_EXTRA, "fixed size"),
        SharedRegion(
            "producer progress",
            "num_workers",
            cfg.num_workers,
            8 * (_PROGRESS_SLOTS + _PROGRESS_SLOTS_PER_WORKER * cfg.num_workers)
            + _NODE_ID_BYTES * cfg.num_workers,  # the Ray node id kept per producer
        ),
        SharedRegion(
            "record gate",
            "buffer_size",
            rows,
            RecordGate.shared_bytes(rows),
            "one gate row per buffer row",
        ),
    ]
    if cfg.lifecycle_event_capacity:
        record = 8 * _EVENT_RECORD_SCALARS + 2 * steps  # plus a valid and an anchor mask of T frames
        regions.append(
            SharedRegion(
                "lifecycle log",
                "lifecycle_event_capacity",
                cfg.lifecycle_event_capacity,
                cfg.lifecycle_event_capacity * record,
                f"{record} bytes per record",
            )
        )
    if cfg.episode_sample_budget is not None:
        quota = 8 * (_QUOTA_COLUMNS * rows + _QUOTA_META)
        regions.append(
            SharedRegion("quota table", "buffer_size", rows, quota, "one quota row per buffer row")
        )
    return [_whole_pages(region) for region in regions]


def free_shared_bytes(path: str = SHM_PATH) -> int | None:
    """Bytes an unprivileged process may still allocate under ``path``; ``None`` if it does not exist."""
    try:
        stats = os.statvfs(path)
    except OSError:  # no /dev/shm (not Linux): nothing to compare with
        return None
    return stats.f_bavail * stats.f_frsize


def check_shared_memory(cfg: OnlineDataEngineCfg, layout: SourceLayout, path: str = SHM_PATH) -> None:
    """Raise before anything is allocated if the engine's shared regions do not fit ``path``'s free space.

    Raises:
        ValueError: naming the field of the largest region, the bytes it and all regions need, and the
            bytes free.
    """
    free = free_shared_bytes(path)
    if free is None:
        return
    regions = shared_regions(cfg, layout)
    if sum(region.nbytes for region in regions) > free:
        # An engine that failed and was dropped without stop() (a retry in a notebook) is held by a
        # reference cycle, its exception's traceback, until the cyclic collector runs, and its segments
        # with it: collect once before refusing.
        gc.collect()
        free = free_shared_bytes(path) or 0
    require_fits(regions, free, path)


def require_fits(regions: list[SharedRegion], free_bytes: int, path: str = SHM_PATH) -> None:
    """Raise ``ValueError`` unless the regions together fit ``free_bytes``, naming the largest one."""
    total = sum(region.nbytes for region in regions)
    if total <= free_bytes:
        return
    largest = max(regions, key=lambda region: region.nbytes)
    detail = f" ({largest.detail})" if largest.detail else ""
    if largest.field:
        what = f"OnlineDataEngineCfg.{largest.field}={largest.value!r} needs {_bytes(largest.nbytes)}"
        fix = f"Lower {largest.field}"
    else:
        what = f"The engine's {largest.name} needs {_bytes(largest.nbytes)}"
        fix = "Free some space"
    others = ", ".join(f"{r.name} {r.nbytes} bytes" for r in regions if r is not largest)
    raise ValueError(
        f"{what} of shared memory for the {largest.name}{detail}; with the other regions ({others}) the "
        f"engine needs {_bytes(total)} but {path} has {_bytes(free_bytes)} free. {fix}, or make {path} "
        "larger (in a container, e.g. `docker run --shm-size=...`)."
    )


def check_context_lengths(
    history_length: object, prediction_horizon: object, max_steps: int
) -> tuple[int, int]:
    """Bound the context lengths of ``sample_batch_with_context`` before a batch is allocated; returns
    them as ``int`` (NumPy integers are accepted, as for ``batch_size``).

    A context never reaches past its row, so positions more than ``T - 1`` frames from the anchor are
    always padding: each length is accepted in ``[1, T]``.

    Raises:
        ValueError: naming the length and its accepted range; for a length that is not a positive
            integer the message starts with the reference's.
    """
    lengths = []
    for name, value in (("history_length", history_length), ("prediction_horizon", prediction_horizon)):
        accepted = f"{name} must be an int in [1, max_episode_steps={max_steps}], got {value!r}"
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"Context lengths must be positive integers: {accepted}")
        if value > max_steps:
            raise ValueError(
                f"{accepted}: a context never reaches past its row, so longer ones would only add padding"
            )
        lengths.append(int(value))
    return lengths[0], lengths[1]


def _whole_pages(region: SharedRegion) -> SharedRegion:
    return replace(region, nbytes=-(-region.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)


def _bytes(count: int) -> str:
    """``"268435456 bytes (256.0 MiB)"``: the exact count for scripts, a readable one for people."""
    size, unit = float(count), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{count} bytes" if unit == "bytes" else f"{count} bytes ({size:.1f} {unit})"
