"""The weights of a Llama model as the native forward uses them (its rope frequencies: ``rope``).

``LlamaWeights.from_hf_state_dict`` fuses a transformers ``LlamaForCausalLM`` state dict (q/k/v
into one matrix, gate/up into another); ``hf_state_dict`` gives the transformers layout back as
views. Matrices (projections, embeddings, LM head) are dense tensors or ``QuantizedWeight`` (a GGUF
file's own blocks, or quantized at load: ``quantize_bits``); norms and rope stay dense.
``native_support_problem`` says which configurations the native forward covers: a family of
``model.families`` (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3; its biases, q/k
norms, fused checkpoint layout, Gemma's norms and windows), with grouped-query attention, tied
or untied embeddings, explicit ``head_dim``, and rope of type default, linear or llama3 (Llama
3.x). Gemma's ``1 + w`` norm weights are held with the 1 added (``Family.norm_offset``).

Dimensions: ``H`` query heads, ``KV`` key/value heads, ``hd`` head_dim, ``D`` hidden_size, ``I``
intermediate_size, ``V`` vocab_size.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridspec.model.families import (
    LLAMA,
    Family,
    attention_scale,
    attention_window,
    family_of,
    family_problem,
    layer_windows,
)
from hybridspec.model.gguf_blocks import GGUFMatrix
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.quant import PackedWeight, QuantizedWeight, cat_rows, quantize
from hybridspec.model.rope import (
    NATIVE_ROPE_TYPES,
    head_dim_of,
    local_rope_inv_freq,
    rope_inv_freq,
    rope_parameters,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# a weight matrix: dense, quantized, or quantized in the block kernel's tiles
Matrix = torch.Tensor | QuantizedWeight | PackedWeight


def dense(matrix: Matrix | MappedRows, dtype: torch.dtype) -> torch.Tensor:
    """``matrix`` as a dense tensor of ``dtype`` (dequantized when it is quantized)."""
    if isinstance(matrix, MappedRows):
        return matrix.dequantize(dtype)
    if isinstance(matrix, PackedWeight):
        matrix = matrix.unpack()
    if isinstance(matrix, QuantizedWeight):
        return matrix.dequantize(dtype)
    return matrix.to(dtype)


def _cat(parts: list[Matrix], dtype: torch.dtype) -> Matrix:
    """q/k/v (or gate/up) stacked into one matrix: quantized parts of any schemes into one
    ``QuantizedWeight`` (``cat_rows``); a dense part among quantized ones makes the whole
    matrix dense in ``dtype`` (a file that keeps, say, v as F16 beside a quantized q and k)."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return cat_rows([p for p in parts if isinstance(p, QuantizedWeight)])
    if any(not isinstance(p, torch.Tensor) for p in parts):
        logger.warning("a fused matrix mixes quantized and dense parts: held dense in %s", dtype)
    return torch.cat([dense(p, dtype) for p in parts])


