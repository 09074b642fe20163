"""Copy sampled frames out of the shared buffer: one ``index_select`` per key.

``index_select`` of flattened frame indices is the memory-bus-bound way to gather runs of frames (an
element-wise advanced-indexing gather was 14x slower on 64x64 images); writing into a caller-provided
output avoids first-touch page faults of a fresh allocation for large batches.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ..buffer.storage import TrajectoryStorage

__all__ = ["BatchGatherer"]


class BatchGatherer:
    """Gathers frames of every stored key into a new (or given) TensorDict ``[n, L]``."""

    def __init__(self, storage: TrajectoryStorage) -> None:
        self._entries = [(spec.path, storage.flat[spec.path], spec.frame_shape) for spec in storage.specs]

    def gather(self, frames: torch.Tensor, out: TensorDict | None = None) -> TensorDict:
        """Copy ``frames`` (an ``[n, L]`` tensor of flat frame indices) of every key.

        Args:
            frames: Flat frame indices; the padding frame index yields padding values.
            out: Optional TensorDict ``[n, L]`` with the buffer's keys to write into instead of allocating.

        Returns:
            A TensorDict ``[n, L]`` that owns its memory (``out`` when given).
        """
        n, length = frames.shape
        flat_index = frames.reshape(-1)
        if out is not None:
            for path, source, _ in self._entries:
                target = out.get(path)
                torch.index_select(source, 0, flat_index, out=target.view(n * length, *target.shape[2:]))
            return out
        data: dict = {}
        for path, source, shape in self._entries:
            values = torch.index_select(source, 0, flat_index).view(n, length, *shape)
            node = data
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = values
        return TensorDict(data, batch_size=[n, length])
