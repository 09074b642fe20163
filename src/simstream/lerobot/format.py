"""The LeRobot dataset format v3.0 as files: paths, features, schemas, stats and atomic writes.

Matches what lerobot 0.6.1 writes (``lerobot/datasets/``): ``meta/info.json``, ``meta/tasks.parquet`` (a
pandas frame indexed by ``task``), ``meta/stats.json``, ``meta/episodes/chunk-XXX/file-YYY.parquet``,
``data/chunk-XXX/file-YYY.parquet`` and ``videos/<key>/chunk-XXX/file-YYY.mp4``. simstream adds, as
LeRobot allows, two per-frame int64 features (``subtask_index``, ``segment_id``), ``meta/subtasks.parquet``
and per-episode columns ``success``, ``terminated``, ``truncated`` and ``segment_accepted``.

pyarrow is imported inside the functions that need it: importing this module costs nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..sources import Field
from .names import BOOKKEEPING_KEYS, KeyMap

__all__ = [
    "CODEBASE_VERSION",
    "EXTRA_KEYS",
    "Feature",
    "LeRobotFormatError",
    "atomic_write_bytes",
    "check_video_frames",
    "features_from_fields",
    "info_features",
]

CODEBASE_VERSION = "v3.0"
CHUNKS_SIZE = 1000
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EXTRA_KEYS = ("subtask_index", "segment_id")
"""simstream's per-frame columns: the subtask text (``meta/subtasks.parquet``) and the segment position."""
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
QUANTILE_BINS = 5000
"""Bins of LeRobot's quantile estimate (``RunningQuantileStats``, ``lerobot/datasets/compute_stats.py``)."""
VIDEO_GOP = 2
VIDEO_CODECS: dict[str, dict[str, Any]] = {
    # LeRobot's own default: smallest files, ~27 ms of CPU per 70-frame 64x64 episode (2 vCPU machine)
    "av1": {"encoder": "libsvtav1", "crf": 30, "preset": 12, "min_side": 4, "even_sides": False},
    # ~5 ms per such episode (one encoder thread) and more bytes: for recording beside busy producers
    "h264": {"encoder": "libx264", "crf": 23, "preset": "ultrafast", "min_side": 1, "even_sides": True},
}
"""The video codecs a dataset can be written with (``video.codec`` in ``info.json``); PyAV decodes both.
``min_side``, ``even_sides``: the frame sizes the encoder opens for (measured with PyAV's FFmpeg)."""


def check_video_frames(features: list[Feature], video_codec: str) -> None:
    """Raise before anything is written if a video feature's frames are a size the codec cannot encode
    (the encoder would otherwise fail at the first flush, with FFmpeg's generic error).

    Raises:
        ValueError: naming the field, its size, the codec's rule and the ways out.
    """
    for feature in features:
        if feature.dtype != "video":
            continue
        _, height, width = feature.shape
        codec = VIDEO_CODECS[video_codec]
        even = not codec["even_sides"] or (height % 2 == 0 and width % 2 == 0)
        if not even or min(height, width) < codec["min_side"]:
            rule = (
                "even height and width" if codec["even_sides"] else f"height and width >= {codec['min_side']}"
            )
            raise ValueError(
                f"field {feature.field!r}: {video_codec} video needs {rule}; its frames are "
                f"{height}x{width}. Record it as PNG images (video=False, --no-video) or use another frame "
                "size or codec"
            )


"""LeRobot's defaults: AV1 (SVT-AV1 through PyAV), a key frame every 2 frames (cheap seeks), CRF 30."""
_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
}
_TORCH = {name: dtype for dtype, name in _DTYPES.items()}
_READABLE = {
    **_TORCH,
    "float16": torch.float16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
}
"""Dtypes a replay reads (LeRobot writes these too); a recording writes only :data:`_DTYPES`."""


class LeRobotFormatError(ValueError):
    """A file is not what a LeRobot v3.0 dataset holds there (the message names the file)."""


