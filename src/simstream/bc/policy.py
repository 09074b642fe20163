"""The behaviour-cloning policy: an MLP from a short state history and an instruction to an action chunk.

Everything the policy needs to act is inside the module: the observation features, the normalisation
statistics (buffers, fitted once on the first generation of streamed episodes) and the action
representation (joint targets relative to the joints "now", the gripper absolute). The loss and the feature
functions are pure, so they are unit-tested without a simulator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .._validation import require_int

__all__ = [
    "ChunkPolicy",
    "PolicyConfig",
    "absolute_actions",
    "cube_positions",
    "masked_chunk_loss",
    "observation_features",
    "relative_actions",
    "select_slot",
]

STATE_DIM, OBJECTS_DIM, ACTION_DIM, NUM_JOINTS = 23, 21, 8, 7
"""Layouts of the built-in tasks (``simstream.tasks.base``), repeated so this module imports no task code."""
_TCP = slice(16, 19)
_KEPT_STATE = [*range(0, 7), *range(14, 23)]
"""``obs/state`` without the joint velocities (indices 7-13); see :func:`observation_features`."""
_NUM_CUBES = OBJECTS_DIM // 7
_ROBOT_DIM = len(_KEPT_STATE)
FEATURE_DIM = _ROBOT_DIM + OBJECTS_DIM + 3 * _NUM_CUBES
_SLOT_DIM = 7 + 3


def cube_positions(objects: torch.Tensor) -> torch.Tensor:
    """``obs/objects [..., 21]`` (position and quaternion per cube) -> cube positions ``[..., 3, 3]``."""
    return objects.unflatten(-1, (_NUM_CUBES, 7))[..., :3]


def observation_features(state: torch.Tensor, objects: torch.Tensor) -> torch.Tensor:
    """Policy input per frame: the robot's pose, the cube poses and each cube's offset from the gripper.

    Joint velocities are left out on purpose. The expert's next joint target leads the joints by an amount
    that grows with their speed, so a policy that sees the speed learns "slow now, slow next": in closed
    loop one hesitant step then feeds on itself and the arm stalls (the copycat problem of behaviour
    cloning). Without velocities it must read the motion off the scene. Measured on pick_place (50 seeded
    episodes, same training): 90% success without velocities, 86% with; 62% vs 38% with 4-step chunk
    execution. The offsets are what the expert servoes on; giving them saves the MLP a subtraction per cube.

    Args:
        state: ``[..., 23]`` joint positions/velocities, fingers, TCP position and quaternion.
        objects: ``[..., 21]`` position and quaternion of each cube.

    Returns:
        ``[..., 46]`` float32: joint positions, fingers, TCP pose, cube poses, cube offsets.
    """
    offsets = (cube_positions(objects) - state[..., None, _TCP]).flatten(-2)
    return torch.cat([state[..., _KEPT_STATE], objects, offsets], dim=-1)


def relative_actions(actions: torch.Tensor, anchor_state: torch.Tensor) -> torch.Tensor:
    """Joint targets as offsets from the anchor frame's joint positions; the gripper stays absolute.

    Args:
        actions: ``[B, F, 8]`` absolute actions of a chunk.
        anchor_state: ``[B, 23]`` state at the anchor ("now").
    """
    joints = actions[..., :NUM_JOINTS] - anchor_state[:, None, :NUM_JOINTS]
    return torch.cat([joints, actions[..., NUM_JOINTS:]], dim=-1)


def absolute_actions(relative: torch.Tensor, anchor_state: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`relative_actions`; ``anchor_state`` needs only the 7 joint positions first."""
    joints = relative[..., :NUM_JOINTS] + anchor_state[:, None, :NUM_JOINTS]
    return torch.cat([joints, relative[..., NUM_JOINTS:]], dim=-1)


