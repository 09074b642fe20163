"""Saving and loading a demo policy: weights, normalisation, text embedding and how to execute it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._files import write_whole
from .evaluate import RolloutConfig
from .policy import ChunkPolicy, PolicyConfig
from .text import HashedTextEmbedding
from .vision import VisionPolicy, VisionPolicyConfig

__all__ = ["FORMAT", "PolicyCheckpoint", "load_checkpoint", "save_checkpoint"]

FORMAT = "simstream-bc-policy/1"
"""Tag stored in every checkpoint; :func:`load_checkpoint` rejects other files with a clear error."""


@dataclass
class PolicyCheckpoint:
    """Everything needed to run a trained policy again, in any process."""

    policy: ChunkPolicy | VisionPolicy
    embedding: HashedTextEmbedding
    task: str
    rollout: RolloutConfig
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form training facts (steps, success rate, ...)."""


def save_checkpoint(path: str | Path, checkpoint: PolicyCheckpoint) -> Path:
    """Write ``checkpoint`` to ``path`` (parent folders are created); returns the path.

    The file is written beside ``path`` and renamed over it, so an interrupted save (a Ctrl-C, a full disk)
    leaves the checkpoint that was there before, never a truncated one.
    """
    path = Path(path)
    _check_embedding(path, checkpoint.embedding, checkpoint.policy.config.text_dim)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "policy_kind": "vision" if isinstance(checkpoint.policy, VisionPolicy) else "state",
        "policy_config": _plain(dataclasses.asdict(checkpoint.policy.config), "policy.config"),
        "state_dict": {key: value.cpu() for key, value in checkpoint.policy.state_dict().items()},
        "text_embedding": checkpoint.embedding.state_dict(),
        "task": checkpoint.task,
        "rollout": _plain(dataclasses.asdict(checkpoint.rollout), "rollout"),
        "info": _plain(checkpoint.info, "info"),
    }
    return write_whole(path, lambda partial: torch.save(payload, partial))


def load_checkpoint(path: str | Path) -> PolicyCheckpoint:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a simstream policy checkpoint.
    """
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"checkpoint {str(path)!r} is a folder; give the file in it (checkpoint.pt)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as error:  # a checkpoint that cannot be read (permissions, I/O): say why
        raise ValueError(f"{str(path)!r} cannot be read: {error.strerror or error}") from error
    except Exception as error:  # torch's own text suggests weights_only=False: unsafe for an unknown file
        raise ValueError(
            f"{str(path)!r} is not a simstream policy checkpoint: torch.load cannot read it "
            f"({type(error).__name__})"
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a simstream policy checkpoint (expected format {FORMAT!r})")
    kind = payload.get("policy_kind", "state")  # checkpoints written before the vision policy: "state"
    configs = {"vision": VisionPolicyConfig, "state": PolicyConfig}
    if kind not in configs:
        raise ValueError(f"{str(path)!r}: unknown policy_kind {kind!r} (expected 'state' or 'vision')")
    missing = [key for key in _PAYLOAD_KEYS if key not in payload]
    if missing:
        raise ValueError(f"{str(path)!r} is not a whole simstream policy checkpoint: it has no {missing}")
    config = _config(path, "policy_config", configs[kind], payload["policy_config"])
    policy: ChunkPolicy | VisionPolicy = VisionPolicy(config) if kind == "vision" else ChunkPolicy(config)
    try:
        policy.load_state_dict(payload["state_dict"])
    except RuntimeError as error:  # missing, unexpected or misshapen weights
        raise ValueError(f"{str(path)!r}: its weights do not fit its policy_config: {error}") from error
    except (KeyError, TypeError, AttributeError) as error:  # not a mapping of tensors at all
        raise ValueError(f"{str(path)!r}: its state_dict is not a policy's weights: {error!r}") from error
    policy.eval()
    try:
        embedding = HashedTextEmbedding.from_state_dict(payload["text_embedding"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{str(path)!r}: its text_embedding is invalid: {error!r}") from error
    _check_embedding(path, embedding, config.text_dim)
    return PolicyCheckpoint(
        policy=policy,
        embedding=embedding,
        task=payload["task"],
        rollout=_config(path, "rollout", RolloutConfig, payload["rollout"]),
        info=payload.get("info", {}),
    )


_PAYLOAD_KEYS = ("policy_config", "state_dict", "text_embedding", "task", "rollout")
"""What every checkpoint holds besides ``format`` (``policy_kind`` and ``info`` came later, defaulted)."""


def _check_embedding(path: Path, embedding: HashedTextEmbedding, text_dim: int) -> None:
    if embedding.dim != text_dim:
        raise ValueError(
            f"{str(path)!r}: the text embedding has dim {embedding.dim}, the policy reads text_dim "
            f"{text_dim}; a policy and its embedding must agree"
        )


def _config(path: Path, key: str, cls: type, fields: dict[str, Any]) -> Any:
    """``cls(**fields)``: fields added later take their defaults; a field this version lacks is an error."""
    if not isinstance(fields, dict) or not all(isinstance(name, str) for name in fields):
        raise ValueError(f"{str(path)!r}: its {key} is invalid: not a mapping of field names")
    try:
        return cls(**fields)
    except TypeError as error:
        raise ValueError(
            f"{str(path)!r}: its {key} does not fit this simstream version's {cls.__name__} ({error}); "
            "it was written by a newer version"
        ) from error
    except ValueError as error:
        raise ValueError(f"{str(path)!r}: its {key} is invalid: {error}") from error


def _plain(value: Any, where: str) -> Any:
    """``value`` with NumPy scalars as Python numbers and paths as strings: what ``load_checkpoint``'s
    ``weights_only`` reading accepts. Anything else that is not a plain value is refused here, when saving,
    instead of making a file that loads as "not a simstream policy checkpoint".

    Raises:
        ValueError: naming where the value sits and its type.
    """
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()  # before the checks below: numpy.float64 is a float, yet pickles as NumPy's
    if value is None or type(value) in _PLAIN or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_plain(item, f"{where}[{k}]") for k, item in enumerate(value)]
    if isinstance(value, tuple):  # a named tuple too: stored as a plain tuple
        return tuple(_plain(item, f"{where}[{k}]") for k, item in enumerate(value))
    if isinstance(value, dict):
        return {_plain_key(name, where): _plain(item, f"{where}[{name!r}]") for name, item in value.items()}
    raise ValueError(
        f"PolicyCheckpoint.{where} holds a {type(value).__module__}.{type(value).__qualname__}; a checkpoint "
        "stores only numbers, strings, bytes, paths, lists, tuples, dicts and tensors"
    )


_PLAIN = (bool, int, float, complex, str, bytes)
"""Values a weights-only ``torch.load`` reads back as they are."""


def _plain_key(name: Any, where: str) -> Any:
    key = _plain(name, f"{where} key")
    if type(key) not in _PLAIN or isinstance(key, bytes):
        raise ValueError(f"PolicyCheckpoint.{where} has a key {name!r}; dict keys must be strings or numbers")
    return key
