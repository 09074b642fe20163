"""Networks and observation statistics shared by the learner and the collector.

The collector rebuilds the same :class:`ActorCritic` from its sizes and receives, as one flat vector
(:func:`pack_policy` / :func:`unpack_policy`), the actor, the critic (needed to bootstrap truncated
episodes) and the normaliser statistics, all from one policy version.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributions import Normal

__all__ = ["ActorCritic", "ObsNormalizer", "pack_policy", "packed_size", "unpack_policy"]

_OBS_CLIP = 10.0


def _mlp(inputs: int, hidden: Sequence[int], outputs: int, last_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = inputs
    for size in hidden:
        layer = nn.Linear(width, size)
        nn.init.orthogonal_(layer.weight, math.sqrt(2))
        nn.init.zeros_(layer.bias)
        layers += [layer, nn.Tanh()]
        width = size
    head = nn.Linear(width, outputs)
    nn.init.orthogonal_(head.weight, last_gain)
    nn.init.zeros_(head.bias)
    return nn.Sequential(*layers, head)


class ActorCritic(nn.Module):
    """A Gaussian policy (state-independent log std) and a separate value network."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_sizes: Sequence[int], init_log_std: float) -> None:
        super().__init__()
        self.actor = _mlp(obs_dim, hidden_sizes, act_dim, last_gain=0.01)
        self.critic = _mlp(obs_dim, hidden_sizes, 1, last_gain=1.0)
        self.log_std = nn.Parameter(torch.full((act_dim,), float(init_log_std)))

    def distribution(self, obs: torch.Tensor) -> Normal:
        """The action distribution for normalised observations ``[..., obs_dim]``."""
        mean = self.actor(obs)
        return Normal(mean, self.log_std.expand_as(mean).exp())

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """State values ``[...]`` for normalised observations ``[..., obs_dim]``."""
        return self.critic(obs).squeeze(-1)


class ObsNormalizer:
    """Running mean and variance of observations (parallel Welford merge, float64).

    ``normalize(x) = clip((x - mean) / sqrt(var + 1e-8), -10, 10)``; disabled, it returns ``x``.
    """

    def __init__(self, obs_dim: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.mean = torch.zeros(obs_dim, dtype=torch.float64)
        self.var = torch.ones(obs_dim, dtype=torch.float64)
        self.count = 1e-4

    def update(self, batch: torch.Tensor) -> None:
        """Fold a batch ``[..., obs_dim]`` into the statistics."""
        if not self.enabled:
            return
        flat = batch.reshape(-1, self.mean.numel()).double()
        n = flat.shape[0]
        if n == 0:
            return
        batch_mean, batch_var = flat.mean(0), flat.var(0, unbiased=False)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.var = (self.var * self.count + batch_var * n + delta.square() * self.count * n / total) / total
        self.count = total

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return obs
        scaled = (obs - self.mean.to(obs.dtype)) / torch.sqrt(self.var.to(obs.dtype) + 1e-8)
        return scaled.clamp(-_OBS_CLIP, _OBS_CLIP)

    def state_dict(self) -> dict:
        return {
            "mean": self.mean.clone(),
            "var": self.var.clone(),
            "count": self.count,
            "enabled": self.enabled,
        }

    def load_state_dict(self, state: dict) -> None:
        # on the CPU whatever device the checkpoint was mapped to: the statistics live there (batches
        # arrive on the CPU, pack_policy concatenates them with CPU copies of the weights)
        self.mean = state["mean"].detach().to("cpu", torch.float64, copy=True)
        self.var = state["var"].detach().to("cpu", torch.float64, copy=True)
        self.count = float(state["count"])
        self.enabled = bool(state["enabled"])


def packed_size(model: ActorCritic, obs_dim: int) -> int:
    """Length of the vector :func:`pack_policy` produces."""
    return sum(p.numel() for p in model.parameters()) + 2 * obs_dim


def pack_policy(model: ActorCritic, normalizer: ObsNormalizer) -> torch.Tensor:
    """Every parameter, then the normaliser mean and variance, as one float32 vector."""
    parts = [p.detach().reshape(-1).float().cpu() for p in model.parameters()]
    parts += [normalizer.mean.float(), normalizer.var.float()]
    return torch.cat(parts)


def unpack_policy(vector: torch.Tensor, model: ActorCritic, normalizer: ObsNormalizer) -> None:
    """Load a :func:`pack_policy` vector into ``model`` and ``normalizer`` (collector side)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(vector[offset : offset + n].view_as(p))
            offset += n
    dim = normalizer.mean.numel()
    normalizer.mean = vector[offset : offset + dim].double().clone()
    normalizer.var = vector[offset + dim : offset + 2 * dim].double().clone()
