"""Published EAGLE and EAGLE-3 draft heads (SafeAILab/EAGLE) as ``eagle`` heads.

A published head for a Llama target is a directory holding a transformers ``LlamaConfig``
(``config.json``, one hidden layer) and its weights (``model.safetensors`` or
``pytorch_model.bin``), an optional ``model.`` prefix on the names allowed. The target's
embedding is used unless the file has its own ``embed_tokens.weight`` (EAGLE-3).

**EAGLE** (e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``), run as an ``EagleHead``:

| name | shape | here |
| --- | --- | --- |
| ``fc.weight`` (``fc.bias`` optional) | ``[D, 2 D]`` | the fusion of ``cat(embed(x), f)`` |
| ``layers.0.self_attn.{q,k,v,o}_proj.weight`` | Llama's | ``wqkv`` (q, k, v stacked), ``wo`` |
| ``layers.0.mlp.{gate,up,down}_proj.weight`` | Llama's | ``w_gate_up`` (stacked), ``w_down`` |
| ``layers.0.post_attention_layernorm.weight`` | ``[D]`` | ``mlp_norm`` |
| ``layers.0.input_layernorm.weight``, ``embed_tokens.weight`` | | unused |

It differs from the heads ``hybridspec distill`` trains in three ways, which ``HeadConfig``
records: the decoder layer has no input norm (EAGLE skips it in its first layer); the head
reads the target's last hidden state *after* the final norm and its outputs go to the target's
LM head as they are; it drafts over the whole vocabulary.

**EAGLE-3** (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``), run as an ``Eagle3Head``: the
target's hidden states at three layers (the inputs of layers ``eagle_config.
eagle_aux_hidden_state_layer_ids``, by default 2, L / 2 and L - 3 of the target's L, i.e. the
outputs of the layers before them) are concatenated and fused by ``fc [D, 3 D]``. The decoder
layer (``midlayer.*``) normalizes the token's embedding (``input_layernorm``) and those
features (``hidden_norm``), attends with q/k/v projected from both side by side (``[., 2 D]``),
adds the attention output to the un-normed features (the residual; the normed ones with
``norm_before_residual``), then the MLP as Llama's. Its output, before the final ``norm``, is
fed back as the next step's features; after it, ``lm_head [S, D]`` gives logits over a draft
vocabulary whose entry ``i`` is the target's token ``i + d2t[i]``.

Rope follows the head's config (default, linear or llama3 scaling, as the target's runtime
does). HASS heads (``add_para_norm``) are refused with a message saying so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridspec.errors import InvalidRequestError, check
from hybridspec.model import rope_inv_freq
from hybridspec.proposers.eagle.config import CONFIG_FILE, DraftHead, HeadConfig, TargetParts
from hybridspec.proposers.eagle.head import DecoderLayerHead, EagleHead

if TYPE_CHECKING:  # imported where a head is read: the class costs about a second to import
    from transformers import LlamaConfig

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_ATTENTION = tuple(f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))
_MLP = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))


def is_eagle_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a published EAGLE or EAGLE-3 head (a ``LlamaConfig`` and
    weights) rather than a head of ``hybridspec distill`` (whose ``config.json`` names its
    format)."""
    config_path = directory / CONFIG_FILE
    if not config_path.is_file() or not any((directory / f).is_file() for f in WEIGHT_FILES):
        return False
    try:
        data = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "format" not in data and "hidden_size" in data


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The head's tensors by name, an optional ``model.`` prefix removed."""
    safetensors, pickled = (directory / name for name in WEIGHT_FILES)
    if safetensors.is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(safetensors))
    else:
        tensors = torch.load(pickled, map_location="cpu", weights_only=True)
        check(isinstance(tensors, dict), "head", f"{pickled}: expected a state dict")
    return {name.removeprefix("model."): tensor for name, tensor in tensors.items()}


def load_eagle_checkpoint(directory: Path, parts: TargetParts, target_layers: int) -> DraftHead:
    """The published head in ``directory`` (module docstring) over the target's ``parts``
    (``target_layers`` decoder layers), in their dtype and device. Raises
    ``InvalidRequestError`` naming what does not fit."""
    source = str(directory)
    data = json.loads((directory / CONFIG_FILE).read_text())
    check(isinstance(data, dict), "head", f"{source}: config.json is not a JSON object")
    check(
        not data.get("add_para_norm"),
        "head",
        f"{source}: a HASS head (add_para_norm) is not supported; EAGLE and EAGLE-3 heads are",
    )
    layers = data.get("num_hidden_layers", 1)
    check(layers == 1, "head", f"{source}: expected one decoder layer, got {layers!r}")
    tensors = read_weights(directory)
    eagle3 = any(name.startswith("midlayer.") for name in tensors)
    if eagle3:
        head: DraftHead = _eagle3(data, tensors, parts, target_layers, source)
    else:
        head = _eagle(data, tensors, parts, source)
    assert isinstance(head, nn.Module)
    return head.to(dtype=parts.embed.dtype, device=parts.embed.device).eval()


