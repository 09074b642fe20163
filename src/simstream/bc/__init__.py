"""Behaviour cloning from the live stream: the policy, its text embedding, training, evaluation, report.

``simstream demo`` runs :func:`run_demo` (``--vision``: :class:`VisionPolicy` from camera frames,
proprioception and language); ``simstream eval`` reloads a checkpoint with
:func:`load_checkpoint` and runs :func:`evaluate_policy`. Importing this package imports torch but no
simulator; MuJoCo is loaded when an evaluation or the engine's producers start.

Examples:
    >>> from simstream.bc import ChunkPolicy, HashedTextEmbedding, PolicyConfig
    >>> policy = ChunkPolicy(PolicyConfig(history=2, horizon=8))
    >>> HashedTextEmbedding(64)(["pick up the red cube and place it in the bin"]).shape
    torch.Size([1, 64])
"""

from __future__ import annotations

from .checkpoint import PolicyCheckpoint, load_checkpoint, save_checkpoint
from .config import QUICK_OVERRIDES, VISION_OVERRIDES, DemoConfig
from .demo import run_demo
from .evaluate import EvalResult, RolloutConfig, eval_seeds, evaluate_policy
from .policy import ChunkPolicy, PolicyConfig, masked_chunk_loss, observation_features
from .text import HashedTextEmbedding
from .vision import VisionPolicy, VisionPolicyConfig, policy_keys, random_shift

__all__ = [
    "QUICK_OVERRIDES",
    "VISION_OVERRIDES",
    "ChunkPolicy",
    "DemoConfig",
    "EvalResult",
    "HashedTextEmbedding",
    "PolicyCheckpoint",
    "PolicyConfig",
    "RolloutConfig",
    "VisionPolicy",
    "VisionPolicyConfig",
    "eval_seeds",
    "evaluate_policy",
    "load_checkpoint",
    "masked_chunk_loss",
    "observation_features",
    "policy_keys",
    "random_shift",
    "run_demo",
    "save_checkpoint",
]
