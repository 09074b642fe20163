"""The visuomotor policy of ``simstream demo --vision``: camera frames, proprioception and language only.

The policy never sees an object pose. Its input per frame is one ``uint8 [3, S, S]`` image per camera
(``obs/images/<camera>``) and the robot's proprioception (joint positions, finger openings, gripper pose:
``obs/state`` without the joint velocities, see :func:`simstream.bc.policy.observation_features`); the
instruction enters as its hashed embedding. :func:`policy_keys` is what the trainer asks the engine to copy,
so ``obs/objects`` never even leaves shared memory on the training side.

Each camera has its own small conv encoder (4 convolutions, GroupNorm, the instruction scaling and shifting
the third layer's channels by FiLM, so the encoder can look for "the red cube") ending in a spatial softmax:
``K`` keypoints, the expected image coordinates of ``K`` feature maps, which is what a reaching policy needs
from a 64 x 64 image. Training applies DrQ's random shift (pad by ``shift`` pixels, replicate the border,
crop back at a random offset per sample).

Optionally (``object_dim > 0``, the demo's ``--object-aux-weight``) a small auxiliary head predicts the
cubes' positions from the same camera keypoints and proprioception. The true cube positions are a training
target only, as the actions are: they never enter :meth:`VisionPolicy.forward`, and evaluation never reads
them. Supervising where the cubes are teaches the encoders to find them much sooner than the action loss
alone does. With ``object_input`` the action head also reads the head's estimate (made from the pixels), its
offsets from the gripper and the instructed cube's slot, as the state policy reads the true poses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._validation import require, require_int
from .camera_source import image_key
from .policy import (
    _KEPT_STATE,
    _NUM_CUBES,
    _TCP,
    ACTION_DIM,
    MAX_CONTEXT_STEPS,
    NETWORK_SIZE_BOUNDS,
    NUM_JOINTS,
    absolute_actions,
    cube_positions,
    masked_target_stats,
    relative_actions,
    select_slot,
)

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .data import InstructionTable

__all__ = [
    "ESTIMATE_DIM",
    "OBJECT_DIM",
    "PROPRIO_DIM",
    "VisionBatch",
    "VisionPolicy",
    "VisionPolicyConfig",
    "object_positions",
    "policy_keys",
    "proprio_features",
    "random_shift",
    "vision_context_batch",
]

PROPRIO_DIM = len(_KEPT_STATE)
"""Joint positions (7), finger openings (2), gripper position (3) and quaternion (4)."""


_PROPRIO_TCP = slice(_KEPT_STATE.index(_TCP.start), _KEPT_STATE.index(_TCP.start) + 3)
"""The gripper (TCP) position inside :func:`proprio_features`."""


def _gripper_offsets(positions: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
    """Cube positions ``[B, 9]`` -> each cube's offset from the gripper in the frame ``proprio [B, 16]``
    (the same subtraction for the fitted statistics and for the estimate the action head reads)."""
    return (positions.unflatten(-1, (_NUM_CUBES, 3)) - proprio[:, None, _PROPRIO_TCP]).flatten(-2)


def proprio_features(state: torch.Tensor) -> torch.Tensor:
    """``obs/state [..., 23]`` -> proprioception ``[..., 16]`` (joint velocities left out, as in the MLP)."""
    return state[..., _KEPT_STATE]


MAX_CHANNELS = 512
"""Most channels of the image encoder's convolutions (``--channels 100000`` failed in the allocator)."""
OBJECT_DIM = 3 * _NUM_CUBES
"""Auxiliary target: the position (3) of each of the three cubes, in ``obs/objects`` order (9 values)."""


ESTIMATE_DIM = 2 * OBJECT_DIM + 6
"""Extra action-head inputs with ``object_input``: estimated cube positions (9), their offsets from the
gripper (9), and the instructed cube's position and offset (6)."""


def object_positions(objects: torch.Tensor) -> torch.Tensor:
    """``obs/objects [..., 21]`` (position and quaternion per cube) -> cube positions ``[..., 9]``."""
    return cube_positions(objects).flatten(-2)


def policy_keys(cameras: tuple[str, ...]) -> list[str]:
    """The stored keys a vision training step reads as inputs: images, ``obs/state``, ``task_index``, and
    ``actions`` (the targets)."""
    return [*(image_key(camera) for camera in cameras), "obs/state", "actions", "task_index"]