FIELD_SHAPE_KEY = "simstream.field_shape"
"""Key of an ``info.json`` feature written only for a field of shape ``(1,)``: LeRobot stores it like a
scalar (shape ``[1]``, one value per frame) and ignores the key; a replay reads it to restore the shape."""


@dataclass(frozen=True)
class Feature:
    """One payload feature: its LeRobot key, simstream field name and how it is stored."""

    key: str
    field: str
    dtype: str
    """``float32``, ``float64``, ``int64``, ``int32``, ``bool``, ``image`` or ``video`` (a replay also
    reads ``float16``, ``uint8``, ``int8`` and ``int16``)."""
    shape: tuple[int, ...]
    """LeRobot's shape: ``(1,)`` for a per-frame scalar, ``(3, H, W)`` for a camera (a replay also reads
    features of several dimensions, e.g. ``(2, 3)``)."""
    scalar: bool = False
    """The field has shape ``()``; a replayed plain column (LeRobot shape ``[1]``) is read as one."""

    @property
    def visual(self) -> bool:
        return self.dtype in ("image", "video")

    @property
    def plain(self) -> bool:
        """Stored as one value per frame, not a list: every LeRobot feature of shape ``[1]`` is (its reader
        casts shape ``[1]`` to a plain value and cannot open a list of one). A field of shape ``(1,)``
        is stored so too (see :attr:`vector_of_one`)."""
        return not self.visual and (self.scalar or tuple(self.shape) == (1,))

    @property
    def vector_of_one(self) -> bool:
        """A field of shape ``(1,)``: stored as a plain column like a scalar, and marked in ``info.json``
        (:data:`FIELD_SHAPE_KEY`) so that a replay gives it back its shape."""
        return not self.visual and not self.scalar and tuple(self.shape) == (1,)

    def field_spec(self) -> Field:
        if self.visual:
            return Field(tuple(self.shape), torch.uint8)
        return Field(() if self.scalar else tuple(self.shape), _READABLE[self.dtype])


def features_from_fields(fields: dict[str, Field], key_map: KeyMap, video: bool) -> list[Feature]:
    """LeRobot features of a source's fields: uint8 ``[3, H, W]`` fields are cameras.

    Raises:
        ValueError: a field LeRobot cannot hold (a dtype outside float32/64, int32/64, bool; a non-camera
            field of more than one dimension), a field whose key is one of the dataset's own columns, or
            two fields with one key, naming them.
    """
    key_map.check_known_fields(fields, "the source")
    features = []
    owners: dict[str, str] = {}
    for name, field in fields.items():
        key = key_map.feature(name)
        if key in BOOKKEEPING_KEYS or key in EXTRA_KEYS:
            raise ValueError(
                f"field {name!r} would be the LeRobot feature {key!r}, a column every dataset of ours "
                "already has (its own values would be replaced): give it another key with key_map"
            )
        if key in owners:
            raise ValueError(
                f"fields {owners[key]!r} and {name!r} would both be the LeRobot feature {key!r} (one "
                "column, one of them lost): give one of them another key with key_map"
            )
        owners[key] = name
        if field.dtype == torch.uint8 and len(field.shape) == 3 and field.shape[0] == 3:
            features.append(Feature(key, name, "video" if video else "image", field.shape))
        elif field.dtype in _DTYPES and len(field.shape) <= 1:
            shape = field.shape or (1,)
            features.append(Feature(key, name, _DTYPES[field.dtype], shape, scalar=not field.shape))
        else:
            raise ValueError(
                f"field {name!r} ({field.dtype}, shape {field.shape}) cannot be a LeRobot feature: use "
                "float32/float64/int32/int64/bool with shape () or (n,), or uint8 [3, H, W] for a camera"
            )
    return features