def _eagle(
    data: dict[str, Any], tensors: dict[str, torch.Tensor], parts: TargetParts, source: str
) -> EagleHead:
    layer = "layers.0."
    needed = ("fc.weight", *_layer_names(layer))
    optional = ("fc.bias", "embed_tokens.weight", f"{layer}input_layernorm.weight")
    _check_names(tensors, needed, optional, source)
    state = _layer_state(tensors, layer)
    has_bias = "fc.bias" in tensors
    config = dataclasses.replace(
        _head_config(data, parts, state, int(parts.embed.shape[0]), source),
        input_norm=False,
        fc_bias=has_bias,
        normed_features=True,
    )
    state["fc.weight"] = tensors["fc.weight"]
    state["draft_vocab"] = torch.arange(config.vocab_size)
    if has_bias:
        state["fc.bias"] = tensors["fc.bias"]
    head = EagleHead(config, parts, state["draft_vocab"])
    _load_state(head, state, source)
    head.inv_freq = _inv_freq(data, source)
    return head


class Eagle3Head(DecoderLayerHead):
    """An EAGLE-3 head (module docstring) behind the ``DraftHead`` protocol.

    ``fuse`` returns the normed embedding, the normed features and the features side by side
    (``[..., 3 D]``): ``qkv`` reads the first two, ``finish`` the last (the residual).
    """

    draft_vocab: torch.Tensor

    def __init__(
        self,
        config: HeadConfig,
        parts: TargetParts,
        draft_vocab: torch.Tensor,
        feature_layers: tuple[int, ...],
        fc_in_features: int,
        embed: torch.Tensor | None,
        norm_before_residual: bool,
    ) -> None:
        super().__init__()
        c = config
        d, q_width, kv_width = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.config, self.parts, self.feature_layers = c, parts, feature_layers
        self.fc = nn.Linear(fc_in_features, d, bias=False)
        self.input_norm = nn.Parameter(torch.ones(d))
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.wqkv = nn.Linear(2 * d, q_width + 2 * kv_width, bias=False)
        self.wo = nn.Linear(q_width, d, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Linear(d, 2 * c.intermediate_size, bias=False)
        self.w_down = nn.Linear(c.intermediate_size, d, bias=False)
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=True)
        self.embed = nn.Parameter(embed, requires_grad=False) if embed is not None else None
        self.norm_before_residual = norm_before_residual
        self.inv_freq = torch.ones(c.head_dim // 2)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.config.hidden_size,), weight, self.config.rms_norm_eps)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` of the target's layers side by side: ``[rows, 3, D_t]`` -> ``[rows, D]``."""
        return self.fc(hidden.flatten(1).to(self.norm.dtype))

    def fuse(self, features: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed if self.embed is not None else self.parts.embed
        embedded = self._rms(F.embedding(next_token_ids, table), self.input_norm)
        features = features.to(embedded.dtype)
        normed = self._rms(features, self.hidden_norm)
        residual = normed if self.norm_before_residual else features
        return torch.cat((embedded, normed, residual), dim=-1)

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.project(x[..., : 2 * self.config.hidden_size], positions)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Predicted features before the final norm (what is fed back)."""
        return self.layer_rest(x[..., 2 * self.config.hidden_size :], attended)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._rms(features.to(self.norm.dtype), self.norm))


def _eagle3(
    data: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    parts: TargetParts,
    target_layers: int,
    source: str,
) -> Eagle3Head:
    layer = "midlayer."
    norms = (f"{layer}input_layernorm.weight", f"{layer}hidden_norm.weight")
    needed = ("fc.weight", "norm.weight", "lm_head.weight", *_layer_names(layer), *norms)
    _check_names(tensors, needed, ("d2t", "t2d", "embed_tokens.weight"), source)
    state = _layer_state(tensors, layer)
    draft_size = int(tensors["lm_head.weight"].shape[0])
    vocab = int(parts.embed.shape[0])
    config = _head_config(data, parts, state, draft_size, source)
    if "d2t" in tensors:
        draft_vocab = torch.arange(draft_size) + tensors["d2t"].long()
    else:
        check(draft_size == vocab, "head", f"{source}: a draft vocabulary needs d2t")
        draft_vocab = torch.arange(vocab)
    check(
        draft_vocab.shape == (draft_size,)
        and int(draft_vocab.min()) >= 0
        and int(draft_vocab.max()) < vocab
        and draft_vocab.unique().numel() == draft_size,
        "head",
        f"{source}: d2t does not map {draft_size} draft ids to distinct ids below {vocab}",
    )
    ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids or [2, target_layers // 2, target_layers - 3]
    check(
        isinstance(ids, list) and all(isinstance(i, int) and 1 <= i <= target_layers for i in ids),
        "head",
        f"{source}: feature layer ids {ids!r} are not inputs of the target's "
        f"{target_layers} layers (1..{target_layers})",
    )
    embed = tensors.get("embed_tokens.weight")
    head = Eagle3Head(
        config,
        parts,
        draft_vocab,
        tuple(i - 1 for i in ids),  # the input of layer i is the output of layer i - 1
        int(tensors["fc.weight"].shape[1]),
        embed,
        bool(data.get("norm_before_residual", False)),
    )
    state.update(
        {
            "fc.weight": tensors["fc.weight"],
            "input_norm": tensors[norms[0]],
            "hidden_norm": tensors[norms[1]],
            "norm": tensors["norm.weight"],
            "lm_head.weight": tensors["lm_head.weight"],
            "draft_vocab": draft_vocab,
        }
    )
    if embed is not None:
        state["embed"] = embed
    expected_fc = len(ids) * int(parts.embed.shape[1])
    check(
        head.fc.weight.shape[1] == expected_fc,
        "head",
        f"{source}: fc reads {head.fc.weight.shape[1]} features, the target's {len(ids)} "
        f"layers give {expected_fc}",
    )
    _load_state(head, state, source)
    head.inv_freq = _inv_freq(data, source)
    return head


def _layer_names(layer: str) -> tuple[str, ...]:
    """The tensors of a Llama decoder layer under ``layer`` that both formats need."""
    return (*(layer + n for n in (*_ATTENTION, *_MLP)), f"{layer}post_attention_layernorm.weight")


def _layer_state(tensors: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    """The decoder layer under ``layer`` as the heads hold it: q/k/v and gate/up stacked."""
    q, k, v, o = (tensors[layer + name] for name in _ATTENTION)
    gate, up, down = (tensors[layer + name] for name in _MLP)
    return {
        "wqkv.weight": torch.cat((q, k, v)),
        "wo.weight": o,
        "mlp_norm": tensors[f"{layer}post_attention_layernorm.weight"],
        "w_gate_up.weight": torch.cat((gate, up)),
        "w_down.weight": down,
    }


def _check_names(
    tensors: dict[str, torch.Tensor],
    needed: tuple[str, ...],
    optional: tuple[str, ...],
    source: str,
) -> None:
    missing = [name for name in needed if name not in tensors]
    check(not missing, "head", f"{source}: missing {missing}")
    unknown = sorted(set(tensors) - set(needed) - set(optional))
    check(not unknown, "head", f"{source}: unexpected tensors {unknown[:5]}")


def _load_state(head: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    wrong = [
        f"{name} {tuple(t.shape)} (expected {expected.get(name)})"
        for name, t in state.items()
        if tuple(t.shape) != expected.get(name)
    ]
    check(not wrong, "head", f"{source}: shapes do not fit the target: {wrong[:3]}")
    head.load_state_dict(state, strict=True)


def _head_config(
    data: dict[str, Any],
    parts: TargetParts,
    layer_state: dict[str, torch.Tensor],
    draft_vocab_size: int,
    source: str,
) -> HeadConfig:
    hidden, heads = data.get("hidden_size"), data.get("num_attention_heads")
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads >= 1):
        raise _refused(f"{source}: config.json needs integer hidden_size and num_attention_heads")
    return HeadConfig(
        hidden_size=hidden,
        intermediate_size=int(layer_state["w_down.weight"].shape[1]),
        num_heads=heads,
        num_kv_heads=_number(data.get("num_key_value_heads", heads), int, source),
        head_dim=_number(data.get("head_dim") or hidden // heads, int, source),
        rms_norm_eps=_number(data.get("rms_norm_eps", 1e-6), float, source),
        rope_theta=_number(_rope_theta(_llama_config(data, source)), float, source),
        vocab_size=int(parts.embed.shape[0]),
        draft_vocab_size=draft_vocab_size,
        target=source,
    )


def _refused(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"head: {message}", "head")


def _llama_config(data: dict[str, Any], source: str) -> LlamaConfig:
    from transformers import LlamaConfig

    try:
        return LlamaConfig(**data)
    except (KeyError, TypeError, ValueError) as exc:
        raise _refused(f"{source}: config.json is not a Llama config: {exc}") from exc


def _rope_theta(config: LlamaConfig) -> object:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def _inv_freq(data: dict[str, Any], source: str) -> torch.Tensor:
    """The head's rope frequencies, scaled as its config says (``model.rope_inv_freq``)."""
    config = _llama_config(data, source)
    try:
        return rope_inv_freq(config)
    except (KeyError, ValueError) as exc:
        raise _refused(f"{source}: rope {exc}") from exc


def _number(value: object, kind: type[int] | type[float], source: str) -> Any:
    check(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        "head",
        f"{source}: config.json has {value!r} where a number belongs",
    )
    assert isinstance(value, (int, float))
    return kind(value)
