"""From a sampled context batch to the policy's tensors: features, masks, targets and instruction embeddings.

``engine.sample_batch_with_context(B, H, F)`` returns ``[B, H + F - 1]`` frames; position ``H - 1`` is the
anchor ("now"). The policy reads the ``H`` frames up to the anchor and learns the ``F`` actions from it on,
relative to the anchor's joint positions, weighted by ``loss_mask`` (False past the episode's end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .policy import observation_features, relative_actions
from .text import HashedTextEmbedding

if TYPE_CHECKING:
    from tensordict import TensorDict

    from simstream.language import SharedLanguageRegistry

__all__ = ["ContextBatch", "InstructionTable", "context_batch"]


@dataclass
class ContextBatch:
    """The tensors of one training step."""

    features: torch.Tensor
    """``[B, H, 46]`` observation features; zeros where ``history_mask`` is False."""
    history_mask: torch.Tensor
    """``[B, H]`` bool: real (not padded) history frames."""
    targets: torch.Tensor
    """``[B, F, 8]`` actions relative to the anchor's joints (gripper absolute)."""
    loss_mask: torch.Tensor
    """``[B, F]`` bool: targets inside the episode."""
    text: torch.Tensor
    """``[B, text_dim]`` embedding of the episode's task instruction."""

    def __len__(self) -> int:
        return self.features.shape[0]

    def inputs(self) -> tuple:
        """The policy's arguments: ``(features, history_mask, text)``."""
        return self.features, self.history_mask, self.text

    def apply(self, fn) -> ContextBatch:
        """A copy with ``fn`` applied to every tensor (pinning, moving to a device)."""
        return ContextBatch(
            fn(self.features), fn(self.history_mask), fn(self.targets), fn(self.loss_mask), fn(self.text)
        )


class InstructionTable:
    """Embeddings of the engine's task texts by ``task_index``, extended as producers intern new texts.

    Owns a ``[num_tasks, dim]`` table; the registry is append-only, so a row never changes once filled.
    """

    def __init__(self, registry: SharedLanguageRegistry, embedding: HashedTextEmbedding) -> None:
        self.registry = registry
        self.embedding = embedding
        self.table = torch.zeros(0, embedding.dim)

    def lookup(self, task_index: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[..., dim]`` of valid (``>= 0``) task indices."""
        needed = int(task_index.max()) + 1 if task_index.numel() else 0
        if needed > self.table.shape[0]:
            new = torch.arange(self.table.shape[0], needed)
            texts = self.registry.resolve(new, kind="task")
            self.table = torch.cat([self.table, self.embedding(list(texts))])
        return self.table[task_index]


def context_batch(batch: TensorDict, history: int, instructions: InstructionTable) -> ContextBatch:
    """Split a ``[B, H + F - 1]`` context batch into history inputs and the action-chunk targets.

    Args:
        batch: From ``engine.sample_batch_with_context(B, history, horizon)``.
        history: ``H``, the history length the batch was sampled with.
        instructions: Resolves ``task_index`` to embeddings.
    """
    state, objects = batch["obs", "state"], batch["obs", "objects"]
    features = observation_features(state[:, :history], objects[:, :history])
    anchor = history - 1
    history_mask = batch["valid"][:, :history]
    targets = relative_actions(batch["actions"][:, anchor:], state[:, anchor])
    text = instructions.lookup(batch["task_index"][:, anchor])
    return ContextBatch(
        features=features * history_mask[..., None],
        history_mask=history_mask,
        targets=targets,
        loss_mask=batch["loss_mask"][:, anchor:],
        text=text,
    )