def select_slot(slots: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The instructed cube's slot: ``slots [B, ..., cubes, D]`` averaged with weights ``softmax(logits)``,
    ``logits [B, cubes]`` (from the instruction), -> ``[B, ..., D]``."""
    weights = logits.softmax(-1)
    return (slots * weights.view(len(weights), *[1] * (slots.dim() - 3), -1, 1)).sum(-2)


def masked_target_stats(targets: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation (floored at 1e-3) of ``targets [N, F, 8]`` over unmasked entries."""
    weight = loss_mask[..., None].to(targets.dtype)
    count = weight.sum(0).clamp_min(1.0)
    mean = (targets * weight).sum(0) / count
    var = ((targets - mean) ** 2 * weight).sum(0) / count
    return mean, var.sqrt().clamp_min(1e-3)


def masked_chunk_loss(
    prediction: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Mean squared error over the valid target frames only.

        loss = sum_{b,k} m[b,k] * mean_a (p[b,k,a] - y[b,k,a])^2 / max(1, sum_{b,k} m[b,k])

    Padded targets (``loss_mask`` False: past the episode end) contribute nothing, whatever they hold.

    Args:
        prediction: ``[B, F, A]``.
        target: ``[B, F, A]``.
        loss_mask: ``[B, F]`` bool.
    """
    mask = loss_mask.to(prediction.dtype)
    per_step = (prediction - target.where(loss_mask[..., None], prediction.detach())).pow(2).mean(-1)
    return (per_step * mask).sum() / mask.sum().clamp_min(1.0)


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of the policy (stored with the checkpoint)."""

    history: int = 1
    """Observation frames up to and including "now"."""
    horizon: int = 16
    """Actions predicted per call (the chunk), from "now" on."""
    hidden: int = 512
    """Width of the hidden layers."""
    layers: int = 3
    """Hidden layers of the MLP."""
    text_dim: int = 64
    """Width of the instruction embedding."""

    def __post_init__(self) -> None:
        for name, low, high in (
            ("history", 1, MAX_CONTEXT_STEPS),
            ("horizon", 1, MAX_CONTEXT_STEPS),
            *NETWORK_SIZE_BOUNDS,
        ):
            require_int("PolicyConfig", name, getattr(self, name), low, high)


MAX_CONTEXT_STEPS = 1024
"""Longest ``history`` and ``horizon``: the first layer's width and the head's grow with them (a history of
10**5 frames asked for a 5 GiB network before a single weight was checked)."""
NETWORK_SIZE_BOUNDS = (("hidden", 8, 8192), ("layers", 1, 32), ("text_dim", 8, 4096))
"""Accepted ``(field, low, high)`` of a policy's sizes: past these a network no longer fits the memory
of a machine this demo runs on (``--hidden 10000000`` failed in the allocator after 30 s)."""


class ChunkPolicy(nn.Module):
    """MLP ``(feature history, history mask, instruction embedding) -> normalised relative action chunk``.

    Owns the normalisation buffers ``feature_mean/std [46]`` and ``target_mean/std [F, 8]``; they are
    identity until :meth:`fit_normalizer` runs and travel in ``state_dict``. Padded history frames enter
    as zeros (after normalisation) with a 0 in the mask input, exactly as during training.
    """

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        history, horizon = config.history, config.horizon
        self.register_buffer("feature_mean", torch.zeros(FEATURE_DIM))
        self.register_buffer("feature_std", torch.ones(FEATURE_DIM))
        self.register_buffer("target_mean", torch.zeros(horizon, ACTION_DIM))
        self.register_buffer("target_std", torch.ones(horizon, ACTION_DIM))
        # Language-conditioned object selection: the instruction picks a soft mix of the cube slots, whose
        # pose and offset from the gripper enter the MLP as extra inputs ("the cube the text talks about").
        self.select = nn.Linear(config.text_dim, _NUM_CUBES)
        width = history * (FEATURE_DIM + _SLOT_DIM + 1) + config.text_dim
        self.hidden = nn.ModuleList()
        for _ in range(config.layers):
            self.hidden.append(nn.Linear(width, config.hidden))
            width = config.hidden
        self.norms = nn.ModuleList(nn.LayerNorm(config.hidden) for _ in range(config.layers))
        # FiLM: the instruction scales and shifts every hidden layer, so units can specialise per cube.
        self.film = nn.Linear(config.text_dim, 2 * config.layers * config.hidden)
        nn.init.zeros_(self.film.weight)
        nn.init.zeros_(self.film.bias)
        self.head = nn.Linear(width, horizon * ACTION_DIM)

    @torch.no_grad()
    def fit_normalizer(
        self, features: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor
    ) -> None:
        """Set the normalisation statistics from valid frames only (``std`` floored at 1e-3).

        Args:
            features: ``[N, H, 46]`` with ``valid [N, H]``.
            targets: ``[N, F, 8]`` relative action chunks with ``loss_mask [N, F]``.
        """
        frames = features[valid]
        self.feature_mean.copy_(frames.mean(0))
        self.feature_std.copy_(frames.std(0).clamp_min(1e-3))
        mean, std = masked_target_stats(targets, loss_mask)
        self.target_mean.copy_(mean)
        self.target_std.copy_(std)

    def normalize_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Relative actions ``[B, F, 8]`` -> the network's output space."""
        return (targets - self.target_mean) / self.target_std

    def forward(self, features: torch.Tensor, mask: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Normalised relative action chunk ``[B, F, 8]``.

        Args:
            features: ``[B, H, 46]`` raw features (padding arbitrary).
            mask: ``[B, H]`` bool, True on real frames.
            text: ``[B, text_dim]`` instruction embeddings.
        """
        normed = (features - self.feature_mean) / self.feature_std
        slots = torch.cat(
            [
                normed[..., _ROBOT_DIM : _ROBOT_DIM + OBJECTS_DIM].unflatten(-1, (_NUM_CUBES, 7)),
                normed[..., _ROBOT_DIM + OBJECTS_DIM :].unflatten(-1, (_NUM_CUBES, 3)),
            ],
            dim=-1,
        )
        selected = select_slot(slots, self.select(text))
        inputs = torch.cat([normed, selected], dim=-1) * mask[..., None]
        inputs = torch.cat([inputs, mask[..., None].to(normed.dtype)], dim=-1).flatten(1)
        x = torch.cat([inputs, text], dim=-1)
        film = self.film(text).view(-1, len(self.hidden), 2, self.config.hidden)
        for layer, (linear, norm) in enumerate(zip(self.hidden, self.norms)):
            x = norm(linear(x)) * (1.0 + film[:, layer, 0]) + film[:, layer, 1]
            x = nn.functional.gelu(x)
        return self.head(x).view(-1, self.config.horizon, ACTION_DIM)

    @torch.no_grad()
    def act(self, features: torch.Tensor, mask: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Absolute action chunk ``[B, F, 8]`` (joint targets, gripper) for the current observation."""
        relative = self.forward(features, mask, text) * self.target_std + self.target_mean
        return absolute_actions(relative, features[:, -1, :NUM_JOINTS])

    def config_dict(self) -> dict[str, int]:
        """The constructor arguments, for a checkpoint."""
        return asdict(self.config)
