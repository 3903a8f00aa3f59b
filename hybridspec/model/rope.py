"""Rotary position embedding (rope), the rotate-half convention of transformers' Llama, for the
target (``llama``: tables of every position, precomputed) and the eagle head (``proposers.eagle``:
the positions it feeds). The C kernel's ``hs_rope_store`` rotates on its own, from
``rope_tables``' float32 halves.

Also the inverse frequencies a model's config or file names: plain (``default_inv_freq``) and
Llama 3.1's scaling (``llama3_inv_freq``), read from a transformers config as its rope init
reads them (``rope_inv_freq``; Gemma 3's sliding layers' own: ``local_rope_inv_freq``).

Dimensions: ``hd`` head_dim, ``S`` positions of a table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

NATIVE_ROPE_TYPES = ("default", "linear", "llama3")


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


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """Unscaled rope inverse frequencies ``theta ** (-2i / hd)``, ``[hd // 2]`` float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: keep short wavelengths, divide long ones by ``factor``, and
    blend in between (transformers' ``_compute_llama3_parameters``)."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context_len / high_freq_factor) & (
        wavelen <= old_context_len / low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


def head_dim_of(config: PretrainedConfig) -> int:
    """The config's ``head_dim``, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of ``layer_type``'s layers (Gemma 3 keeps one dict per layer type;
    None: the global layers')."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if isinstance(params.get("full_attention"), Mapping):
        params = dict(params.get(layer_type or "full_attention") or params["full_attention"])
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: PretrainedConfig, layer_type: str | None = None) -> torch.Tensor:
    """Rope inverse frequencies ``[hd // 2]`` float32, as transformers' rope init computes them
    (for ``layer_type``'s layers where they differ by type, as Gemma 3's local ones)."""
    params = rope_parameters(config, layer_type)
    inv_freq = default_inv_freq(float(params["rope_theta"]), head_dim_of(config))
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, params)
    if rope_type != "default":
        raise ValueError(f"rope_type: expected one of {NATIVE_ROPE_TYPES}, got {rope_type!r}")
    return inv_freq


def local_rope_inv_freq(config: PretrainedConfig) -> torch.Tensor | None:
    """The rope of the sliding-window layers where it is their own (Gemma 3's
    ``rope_local_base_freq``), or None."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params.get("sliding_attention"), Mapping):
        return None
    return rope_inv_freq(config, "sliding_attention")
