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
| ``gemma2`` | ``gemma2`` | ``gemma2`` | Gemma's layer (below), soft-capped scores and logits |
| ``gemma3`` | ``gemma3_text`` | ``gemma3`` | Gemma's layer, q/k norms, the local layers' rope |

Gemma's layer: RMSNorms scale by ``1 + w`` (the 1 is added to ``w`` at load, so every norm runs
as Llama's), a norm after attention and one after the MLP, each before its residual add, the
MLP's ``gelu_tanh(gate) * up``, embeddings scaled by ``sqrt(hidden_size)``, attention scaled by
``query_pre_attn_scalar ** -0.5``, and sliding-window layers (``layer_types``) among global ones:
a query of a local layer attends only the last ``sliding_window`` keys (``attention.Scoring``).

A sliding attention window on every layer (Mistral v0.1's ``sliding_window``, Phi-3's, Qwen's
when ``use_sliding_window``) is not applied by the forward: instead the model's context length
is capped at the window, within which windowed attention and full attention are the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the class's import costs about a second: the native GGUF path needs none
    from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture's differences from Llama's decoder layer (see the module's table)."""

    name: str  # the transformers model_type
    qkv_bias: bool = False  # q, k and v projections add a bias
    qk_norm: bool = False  # RMSNorm (weights [hd], eps rms_norm_eps) on each head of q and k
    fused_checkpoint: bool = False  # transformers names: qkv_proj and gate_up_proj, fused
    model_type: str = ""  # transformers' model_type where it is not ``name``
    gemma_layer: bool = False  # (1 + w) norms, post-norms, GeGLU, scaled embeddings, windows
    activation: str = "silu"  # the MLP's: transformers' hidden_act(ivation) name

    @property
    def transformers_type(self) -> str:
        return self.model_type or self.name

    @property
    def norm_offset(self) -> float:
        """What the forward adds to every RMSNorm weight of a checkpoint (Gemma's ``1 + w``)."""
        return 1.0 if self.gemma_layer else 0.0


FAMILIES = {
    family.name: family
    for family in (
        Family("llama"),
        Family("mistral"),
        Family("qwen2", qkv_bias=True),
        Family("qwen3", qk_norm=True),
        Family("phi3", fused_checkpoint=True),
        Family("gemma2", gemma_layer=True, activation="gelu_pytorch_tanh"),
        Family(
            "gemma3",
            qk_norm=True,
            model_type="gemma3_text",
            gemma_layer=True,
            activation="gelu_pytorch_tanh",
        ),
    )
}
LLAMA = FAMILIES["llama"]
_BY_MODEL_TYPE = {family.transformers_type: family for family in FAMILIES.values()}


def family_of(config: PretrainedConfig) -> Family:
    """The family of a transformers config; ValueError for a model_type not in ``FAMILIES``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"config: model_type is {model_type!r}, not one of {', '.join(_BY_MODEL_TYPE)}"
        )
    return _BY_MODEL_TYPE[model_type]


def family_problem(config: PretrainedConfig) -> str | None:
    """Why ``config`` is not one the family's description covers, or None."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _BY_MODEL_TYPE:
        return f"model_type is {model_type!r}, not one of {', '.join(_BY_MODEL_TYPE)}"
    family = _BY_MODEL_TYPE[model_type]
    if model_type in ("llama", "qwen3", "mistral", "gemma2", "gemma3_text"):
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                return f"{flag} is set"
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if (activation or "silu") != family.activation:
        return f"hidden_act is {activation!r}, not {family.activation!r}"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention is set"
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if float(partial or 1.0) != 1.0:
        return "partial_rotary_factor is not 1 (partial rotary embeddings)"
    return None


def attention_window(config: PretrainedConfig) -> int | None:
    """The sliding attention window ``config`` applies to every layer, or None (Gemma's windows
    are per layer: ``layer_windows``)."""
    if getattr(config, "use_sliding_window", True) is False:  # Qwen: off unless asked
        return None
    family = _BY_MODEL_TYPE.get(str(getattr(config, "model_type", "")))
    if family is not None and family.gemma_layer:
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if isinstance(window, int) and window > 0 else None


def layer_windows(config: PretrainedConfig) -> tuple[int, ...]:
    """Each layer's sliding window (0: a global layer) for Gemma's interleaved layers, from
    ``layer_types``; () for a family whose layers all attend every key."""
    if not family_of(config).gemma_layer:
        return ()
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def attention_scale(config: PretrainedConfig) -> float | None:
    """The attention scores' scale (Gemma's ``query_pre_attn_scalar ** -0.5``), or None for
    ``head_dim ** -0.5``."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return float(scalar) ** -0.5 if family_of(config).gemma_layer and scalar else None
