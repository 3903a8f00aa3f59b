"""Rotary position embedding (rope), the rotate-half convention of transformers' Llama, for the
target (``llama``: tables of every position, precomputed) and the eagle head (``proposers.eagle``:
the positions it feeds). The C kernel's ``hs_rope_store`` rotates on its own, from
``rope_tables``' float32 halves.

Dimensions: ``hd`` head_dim, ``S`` positions of a table.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., 1, hd]`` at integer ``positions [...]`` for ``inv_freq [hd // 2]``,
    computed in float32 like transformers, then cast to ``dtype``."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_tables(inv_freq: torch.Tensor, max_seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin of every position, ``[2, S, 1, hd]`` (``rope_cos_sin`` of 0 .. S - 1)."""
    positions = torch.arange(max_seq_len, device=inv_freq.device)
    return torch.stack(rope_cos_sin(inv_freq, positions, dtype))


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused: bool = True
) -> torch.Tensor:
    """Rotate ``x [..., heads, hd]`` by ``cos, sin [..., 1, hd]`` (rotate-half convention).

    ``fused``: ``x * cos`` plus the rotated half times ``sin`` in one ``addcmul`` (one rounding
    of the sum, as the target runs); False rounds the product first, as the eagle head always
    has: its draft logits, and so seeded sampled texts, stay those its heads were pinned with.
    """
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    if fused:
        return torch.addcmul(x * cos, rotated, sin)
    return x * cos + rotated * sin