@dataclass(frozen=True, slots=True)
class LlamaDims:
    """The shape of a Llama model, read from its transformers config.

    ``max_position_embeddings`` is capped at a sliding attention window (``families``); the
    attention fields are Gemma's (``attention.Scoring``; 0: none)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores capped at c * tanh(score / c)
    final_softcap: float = 0.0  # logits capped the same way
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: global)

    @staticmethod
    def from_hf_config(config: PretrainedConfig) -> LlamaDims:
        num_heads = config.num_attention_heads
        context = int(config.max_position_embeddings)
        window = attention_window(config)
        return LlamaDims(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim_of(config),
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=context if window is None else min(context, window),
            attn_scale=attention_scale(config),
            attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
            layer_windows=layer_windows(config),
        )


def native_support_problem(config: PretrainedConfig) -> str | None:
    """Why the native forward cannot run ``config``, or None when it can."""
    problem = family_problem(config)
    if problem is not None:
        return problem
    for layer_type in ("full_attention", "sliding_attention"):
        rope_type = rope_parameters(config, layer_type).get("rope_type", "default")
        if rope_type not in NATIVE_ROPE_TYPES:
            return f"rope_type {rope_type!r} is not one of {NATIVE_ROPE_TYPES}"
    if config.num_attention_heads % (getattr(config, "num_key_value_heads", None) or 1):
        return "num_attention_heads is not a multiple of num_key_value_heads"
    return None


@dataclass(frozen=True, slots=True)
class LlamaLayerWeights:
    attn_norm: torch.Tensor  # [D]
    wqkv: Matrix  # [(H + 2 KV) hd, D]: q rows, then k rows, then v rows
    wo: Matrix  # [D, H hd]
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: Matrix  # [2 I, D]: gate rows, then up rows
    w_down: Matrix  # [D, I]
    qkv_bias: torch.Tensor | None = None  # [(H + 2 KV) hd] where the family has biases
    q_norm: torch.Tensor | None = None  # [hd] where the family norms q and k
    k_norm: torch.Tensor | None = None  # [hd]
    post_attn_norm: torch.Tensor | None = None  # [D] Gemma's norm of the attention output
    post_mlp_norm: torch.Tensor | None = None  # [D] and of the MLP's


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    """Every tensor of a Llama model, fused for the native forward, on one device; dense ones
    of one dtype (the dtype the forward computes in)."""

    dims: LlamaDims
    embed: Matrix | MappedRows  # [V, D]; an untied one may stay in its GGUF file
    layers: tuple[LlamaLayerWeights, ...]
    norm: torch.Tensor  # [D]
    lm_head: Matrix  # [V, D]; the very object ``embed`` when embeddings are tied
    inv_freq: torch.Tensor  # [hd // 2] float32
    family: Family = LLAMA  # what the forward does beyond Llama's layer
    local_inv_freq: torch.Tensor | None = None  # [hd // 2] the sliding layers' own rope

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def is_quantized(self) -> bool:
        """Whether any matrix is quantized (a ``QuantizedWeight`` or ``PackedWeight``)."""
        matrices = [self.embed, self.lm_head]
        for layer in self.layers:
            matrices += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
        return any(not isinstance(m, torch.Tensor) for m in matrices)

    def map_quantized(self, convert: Callable[[QuantizedWeight], Matrix]) -> LlamaWeights:
        """These weights with each ``QuantizedWeight`` replaced by ``convert(it)`` (the block
        kernel's packing), one at a time; a tied embedding stays the LM head's very object."""

        def one(matrix: Matrix) -> Matrix:
            return convert(matrix) if isinstance(matrix, QuantizedWeight) else matrix

        layers = tuple(
            dataclasses.replace(
                layer,
                wqkv=one(layer.wqkv),
                wo=one(layer.wo),
                w_gate_up=one(layer.w_gate_up),
                w_down=one(layer.w_down),
            )
            for layer in self.layers
        )
        if isinstance(self.embed, MappedRows):  # left in its file: never tied
            return dataclasses.replace(self, layers=layers, lm_head=one(self.lm_head))
        embed = one(self.embed)
        lm_head = embed if self.lm_head is self.embed else one(self.lm_head)
        return dataclasses.replace(self, embed=embed, layers=layers, lm_head=lm_head)

    @staticmethod
    def from_hf_state_dict(
        state_dict: Mapping[str, torch.Tensor | QuantizedWeight | GGUFMatrix],
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        quantize_bits: int | None = None,
        pack: Callable[[GGUFMatrix], Matrix] | None = None,
        rows: Callable[[GGUFMatrix], MappedRows | None] | None = None,
    ) -> LlamaWeights:
        """Fuse a ``LlamaForCausalLM`` state dict (transformers names and layout).

        Quantized matrices in ``state_dict`` stay quantized; ``quantize_bits`` (4 or 8)
        quantizes the dense matrices too (``quant.quantize``). Norms are cast to ``dtype``.
        Matrices still in a GGUF file (``GGUFMatrix``) are stacked where they fuse and turned
        into what the forward holds by ``pack``, one at a time in the order of the layers; an
        untied embedding still in the file is left there by ``rows`` where it returns one
        (``gguf_rows.MappedRows``: a forward reads a row per token), else packed.
        """
        problem = native_support_problem(config)
        if problem is not None:
            raise ValueError(f"config: the native Llama forward cannot run it: {problem}")
        dims = LlamaDims.from_hf_config(config)

        def tensor(name: str, shape: tuple[int, ...]) -> Matrix:
            if name not in state_dict:
                raise ValueError(f"state_dict: missing tensor {name!r}")
            value = state_dict[name]
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"state_dict: {name} has shape {tuple(value.shape)}, expected {shape}"
                )
            if isinstance(value, GGUFMatrix):
                if pack is None or len(shape) != 2:
                    raise ValueError(f"state_dict: {name} is a GGUF matrix and nothing reads it")
                return pack(value)
            if isinstance(value, QuantizedWeight):
                if len(shape) != 2:
                    raise ValueError(f"state_dict: {name} must be dense, got a quantized matrix")
                return value.to(device)
            if quantize_bits is not None and len(shape) == 2:
                return quantize(value, quantize_bits).to(device)
            return value.to(device=device, dtype=dtype).contiguous()

        family, d = family_of(config), dims.hidden_size

        def vector(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            value = tensor(name, shape)
            assert isinstance(value, torch.Tensor)  # one-dimensional: never quantized
            if family.norm_offset and name.endswith("norm.weight"):  # Gemma's 1 + w
                value = (value.float() + family.norm_offset).to(dtype)
            return value

        def stacked(names: list[tuple[str, tuple[int, int]]]) -> Matrix:
            """q/k/v or gate/up fused: GGUF matrices before they are packed, as one."""
            values = [state_dict.get(name) for name, _ in names]
            lazy = [v for v in values if isinstance(v, GGUFMatrix)]
            if pack is not None and len(lazy) == len(values):
                for (name, shape), value in zip(names, lazy, strict=True):
                    if value.shape != shape:
                        tensor(name, shape)  # raises ValueError, naming it
                return pack(GGUFMatrix.stack(lazy))
            return _cat([tensor(name, shape) for name, shape in names], dtype)

        layers = tuple(
            _layer(tensor, vector, stacked, dims, family, f"model.layers.{i}.")
            for i in range(dims.num_layers)
        )
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state_dict
        embed_name, embed_shape = "model.embed_tokens.weight", (dims.vocab_size, d)
        source = state_dict.get(embed_name)
        mapped = None
        if rows is not None and not tied and isinstance(source, GGUFMatrix):
            mapped = rows(source) if source.shape == embed_shape else None
        embed: Matrix | MappedRows
        if mapped is None:
            embed = packed = tensor(embed_name, embed_shape)
            lm_head = packed if tied else tensor("lm_head.weight", (dims.vocab_size, d))
        else:
            embed, lm_head = mapped, tensor("lm_head.weight", (dims.vocab_size, d))
        local = local_rope_inv_freq(config)
        return LlamaWeights(
            dims=dims,
            embed=embed,
            layers=tuple(layers),
            norm=vector("model.norm.weight", (d,)),
            lm_head=lm_head,
            inv_freq=rope_inv_freq(config).to(device),
            family=family,
            local_inv_freq=None if local is None else local.to(device),
        )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Transformers' ``LlamaForCausalLM`` state dict: views of the fused dense tensors (no
        copy); quantized matrices are dequantized to ``dtype``."""
        dims = self.dims
        q_rows = dims.num_heads * dims.head_dim
        kv_rows = dims.num_kv_heads * dims.head_dim
        embed = dense(self.embed, self.dtype)
        offset = self.family.norm_offset

        def norm(weight: torch.Tensor) -> torch.Tensor:  # Gemma's: w back from 1 + w
            return (weight.float() - offset).to(weight.dtype) if offset else weight

        state = {"model.embed_tokens.weight": embed, "model.norm.weight": norm(self.norm)}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qkv, gate_up = dense(layer.wqkv, self.dtype), dense(layer.w_gate_up, self.dtype)
            state |= {
                p + "input_layernorm.weight": norm(layer.attn_norm),
                p + "self_attn.o_proj.weight": dense(layer.wo, self.dtype),
                p + "mlp.down_proj.weight": dense(layer.w_down, self.dtype),
            }
            if layer.post_attn_norm is not None and layer.post_mlp_norm is not None:
                state |= {
                    p + "post_attention_layernorm.weight": norm(layer.post_attn_norm),
                    p + "pre_feedforward_layernorm.weight": norm(layer.mlp_norm),
                    p + "post_feedforward_layernorm.weight": norm(layer.post_mlp_norm),
                }
            else:
                state[p + "post_attention_layernorm.weight"] = layer.mlp_norm
            if self.family.fused_checkpoint:
                state[p + "self_attn.qkv_proj.weight"] = qkv
                state[p + "mlp.gate_up_proj.weight"] = gate_up
            else:
                qkv_parts = dict(zip("qkv", qkv.split([q_rows, kv_rows, kv_rows]), strict=True))
                state |= {p + f"self_attn.{n}_proj.weight": w for n, w in qkv_parts.items()}
                gate, up = gate_up.split([dims.intermediate_size] * 2)
                state |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
            if layer.qkv_bias is not None:
                biases = layer.qkv_bias.split([q_rows, kv_rows, kv_rows])
                state |= {
                    p + f"self_attn.{n}_proj.bias": b for n, b in zip("qkv", biases, strict=True)
                }
            if layer.q_norm is not None and layer.k_norm is not None:
                state[p + "self_attn.q_norm.weight"] = norm(layer.q_norm)
                state[p + "self_attn.k_norm.weight"] = norm(layer.k_norm)
        if self.lm_head is not self.embed:
            state["lm_head.weight"] = dense(self.lm_head, self.dtype)
        return state


def _layer(
    tensor: Callable[[str, tuple[int, ...]], Matrix],
    vector: Callable[[str, tuple[int, ...]], torch.Tensor],
    stacked: Callable[[list[tuple[str, tuple[int, int]]]], Matrix],
    dims: LlamaDims,
    family: Family,
    p: str,
) -> LlamaLayerWeights:
    """Layer ``p`` (``model.layers.{i}.``) of a state dict in transformers' names for
    ``family``, fused: q/k/v (and their biases) into one matrix, gate/up into another
    (``stacked``)."""
    d, hd, inter = dims.hidden_size, dims.head_dim, dims.intermediate_size
    q_rows, kv_rows = dims.num_heads * hd, dims.num_kv_heads * hd
    if family.fused_checkpoint:
        wqkv = tensor(p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, d))
        w_gate_up = tensor(p + "mlp.gate_up_proj.weight", (2 * inter, d))
    else:
        wqkv = stacked(
            [(p + "self_attn.q_proj.weight", (q_rows, d))]
            + [(p + f"self_attn.{n}_proj.weight", (kv_rows, d)) for n in "kv"]
        )
        w_gate_up = stacked([(p + f"mlp.{n}_proj.weight", (inter, d)) for n in ("gate", "up")])
    qkv_bias = q_norm = k_norm = None
    if family.qkv_bias:
        qkv_bias = torch.cat(
            [vector(p + "self_attn.q_proj.bias", (q_rows,))]
            + [vector(p + f"self_attn.{n}_proj.bias", (kv_rows,)) for n in "kv"]
        )
    if family.qk_norm:
        q_norm = vector(p + "self_attn.q_norm.weight", (hd,))
        k_norm = vector(p + "self_attn.k_norm.weight", (hd,))
    post_attn_norm = post_mlp_norm = None
    if family.gemma_layer:  # Gemma's post_attention_layernorm norms the attention output
        post_attn_norm = vector(p + "post_attention_layernorm.weight", (d,))
        post_mlp_norm = vector(p + "post_feedforward_layernorm.weight", (d,))
        mlp_norm = vector(p + "pre_feedforward_layernorm.weight", (d,))
    else:
        mlp_norm = vector(p + "post_attention_layernorm.weight", (d,))
    return LlamaLayerWeights(
        attn_norm=vector(p + "input_layernorm.weight", (d,)),
        wqkv=wqkv,
        wo=tensor(p + "self_attn.o_proj.weight", (d, q_rows)),
        mlp_norm=mlp_norm,
        w_gate_up=w_gate_up,
        w_down=tensor(p + "mlp.down_proj.weight", (d, inter)),
        qkv_bias=qkv_bias,
        q_norm=q_norm,
        k_norm=k_norm,
        post_attn_norm=post_attn_norm,
        post_mlp_norm=post_mlp_norm,
    )
