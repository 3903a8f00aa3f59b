"""Tiny random models of every family of ``model.families``, built with transformers' own
classes (float32, seeded), and GGUF files of them written with the ``gguf`` package's writer
the way llama.cpp's converter names their tensors (tests only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from hybridspec.model.gguf import permute_qk
from tests.conftest import (
    TINY_BOS,
    TINY_EOS,
    TINY_SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    byte_level_tokens,
)

FAMILY_NAMES = ("qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3")
# Gemma: a window of 8 keys on the first (local) layer, shorter than the tests' prompts.
# query_pre_attn_scalar: Gemma 3's is head_dim (a GGUF file holds no other), Gemma 2's is not.
_GEMMA = {
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
}
_MODEL_TYPES = {"gemma3": "gemma3_text"}
GGUF_READY: dict[str, dict[str, Any]] = {"gemma2": {"query_pre_attn_scalar": 32}}
_EXTRA: dict[str, dict[str, Any]] = {
    "gemma2": _GEMMA
    | {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 10.0},
    "gemma3": _GEMMA,
    "qwen2": {},
    "qwen3": {"head_dim": 32},  # head_dim * heads != hidden, as in Qwen3's own models
    "mistral": {"sliding_window": None},
    "phi3": {"pad_token_id": TINY_EOS},
}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up in one tensor
    "mlp.down_proj": "ffn_down",
}
_GGUF_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def family_config(family: str, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """A tiny config of ``family`` (two layers, grouped-query attention, untied)."""
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "bos_token_id": TINY_BOS if vocab_size > TINY_BOS else 0,
        "eos_token_id": TINY_EOS if vocab_size > TINY_EOS else vocab_size - 1,
        "tie_word_embeddings": False,
    }
    fields |= _EXTRA[family] | overrides
    if fields.get("pad_token_id") is not None:
        fields["pad_token_id"] = fields["eos_token_id"]
    return AutoConfig.for_model(_MODEL_TYPES.get(family, family), **fields)


def tiny_family(
    family: str, seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE, **overrides: Any
) -> Any:
    """A seeded random model of ``family`` in float32, eval mode: norms and biases away from
    their defaults (1 and 0), so that a norm or a bias mixed up shows in the logits."""
    torch.manual_seed(seed)
    config = family_config(family, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    norm_one = 0.0 if family.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + w
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
            elif "norm" in name:
                param.copy_(norm_one + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.5 * torch.randn_like(param))
    return model


# A SentencePiece vocabulary as Gemma's GGUF files hold theirs (tokenizer model "llama"): Gemma's
# special ids (pad 0, eos 1, bos 2, unk 3), its turn markers, byte fallback, a few pieces.
_SPM_PIECES = ["▁", "H", "i", "▁t", "h", "e", "r", "▁the", "re", "t"]
SPM_TOKENS = (
    ["<pad>", "</s>", "<s>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    + [f"<0x{b:02X}>" for b in range(256)]
    + _SPM_PIECES
)
SPM_EOS = 1
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _add_spm_vocabulary(writer: GGUFWriter) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    writer.add_token_scores([0.0] * 262 + [-float(i) for i in range(len(_SPM_PIECES))])
    writer.add_token_types([3, 3, 3, 2, 4, 4] + [6] * 256 + [1] * len(_SPM_PIECES))
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(SPM_EOS)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(GEMMA_CHAT_TEMPLATE)


def write_family_gguf(path: Path, model: PreTrainedModel, spm: bool = False) -> Path:
    """Write ``model`` (F32, the tiny byte-level vocabulary, or with ``spm`` ``SPM_TOKENS``)
    with llama.cpp's tensor names for its architecture: ``llama`` (q/k rows permuted) for
    Mistral, else the family's own; Gemma's norms as ``1 + w`` and its windows' metadata, as
    llama.cpp's converter writes them."""
    config = model.config
    arch = {"mistral": "llama", "gemma3_text": "gemma3"}.get(config.model_type, config.model_type)
    gemma = arch.startswith("gemma")
    writer = GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    if gemma:
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
        if "sliding_attention" in rope:
            writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        if config.attn_logit_softcapping:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if spm:
        _add_spm_vocabulary(writer)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(byte_level_tokens())
        writer.add_token_types([1] * 256 + [3] * len(TINY_SPECIAL_TOKENS))
        writer.add_token_merges([])
        writer.add_token_scores([0.0] * len(byte_level_tokens()))
        writer.add_bos_token_id(TINY_BOS)
        writer.add_eos_token_id(TINY_EOS)
    for name, tensor in model.state_dict().items():
        if name in _GGUF_GLOBAL_NAMES:
            gguf_name = _GGUF_GLOBAL_NAMES[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            base, suffix = rest.rsplit(".", 1)
            names = _GGUF_LAYER_NAMES | (_GGUF_GEMMA_NAMES if gemma else {})
            gguf_name = f"blk.{layer}.{names[base]}.{suffix}"
            if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = (
                    config.num_attention_heads if "q_proj" in base else config.num_key_value_heads
                )
                tensor = permute_qk(tensor, heads)
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1
        writer.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
