"""Reading llama.cpp GGUF files into transformers' layout, without transformers' loader.

Architectures: ``SUPPORTED_ARCHITECTURES`` (the families of ``model.families`` whose GGUF
architecture has the family's name; llama.cpp writes dense Mistral as ``llama``).

Gemma files: llama.cpp's converter adds Gemma's 1 to every norm weight (its RMSNorm scales by
``w``); it is taken off here, so that the state dict is the checkpoint's. What llama.cpp does not
read from the file, the config mirrors from llama.cpp's own loader: every 6th layer global in
Gemma 3 (every 2nd in Gemma 2) unless ``attention.sliding_window_pattern`` says otherwise,
``query_pre_attn_scalar`` = ``head_dim`` (``hidden_size / heads`` for the 27B models), Gemma 2's
window 4096 when the file names none.

``read_gguf`` dequantises every tensor (Q4_K, Q8_0, F16, F32, ...) to float32 (or, with
``keep_quantized``, keeps quantized matrices as their blocks: ``QuantizedWeight``,
``model.gguf_blocks``),
renames it to its transformers name, undoes llama.cpp's rope permutation of the q/k rows (only
``llama`` files are permuted) and builds the architecture's transformers config from the
metadata (or, for a load in place, reads its fields saved by an earlier load: ``gguf_meta``).
``load_gguf_tokenizer`` (``gguf_tokenizer``) converts the file's vocabulary with transformers
once (a second or two for a 128k vocabulary) and caches the result on disk.

llama.cpp's converter stores each q/k projection with the rows of every head reordered from
transformers' rotate-half pairing (i, i + hd/2) to interleaved pairing (2i, 2i + 1):
``w.reshape(heads, 2, hd // 2, D).swapaxes(1, 2)``. With hd = 4, rows [a0 a1 b0 b1] of a head
become [a0 b0 a1 b1]; ``unpermute_qk`` maps them back.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf.quants import dequantize

from hybridspec.errors import ModelLoadError
from hybridspec.model.gguf_blocks import (
    DENSE_TYPES,
    GGUF_TYPES,
    GGUFMatrix,
    GGUFPart,
    from_gguf_blocks,
)
from hybridspec.model.gguf_file import GGUFFile
from hybridspec.model.gguf_meta import StoredConfig, config_for
from hybridspec.model.gguf_tokenizer import (  # re-exported: callers import them from here
    convert_gguf_tokenizer as convert_gguf_tokenizer,
)
from hybridspec.model.gguf_tokenizer import default_cache_dir as default_cache_dir
from hybridspec.model.gguf_tokenizer import load_gguf_tokenizer as load_gguf_tokenizer
from hybridspec.model.quant import QuantizedWeight
from hybridspec.model.rope import default_inv_freq, llama3_inv_freq

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
_PERMUTED_ARCHITECTURES = ("llama",)  # whose q/k rows llama.cpp's converter reorders
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_NAMES = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FUSED_UP = {"phi3": "mlp.gate_up_proj"}  # architectures whose ffn_up holds gate and up
_GEMMA_NAMES = {  # Gemma's norm around attention and the MLP
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = {  # architecture: transformers model_type, layers per global one, 27B's layer count
    "gemma2": ("gemma2", 2, 46),
    "gemma3": ("gemma3_text", 6, 62),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The Llama 3.1 rope scaling that Meta's checkpoints share; only ``factor`` varies (8 or 32).
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """A GGUF model in transformers' layout."""

    # the architecture's own config class (LlamaConfig, Qwen3Config...), or its saved
    # attributes (``read_gguf``'s ``stored_config``)
    config: PretrainedConfig | StoredConfig
    # transformers' names and layout: float32, or a file's own blocks (``keep_quantized``),
    # decoded or still in the file (``lazy``)
    state_dict: dict[str, torch.Tensor | QuantizedWeight | GGUFMatrix]
    eos_token_ids: tuple[int, ...]  # from eos/eot/eom metadata
    tensor_bytes: int = 0  # the file's tensors' bytes, all together


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's reordering of q/k rows ``[heads * hd, D]`` (see the module docstring)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, -1)
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo ``permute_qk``: back to transformers' rotate-half row order."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, -1)
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def unpermute_qk_rows(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """``unpermute_qk`` for a quantized matrix: the same row order, codes and scales moved whole."""
    rows = torch.arange(weight.shape[0])[:, None]
    return weight.select_rows(unpermute_qk(rows, num_heads)[:, 0])


def read_gguf(
    path: str | os.PathLike[str],
    *,
    keep_quantized: bool = False,
    lazy: bool = False,
    stored_config: bool = False,
) -> GGUFModel:
    """Read a GGUF file; raises ModelLoadError for an unreadable, truncated or unsupported file
    (``gguf_file.GGUFFile``).

    ``keep_quantized``: quantized matrices come back as ``QuantizedWeight`` (their blocks,
    exactly: ``model.gguf_blocks`` lists the types), F32/F16/BF16 ones and vectors as float32;
    a matrix of another type is refused, naming it and its type. ``lazy`` (with
    ``keep_quantized``): quantized matrices come back as ``GGUFMatrix``, views of the mapped
    file not read yet, for ``gguf_pack`` to convert one at a time. ``stored_config``: the
    config may be a ``gguf_meta.StoredConfig`` (saved by an earlier load: no transformers import).
    """
    reader = GGUFFile(path)
    meta = _Metadata(reader, os.fspath(path))
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {meta.path!r}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in tensors:
            raise ModelLoadError(f"GGUF file {meta.path!r}: tensor {name!r} is missing")
    config = _config(meta, tensors, stored_config)
    heads = {}
    if arch in _PERMUTED_ARCHITECTURES:
        heads = {
            "attn_q": int(config.num_attention_heads),
            "attn_k": int(config.num_key_value_heads or 0),
        }
    names = _LAYER_NAMES | ({"ffn_up": _FUSED_UP[arch]} if arch in _FUSED_UP else {})
    names |= _GEMMA_NAMES if arch in _GEMMA else {}
    state_dict: dict[str, torch.Tensor | QuantizedWeight | GGUFMatrix] = {}
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":  # folded into config.rope_parameters by _llama_config
            continue
        values: torch.Tensor | QuantizedWeight | GGUFMatrix
        kind = tensor.tensor_type.name
        if keep_quantized and len(tensor.shape) == 2 and kind not in (*GGUF_TYPES, *DENSE_TYPES):
            raise ModelLoadError(
                f"GGUF file {meta.path!r}: tensor {name} is of type {kind}, which is not "
                f"supported (supported: {', '.join((*GGUF_TYPES, *DENSE_TYPES))}); "
                "quantize 'none' dequantizes every type that the gguf package reads"
            )
        match = _LAYER_TENSOR.fullmatch(name)
        permuted = match is not None and match.group(2) in heads and match.group(3) == "weight"
        try:
            if keep_quantized and kind in GGUF_TYPES and len(tensor.shape) == 2:
                shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists columns first
                if lazy:
                    order = None
                    if match is not None and permuted:
                        rows = torch.arange(shape[0])[:, None]
                        order = unpermute_qk(rows, heads[match[2]])[:, 0].numpy()
                    part = GGUFPart(name, kind, tensor.data, shape, order)
                    values = GGUFMatrix((part,))
                else:
                    values = from_gguf_blocks(tensor.data, kind, shape)
            else:
                values = torch.from_numpy(_dequantize(tensor))
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(
                f"GGUF file {meta.path!r}: cannot dequantize {name} ({kind}): {exc}"
            ) from exc
        if arch in _GEMMA and name.endswith("norm.weight") and isinstance(values, torch.Tensor):
            values = values - 1  # the converter's 1 + w back to w
        if match is not None and match.group(2) in names:
            layer, kind, suffix = match.groups()
            if permuted and not isinstance(values, GGUFMatrix):  # a lazy one has its order
                if isinstance(values, QuantizedWeight):
                    values = unpermute_qk_rows(values, heads[kind])
                else:
                    values = unpermute_qk(values, heads[kind])
            state_dict[f"model.layers.{layer}.{names[kind]}.{suffix}"] = values
        elif name in _GLOBAL_NAMES:
            state_dict[_GLOBAL_NAMES[name]] = values
        else:
            raise ModelLoadError(f"GGUF file {meta.path!r}: unexpected tensor {name!r}")
    eos = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    eos_ids = tuple(sorted({int(t) for t in eos if t is not None}))
    return GGUFModel(config, state_dict, eos_ids, sum(int(t.n_bytes) for t in reader.tensors))


def _dequantize(tensor: Any) -> np.ndarray:
    """A tensor's values as a fresh float32 array, shaped ``[rows, columns]`` like torch."""
    shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the fastest dimension first
    values = dequantize(tensor.data, tensor.tensor_type)
    return np.array(values, dtype=np.float32).reshape(shape)  # a copy: data maps the file


class _Metadata:
    """Typed access to a GGUF file's key-value metadata."""

    def __init__(self, reader: GGUFFile, path: str) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = None) -> Any:
        return self.reader.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF file {self.path!r}: metadata {key!r} is missing")
        return value


