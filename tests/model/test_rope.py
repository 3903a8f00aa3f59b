"""One rope (``model.rope``) for the target and the eagle head: its tables, its rotations and
the eagle head's projections equal, to the bit, the two copies they replaced (written out here
as the references)."""

from __future__ import annotations

import pytest
import torch

from hybridspec.model.rope import apply_rope, rope_cos_sin, rope_tables
from tests.engine.tiny import tiny_loaded
from tests.proposers.eagle_helpers import random_head

DTYPES = [torch.float32, torch.bfloat16]


def inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def old_llama_tables(inv: torch.Tensor, max_seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = positions[:, None] * inv[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((angles.cos(), angles.sin())).to(dtype)[:, :, None, :]


def old_llama_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)


def old_eagle_cos_sin(
    inv: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[..., None] * inv.to(positions.device)
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def old_eagle_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_tables_and_rotations_equal_the_old_copies_bitwise(
    dtype: torch.dtype, head_dim: int
) -> None:
    inv = inv_freq(head_dim)
    tables = rope_tables(inv, 2048, dtype)
    assert torch.equal(tables, old_llama_tables(inv, 2048, dtype))
    positions = torch.randint(0, 2048, (37,), generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(inv, positions, dtype)
    old_cos, old_sin = old_eagle_cos_sin(inv, positions, dtype)
    assert torch.equal(cos, old_cos) and torch.equal(sin, old_sin)
    assert torch.equal(cos, tables[0, positions]) and torch.equal(sin, tables[1, positions])
    x = torch.randn(37, 6, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(apply_rope(x, cos, sin), old_llama_rotate(x, cos, sin))
    assert torch.equal(apply_rope(x, cos, sin, fused=False), old_eagle_rotate(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_eagle_heads_projections_are_unchanged(dtype: torch.dtype) -> None:
    """The head's q and k on a fixed input, against the old eagle rope applied to its own
    unrotated projection (everything after them in the head is untouched)."""
    target = tiny_loaded(0)
    head = random_head(target, 48, seed=5).to(dtype)
    c = head.config
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, c.hidden_size, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 7, 8, 30, 31, 100])
    with torch.inference_mode():
        q, k, v = head.qkv(x, positions)
        h = torch.nn.functional.rms_norm(x, (c.hidden_size,), head.input_norm, c.rms_norm_eps)
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q0, k0, v0 = head.wqkv(h).split([q_width, kv_width, kv_width], dim=-1)
        cos, sin = old_eagle_cos_sin(head.inv_freq, positions, dtype)
        old_q = old_eagle_rotate(q0.unflatten(-1, (c.num_heads, c.head_dim)), cos, sin)
        old_k = old_eagle_rotate(k0.unflatten(-1, (c.num_kv_heads, c.head_dim)), cos, sin)
    assert torch.equal(q, old_q)
    assert torch.equal(k, old_k)
    assert torch.equal(v, v0.unflatten(-1, (c.num_kv_heads, c.head_dim)))
