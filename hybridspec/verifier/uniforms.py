"""Position-keyed uniforms: the randomness of a sampled sequence whose drafts are deterministic.

A sampled sequence verified this way (``KeyedUniforms``) has one uniform per absolute position
of its text, ``u(key, p)``, and its token at position ``p`` is always the inverse-CDF sample
(``acceptance.sample_from_probs``) of the target's transformed distribution there at
``u(key, p)``. A deterministic draft ``d`` for that position is accepted exactly when it is that
token, which happens with probability ``p(d)``: the acceptance rate of rejection sampling with a
one-hot draft, and the same output distribution, since every position is an ordinary
inverse-CDF sample given the text before it. But the realised text no longer depends on what
was drafted: a seeded request gives the same tokens with any deterministic proposer and any K,
alone or batched, wherever the target's logits do not depend on the forward's shape (the native
Llama runtime on CPU in bfloat16 or float32, through its row-invariant attention kernel; on
CUDA, in float16 or with transformers' own model code another batch may round otherwise). So
such a request may also price its drafts by the whole engine step, as a greedy one does
(``engine.speculation``).

``u(key, p)`` is output ``p`` of a SplitMix64 stream seeded with ``key`` (Steele, Lea and Flood
2014, the generator behind Java's ``SplittableRandom``): counter-based, so any position is
computed directly. Its top 53 bits give a float64 in ``[0, 1)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / golden ratio, odd


def splitmix64(key: int, index: int) -> int:
    """Output ``index`` (from 0) of the SplitMix64 stream seeded with ``key``, in [0, 2^64)."""
    z = (key + (index + 1) * _GAMMA) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def position_uniform(key: int, position: int) -> float:
    """``u(key, position)`` in [0, 1) (module docstring)."""
    return (splitmix64(key, position) >> 11) * 2.0**-53


def key_of(seed: int | None) -> int:
    """A request's key: derived from its seed, or fresh entropy when it has none."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little")
    return splitmix64(seed & _MASK, 0)


@dataclass(frozen=True, slots=True)
class KeyedUniforms:
    """A sequence's key, and the absolute position (prompt included) of the first token this
    round decides: the one after its committed text."""

    key: int
    position: int

    def uniform(self, offset: int) -> float:
        """The uniform of position ``position + offset``."""
        return position_uniform(self.key, self.position + offset)
