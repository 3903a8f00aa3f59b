"""What Gemma's layer adds to the native forward, beyond the family tests: the sliding window
of its local layers (a position attends only the last ``sliding_window`` keys), the soft cap of
Gemma 2's attention scores, row invariance with windows (a row's logits do not depend on its
batch, its drafts or a rollback of the cache), dense and through the block kernel.

Tiny random models built here (``tiny_families``: window 8, prompts of 40 to 60 tokens, so that
every local layer drops keys).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from hybridspec.config import ModelConfig
from hybridspec.model.attention_kernels import attend
from hybridspec.model.decoder import FusedAttentionIn, StoredAttentionIn, UnfusedMlpBlock
from hybridspec.model.kv_cache import numpy_view
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import LlamaDims, LlamaWeights, native_support_problem
from hybridspec.model.loader import load_model
from hybridspec.model.qgemm import kernel
from hybridspec.model.runtime import ForwardBatch
from tests.conftest import TINY_VOCAB_SIZE
from tests.model.test_invariance import assert_logits_alike_decoded_verified_and_batched
from tests.model.tiny_families import (
    SPM_EOS,
    SPM_TOKENS,
    family_config,
    tiny_family,
    write_family_gguf,
)

GEMMAS = ("gemma2", "gemma3")
TOLERANCE = 1e-3  # issue 34's bar for float32 logits against transformers


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def random_ids(count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_VOCAB_SIZE, (count,), generator=generator).tolist()


@pytest.mark.parametrize("family", GEMMAS)
def test_long_prompts_match_transformers_and_the_window_matters(family: str) -> None:
    model = tiny_family(family, seed=7)
    ids = random_ids(40, seed=8)
    expected = reference_logits(model, ids)
    # the same weights with a window wider than the prompt: other logits, so the window counts
    wide = reference_logits(tiny_family(family, seed=7, sliding_window=64), ids)
    assert (wide - expected)[8:].abs().max().item() > 20 * TOLERANCE
    weights = LlamaWeights.from_hf_state_dict(model.state_dict(), model.config, dtype=torch.float32)
    assert weights.dims.layer_windows == (8, 0)
    for invariant in (False, True):
        runtime = LlamaRuntime(weights, 2, 64, invariant_attention=invariant)
        a, b = runtime.allocate(), runtime.allocate()
        first = runtime.forward(ForwardBatch.from_lists([a], [ids[:13]])).logits
        # the rest beside another sequence's short span: padded or kernel attention
        both = runtime.forward(ForwardBatch.from_lists([b, a], [ids[:5], ids[13:]])).logits
        logits = torch.cat([first, both[5:]])
        assert (logits - expected).abs().max().item() <= TOLERANCE, invariant
        assert (both[:5] - expected[:5]).abs().max().item() <= TOLERANCE, invariant


def window_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: int,
    window: int,
    cap: float,
) -> torch.Tensor:
    """Float64 attention of ``q [H, hd]`` at ``position`` over ``keys, values [KV, S, hd]``:
    scaled by hd ** -0.5, capped, the last ``window`` keys."""
    num_heads, hd = q.shape
    rep = num_heads // keys.shape[0]
    first = max(0, position + 1 - window)
    k = keys[:, first : position + 1].double().repeat_interleave(rep, dim=0)
    v = values[:, first : position + 1].double().repeat_interleave(rep, dim=0)
    scores = torch.einsum("hd,hld->hl", q.double(), k) / math.sqrt(hd)
    scores = cap * torch.tanh(scores / cap)
    return torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), v)


def test_the_kernel_windows_and_caps_each_row_alike_in_any_item() -> None:
    gen = torch.Generator().manual_seed(9)
    kv, rep, hd, length, window, cap = 2, 2, 16, 40, 8, 1.5
    keys = torch.randn(1, kv, length, hd, generator=gen)
    values = torch.randn(1, kv, length, hd, generator=gen)
    keys_t = keys.transpose(-1, -2).contiguous()
    q = torch.randn(30, kv * rep, hd, generator=gen)  # positions 10..39

    def run(counts: list[int]) -> np.ndarray:
        items, token = [], 0
        for count in counts:
            items += [(0, h, token, 10 + token, count) for h in range(kv)]
            token += count
        out = np.full(q.shape, np.nan, dtype=np.float32)
        scale = np.float32(hd**-0.5)
        rows = np.array(items, np.int32)
        kernel_keys, kernel_values = numpy_view(keys_t), numpy_view(values)
        attend(q.numpy(), kernel_keys, kernel_values, rows, scale, np.float32(cap), window, out)
        return out

    alone = run([1] * 30)  # each token an item of its own
    for t in range(30):
        want = window_reference(q[t], keys[0], values[0], 10 + t, window, cap)
        torch.testing.assert_close(torch.from_numpy(alone[t]).double(), want, atol=2e-6, rtol=0)
    for counts in ([30], [4] * 7 + [2], [13, 17]):
        assert run(counts).tobytes() == alone.tobytes(), counts


@pytest.mark.parametrize("family", GEMMAS)
@pytest.mark.parametrize("quantize_bits", [None, 8])
def test_rows_alike_decoded_verified_batched_and_rolled_back(
    family: str, quantize_bits: int | None
) -> None:
    """bfloat16, dense (torch's matmuls) or 8-bit (the block kernel, where it builds): with
    windows of 8, each of positions 39..48 has the same logits decoded one at a time, verified
    as drafts after a rollback of the cache, and beside another sequence."""
    if quantize_bits is not None and kernel() is None:
        pytest.skip("the block kernel does not build here")
    model = tiny_family(family, seed=10)
    weights = LlamaWeights.from_hf_state_dict(
        model.state_dict(), model.config, dtype=torch.bfloat16, quantize_bits=quantize_bits
    )
    runtime = LlamaRuntime(weights, 2, 64)
    assert runtime.invariant_attention
    if quantize_bits is not None:  # the kernel's own rope and cache writes, its matmuls
        layer = runtime._stack.layers[0]
        assert isinstance(layer.attention_in, (FusedAttentionIn, StoredAttentionIn))
        assert isinstance(layer.after_attention, UnfusedMlpBlock)  # the post-norms: unfused
    ids = random_ids(60, seed=11)
    plain = assert_logits_alike_decoded_verified_and_batched(runtime, ids)
    # and close to transformers' float32 logits (bfloat16, quantized: a loose bound)
    expected = reference_logits(model, ids[:49])[39:]
    assert (plain - expected).abs().max().item() < 0.1 * expected.abs().max().item()


def test_a_gemma_gguf_brings_its_sentencepiece_vocabulary_and_chat_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_family("gemma3", seed=12, vocab_size=len(SPM_TOKENS))
    path = write_family_gguf(tmp_path / "gemma3.gguf", model, spm=True)
    loaded = load_model(ModelConfig(str(path), dtype="float32"))
    assert loaded.is_native and loaded.eos_token_ids == (SPM_EOS,)
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[:3] == ["H", "i", "▁t"]
    assert tokenizer.decode(ids) == "Hi there"
    assert tokenizer.decode(tokenizer.encode("é", add_special_tokens=False)) == "é"  # bytes
    chat = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    runtime = loaded.create_runtime(1, 32)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    assert prompt[:2] == [2, 4]  # <s>, <start_of_turn>: the template's specials, one id each
    logits = runtime.forward(ForwardBatch.from_lists([runtime.allocate()], [prompt])).logits
    expected = reference_logits(model, prompt)
    assert (logits - expected).abs().max().item() <= TOLERANCE


def test_gemma_configurations_outside_the_family_name_the_reason() -> None:
    bidirectional = family_config("gemma3", 300, use_bidirectional_attention=True)
    assert "use_bidirectional_attention" in str(native_support_problem(bidirectional))
    silu = family_config("gemma2", 300, hidden_activation="silu")
    assert "gelu_pytorch_tanh" in str(native_support_problem(silu))
    multimodal = AutoConfig.for_model("gemma3")  # Gemma3ForConditionalGeneration: not the text
    assert "model_type is 'gemma3'" in str(native_support_problem(multimodal))
    scaled = LlamaDims.from_hf_config(family_config("gemma2", 300, query_pre_attn_scalar=24))
    assert scaled.attn_scale == 24**-0.5 and scaled.attn_softcap == 2.0


def test_the_eagle_heads_logits_on_gemma2_are_the_targets_soft_capped_ones() -> None:
    from hybridspec.distill.data import FeatureReader
    from hybridspec.model.loader import LoadedModel
    from tests.proposers.eagle_helpers import random_head

    model = tiny_family("gemma2", seed=13)  # final_logit_softcapping 10
    with torch.no_grad():  # logits well beyond the cap, where capping changes them most
        model.lm_head.weight.mul_(8)
    weights = LlamaWeights.from_hf_state_dict(model.state_dict(), model.config, dtype=torch.float32)
    config = model.config
    target = LoadedModel(weights, None, config, torch.float32, (1,), "tiny-gemma2")  # type: ignore[arg-type]
    head = random_head(target, TINY_VOCAB_SIZE)  # the whole vocabulary: its logits are V wide
    assert head.parts.final_softcap == 10.0
    ids = random_ids(20, seed=14)
    features = FeatureReader(target, 64)(ids)[:, 0]  # the last layer's outputs, [n, D]
    expected = reference_logits(model, ids)  # transformers' Gemma 2: capped at 10
    with torch.no_grad():
        logits = head.logits(features)
        uncapped = torch.nn.functional.linear(head.target_norm(features), head.draft_lm_head)
    assert (logits - expected).abs().max().item() <= TOLERANCE
    assert uncapped.abs().max().item() > 2 * 10.0  # without the cap: other logits
