"""Published EAGLE draft heads (Li et al. 2024, SafeAILab/EAGLE) as ``eagle`` heads.

An EAGLE head for a Llama target (e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``) is a directory
holding a transformers ``LlamaConfig`` (``config.json``, one hidden layer) and its weights
(``model.safetensors`` or ``pytorch_model.bin``) under these names, an optional ``model.``
prefix allowed:

| name | shape | here |
| --- | --- | --- |
| ``fc.weight`` (``fc.bias`` optional) | ``[D, 2 D]`` | the fusion of ``cat(embed(x), f)`` |
| ``layers.0.self_attn.{q,k,v,o}_proj.weight`` | Llama's | ``wqkv`` (q, k, v stacked), ``wo`` |
| ``layers.0.mlp.{gate,up,down}_proj.weight`` | Llama's | ``w_gate_up`` (stacked), ``w_down`` |
| ``layers.0.post_attention_layernorm.weight`` | ``[D]`` | ``mlp_norm`` |
| ``layers.0.input_layernorm.weight``, ``embed_tokens.weight`` | | unused |

It differs from the heads ``hybridspec distill`` trains in three ways, which ``HeadConfig``
records: the decoder layer has no input norm (EAGLE skips it in its first layer); the head
reads the target's features *after* the final norm (a transformers model's last hidden state)
and its outputs go to the target's LM head as they are; it drafts over the whole vocabulary.
The embedding and LM head are the target's (an ``embed_tokens.weight`` in the file is not
read). EAGLE-3 heads (a ``midlayer``, features from three layers, a draft vocabulary mapped by
``d2t``) and HASS's extra norms (``add_para_norm``) are another architecture and are refused
with a message saying so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hybridspec.errors import check
from hybridspec.proposers.eagle_head import CONFIG_FILE, EagleHead, HeadConfig, TargetParts

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER = "layers.0."
_ATTENTION = tuple(f"{_LAYER}self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))
_MLP = tuple(f"{_LAYER}mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_MLP_NORM = f"{_LAYER}post_attention_layernorm.weight"
_UNUSED = ("embed_tokens.weight", f"{_LAYER}input_layernorm.weight", "lm_head.weight")


def is_eagle_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a published EAGLE head (a ``LlamaConfig`` and weights)
    rather than a head of ``hybridspec distill`` (whose ``config.json`` names its format)."""
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


def head_config(
    data: dict[str, object], parts: TargetParts, intermediate_size: int, fc_bias: bool, source: str
) -> HeadConfig:
    """The ``HeadConfig`` of an EAGLE head's ``LlamaConfig`` fields ``data``."""
    check(
        not data.get("add_para_norm"),
        "head",
        f"{source}: a HASS head (add_para_norm) is not supported; plain EAGLE heads are",
    )
    layers = data.get("num_hidden_layers", 1)
    check(layers == 1, "head", f"{source}: expected one decoder layer, got {layers!r}")
    hidden = data.get("hidden_size")
    heads = data.get("num_attention_heads")
    check(
        isinstance(hidden, int) and isinstance(heads, int) and heads >= 1,
        "head",
        f"{source}: config.json needs integer hidden_size and num_attention_heads",
    )
    assert isinstance(hidden, int) and isinstance(heads, int)
    vocab = int(parts.embed.shape[0])
    rope = data.get("rope_parameters")  # transformers 5; older files: rope_theta, rope_scaling
    rope = rope if isinstance(rope, dict) else {}
    theta = data.get("rope_theta", rope.get("rope_theta", 10000.0))
    for scaling in (data.get("rope_scaling"), rope):
        kind = scaling.get("rope_type", "default") if isinstance(scaling, dict) else scaling
        check(
            kind in (None, "default"),
            "head",
            f"{source}: rope scaling {kind!r} is not supported (plain rope only)",
        )
    return HeadConfig(
        hidden_size=hidden,
        intermediate_size=intermediate_size,
        num_heads=heads,
        num_kv_heads=_number(data.get("num_key_value_heads", heads), int, source),
        head_dim=_number(data.get("head_dim") or hidden // heads, int, source),
        rms_norm_eps=_number(data.get("rms_norm_eps", 1e-6), float, source),
        rope_theta=_number(theta, float, source),
        vocab_size=vocab,
        draft_vocab_size=vocab,
        target=source,
        input_norm=False,
        fc_bias=fc_bias,
        normed_features=True,
    )


def load_eagle_checkpoint(directory: Path, parts: TargetParts) -> EagleHead:
    """The published EAGLE head in ``directory`` (module docstring) over the target's
    ``parts``, in their dtype and device. Raises ValueError naming what does not fit."""
    source = str(directory)
    data = json.loads((directory / CONFIG_FILE).read_text())
    check(isinstance(data, dict), "head", f"{source}: config.json is not a JSON object")
    tensors = read_weights(directory)
    eagle3 = sorted(n for n in tensors if n.startswith("midlayer.") or n in ("d2t", "t2d"))
    check(
        not eagle3,
        "head",
        f"{source}: an EAGLE-3 head ({', '.join(eagle3[:3])}) is not supported; EAGLE heads are",
    )
    needed = ("fc.weight", *_ATTENTION, *_MLP, _MLP_NORM)
    missing = [name for name in needed if name not in tensors]
    check(not missing, "head", f"{source}: missing {missing}")
    known = {*needed, "fc.bias", *_UNUSED}
    unknown = sorted(name for name in tensors if name not in known)
    check(not unknown, "head", f"{source}: unexpected tensors {unknown[:5]}")
    has_bias = "fc.bias" in tensors
    q, k, v, o = (tensors[name] for name in _ATTENTION)
    gate, up, down = (tensors[name] for name in _MLP)
    config = head_config(data, parts, int(gate.shape[0]), has_bias, source)
    state = {
        "fc.weight": tensors["fc.weight"],
        "wqkv.weight": torch.cat((q, k, v)),
        "wo.weight": o,
        "mlp_norm": tensors[_MLP_NORM],
        "w_gate_up.weight": torch.cat((gate, up)),
        "w_down.weight": down,
        "draft_vocab": torch.arange(config.vocab_size),
    }
    if has_bias:
        state["fc.bias"] = tensors["fc.bias"]
    head = EagleHead(config, parts, state["draft_vocab"])
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    wrong = [
        f"{name} {tuple(t.shape)} (expected {expected[name]})"
        for name, t in state.items()
        if tuple(t.shape) != expected[name]
    ]
    check(not wrong, "head", f"{source}: shapes do not fit the target: {wrong[:3]}")
    head.load_state_dict(state, strict=True)
    return head.to(dtype=parts.embed.dtype, device=parts.embed.device).eval()


def _number(value: object, kind: type[int] | type[float], source: str) -> Any:
    check(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        "head",
        f"{source}: config.json has {value!r} where a number belongs",
    )
    assert isinstance(value, (int, float))
    return kind(value)
