"""Published EAGLE and EAGLE-3 heads: small heads written in their layouts load, compute what
their architectures compute (EAGLE: a transformers Llama layer without its input norm over
normed target features, the LM head on its outputs; EAGLE-3: a reference written here from the
format's description), draft losslessly through the engine, and what does not fit is refused
by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from hybridspec import GenerationParams
from hybridspec.config import EagleConfig
from hybridspec.errors import InvalidRequestError
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers.eagle import (
    SHIPPED_HEADS,
    HeadCache,
    forward_cached,
    is_eagle_checkpoint,
    load_eagle_checkpoint,
    target_parts,
)
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
    """``layer`` and ``fc`` saved as EAGLE saves a head (``eagle.published``'s docstring)."""
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
    head = load_eagle_checkpoint(directory, parts, 2)
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
        features = head.target_features(raw[:, None])  # [rows, 1 layer, D]
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
    assert_drafts_losslessly(target, write_eagle_head(tmp_path / "head", target, layer, fc), (4,))


def assert_drafts_losslessly(target: LoadedModel, head: Path, ks: tuple[int, ...]) -> None:
    """Greedy ``eagle`` text with the head in ``head`` equals plain decoding, and it drafts."""
    engine = make_engine(target, eagle=EagleConfig(head=str(head), cost_per_token=0.0))
    drafted = 0
    for prompt in PROMPTS[:4]:
        for k in ks:
            params = GenerationParams(max_new_tokens=30, proposer="eagle", num_speculative_tokens=k)
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
    hass = write_eagle_head(tmp_path / "hass", target, layer, fc)
    config = json.loads((hass / "config.json").read_text())
    (hass / "config.json").write_text(json.dumps({**config, "add_para_norm": True}))
    with pytest.raises(InvalidRequestError, match="HASS"):
        load_eagle_checkpoint(hass, parts, 2)
    scaled = write_eagle_head(tmp_path / "scaled", target, layer, fc)
    (scaled / "config.json").write_text(
        json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    )
    with pytest.raises(InvalidRequestError, match="rope"):
        load_eagle_checkpoint(scaled, parts, 2)
    broken = write_eagle_head(tmp_path / "broken", target, layer, fc)
    from safetensors.torch import load_file

    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(InvalidRequestError, match="down_proj"):
        load_eagle_checkpoint(broken, parts, 2)
    wide = write_eagle_head(tmp_path / "wide", target, layer, nn.Linear(64, 32, bias=False))
    with pytest.raises(InvalidRequestError, match="shapes"):
        load_eagle_checkpoint(wide, parts, 2)
    # the heads hybridspec distill writes are not EAGLE checkpoints
    assert not any(is_eagle_checkpoint(p) for p in SHIPPED_HEADS.iterdir())


def test_rope_scaling_follows_the_heads_config(target: LoadedModel, tmp_path: Path) -> None:
    layer = eagle_layer(target)
    fc = nn.Linear(2 * layer.config.hidden_size, layer.config.hidden_size, bias=False)
    directory = write_eagle_head(tmp_path / "head", target, layer, fc)
    config = json.loads((directory / "config.json").read_text())
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config.pop("rope_parameters", None)
    (directory / "config.json").write_text(json.dumps({**config, "rope_scaling": llama3}))
    head = load_eagle_checkpoint(directory, target_parts(target), 2)
    want = LlamaRotaryEmbedding(LlamaConfig(**json.loads((directory / "config.json").read_text())))
    torch.testing.assert_close(head.inv_freq, want.inv_freq.float())


# ------------------------------------------------------------------------------------ EAGLE-3


def write_eagle3_head(
    directory: Path, target: LoadedModel, draft_size: int, ids: list[int], seed: int = 7
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random EAGLE-3 head in its published layout over ``target`` (module docstring of
    proposers.eagle.published): the layer ids of its features are ``ids``."""
    hf = target.hf_config
    d, heads, kv = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
    hd = d // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm() -> torch.Tensor:
        return torch.rand(d, generator=gen) + 0.5

    vocab = hf.vocab_size
    d2t = torch.randperm(vocab, generator=gen)[:draft_size].sort().values - torch.arange(draft_size)
    tensors = {
        "fc.weight": rand(d, len(ids) * d),
        "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": rand(kv * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": rand(kv * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": rand(d, heads * hd),
        "midlayer.mlp.gate_proj.weight": rand(INTERMEDIATE, d),
        "midlayer.mlp.up_proj.weight": rand(INTERMEDIATE, d),
        "midlayer.mlp.down_proj.weight": rand(d, INTERMEDIATE),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": rand(draft_size, d, scale=1.0),
        "d2t": d2t,
        "t2d": torch.zeros(vocab, dtype=torch.bool),
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": d,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": draft_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory, tensors


def eagle3_reference(
    tensors: dict[str, torch.Tensor],
    target: LoadedModel,
    layer_features: torch.Tensor,  # [n, 3, D]: the target's features of n positions 0..n-1
    next_ids: torch.Tensor,  # [n]
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's step over n real positions, from the format's description: (features before
    the final norm, logits over the target's vocabulary)."""
    hf, parts = target.hf_config, target_parts(target)
    d, heads, kv = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
    hd, n = d // heads, next_ids.shape[0]
    w = {k.removeprefix("midlayer."): v for k, v in tensors.items()}

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    f = layer_features.flatten(1) @ w["fc.weight"].T
    joined = torch.cat(
        (rms(parts.embed[next_ids], w["input_layernorm.weight"]), rms(f, w["hidden_norm.weight"])),
        dim=-1,
    )
    q = (joined @ w["self_attn.q_proj.weight"].T).view(n, heads, hd).transpose(0, 1)
    k = (joined @ w["self_attn.k_proj.weight"].T).view(n, kv, hd).transpose(0, 1)
    v = (joined @ w["self_attn.v_proj.weight"].T).view(n, kv, hd).transpose(0, 1)
    config = LlamaConfig(hidden_size=d, num_attention_heads=heads, rope_theta=10000.0)
    cos, sin = LlamaRotaryEmbedding(config)(v, torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    k, v = k[0].repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q[0] @ k.transpose(-1, -2)) / hd**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * hd)
    residual = f + attended @ w["self_attn.o_proj.weight"].T
    h = rms(residual, w["post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (
        h @ w["mlp.up_proj.weight"].T
    )
    out = residual + mlp @ w["mlp.down_proj.weight"].T
    draft_logits = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    logits = torch.full((n, hf.vocab_size), float("-inf"))
    logits[:, torch.arange(draft_logits.shape[1]) + w["d2t"]] = draft_logits
    return out, logits


def test_an_eagle3_head_computes_its_architecture(target: LoadedModel, tmp_path: Path) -> None:
    directory, tensors = write_eagle3_head(tmp_path / "head", target, 40, [1, 2, 2])
    assert is_eagle_checkpoint(directory)
    parts = target_parts(target)
    head = load_eagle_checkpoint(directory, parts, 2)
    assert head.feature_layers == (0, 1, 1)  # the outputs of the layers before 1, 2, 2
    torch.manual_seed(8)
    hidden = torch.randn(10, 3, parts.embed.shape[1])
    next_ids = torch.randint(0, parts.embed.shape[0], (10,))
    want, want_logits = eagle3_reference(tensors, target, hidden, next_ids)
    with torch.no_grad():
        cache = HeadCache(head.config, torch.float32, torch.device("cpu"))
        features = head.target_features(hidden)
        got = forward_cached(head, cache, [cache.allocate()], features, next_ids, [10])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        logits = torch.full((10, parts.embed.shape[0]), float("-inf"))
        logits[:, head.draft_vocab] = head.logits(got)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_greedy_text_with_an_eagle3_head_equals_plain_decoding(
    target: LoadedModel, tmp_path: Path
) -> None:
    directory, _ = write_eagle3_head(tmp_path / "head", target, 48, [1, 2, 2])
    assert_drafts_losslessly(target, directory, (2, 5))


def test_eagle3_heads_that_do_not_fit_are_refused_by_name(
    target: LoadedModel, tmp_path: Path
) -> None:
    parts = target_parts(target)
    directory, tensors = write_eagle3_head(tmp_path / "ids", target, 40, [0, 1, 2])
    with pytest.raises(InvalidRequestError, match="feature layer ids"):
        load_eagle_checkpoint(directory, parts, 2)
    directory, tensors = write_eagle3_head(tmp_path / "d2t", target, 40, [1, 2, 2])
    save_file({**tensors, "d2t": tensors["d2t"] + 10_000}, str(directory / "model.safetensors"))
    with pytest.raises(InvalidRequestError, match="d2t"):
        load_eagle_checkpoint(directory, parts, 2)
    directory, tensors = write_eagle3_head(tmp_path / "fc", target, 40, [1, 2, 2])
    config = json.loads((directory / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2]  # fc reads three
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="fc reads 192 features"):
        load_eagle_checkpoint(directory, parts, 2)
