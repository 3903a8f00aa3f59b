"""A lean native forward for the Llama family over a slot-indexed KV cache (gpt-fast style).

Covers any ``LlamaForCausalLM`` configuration without biases: grouped-query attention, tied or
untied embeddings, explicit ``head_dim``, and rope of type default, linear or llama3 (Llama 3.x).
Other variants load through the generic transformers runtime (``hf_runtime``).

Dimensions: ``T`` new tokens in the batch (flat), ``B`` sequences, ``H`` query heads, ``KV``
key/value heads, ``rep = H // KV`` query heads per key/value head, ``hd`` head_dim, ``D``
hidden_size, ``I`` intermediate_size, ``V`` vocab_size, ``S`` max_seq_len, ``L`` keys attended.

Speed choices: q/k/v and gate/up are each one fused matmul; rope cos/sin are precomputed tables;
q and k are rotated in one op (they sit side by side in the fused projection); grouped-query
attention folds the ``rep`` query heads of a key/value head into extra query rows, so keys and
values are never repeated; a single sequence attends to slice views of its cache (no gathers);
the LM head runs only at ``logits_indices``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from hybridspec.model.kv_cache import (
    Attention,
    KernelAttention,
    KVCache,
    OneSequenceAttention,
    RaggedAttention,
    read_batch,
)
from hybridspec.model.runtime import ForwardBatch

logger = logging.getLogger(__name__)

NATIVE_ROPE_TYPES = ("default", "linear", "llama3")
# oneDNN sums a row over more than this many input features in another order when the row is
# alone than when it has company (PackedLinear docstring).
ONE_ROW_MAX_IN_FEATURES = 1024


@dataclass(frozen=True, slots=True)
class LlamaDims:
    """The shape of a Llama model, read from its transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int

    @staticmethod
    def from_hf_config(config: PretrainedConfig) -> LlamaDims:
        num_heads = config.num_attention_heads
        return LlamaDims(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=config.max_position_embeddings,
        )


def native_support_problem(config: PretrainedConfig) -> str | None:
    """Why the native forward cannot run ``config``, or None when it can."""
    if getattr(config, "model_type", None) != "llama":
        return f"model_type is {getattr(config, 'model_type', None)!r}, not 'llama'"
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            return f"{flag} is set"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act is {config.hidden_act!r}, not 'silu'"
    rope_type = _rope_parameters(config).get("rope_type", "default")
    if rope_type not in NATIVE_ROPE_TYPES:
        return f"rope_type {rope_type!r} is not one of {NATIVE_ROPE_TYPES}"
    if config.num_attention_heads % (getattr(config, "num_key_value_heads", None) or 1):
        return "num_attention_heads is not a multiple of num_key_value_heads"
    return None


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: PretrainedConfig) -> torch.Tensor:
    """Rope inverse frequencies ``[hd // 2]`` float32, as transformers' rope init computes them."""
    params = _rope_parameters(config)
    inv_freq = default_inv_freq(
        float(params["rope_theta"]), LlamaDims.from_hf_config(config).head_dim
    )
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, params)
    if rope_type != "default":
        raise ValueError(f"rope_type: expected one of {NATIVE_ROPE_TYPES}, got {rope_type!r}")
    return inv_freq


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


