"""PyTorch data-loading on top of the engine: ``OnlineDataset`` and chunk-size samplers."""

from .chunk_sizes import ChunkSizeSampler, GMMChunkSampler, UniformChunkSampler
from .dataset import OnlineDataset
from .loader_context import loader_context

__all__ = ["ChunkSizeSampler", "GMMChunkSampler", "OnlineDataset", "UniformChunkSampler", "loader_context"]
