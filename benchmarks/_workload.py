"""The reference streaming workload and the baselines measured against the engine on the same memory.

Workload (issue 6): a buffer of ``buffer_size`` episodes x 300 steps; per frame ``obs/state`` f32[64],
``obs/qpos`` f32[14], ``actions`` f32[14] (plus the synthetic source's ``rewards`` f32 and the engine's
13 derived metadata keys), optionally ``obs/image`` u8[3,64,64]; batches of 256 chunks of 32 frames.

Every baseline reads the engine's own shared tensors (``engine.shared_buffer``), so all candidates copy
the same bytes from the same pages: the raw gather (one ``index_select`` per key of the sampled slices into
preallocated outputs: the memory-bus ceiling of this layout) and TorchRL's ``ReplayBuffer`` +
``SliceSampler`` over a ``TensorStorage`` that wraps those tensors without copying.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.synthetic import SyntheticSpec

__all__ = [
    "CamerasSpec",
    "ContinuousPublication",
    "RawGather",
    "Workload",
    "make_engine",
    "make_torchrl_sampler",
    "payload_keys",
    "synthetic_spec",
]


@dataclass(frozen=True)
class Workload:
    """Shape of one benchmark configuration."""

    buffer_size: int = 512
    max_steps: int = 300
    batch_size: int = 256
    chunk_size: int = 32
    image_size: int | None = None
    num_workers: int = 1
    work_us_per_step: float = 0.0

    def describe(self) -> str:
        image = f", obs/image u8[3,{self.image_size},{self.image_size}]" if self.image_size else ""
        return (
            f"buffer {self.buffer_size} x {self.max_steps}{image}, batch {self.batch_size} x "
            f"{self.chunk_size}, {self.num_workers} producer(s)"
        )


def synthetic_spec(workload: Workload, num_envs: int = 16, fixed_length: bool = True) -> SyntheticSpec:
    """The synthetic source of ``workload``; ``fixed_length=False`` draws lengths in ``[2T/3, T]``."""
    return SyntheticSpec(
        num_envs=min(num_envs, workload.buffer_size // workload.num_workers),
        max_episode_steps=workload.max_steps,
        min_length=workload.max_steps if fixed_length else max(1, 2 * workload.max_steps // 3),
        image_size=workload.image_size,
        work_us_per_step=workload.work_us_per_step,
    )


@dataclass(frozen=True)
class CamerasSpec:
    """The synthetic source with more cameras: ``obs/<name>`` u8[3, S, S] per extra name, each a copy of
    ``obs/image`` (``base.image_size`` must be set). For the ``keys=`` benchmark: one camera of three."""

    base: SyntheticSpec
    extra: tuple[str, ...] = ("wrist_image", "side_image")

    @property
    def num_envs(self) -> int:
        return self.base.num_envs

    @property
    def max_episode_steps(self) -> int:
        return self.base.max_episode_steps

    def fields(self):
        fields = dict(self.base.fields())
        for name in self.extra:
            fields[f"obs/{name}"] = fields["obs/image"]
        return fields

    def build(self, worker_index: int, seed: int) -> _CamerasSource:
        return _CamerasSource(self.base.build(worker_index, seed), self.extra)


class _CamerasSource:
    def __init__(self, inner, extra: tuple[str, ...]) -> None:
        self.inner, self.extra = inner, extra

    def rollout(self, rows, *, attempt: int, should_stop):
        episodes = self.inner.rollout(rows, attempt=attempt, should_stop=should_stop)
        for row, episode in enumerate(episodes or ()):
            for name in self.extra:
                rows["obs", name][row, : episode.length] = rows["obs", "image"][row, : episode.length]
        return episodes

    def close(self) -> None:
        self.inner.close()


def make_engine(
    workload: Workload,
    *,
    num_envs: int = 16,
    fixed_length: bool = True,
    extra_cameras: tuple[str, ...] = (),
    **cfg_overrides,
) -> OnlineDataEngine:
    """A started engine on the synthetic source; by default episodes fill whole rows (length ``T``).

    Fixed-length episodes make every frame of the buffer valid, so TorchRL's trajectory-id slices and the
    engine's eligible windows cover exactly the same frames. ``extra_cameras`` adds image fields
    ``obs/<name>`` beside ``obs/image`` (:class:`CamerasSpec`).
    """
    spec = synthetic_spec(workload, num_envs, fixed_length)
    if extra_cameras:
        spec = CamerasSpec(spec, extra_cameras)
    values = {
        "source": spec,
        "buffer_size": workload.buffer_size,
        "num_workers": workload.num_workers,
        "refill_policy": "manual",
        "initialization_timeout": 600.0,
    }
    values.update(cfg_overrides)
    engine = OnlineDataEngine(OnlineDataEngineCfg(**values))
    engine.start()
    return engine


def flat_tensors(engine: OnlineDataEngine) -> dict[tuple[str, ...], torch.Tensor]:
    """Every stored key as a ``[buffer_size * T, *frame]`` view of the engine's shared memory."""
    buffer = engine.shared_buffer
    rows, steps = buffer.batch_size
    flat = {}
    for key in buffer.keys(include_nested=True, leaves_only=True):
        path = key if isinstance(key, tuple) else (key,)
        tensor = buffer.get(key)
        flat[path] = tensor.view(rows * steps, *tensor.shape[2:])
    return flat


