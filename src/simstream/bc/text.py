"""A small deterministic text embedding: hashed bag of words, word pairs and triples of an instruction.

No vocabulary, no download, no training: the embedding of a text is a pure function of the text and the
two settings stored with every checkpoint (``dim``, ``ngram``), so a policy conditioned on it can be
reloaded in any process and reads instructions it never saw during training the same way.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import torch

from .._validation import require_int

__all__ = ["HashedTextEmbedding", "tokenize"]

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric words: ``"Pick up the RED cube!"`` -> ``[pick, up, the, red, cube]``."""
    return _TOKEN.findall(text.lower())


def _bucket(feature: str, dim: int) -> tuple[int, float]:
    # blake2b, not hash(): Python salts str hashes per process, which would change the embedding.
    digest = int.from_bytes(hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest(), "little")
    return digest % dim, (1.0 if (digest >> 63) & 1 else -1.0)


class HashedTextEmbedding:
    """Maps instruction texts to unit vectors ``float32 [dim]`` by signed feature hashing.

    Every word and, up to ``ngram``, every run of 2 or 3 adjacent words adds ``±1`` to one of ``dim``
    buckets, bucket and sign drawn from an unkeyed BLAKE2b digest of the feature; the sum is L2-normalised:

        e(text) = v / ||v||,  v = sum_f sign(f) * onehot(bucket(f))

    Owns a per-text cache only. Pure function of ``(text, dim, ngram)``.

    Args:
        dim: Embedding width (>= 8).
        ngram: Longest run of adjacent words hashed: 1 (words only), 2 (and pairs) or 3 (and triples,
            the default). Pairs are not enough for word order: "stack the red cube on the blue cube"
            and "stack the blue cube on the red cube" hold the same words and the same pairs, and
            embed identically with ``ngram=2`` (checkpoints saved so keep their setting).

    Raises:
        ValueError: naming the argument when it is out of range.

    Examples:
        >>> embed = HashedTextEmbedding(dim=64)
        >>> embed(["pick up the red cube"]).shape
        torch.Size([1, 64])
    """

    def __init__(self, dim: int = 64, ngram: int = 3) -> None:
        require_int("HashedTextEmbedding", "dim", dim, 8)
        require_int("HashedTextEmbedding", "ngram", ngram, 1, 3)
        self.dim = dim
        self.ngram = ngram
        self._cache: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, int]:
        """The settings that define the embedding (stored with a checkpoint)."""
        return {"dim": self.dim, "ngram": self.ngram}

    @classmethod
    def from_state_dict(cls, state: dict[str, int]) -> HashedTextEmbedding:
        """Rebuild the embedding saved by :meth:`state_dict`."""
        return cls(dim=int(state["dim"]), ngram=int(state["ngram"]))

    def embed_one(self, text: str) -> torch.Tensor:
        """The embedding of one text (cached)."""
        cached = self._cache.get(text)
        if cached is not None:
            return cached
        words = tokenize(text)
        features = [
            " ".join(words[start : start + n])
            for n in range(1, self.ngram + 1)
            for start in range(len(words) - n + 1)
        ]
        vector = torch.zeros(self.dim)
        for feature in features:
            index, sign = _bucket(feature, self.dim)
            vector[index] += sign
        norm = vector.norm()
        vector = vector / norm if norm > 0 else vector
        self._cache[text] = vector
        return vector

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """Embeddings ``float32 [len(texts), dim]``."""
        if not texts:
            return torch.zeros(0, self.dim)
        return torch.stack([self.embed_one(text) for text in texts])