def _config(
    meta: _Metadata, tensors: dict[str, Any], stored: bool
) -> PretrainedConfig | StoredConfig:
    arch = meta.require("general.architecture")
    num_heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(
            f"GGUF file {meta.path!r}: partial rotary embeddings ({rope_dim} of {head_dim} "
            "channels) are not supported"
        )
    embed_rows = int(tensors["token_embd.weight"].shape[1])
    extra = _gemma_fields(meta, arch, hidden, num_heads, head_dim) if arch in _GEMMA else {}
    rope = _rope_parameters(meta, arch, tensors, head_dim)
    if arch == "gemma3":  # its global and local layers' ropes
        local = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        rope = {"full_attention": rope, "sliding_attention": _default_rope(local)}
    fields = dict(
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
        rope_parameters=rope,
    )
    fields |= dict(
        vocab_size=int(meta.get(f"{arch}.vocab_size", embed_rows)),
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.require(f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in tensors,
        **extra,
    )
    model_type = _GEMMA[arch][0] if arch in _GEMMA else arch
    if stored:
        return config_for(model_type, fields, default_cache_dir())
    from transformers import AutoConfig

    config: PretrainedConfig = AutoConfig.for_model(model_type, **fields)
    return config


def _default_rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


def _gemma_fields(
    meta: _Metadata, arch: str, hidden: int, num_heads: int, head_dim: int
) -> dict[str, Any]:
    """A Gemma file's attention fields, as llama.cpp's loader reads them (module docstring)."""
    _, every, layers_27b = _GEMMA[arch]
    num_layers = int(meta.require(f"{arch}.block_count"))
    window = int(meta.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else 0))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern: every n-th layer global
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    if window <= 0:
        sliding = [False] * num_layers
    caps = {
        f"{name}_logit_softcapping": float(value) if value else None
        for name in ("attn", "final")
        for value in [meta.get(f"{arch}.{name}_logit_softcapping")]
    }
    return {
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": hidden // num_heads if num_layers == layers_27b else head_dim,
        **caps,
    }


def _rope_parameters(
    meta: _Metadata, arch: str, tensors: dict[str, Any], head_dim: int
) -> dict[str, Any]:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = float(meta.require(f"{arch}.rope.scaling.factor"))
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if scaling != "none":
        raise ModelLoadError(f"GGUF file {meta.path!r}: rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" not in tensors:
        return _default_rope(theta)
    # Llama 3.x files carry the per-frequency divisors instead of the scaling parameters; find
    # the llama3 parameters that reproduce them.
    divisors = torch.from_numpy(_dequantize(tensors["rope_freqs.weight"])).flatten()
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": float(divisors.max())}
    params.update(_LLAMA3_ROPE)
    plain = default_inv_freq(theta, head_dim)
    if divisors.shape != plain.shape or not torch.allclose(
        plain / llama3_inv_freq(plain, params), divisors, rtol=1e-4
    ):
        raise ModelLoadError(
            f"GGUF file {meta.path!r}: rope_freqs do not match Llama 3 rope scaling {_LLAMA3_ROPE}"
        )
    return params
