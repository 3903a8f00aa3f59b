"""The feature-level draft head of the ``eagle`` proposer (EAGLE, Li et al. 2024; EAGLE-3's
training-time test), its configuration and its files.

The head reads the target's own hidden state ``f_t`` (the last decoder layer's output, before
the final norm: ``ForwardBatch.hidden_layers = (-1,)``; or, as EAGLE-3 does, several layers'
outputs at ``t``, low, middle and last, side by side through a linear map ``feature_fc`` to the
target's width) and the embedding of the token that followed, ``x_{t+1}``; one
fully-connected layer fuses them, one Llama decoder layer at the
target's width (its own small KV cache) turns the sequence of fused inputs into predicted
features ``h_t`` of position ``t + 1``, and the target's final norm and LM head, restricted to a
frequency-ranked draft vocabulary (FR-Spec), turn ``h_t`` into logits of ``x_{t+2}``. The
target's embedding, final norm and LM head rows are borrowed, frozen, never stored in the head's
file; the file holds the fusion, the decoder layer and the draft vocabulary.

Drafting ``k`` tokens after a committed context ``x_0 .. x_{L-1}`` whose features
``f_0 .. f_{L-2}`` are known: the pairs ``(f_j, x_{j+1})`` for ``j < L - 1`` are real (the
target's features) and stay in the head's cache; the last one's output gives ``d_1``; then
``(h, d_1)``, ``(h', d_2)``, ... are fed with the head's own predicted features, and those
entries are dropped again at the next commit (``HeadCache.truncate``).

Dimensions: ``N`` rows (flat, ragged over sequences), ``D`` hidden size, ``H`` query heads,
``KV`` key/value heads, ``hd`` head_dim, ``I`` intermediate size, ``S`` draft vocabulary size,
``V`` the target's vocabulary size, ``B`` training windows of ``T`` positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.errors import check
from hybridspec.model import apply_rope, rope_cos_sin
from hybridspec.proposers.eagle.config import HeadConfig, TargetParts
from hybridspec.proposers.eagle.training import unrolled


class DecoderLayerHead(nn.Module):
    """What EAGLE-style heads share: a Llama decoder layer's q/k/v projection with rope, and
    its rest after attention (``wo``, the residual add, the MLP and its add). The subclass
    builds the modules named below; ``inv_freq`` is its rope's."""

    config: HeadConfig
    inv_freq: torch.Tensor
    wqkv: nn.Module
    wo: nn.Module
    mlp_norm: nn.Parameter
    w_gate_up: nn.Module
    w_down: nn.Module

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin ``[..., 1, hd]`` at integer ``positions [...]``."""
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def project(
        self, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's input ``h`` -> q ``[..., H, hd]``, k, v ``[..., KV, hd]`` (rotated)."""
        c = self.config
        qkv = self.wqkv(h)
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        cos, sin = self.rope(positions, h.dtype)
        q = apply_rope(q.unflatten(-1, (c.num_heads, c.head_dim)), cos, sin, fused=False)
        k = apply_rope(k.unflatten(-1, (c.num_kv_heads, c.head_dim)), cos, sin, fused=False)
        return q, k, v.unflatten(-1, (c.num_kv_heads, c.head_dim))

    def layer_rest(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """``residual + wo(attended)``, then the MLP and its add: the layer's output."""
        c = self.config
        x = residual + self.wo(attended.flatten(-2))
        h = F.rms_norm(x, (c.hidden_size,), self.mlp_norm, c.rms_norm_eps)
        gate, up = self.w_gate_up(h).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class EagleHead(DecoderLayerHead):
    """Fusion FC, one decoder layer, and logits over the draft vocabulary (module docstring)."""

    draft_vocab: torch.Tensor  # [S] int64: the target's ids of the draft vocabulary, sorted
    feature_layers: tuple[int, ...]  # ``HeadConfig.feature_layers``

    def __init__(self, config: HeadConfig, parts: TargetParts, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        c = config
        check(
            tuple(parts.embed.shape) == (c.vocab_size, c.hidden_size),
            "target",
            f"a head for hidden size {c.hidden_size} and vocabulary {c.vocab_size} cannot run "
            f"on a target whose embedding is {tuple(parts.embed.shape)}",
        )
        check(
            tuple(draft_vocab.shape) == (c.draft_vocab_size,),
            "draft_vocab",
            f"expected {c.draft_vocab_size} token ids, got shape {tuple(draft_vocab.shape)}",
        )
        self.config = c
        d, q_width, kv_width = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.feature_layers = c.feature_layers
        # several layers' outputs side by side -> f_t [D]; None: the one layer's output is f_t
        self.feature_fc = (
            nn.Linear(len(c.feature_layers) * d, d, bias=False)
            if len(c.feature_layers) > 1
            else None
        )
        self.fc = nn.Linear(2 * d, d, bias=c.fc_bias)  # cat(embed(x_{t+1}), f_t) -> D
        self.input_norm = nn.Parameter(torch.ones(d)) if c.input_norm else None
        self.wqkv = nn.Linear(d, q_width + 2 * kv_width, bias=False)
        self.wo = nn.Linear(q_width, d, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Linear(d, 2 * c.intermediate_size, bias=False)
        self.w_down = nn.Linear(c.intermediate_size, d, bias=False)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=True)
        self.parts = parts
        self.draft_lm_head = parts.lm_head[draft_vocab.to(parts.lm_head.device)]  # [S, D]
        # its 8-bit form, an ``int8.Int8DraftLinear`` (``quantize_matmuls``)
        self.draft_lm: nn.Module | None = None
        half = torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim
        self.inv_freq = 1.0 / (c.rope_theta**half)  # [hd // 2]

    # ------------------------------------------------------------------ pieces

    def fuse(self, features: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` features and the ids of the tokens after them -> fused inputs [..., D]."""
        embedded = F.embedding(next_token_ids, self.parts.embed)
        return self.fc(torch.cat((embedded, features.to(embedded.dtype)), dim=-1))

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused inputs ``[..., D]`` -> q ``[..., H, hd]``, k, v ``[..., KV, hd]`` (rotated)."""
        c = self.config
        h = x
        if self.input_norm is not None:
            h = F.rms_norm(x, (c.hidden_size,), self.input_norm, c.rms_norm_eps)
        return self.project(h, positions)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's rest: ``x + wo(attended)``, then the MLP; predicted features [..., D]."""
        return self.layer_rest(x, attended)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[..., S]`` of features ``[..., D]`` (the target's
        final norm, unless the features are normed already, its LM head rows and its final
        soft cap; for the target's own features, its logits there)."""
        h = features.to(self.draft_lm_head.dtype)
        if not self.config.normed_features:
            h = self.target_norm(h)
        lm = self.draft_lm
        logits = lm(h) if lm is not None else F.linear(h, self.draft_lm_head)
        return softcap(logits, self.parts.final_softcap)

    def target_norm(self, features: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm of ``features [..., D]``."""
        c = self.config
        return F.rms_norm(features, (c.hidden_size,), self.parts.norm, c.rms_norm_eps)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's inputs ``[..., D]`` from the target's outputs of ``feature_layers``
        ``[..., len(feature_layers), D]`` (before its final norm, as the runtime hands them):
        one layer's as they are (normed where the head reads normed features), several fused
        by ``feature_fc``."""
        if self.feature_fc is not None:
            return self.feature_fc(hidden.flatten(-2).to(self.draft_lm_head.dtype))
        one = hidden[..., 0, :]
        return self.target_norm(one) if self.config.normed_features else one

    def unrolled(
        self, features: torch.Tensor, next_token_ids: torch.Tensor, num_steps: int
    ) -> list[torch.Tensor]:
        """Predicted features of each drafting step, as drafting meets them: the training-time
        unroll (``training.unrolled``)."""
        return unrolled(self, features, next_token_ids, num_steps)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, as the target caps its logits (``TargetParts``); the
    logits as they are for ``cap`` 0."""
    return torch.tanh(logits / cap) * cap if cap > 0 else logits