def random_shift(images: torch.Tensor, pad: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """DrQ's augmentation: shift each image by up to ``pad`` pixels, filling with the replicated border.

    Args:
        images: ``[N, C, S, S]`` (any dtype; uint8 stays uint8).
        pad: Largest shift in pixels (0 returns ``images``).
        generator: RNG of the shifts (one ``(dy, dx)`` in ``[0, 2 * pad]`` per image).

    Returns:
        ``[N, C, S, S]``: ``out[n, :, y, x] = padded[n, :, y + dy_n, x + dx_n]``.
    """
    if pad == 0:
        return images
    n, _, height, width = images.shape
    padded = nn.functional.pad(images.float(), (pad, pad, pad, pad), mode="replicate").to(images.dtype)
    offsets = torch.randint(0, 2 * pad + 1, (2, n), generator=generator).tolist()
    out = torch.empty_like(images)
    # one slice copy per image: a batched gather (advanced indexing) cost 4x as much, and the whole
    # training step 1.33x (95 against 71 ms at batch 64, two 64 x 64 cameras, one thread)
    for k, (dy, dx) in enumerate(zip(*offsets)):
        out[k] = padded[k, :, dy : dy + height, dx : dx + width]
    return out


@dataclass(frozen=True)
class VisionPolicyConfig:
    """Shape of the vision policy (stored with the checkpoint)."""

    cameras: tuple[str, ...] = ("front", "wrist")
    """Cameras the policy reads, in order."""
    image_size: int = 64
    """Side of the square camera frames."""
    history: int = 1
    """Observation frames up to and including "now"."""
    horizon: int = 16
    """Actions predicted per call (the chunk)."""
    hidden: int = 256
    """Width of the MLP head."""
    layers: int = 3
    """Hidden layers of the MLP head."""
    text_dim: int = 64
    """Width of the instruction embedding."""
    channels: int = 16
    """Channels of the conv encoders."""
    keypoints: int = 32
    """Spatial-softmax keypoints per camera (each gives 2 coordinates)."""
    shift: int = 4
    """Random-shift augmentation during training, in pixels (0: none)."""
    object_dim: int = 0
    """Outputs of the auxiliary cube-position head (0: no head; :data:`OBJECT_DIM` with one). A training
    target only: never an input of the policy."""
    object_input: bool = False
    """Feed the auxiliary head's own estimate of the cube positions (computed from the camera features),
    their offsets from the gripper and the instructed cube's slot to the action head, as the state policy
    reads the true ones. Needs the head (``object_dim > 0``); the true positions stay a training target."""

    def __post_init__(self) -> None:
        from simstream.tasks import CAMERAS

        object.__setattr__(self, "cameras", tuple(self.cameras))  # a checkpoint stores a list
        cameras = self.cameras
        require(
            bool(cameras) and set(cameras) <= set(CAMERAS) and len(set(cameras)) == len(cameras),
            "VisionPolicyConfig", "cameras", f"a nonempty tuple of distinct cameras from {CAMERAS}", cameras,
        )  # fmt: skip
        require_int("VisionPolicyConfig", "image_size", self.image_size, 16, 512)
        for name, low, high in (("history", 1, MAX_CONTEXT_STEPS), ("horizon", 1, MAX_CONTEXT_STEPS),
                                *NETWORK_SIZE_BOUNDS,
                                ("channels", 8, MAX_CHANNELS), ("keypoints", 1, 1024)):  # fmt: skip
            require_int("VisionPolicyConfig", name, getattr(self, name), low, high)
        require_int("VisionPolicyConfig", "shift", self.shift, 0, self.image_size // 4)
        require(
            self.object_dim in (0, OBJECT_DIM), "VisionPolicyConfig", "object_dim",
            f"0 (no auxiliary head) or {OBJECT_DIM} (the cube positions)", self.object_dim,
        )  # fmt: skip
        require(
            isinstance(self.object_input, bool), "VisionPolicyConfig", "object_input", "a bool",
            self.object_input,
        )  # fmt: skip
        require(
            not self.object_input or self.object_dim > 0, "VisionPolicyConfig", "object_input",
            f"False unless object_dim is {OBJECT_DIM} (the auxiliary head)", self.object_input,
        )  # fmt: skip


class CameraEncoder(nn.Module):
    """``[N, 3, S, S]`` image in ``[-0.5, 0.5]``, instruction ``[N, text_dim]`` -> ``[N, 2K]`` keypoints."""

    def __init__(self, channels: int, keypoints: int, text_dim: int) -> None:
        super().__init__()
        c = channels
        self.convs = nn.ModuleList(
            [nn.Conv2d(3, c, 3, 2, 1), nn.Conv2d(c, c, 3, 2, 1), nn.Conv2d(c, c, 3, 1, 1)]
        )
        self.norms = nn.ModuleList(nn.GroupNorm(8 if c % 8 == 0 else 1, c) for _ in range(3))
        self.film = nn.Linear(text_dim, 2 * c)
        nn.init.zeros_(self.film.weight)
        nn.init.zeros_(self.film.bias)
        self.keypoint_maps = nn.Conv2d(c, keypoints, 3, 1, 1)
        self.log_temperature = nn.Parameter(torch.zeros(()))

    def forward(self, images: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = images
        for index, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            x = norm(conv(x))
            if index == 2:
                scale, shift = self.film(text).chunk(2, dim=-1)
                x = x * (1.0 + scale[..., None, None]) + shift[..., None, None]
            x = nn.functional.gelu(x)
        maps = self.keypoint_maps(x).float()  # keypoint coordinates in float32, also under autocast
        n, k, height, width = maps.shape
        attention = (maps.flatten(2) * self.log_temperature.exp()).softmax(-1).view(n, k, height, width)
        ys = torch.linspace(-1.0, 1.0, height, device=maps.device)
        xs = torch.linspace(-1.0, 1.0, width, device=maps.device)
        return torch.cat([(attention.sum(3) * ys).sum(-1), (attention.sum(2) * xs).sum(-1)], dim=-1)


class VisionPolicy(nn.Module):
    """``(camera frames, proprioception, history mask, instruction) -> normalised relative action chunk``.

    Owns one :class:`CameraEncoder` per camera, an MLP head with FiLM (as :class:`ChunkPolicy`) and the
    normalisation buffers ``proprio_mean/std [16]`` and ``target_mean/std [F, 8]`` (identity until
    :meth:`fit_normalizer`); with the auxiliary head also ``object_mean/std [9]`` and the head
    ``object_head``, and with ``object_input`` ``offset_mean/std [9]`` and the instruction's cube selection
    ``select``. Padded history frames enter as zeros with a 0 in the mask input.
    """

    def __init__(self, config: VisionPolicyConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("proprio_mean", torch.zeros(PROPRIO_DIM))
        self.register_buffer("proprio_std", torch.ones(PROPRIO_DIM))
        self.register_buffer("target_mean", torch.zeros(config.horizon, ACTION_DIM))
        self.register_buffer("target_std", torch.ones(config.horizon, ACTION_DIM))
        self.encoders = nn.ModuleDict(
            {cam: CameraEncoder(config.channels, config.keypoints, config.text_dim) for cam in config.cameras}
        )
        frame_dim = PROPRIO_DIM + 2 * config.keypoints * len(config.cameras) + 1
        width = config.history * frame_dim + config.text_dim + (ESTIMATE_DIM if config.object_input else 0)
        self.hidden = nn.ModuleList()
        for _ in range(config.layers):
            self.hidden.append(nn.Linear(width, config.hidden))
            width = config.hidden
        self.norms = nn.ModuleList(nn.LayerNorm(config.hidden) for _ in range(config.layers))
        self.film = nn.Linear(config.text_dim, 2 * config.layers * config.hidden)
        nn.init.zeros_(self.film.weight)
        nn.init.zeros_(self.film.bias)
        self.head = nn.Linear(width, config.horizon * ACTION_DIM)
        if config.object_dim:
            self.register_buffer("object_mean", torch.zeros(config.object_dim))
            self.register_buffer("object_std", torch.ones(config.object_dim))
            self.object_head = nn.Sequential(
                nn.Linear(config.history * frame_dim, config.hidden), nn.GELU(),
                nn.Linear(config.hidden, config.object_dim),
            )  # fmt: skip
        if config.object_input:
            self.register_buffer("offset_mean", torch.zeros(config.object_dim))
            self.register_buffer("offset_std", torch.ones(config.object_dim))
            self.select = nn.Linear(config.text_dim, _NUM_CUBES)

    @torch.no_grad()
    def fit_normalizer(
        self,
        proprio: torch.Tensor,
        valid: torch.Tensor,
        targets: torch.Tensor,
        loss_mask: torch.Tensor,
        object_targets: torch.Tensor | None = None,
    ) -> None:
        """Normalisation statistics from valid frames and targets only (``std`` floored at 1e-3); with an
        auxiliary head also of its targets ``object_targets [B, object_dim]``."""
        frames = proprio[valid]
        self.proprio_mean.copy_(frames.mean(0))
        self.proprio_std.copy_(frames.std(0).clamp_min(1e-3))
        mean, std = masked_target_stats(targets, loss_mask)
        self.target_mean.copy_(mean)
        self.target_std.copy_(std)
        if self.config.object_dim:
            require(
                object_targets is not None, "VisionPolicy.fit_normalizer", "object_targets",
                f"a [B, {self.config.object_dim}] tensor (the policy has an auxiliary head)", object_targets,
            )  # fmt: skip
            self.object_mean.copy_(object_targets.mean(0))
            self.object_std.copy_(object_targets.std(0).clamp_min(1e-3))
        if self.config.object_input:
            offsets = _gripper_offsets(object_targets, proprio[:, -1])
            self.offset_mean.copy_(offsets.mean(0))
            self.offset_std.copy_(offsets.std(0).clamp_min(1e-3))

    def normalize_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Relative actions ``[B, F, 8]`` -> the network's output space."""
        return (targets - self.target_mean) / self.target_std

    def object_loss(self, prediction: torch.Tensor, object_targets: torch.Tensor) -> torch.Tensor:
        """Mean squared error of the auxiliary head on normalised cube positions ``[B, object_dim]``.

        Args:
            prediction: The auxiliary head's output, from :meth:`forward_with_objects`.
            object_targets: Cube positions at the anchor frame (:func:`object_positions`).
        """
        return (prediction - (object_targets - self.object_mean) / self.object_std).pow(2).mean()

    def forward(
        self, images: dict[str, torch.Tensor], proprio: torch.Tensor, mask: torch.Tensor, text: torch.Tensor
    ) -> torch.Tensor:
        """Normalised relative action chunk ``[B, F, 8]``.

        Args:
            images: camera -> ``uint8 [B, H, 3, S, S]``; shifted at random in training mode.
            proprio: ``[B, H, 16]`` raw proprioception.
            mask: ``[B, H]`` bool, True on real frames.
            text: ``[B, text_dim]`` instruction embeddings.
        """
        return self._run(images, proprio, mask, text, with_objects=False)[0]

    def forward_with_objects(
        self, images: dict[str, torch.Tensor], proprio: torch.Tensor, mask: torch.Tensor, text: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` and the auxiliary head's cube positions ``[B, object_dim]`` (normalised, for
        :meth:`object_loss`), from one pass; same arguments. Needs ``object_dim > 0``."""
        if not self.config.object_dim:
            raise ValueError("VisionPolicy.forward_with_objects needs a policy with object_dim > 0")
        return self._run(images, proprio, mask, text, with_objects=True)

    def _run(
        self,
        images: dict[str, torch.Tensor],
        proprio: torch.Tensor,
        mask: torch.Tensor,
        text: torch.Tensor,
        with_objects: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, history = mask.shape
        frame_text = text.repeat_interleave(history, dim=0)
        parts = [(proprio - self.proprio_mean) / self.proprio_std]
        for camera, encoder in self.encoders.items():
            frames = images[camera].flatten(0, 1)
            if self.training:
                frames = random_shift(frames, self.config.shift)
            frames = frames.to(text.dtype) / 255.0 - 0.5
            parts.append(encoder(frames, frame_text).view(batch, history, -1))
        inputs = torch.cat(parts, dim=-1) * mask[..., None]
        features = torch.cat([inputs, mask[..., None].to(text.dtype)], dim=-1).flatten(1)
        x = torch.cat([features, text], dim=-1)
        # one pass of the auxiliary head serves both its loss and (detached) the action head's inputs
        objects = self.object_head(features) if with_objects or self.config.object_input else None
        if self.config.object_input:
            x = torch.cat([x, self._estimate_inputs(objects, proprio[:, -1], text)], dim=-1)
        film = self.film(text).view(-1, len(self.hidden), 2, self.config.hidden)
        for layer, (linear, norm) in enumerate(zip(self.hidden, self.norms)):
            x = nn.functional.gelu(norm(linear(x)) * (1.0 + film[:, layer, 0]) + film[:, layer, 1])
        return self.head(x).view(-1, self.config.horizon, ACTION_DIM), objects

    def _estimate_inputs(
        self, objects: torch.Tensor, anchor_proprio: torch.Tensor, text: torch.Tensor
    ) -> torch.Tensor:
        """The head's extra inputs with ``object_input``: the estimated cube positions, their offsets from
        the gripper at the anchor frame, and the instructed cube's slot (both, normalised), ``[B, 24]``.

        Args:
            objects: The auxiliary head's output (normalised positions ``[B, object_dim]``).

        The estimate is detached: the action loss reads it but only the auxiliary loss trains it, so it
        stays an estimate of where the cubes are.
        """
        estimate = objects.detach().float()
        positions = estimate * self.object_std + self.object_mean
        offsets = (_gripper_offsets(positions, anchor_proprio.float()) - self.offset_mean) / self.offset_std
        slots = torch.cat(
            [estimate.unflatten(-1, (_NUM_CUBES, 3)), offsets.unflatten(-1, (_NUM_CUBES, 3))], -1
        )
        selected = select_slot(slots, self.select(text).float())
        return torch.cat([estimate, offsets, selected], dim=-1).to(text.dtype)

    @torch.no_grad()
    def act(
        self, images: dict[str, torch.Tensor], proprio: torch.Tensor, mask: torch.Tensor, text: torch.Tensor
    ) -> torch.Tensor:
        """Absolute action chunk ``[B, F, 8]`` (joint targets, gripper) for the current observation."""
        relative = self.forward(images, proprio, mask, text) * self.target_std + self.target_mean
        return absolute_actions(relative, proprio[:, -1, :NUM_JOINTS])

    def config_dict(self) -> dict[str, object]:
        """The constructor arguments, for a checkpoint."""
        return asdict(self.config)


@dataclass
class VisionBatch:
    """The tensors of one vision training step; :meth:`inputs` is exactly what the policy reads."""

    images: dict[str, torch.Tensor]
    """camera -> ``uint8 [B, H, 3, S, S]``; zeros where ``history_mask`` is False."""
    proprio: torch.Tensor
    """``[B, H, 16]`` proprioception; zeros where ``history_mask`` is False."""
    history_mask: torch.Tensor
    """``[B, H]`` bool: real (not padded) history frames."""
    targets: torch.Tensor
    """``[B, F, 8]`` actions relative to the anchor's joints (gripper absolute)."""
    loss_mask: torch.Tensor
    """``[B, F]`` bool: targets inside the episode."""
    text: torch.Tensor
    """``[B, text_dim]`` embedding of the episode's task instruction."""
    object_targets: torch.Tensor | None = None
    """``[B, 9]`` cube positions at the anchor frame: the auxiliary head's target (never an input); ``None``
    unless the batch was built with ``objects=True``."""

    def __len__(self) -> int:
        return self.proprio.shape[0]

    def inputs(self) -> tuple:
        """The policy's arguments: ``(images, proprio, history_mask, text)``."""
        return self.images, self.proprio, self.history_mask, self.text

    def apply(self, fn) -> VisionBatch:
        """A copy with ``fn`` applied to every tensor (pinning, moving to a device)."""
        return VisionBatch(
            images={camera: fn(value) for camera, value in self.images.items()},
            proprio=fn(self.proprio), history_mask=fn(self.history_mask), targets=fn(self.targets),
            loss_mask=fn(self.loss_mask), text=fn(self.text),
            object_targets=None if self.object_targets is None else fn(self.object_targets),
        )  # fmt: skip


def vision_context_batch(
    batch: TensorDict,
    history: int,
    instructions: InstructionTable,
    cameras: tuple[str, ...],
    *,
    objects: bool = False,
) -> VisionBatch:
    """Split a ``[B, H + F - 1]`` context batch into the vision policy's inputs and its chunk targets.

    The inputs are built from :func:`policy_keys` only (plus ``valid`` and ``loss_mask``): whatever else the
    batch holds, the cube poses included, cannot reach the policy. ``objects=True`` also reads the cube
    positions at the anchor frame into ``object_targets``, the auxiliary head's training target.
    """
    anchor = history - 1
    history_mask = batch["valid"][:, :history]
    state = batch["obs", "state"]
    images = {}
    for camera in cameras:
        frames = batch.get(tuple(image_key(camera).split("/")))[:, :history]
        images[camera] = frames * history_mask[..., None, None, None].to(frames.dtype)
    return VisionBatch(
        images=images,
        proprio=proprio_features(state[:, :history]) * history_mask[..., None],
        history_mask=history_mask,
        targets=relative_actions(batch["actions"][:, anchor:], state[:, anchor]),
        loss_mask=batch["loss_mask"][:, anchor:],
        text=instructions.lookup(batch["task_index"][:, anchor]),
        object_targets=object_positions(batch["obs", "objects"][:, anchor]) if objects else None,
    )