@dataclass(frozen=True, slots=True)
class LlamaLayerWeights:
    attn_norm: torch.Tensor  # [D]
    wqkv: torch.Tensor  # [(H + 2 KV) hd, D]: q rows, then k rows, then v rows
    wo: torch.Tensor  # [D, H hd]
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: torch.Tensor  # [2 I, D]: gate rows, then up rows
    w_down: torch.Tensor  # [D, I]


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    """Every tensor of a Llama model, fused for the native forward; all of one dtype and device."""

    dims: LlamaDims
    embed: torch.Tensor  # [V, D]
    layers: tuple[LlamaLayerWeights, ...]
    norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]; the very tensor ``embed`` when embeddings are tied
    inv_freq: torch.Tensor  # [hd // 2] float32

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @staticmethod
    def from_hf_state_dict(
        state_dict: Mapping[str, torch.Tensor],
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> LlamaWeights:
        """Fuse a ``LlamaForCausalLM`` state dict (transformers names and layout)."""
        problem = native_support_problem(config)
        if problem is not None:
            raise ValueError(f"config: the native Llama forward cannot run it: {problem}")
        dims = LlamaDims.from_hf_config(config)

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"state_dict: missing tensor {name!r}")
            tensor = state_dict[name]
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"state_dict: {name} has shape {tuple(tensor.shape)}, expected {shape}"
                )
            return tensor.to(device=device, dtype=dtype).contiguous()

        d, hd, inter = dims.hidden_size, dims.head_dim, dims.intermediate_size
        q_rows, kv_rows = dims.num_heads * hd, dims.num_kv_heads * hd
        layers = []
        for i in range(dims.num_layers):
            p = f"model.layers.{i}."
            wqkv = [get(p + "self_attn.q_proj.weight", (q_rows, d))] + [
                get(p + f"self_attn.{n}_proj.weight", (kv_rows, d)) for n in "kv"
            ]
            gate_up = [get(p + f"mlp.{n}_proj.weight", (inter, d)) for n in ("gate", "up")]
            layers.append(
                LlamaLayerWeights(
                    attn_norm=get(p + "input_layernorm.weight", (d,)),
                    wqkv=torch.cat(wqkv),
                    wo=get(p + "self_attn.o_proj.weight", (d, q_rows)),
                    mlp_norm=get(p + "post_attention_layernorm.weight", (d,)),
                    w_gate_up=torch.cat(gate_up),
                    w_down=get(p + "mlp.down_proj.weight", (d, inter)),
                )
            )
        embed = get("model.embed_tokens.weight", (dims.vocab_size, d))
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state_dict
        return LlamaWeights(
            dims=dims,
            embed=embed,
            layers=tuple(layers),
            norm=get("model.norm.weight", (d,)),
            lm_head=embed if tied else get("lm_head.weight", (dims.vocab_size, d)),
            inv_freq=rope_inv_freq(config).to(device),
        )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Transformers' ``LlamaForCausalLM`` state dict as views of the fused tensors (no copy)."""
        dims = self.dims
        q_rows = dims.num_heads * dims.head_dim
        kv_rows = dims.num_kv_heads * dims.head_dim
        state = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = layer.wqkv.split([q_rows, kv_rows, kv_rows])
            gate, up = layer.w_gate_up.split([dims.intermediate_size, dims.intermediate_size])
            state |= {
                p + "input_layernorm.weight": layer.attn_norm,
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": layer.wo,
                p + "post_attention_layernorm.weight": layer.mlp_norm,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.w_down,
            }
        if self.lm_head is not self.embed:
            state["lm_head.weight"] = self.lm_head
        return state


