"""Published EAGLE heads: a small head written in EAGLE's layout loads, computes what EAGLE's
architecture computes (a transformers Llama layer without its input norm over normed target
features, the LM head on its outputs), drafts losslessly through the engine, and heads of
another architecture are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaModel

from hybridspec import GenerationParams
from hybridspec.config import EagleConfig
from hybridspec.errors import InvalidRequestError
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers.eagle import SHIPPED_HEADS, target_parts
from hybridspec.proposers.eagle_head import HeadCache, forward_cached
from hybridspec.proposers.eagle_import import is_eagle_checkpoint, load_eagle_checkpoint
from tests.engine.tiny import PROMPTS, make_engine, plain, tiny_loaded

INTERMEDIATE = 96


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_loaded(0)


def eagle_layer(target: LoadedModel, seed: int = 5) -> LlamaModel:
    """A one-layer transformers Llama at the target's width: EAGLE's decoder layer."""
    hf = target.hf_config
    config = LlamaConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=1,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = LlamaModel(config).eval()
    with torch.no_grad():  # norms away from 1, so that a misplaced norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def write_eagle_head(
    directory: Path, target: LoadedModel, layer: LlamaModel, fc: nn.Linear, **extra: torch.Tensor
) -> Path:
    """``layer`` and ``fc`` saved as EAGLE saves a head (module docstring of eagle_import)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"layers.0.{k}": v for k, v in layer.layers[0].state_dict().items()}
    tensors["fc.weight"] = fc.weight.detach()
    if fc.bias is not None:
        tensors["fc.bias"] = fc.bias.detach()
    tensors["embed_tokens.weight"] = target_parts(target).embed.detach()
    tensors.update(extra)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = layer.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("bias", [False, True])
def test_the_head_computes_eagles_architecture(
    target: LoadedModel, tmp_path: Path, bias: bool
) -> None:
    layer = eagle_layer(target)
    torch.manual_seed(6)
    fc = nn.Linear(2 * layer.config.hidden_size, layer.config.hidden_size, bias=bias)
    directory = write_eagle_head(tmp_path / "head", target, layer, fc)
    assert is_eagle_checkpoint(directory)
    parts = target_parts(target)
    head = load_eagle_checkpoint(directory, parts)
    assert head.config.draft_vocab_size == head.config.vocab_size  # the whole vocabulary
    # the reference: EAGLE's forward, in transformers, with the input norm of layer 0 skipped
    layer.layers[0].input_layernorm = nn.Identity()
    layer.norm = nn.Identity()
    raw = torch.randn(12, layer.config.hidden_size)  # the target's last-layer outputs
    normed = torch.nn.functional.rms_norm(
        raw, (raw.shape[-1],), parts.norm, target.hf_config.rms_norm_eps
    )
    next_ids = torch.randint(0, parts.embed.shape[0], (12,))
    with torch.no_grad():
        fused = fc(torch.cat((parts.embed[next_ids], normed), dim=-1))
        want = layer(inputs_embeds=fused[None]).last_hidden_state[0]
        features = head.target_features(raw)
        torch.testing.assert_close(features, normed)
        cache = HeadCache(head.config, torch.float32, torch.device("cpu"))
        got = forward_cached(head, cache, [cache.allocate()], features, next_ids, [12])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # logits: the target's LM head on the head's outputs, no norm between
        torch.testing.assert_close(head.logits(got), got @ parts.lm_head.T, rtol=1e-4, atol=1e-5)


def test_greedy_text_with_a_published_head_equals_plain_decoding(
    target: LoadedModel, tmp_path: Path
) -> None:
    layer = eagle_layer(target)
    fc = nn.Linear(2 * layer.config.hidden_size, layer.config.hidden_size, bias=False)
    directory = write_eagle_head(tmp_path / "head", target, layer, fc)
    engine = make_engine(target, eagle=EagleConfig(head=str(directory), cost_per_token=0.0))
    drafted = 0
    for prompt in PROMPTS[:4]:
        params = GenerationParams(max_new_tokens=30, proposer="eagle", num_speculative_tokens=4)
        result = engine.generate(prompt_token_ids=prompt, params=params)
        assert result.token_ids == plain(engine, prompt, 30)
        drafted += result.stats.draft_tokens_proposed
    assert drafted > 0


def test_other_architectures_and_broken_heads_are_refused_by_name(
    target: LoadedModel, tmp_path: Path
) -> None:
    layer = eagle_layer(target)
    fc = nn.Linear(2 * layer.config.hidden_size, layer.config.hidden_size, bias=False)
    parts = target_parts(target)
    eagle3 = write_eagle_head(
        tmp_path / "eagle3", target, layer, fc, d2t=torch.zeros(4, dtype=torch.int64)
    )
    with pytest.raises(InvalidRequestError, match="EAGLE-3"):
        load_eagle_checkpoint(eagle3, parts)
    hass = write_eagle_head(tmp_path / "hass", target, layer, fc)
    config = json.loads((hass / "config.json").read_text())
    (hass / "config.json").write_text(json.dumps({**config, "add_para_norm": True}))
    with pytest.raises(InvalidRequestError, match="HASS"):
        load_eagle_checkpoint(hass, parts)
    scaled = write_eagle_head(tmp_path / "scaled", target, layer, fc)
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    (scaled / "config.json").write_text(json.dumps({**config, "rope_scaling": llama3}))
    with pytest.raises(InvalidRequestError, match="rope scaling 'llama3'"):
        load_eagle_checkpoint(scaled, parts)
    broken = write_eagle_head(tmp_path / "broken", target, layer, fc)
    from safetensors.torch import load_file

    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(InvalidRequestError, match="down_proj"):
        load_eagle_checkpoint(broken, parts)
    wide = write_eagle_head(tmp_path / "wide", target, layer, nn.Linear(64, 32, bias=False))
    with pytest.raises(InvalidRequestError, match="shapes"):
        load_eagle_checkpoint(wide, parts)
    # the heads hybridspec distill writes are not EAGLE checkpoints
    assert not any(is_eagle_checkpoint(p) for p in SHIPPED_HEADS.iterdir())