def info_features(features: list[Feature], fps: int, video_codec: str = "av1") -> dict[str, Any]:
    """``info.json["features"]``: the payload, LeRobot's bookkeeping columns and simstream's extras."""
    out: dict[str, Any] = {}
    for f in features:
        if f.visual:
            entry: dict[str, Any] = {
                "dtype": f.dtype,
                "shape": list(f.shape),
                "names": ["channels", "height", "width"],
            }
            if f.dtype == "video":
                c, h, w = f.shape
                codec = VIDEO_CODECS[video_codec]
                info = {"video.height": h, "video.width": w, "video.codec": video_codec,
                        "video.pix_fmt": "yuv420p", "video.fps": fps, "video.channels": c, "has_audio": False,
                        "video.g": VIDEO_GOP, "video.crf": codec["crf"], "video.preset": codec["preset"],
                        "video.fast_decode": 0, "video.video_backend": "pyav", "video.extra_options": {},
                        "is_depth_map": False}  # fmt: skip
                entry["info"] = info
            out[f.key] = entry
        else:
            out[f.key] = {"dtype": f.dtype, "shape": list(f.shape), "names": None}
            if f.vector_of_one:
                out[f.key][FIELD_SHAPE_KEY] = [1]
    out["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
    for key in (*BOOKKEEPING_KEYS[1:], *EXTRA_KEYS):
        out[key] = {"dtype": "int64", "shape": [1], "names": None}
    return out


def features_from_info(
    info: dict[str, Any], scalar_keys: set[str], key_map: KeyMap, path: Path
) -> tuple[list[Feature], dict[str, str]]:
    """Payload features of ``info.json``, and the features a replay cannot stream, each with the reason
    (bookkeeping columns and simstream's extras are neither).

    Raises:
        LeRobotFormatError: a feature without a shape, a camera feature whose shape is not 3-D.
        ValueError: two features that would be one field (naming both; a ``key_map`` tells them apart).
    """
    features: list[Feature] = []
    skipped: dict[str, str] = {}
    owners: dict[str, str] = {}
    for key, spec in info["features"].items():
        if key in BOOKKEEPING_KEYS or key in EXTRA_KEYS:
            continue
        dtype, raw_shape = spec.get("dtype"), spec.get("shape")
        if dtype in ("string", "audio"):
            skipped[key] = f"a {dtype} feature, which is not a tensor"
            continue
        valid_shape = isinstance(raw_shape, list) and all(type(n) is int and n >= 1 for n in raw_shape)
        if not valid_shape or not raw_shape:
            raise LeRobotFormatError(
                f"{path}: feature {key!r} ({dtype}) needs a shape, a non-empty list of ints >= 1, got "
                f"{raw_shape!r}"
            )
        shape = tuple(raw_shape)
        if dtype in ("image", "video"):
            if len(shape) != 3:
                raise LeRobotFormatError(
                    f"{path}: feature {key!r} ({dtype}) must have a 3-D shape, got {shape}"
                )
            if shape[0] != 3 and shape[-1] == 3:  # [H, W, C] as some converters write it
                shape = (3, shape[0], shape[1])
            if shape[0] != 3 or (spec.get("info") or {}).get("is_depth_map"):
                # skipped, not refused: the rest of an RGB-D dataset replays (lerobot 0.6.1 writes depth)
                skipped[key] = (
                    f"a {dtype} of shape {list(spec.get('shape') or ())} that is not an RGB camera; only "
                    "3-channel images and videos are read (depth maps are not)"
                )
                continue
            features.append(Feature(key, key_map.field(key), dtype, shape))
        elif dtype in _READABLE:
            scalar = len(shape) == 1 and key in scalar_keys and spec.get(FIELD_SHAPE_KEY) != [1]
            features.append(Feature(key, key_map.field(key), dtype, shape, scalar=scalar))
        else:
            skipped[key] = f"dtype {dtype!r}; a replay reads {sorted(_READABLE)}, images and videos"
            continue
        field = features[-1].field
        if field in owners:
            raise ValueError(
                f"{path}: features {owners[field]!r} and {key!r} would both be the field {field!r} (one of "
                "them overwritten in every frame): give one of them another name with key_map"
            )
        owners[field] = key
    return features, skipped


# -- stats ---------------------------------------------------------------------------------------------
def episode_stats(values: np.ndarray, visual: bool) -> dict[str, np.ndarray]:
    """LeRobot's per-episode stats of one feature (``min/max/mean/std/count/q01..q99``).

    Cameras: per channel over (a sample of) the pixels, scaled to ``[0, 1]``, shaped ``[3, 1, 1]``.
    """
    if visual:
        return image_stats(values)
    return columns_stats({"values": values})["values"]


def columns_stats(columns: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """:func:`episode_stats` of several non-visual features of one episode (equal lengths) at once.

    One pass of each reduction over the features side by side: the recorder computes a dozen columns per
    episode, and NumPy's per-call overhead (``np.quantile`` above all) cost more than the arithmetic.
    """
    length = len(next(iter(columns.values())))
    flats = [np.asarray(v).reshape(length, -1) for v in columns.values()]
    flat = np.concatenate(flats, axis=1, dtype=np.float64)
    reduced = {"min": flat.min(0), "max": flat.max(0), "mean": flat.mean(0), "std": flat.std(0)}
    if length < 2:  # LeRobot's rule for a single frame: every quantile is the mean
        quantiles = np.broadcast_to(reduced["mean"], (len(QUANTILES), flat.shape[1]))
    else:
        quantiles = histogram_quantiles(np.sort(flat, axis=0))
    for q, row in zip(QUANTILES, quantiles):
        reduced[f"q{round(q * 100):02d}"] = row
    count = np.array([length], dtype=np.int64)
    out, start = {}, 0
    for key, part in zip(columns, flats):
        end = start + part.shape[1]
        out[key] = {name: row[start:end] for name, row in reduced.items()}
        out[key]["count"] = count
        start = end
    return out


def histogram_quantiles(values: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """LeRobot's quantile estimate of each column of ``values`` (sorted ascending along axis 0):
    ``[len(QUANTILES), columns]``.

    LeRobot 0.6.1 counts a column into ``QUANTILE_BINS`` equal bins from ``min - 1e-10`` to ``max + 1e-10``
    and takes the ``q``-quantile inside the bin where the cumulative count reaches ``q * count``,
    interpolating linearly by count within that bin (the bin's lower edge for the first bin). That is
    the inverse of the empirical distribution, not ``np.quantile``'s interpolation between order
    statistics: on a sparse 0/1 column the two differ by most of the range (``q99`` 1.0 against 0.24),
    and policies that normalise by quantiles must see LeRobot's. The bins are never built: each value's
    bin is computed, so this costs a few passes over ``values``.

    Args:
        values: ``[m, columns]``, each column sorted ascending, at least two counted values per column.
        weights: How many times each value counts (``None``: once each); a column's counted values
            define its range.
    """
    values = np.asarray(values, dtype=np.float64)
    if weights is None:
        low, high = values[0] - 1e-10, values[-1] + 1e-10
    else:
        counted = weights > 0
        low = np.where(counted, values, np.inf).min(0) - 1e-10
        high = np.where(counted, values, -np.inf).max(0) + 1e-10
    step = (high - low) / QUANTILE_BINS

    def edge(k: np.ndarray) -> np.ndarray:  # as np.linspace(low, high, QUANTILE_BINS + 1)[k]
        return np.where(k >= QUANTILE_BINS, high, k * step + low)

    with np.errstate(divide="ignore", invalid="ignore"):
        bins = np.floor((values - low) / step)
    bins = np.clip(np.nan_to_num(bins, nan=QUANTILE_BINS - 1), 0, QUANTILE_BINS - 1).astype(np.int64)
    # np.histogram's bin is the one whose edges hold the value (the last bin includes its upper edge)
    bins -= values < edge(bins)
    bins += (bins + 1 < QUANTILE_BINS) & (values >= edge(bins + 1))
    quantiles = np.asarray(QUANTILES)[:, None]
    columns = np.arange(values.shape[1])
    if weights is None:  # every value counts once: the crossing is the ceil(q * n)-th value
        target = quantiles * len(values)
        crossing = np.broadcast_to(np.ceil(target).astype(np.int64) - 1, (len(QUANTILES), len(columns)))
        k = bins[crossing, columns]
        before = (bins[None] < k[:, None]).sum(1)
        inside = (bins[None] == k[:, None]).sum(1)
    else:
        cumulative = np.cumsum(weights, axis=0)
        target = quantiles * cumulative[-1]
        crossing = np.minimum((cumulative[None] < target[:, None]).sum(1), len(values) - 1)
        k = bins[crossing, columns]
        before = (weights[None] * (bins[None] < k[:, None])).sum(1)
        inside = (weights[None] * (bins[None] == k[:, None])).sum(1)
    out = np.where(k == 0, low, edge(k) + (target - before) / inside * (edge(k + 1) - edge(k)))
    # all values equal and the 1e-10 margins lost to rounding (huge magnitudes): no width to share
    return np.where(step > 0, out, low)


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats of uint8 ``[n, 3, H, W]`` frames over a sample of their pixels, in ``[0, 1]``.

    The sample is every ``n // 32``-th frame at half resolution. Computed from one 256-bin histogram per
    channel: exact reductions, and LeRobot's quantile estimate (:func:`histogram_quantiles`) with each
    level weighted by its count, in a counting pass instead of a sort.
    """
    step = max(1, len(frames) // 32)
    sample = np.ascontiguousarray(frames[::step, :, ::2, ::2]).transpose(1, 0, 2, 3).reshape(3, -1)
    size = sample.shape[1]
    offsets = (np.arange(3, dtype=np.int64) * 256)[:, None]
    counts = np.bincount((sample + offsets).ravel(), minlength=3 * 256).reshape(3, 256).astype(np.float64)
    levels = np.arange(256, dtype=np.float64)
    mean = counts @ levels / size
    variance = np.maximum(counts @ (levels**2) / size - mean**2, 0.0)
    present = counts > 0
    shape = (3, 1, 1)
    stats = {
        "min": present.argmax(1).astype(np.float64),
        "max": 255.0 - present[:, ::-1].argmax(1),
        "mean": mean,
        "std": np.sqrt(variance),
    }
    if size < 2:  # LeRobot's rule for a single value: every quantile is the mean
        quantiles = np.broadcast_to(mean, (len(QUANTILES), 3))
    else:
        quantiles = histogram_quantiles(np.broadcast_to(levels[:, None], (256, 3)), counts.T)
    for k, q in enumerate(QUANTILES):
        stats[f"q{round(q * 100):02d}"] = quantiles[k]
    stats = {name: (value / 255.0).reshape(shape) for name, value in stats.items()}
    stats["count"] = np.array([len(frames)], dtype=np.int64)
    return stats


STAT_NAMES = ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99")


def aggregate_stats(per_episode: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stats over all episodes from per-episode stats (as LeRobot aggregates them).

    ``mean`` is count-weighted; ``std`` combines within- and between-episode variance; quantiles are the
    count-weighted mean of the episodes' quantiles.
    """
    counts = np.array([float(s["count"][0]) for s in per_episode])
    weights = counts / counts.sum()

    def stacked(name: str) -> np.ndarray:
        return np.stack([np.asarray(s[name], dtype=np.float64) for s in per_episode])

    def weighted(values: np.ndarray) -> np.ndarray:  # over the first axis, by the episodes' weights
        return np.tensordot(weights, values, axes=1)

    means = stacked("mean")
    mean = weighted(means)
    variance = weighted(stacked("std") ** 2 + (means - mean) ** 2)
    out = {
        "min": stacked("min").min(0),
        "max": stacked("max").max(0),
        "mean": mean,
        "std": np.sqrt(variance),
        "count": np.array([int(counts.sum())], dtype=np.int64),
    }
    for name in STAT_NAMES[5:]:
        out[name] = weighted(stacked(name))
    return out


def stats_to_json(stats: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    return {key: {name: np.asarray(v).tolist() for name, v in s.items()} for key, s in stats.items()}


# -- files ---------------------------------------------------------------------------------------------
def temp_path(path: Path) -> Path:
    """Where a file is written before its rename (hidden, and no LeRobot glob matches it)."""
    return path.with_name(f".{path.name}.tmp")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_folders(path: Path) -> None:
    """``mkdir -p path``, fsyncing the parent of every folder it creates: a file committed into a new
    chunk folder survives a power loss only if the folder's own entry does."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        fsync_dir(folder.parent)


def commit_file(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, rename it to ``path`` (atomic) and fsync the folder."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` all at once: a reader sees the old file or the new, never a part."""
    make_folders(path.parent)
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
    commit_file(tmp, path)


def write_json(path: Path, value: Any, *, indent: int | None = 4) -> None:
    """Replace ``path`` with ``value`` as JSON. ``indent=None`` writes it compact, with the C encoder:
    ``stats.json``, rewritten at every flush, then took about 15% less of the recorder's writer CPU
    (``BENCHMARKS.md``, recording run 22), and leaves no reference cycles for the trainer's garbage
    collector (the indenting encoder is pure Python and leaves its closures in cycles)."""
    atomic_write_bytes(path, (json.dumps(value, indent=indent) + "\n").encode())


def write_parquet(path: Path, table) -> None:
    """Write a closed parquet file atomically.

    Only columns that are not floating point (indices, texts) are dictionary-encoded: sensor values
    rarely repeat, and a dictionary for them cost 2.3x the CPU of the whole write and produced a larger
    file (a 560-frame ``pick_place`` data file: 3.1 against 1.1 ms, 195 against 143 kB).
    """
    import pyarrow.parquet as pq

    make_folders(path.parent)
    tmp = temp_path(path)
    pq.write_table(table, tmp, compression="snappy", use_dictionary=_dictionary_columns(table))
    commit_file(tmp, path)


def _dictionary_columns(table) -> list[str]:
    import pyarrow as pa

    def floating(kind) -> bool:
        while pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind):
            kind = kind.value_type
        return pa.types.is_floating(kind)

    return [field.name for field in table.schema if not floating(field.type)]


def language_table(texts: list[str], index_name: str, text_name: str):
    """``tasks.parquet`` / ``subtasks.parquet``: a pandas frame indexed by its text, as LeRobot stores it."""
    import pyarrow as pa

    pandas_meta = {
        "index_columns": [text_name],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                            "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": index_name, "field_name": index_name, "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": None, "field_name": text_name, "pandas_type": "unicode", "numpy_type": "object",
             "metadata": None},
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.3.3",
    }  # fmt: skip
    # LeRobot's file names the index column like the text; pandas restores the index from "field_name"
    pandas_meta["columns"][1]["name"] = text_name
    schema = pa.schema([(index_name, pa.int64()), (text_name, pa.string())]).with_metadata(
        {"pandas": json.dumps(pandas_meta)}
    )
    return pa.table({index_name: np.arange(len(texts), dtype=np.int64), text_name: texts}, schema=schema)


def hf_features(features: list[Feature]) -> dict[str, Any]:
    """The ``huggingface`` schema metadata ``datasets`` writes beside the data columns."""
    out: dict[str, Any] = {}
    for f in features:
        if f.dtype == "video":
            continue
        if f.dtype == "image":
            out[f.key] = {"_type": "Image"}
        elif f.plain:
            out[f.key] = {"dtype": f.dtype, "_type": "Value"}
        else:
            out[f.key] = {
                "feature": {"dtype": f.dtype, "_type": "Value"},
                "length": f.shape[0],
                "_type": "List",
            }
    out["timestamp"] = {"dtype": "float32", "_type": "Value"}
    for key in (*BOOKKEEPING_KEYS[1:], *EXTRA_KEYS):
        out[key] = {"dtype": "int64", "_type": "Value"}
    return {"info": {"features": out}}