def rope_tables(inv_freq: torch.Tensor, max_seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin of every position, ``[2, S, 1, hd]``, computed in float32 like transformers."""
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq[None, :]  # [S, hd // 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [S, hd]
    return torch.stack((angles.cos(), angles.sin())).to(dtype)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, hd]`` by ``cos, sin [T, 1, hd]`` (the rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)


class PackedLinear:
    """``y = x @ W.T``, with ``W [out, in]`` reordered once into oneDNN's blocked layout on CPU.

    A plain ``F.linear`` streams a row-major weight through a generic kernel; oneDNN's prepacked
    weight is what its own GEMM reads best. Measured on the development CPU (one thread), the
    SmolLM2 LM head ``[49152, 576]`` for 1 and 9 rows: bfloat16 6.8 -> 4.2 ms and 8.8 -> 4.4 ms,
    float32 10.0 -> 7.9 ms and 20.6 -> 13.7 ms; the gate/up weight ``[3072, 576]``, 1 row:
    bfloat16 162 -> 73 us. Results are identical in bfloat16 and within 1e-6 relative in
    float32 (another summation order). Without oneDNN (CUDA, a float16 weight on a CPU without
    avx512_fp16, a torch without mkldnn) this is plain ``F.linear``, the reference it is tested
    against.

    Two rows go through as three (the first repeated, its result dropped): oneDNN's kernel for
    exactly two rows streams the weights slower than for one or three. Measured on the
    development CPU, a whole forward after a 300-token context, relative to one token: 2 tokens
    1.10 -> 1.03 (3 tokens: 1.01). Each row's result is unchanged (oneDNN's rows are
    independent), so outputs are identical.

    One row also goes through as three when the weight has more than
    ``ONE_ROW_MAX_IN_FEATURES`` input features: oneDNN then sums a lone row in another order
    than a row among 3 or more (measured: 6 to 49 of 128 rows differ in bfloat16 for 1088 to
    1536 features, none for 576 to 1024), so a token decoded alone would come out slightly
    different from the same token verified among drafts. With the padding every row is
    computed the same way in any call (``tests/engine/test_invariance.py``); it costs about
    8 us per call (SmolLM2's down projection, 1536 features).
    """

    __slots__ = ("packed", "pad_one_row", "weight")

    def __init__(self, weight: torch.Tensor, *, prepack: bool) -> None:
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.pad_one_row = weight.shape[1] > ONE_ROW_MAX_IN_FEATURES
        if prepack and weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:  # batch-size hint 1: decode; measured as fast or faster for 9..256 rows too
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
                self.weight = None  # the runtime keeps only the packed copy
            except RuntimeError as exc:
                logger.debug(
                    "oneDNN cannot pack a %s weight, using F.linear: %s", weight.dtype, exc
                )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = x.shape[0]
            if rows == 2 or (rows == 1 and self.pad_one_row):  # see the class docstring
                return self._packed(torch.cat((x, x[:1].expand(3 - rows, -1))))[:rows]
            return self._packed(x)
        assert self.weight is not None
        return F.linear(x, self.weight)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


@dataclass(frozen=True, slots=True)
class _RuntimeLayer:
    """One decoder layer's weights as the runtime uses them (matmul weights maybe prepacked)."""

    attn_norm: torch.Tensor  # [D]
    wqkv: PackedLinear  # D -> (H + 2 KV) hd
    wo: PackedLinear  # H hd -> D
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: PackedLinear  # D -> 2 I
    w_down: PackedLinear  # I -> D

    @staticmethod
    def of(layer: LlamaLayerWeights, prepack: bool) -> _RuntimeLayer:
        return _RuntimeLayer(
            attn_norm=layer.attn_norm,
            wqkv=PackedLinear(layer.wqkv, prepack=prepack),
            wo=PackedLinear(layer.wo, prepack=prepack),
            mlp_norm=layer.mlp_norm,
            w_gate_up=PackedLinear(layer.w_gate_up, prepack=prepack),
            w_down=PackedLinear(layer.w_down, prepack=prepack),
        )


class LlamaRuntime:
    """The native Llama forward behind the ``ModelRuntime`` protocol.

    ``prepack`` (default: on CPU) keeps the matmul weights in oneDNN's layout (``PackedLinear``);
    this runtime then holds its own packed copy beside the plain ``weights``.
    """

    def __init__(
        self,
        weights: LlamaWeights,
        max_num_seqs: int,
        max_seq_len: int,
        *,
        prepack: bool | None = None,
        invariant_attention: bool | None = None,
    ) -> None:
        dims = weights.dims
        self.weights = weights
        on_cpu = weights.device.type == "cpu"
        prepack = on_cpu if prepack is None else prepack
        kernel_dtypes = (torch.bfloat16, torch.float32)
        if invariant_attention is None:
            invariant_attention = on_cpu and weights.dtype in kernel_dtypes
        if invariant_attention and not (on_cpu and weights.dtype in kernel_dtypes):
            raise ValueError(
                "invariant_attention: the row-invariant kernel runs on CPU in bfloat16 or "
                f"float32, not on {weights.device.type} in {weights.dtype}"
            )
        self.invariant_attention = invariant_attention
        self._layers = tuple(_RuntimeLayer.of(layer, prepack) for layer in weights.layers)
        self._lm_head = PackedLinear(weights.lm_head, prepack=prepack)
        self._cache = KVCache(
            num_layers=dims.num_layers,
            max_num_seqs=max_num_seqs,
            num_kv_heads=dims.num_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=dims.head_dim,
            dtype=weights.dtype,
            device=weights.device,
            transposed_keys=invariant_attention,
        )
        self._slots = self._cache.slots
        self._rope = rope_tables(weights.inv_freq, max_seq_len, weights.dtype)  # [2, S, 1, hd]
        self._rep = dims.num_heads // dims.num_kv_heads
        self._qk_width = (dims.num_heads + dims.num_kv_heads) * dims.head_dim
        self._norm_shape = (dims.hidden_size,)

    @property
    def vocab_size(self) -> int:
        return self.weights.dims.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self._slots.max_seq_len

    @property
    def max_num_seqs(self) -> int:
        return self._slots.max_num_seqs

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def allocate(self) -> int:
        return self._slots.allocate()

    def free(self, slot: int) -> None:
        self._slots.free(slot)

    def num_free_slots(self) -> int:
        return self._slots.num_free_slots()

    def seq_len(self, slot: int) -> int:
        return self._slots.seq_len(slot)

    def truncate(self, slot: int, length: int) -> None:
        self._slots.truncate(slot, length)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Append the batch's tokens to their slots; float32 logits ``[num_logits, V]``."""
        host = read_batch(batch, self.vocab_size)
        starts = self._slots.reserve(host.slots, host.num_new_tokens)
        with torch.inference_mode():
            logits = self._forward(
                host.token_ids, host.slots, starts, host.num_new_tokens, host.logits_indices
            )
        self._cache.commit(
            host.slots, [s + n for s, n in zip(starts, host.num_new_tokens, strict=True)]
        )
        return logits

    def _forward(
        self,
        token_ids: torch.Tensor,  # [T]
        slots: list[int],
        starts: list[int],
        num_new: list[int],
        logits_indices: torch.Tensor | None,  # [num_logits]
    ) -> torch.Tensor:
        device = self.device
        attention: Attention
        if self.invariant_attention:
            attention = KernelAttention(self._cache, slots, starts, num_new, self._rep)
        elif len(slots) == 1:
            attention = OneSequenceAttention(
                self._cache, slots[0], starts[0], num_new[0], self._rep
            )
        else:
            attention = RaggedAttention(self._cache, slots, starts, num_new, self._rep)
        if len(slots) == 1:
            cos, sin = self._rope[:, starts[0] : starts[0] + num_new[0]]  # [T, 1, hd] views
        else:
            assert not isinstance(attention, OneSequenceAttention)
            cos, sin = self._rope[:, attention.positions]
        x = F.embedding(token_ids.to(device, non_blocking=True), self.weights.embed)  # [T, D]
        for i, layer in enumerate(self._layers):
            x = self._decoder_layer(x, i, layer, cos, sin, attention)
        if logits_indices is not None:
            x = x[logits_indices.to(device, non_blocking=True)]
        x = F.rms_norm(x, self._norm_shape, self.weights.norm, self.weights.dims.rms_norm_eps)
        return self._lm_head(x).float()  # [num_logits, V]

    def _decoder_layer(
        self,
        x: torch.Tensor,  # [T, D]
        i: int,
        layer: _RuntimeLayer,
        cos: torch.Tensor,  # [T, 1, hd]
        sin: torch.Tensor,
        attention: Attention,
    ) -> torch.Tensor:
        dims, eps = self.weights.dims, self.weights.dims.rms_norm_eps
        h = F.rms_norm(x, self._norm_shape, layer.attn_norm, eps)
        qkv = layer.wqkv(h)  # [T, (H + 2 KV) hd]
        qk = qkv[:, : self._qk_width].view(-1, dims.num_heads + dims.num_kv_heads, dims.head_dim)
        qk = apply_rope(qk, cos, sin)  # [T, H + KV, hd]
        v = qkv[:, self._qk_width :].view(-1, dims.num_kv_heads, dims.head_dim)
        attn = attention(i, qk[:, : dims.num_heads], qk[:, dims.num_heads :], v)  # [T, H hd]
        x = x + layer.wo(attn)
        h = F.rms_norm(x, self._norm_shape, layer.mlp_norm, eps)
        gate, up = layer.w_gate_up(h).chunk(2, dim=-1)  # [T, I] each
        return x + layer.w_down(F.silu(gate) * up)
