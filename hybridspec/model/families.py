"""The model families the native forward runs, each one small frozen description.

A ``Family`` says what sets an architecture's decoder layer apart from Llama's; the one forward
(``model.llama``) and the weight fusing (``model.llama_weights``) read it, so that a family is
a row of ``FAMILIES`` and not a branch through the runtime:

| family | transformers ``model_type`` | GGUF ``general.architecture`` | what differs from Llama |
| --- | --- | --- | --- |
| ``llama`` | ``llama`` | ``llama`` | nothing (Llama 2/3.x, rope scaling default/linear/llama3) |
| ``mistral`` | ``mistral`` | ``llama`` (llama.cpp converts dense Mistral as Llama) | nothing |
| ``qwen2`` | ``qwen2`` | ``qwen2`` | biases on q, k and v |
| ``qwen3`` | ``qwen3`` | ``qwen3`` | an RMSNorm over each head of q and of k, before rope |
| ``phi3`` | ``phi3`` | ``phi3`` | fused ``qkv_proj`` and ``gate_up_proj`` in checkpoints |

A sliding attention window (Mistral v0.1's ``sliding_window``, Phi-3's, Qwen's when
``use_sliding_window``) is not applied by the forward: instead the model's context length is
capped at the window, within which windowed attention and full attention are the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture's differences from Llama's decoder layer (see the module's table)."""

    name: str  # the transformers model_type
    qkv_bias: bool = False  # q, k and v projections add a bias
    qk_norm: bool = False  # RMSNorm (weights [hd], eps rms_norm_eps) on each head of q and k
    fused_checkpoint: bool = False  # transformers names: qkv_proj and gate_up_proj, fused


FAMILIES = {
    family.name: family
    for family in (
        Family("llama"),
        Family("mistral"),
        Family("qwen2", qkv_bias=True),
        Family("qwen3", qk_norm=True),
        Family("phi3", fused_checkpoint=True),
    )
}
LLAMA = FAMILIES["llama"]


def family_of(config: PretrainedConfig) -> Family:
    """The family of a transformers config; ValueError for a model_type not in ``FAMILIES``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"config: model_type is {model_type!r}, not one of {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def family_problem(config: PretrainedConfig) -> str | None:
    """Why ``config`` is not one the family's description covers, or None."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model_type is {model_type!r}, not one of {', '.join(FAMILIES)}"
    if model_type in ("llama", "qwen3", "mistral"):
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                return f"{flag} is set"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act is {config.hidden_act!r}, not 'silu'"
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if float(partial or 1.0) != 1.0:
        return "partial_rotary_factor is not 1 (partial rotary embeddings)"
    return None


def attention_window(config: PretrainedConfig) -> int | None:
    """The sliding attention window ``config`` applies to every layer, or None."""
    if getattr(config, "use_sliding_window", True) is False:  # Qwen: off unless asked
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if isinstance(window, int) and window > 0 else None