def payload_keys(engine: OnlineDataEngine) -> list[tuple[str, ...]]:
    """The source's payload keys (what the peers' ~2,800 batches/s raw-gather figure copies)."""
    fields = engine.cfg.source.fields()
    return [tuple(name.split("/")) for name in fields]


class RawGather:
    """The ceiling: sampled slices of every key, one ``index_select`` each into preallocated outputs.

    Draws rows and starts uniformly (every window is valid in the fixed-length workload) and does nothing
    else: no eligibility, no versions, no TensorDict. ``windowed=False`` is issue 6's baseline (the flat
    frame indices of the slices, as in peers.md ``c_gather_slices``); ``windowed=True`` copies one whole
    slice per index from an overlapping ``as_strided`` view (the engine does this for small frames).
    """

    def __init__(
        self,
        engine: OnlineDataEngine,
        workload: Workload,
        keys: list[tuple[str, ...]] | None = None,
        windowed: bool = False,
    ) -> None:
        flat = flat_tensors(engine)
        keys = list(flat) if keys is None else keys
        b, c = workload.batch_size, workload.chunk_size
        self._pairs = []
        for key in keys:
            source = flat[key]
            if windowed:
                step = source.stride(0)
                shape = (source.shape[0] - c + 1, c, *source.shape[1:])
                source = source.as_strided(shape, (step, step, *source.stride()[1:]))
                out = torch.empty((b, c, *flat[key].shape[1:]), dtype=source.dtype)
            else:
                out = torch.empty((b * c, *source.shape[1:]), dtype=source.dtype)
            self._pairs.append((source, out))
        self._windowed = windowed
        self._rows, self._steps = engine.shared_buffer.batch_size
        self._batch, self._chunk = b, c
        self._offsets = torch.arange(c)
        self._generator = torch.Generator().manual_seed(1)
        self.bytes_per_batch = sum(out.numel() * out.element_size() for _, out in self._pairs)

    def __call__(self) -> None:
        g = self._generator
        rows = torch.randint(0, self._rows, (self._batch,), generator=g)
        starts = torch.randint(0, self._steps - self._chunk + 1, (self._batch,), generator=g)
        index = rows * self._steps + starts
        if not self._windowed:
            index = (index[:, None] + self._offsets).view(-1)
        for source, out in self._pairs:
            torch.index_select(source, 0, index, out=out)


def make_torchrl_sampler(engine: OnlineDataEngine, workload: Workload) -> Callable[[], object] | None:
    """``ReplayBuffer.sample`` of TorchRL's ``SliceSampler`` on the engine's memory, or ``None``.

    Same keys, same frames: a ``TensorStorage`` wrapping the flat shared tensors plus an ``episode`` id
    per frame (``traj_key``); ``strict_length=True`` and no truncation key, TorchRL's lean slice path.
    """
    # importing torchrl sets the process-wide start method to spawn unless one is set already: pin the
    # platform default first, so the DataLoader workers measured after this keep the context users get
    mp.get_start_method()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="failed to set start method")
            from torchrl.data import ReplayBuffer, TensorStorage
            from torchrl.data.replay_buffers.samplers import SliceSampler
    except ImportError:
        return None
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    flat = flat_tensors(engine)
    rows, steps = engine.shared_buffer.batch_size
    data: dict = {}
    for path, tensor in flat.items():
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = tensor
    data["episode"] = torch.arange(rows * steps) // steps
    storage = TensorStorage(TensorDict(data, batch_size=[rows * steps]))
    sampler = SliceSampler(
        slice_len=workload.chunk_size, traj_key="episode", strict_length=True, truncated_key=None
    )
    buffer = ReplayBuffer(
        storage=storage, sampler=sampler, batch_size=workload.batch_size * workload.chunk_size
    )
    return buffer.sample


class ContinuousPublication:
    """Keep the engine's producers rewriting the buffer for the duration of the ``with`` block.

    A background thread requests a generation and waits for it, then requests the next: producers start
    the next generation as soon as the owner's wait returns (it wakes on completion), so they publish
    back to back. ``episodes_per_s`` is measured from one publication to another, so partial write
    windows bias neither end.
    """

    def __init__(self, engine: OnlineDataEngine) -> None:
        self.engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None
        self.episodes_per_s = float("nan")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.engine.wait_for_generation(self.engine.request_refill(), timeout=600.0)
        except BaseException as error:  # re-raised by __exit__ in the measuring thread
            self._error = error

    def _next_publication(self, timeout_s: float = 60.0) -> tuple[int, float]:
        """Episode count and time of the next publication (polled every millisecond)."""
        first = self.engine.get_stats()["successful_episodes"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            count = self.engine.get_stats()["successful_episodes"]
            if count != first:
                return count, time.perf_counter()
            time.sleep(0.001)
        raise TimeoutError(f"no episode was published within {timeout_s} s")

    def __enter__(self) -> ContinuousPublication:
        self._thread.start()
        self._next_publication()  # producers are running: timing starts at the next publication
        self._first, self._began = self._next_publication()
        return self

    def __exit__(self, *exc) -> None:
        try:
            last, ended = self._next_publication()
            self.episodes_per_s = (last - self._first) / (ended - self._began)
        finally:
            self._stop.set()
            self._thread.join(timeout=600.0)  # it returns once the outstanding generation is in
            if self._error is not None:
                raise self._error
