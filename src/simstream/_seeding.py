"""Seeds derived from several integers, without collisions between different tuples.

NumPy's ``SeedSequence`` splits each integer of its entropy into as many 32-bit words as it needs and pads
short entropy with zero words, so ``[2**32 + s, 0]`` (words ``s, 1, 0``) and ``[s, 1]`` (words ``s, 1``,
padded) hash alike: an engine seeded ``2**32 + s`` would replay the episodes of producer 1 of seed ``s`` in
its producer 0. Each part here is exactly two words, so tuples of one length map to distinct entropy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["derived_seed"]

_WORD = 2**32


def derived_seed(*parts: int, bits: int = 63) -> int:
    """A reproducible ``bits``-bit seed (at most 64) hashed from ``parts`` (each taken modulo ``2**64``)."""
    words = []
    for part in parts:
        part %= 2**64
        words += [part % _WORD, part // _WORD]
    state = int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0])
    return state >> (64 - bits)
