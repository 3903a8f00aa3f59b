"""Every family of ``model.families`` on the native forward against transformers' own
implementation of it: tiny random models built here (float32), from state dicts, checkpoint
folders and GGUF files written with the ``gguf`` package's writer.

Tolerance: float32 logits agree to ~3e-6 here; ``ATOL`` leaves room for other summation orders.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from hybridspec.config import ModelConfig
from hybridspec.model.families import FAMILIES, family_of
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import LlamaWeights, native_support_problem
from hybridspec.model.loader import load_model
from hybridspec.model.runtime import ForwardBatch
from tests.conftest import TINY_EOS, tiny_tokenizer
from tests.model.tiny_families import (
    FAMILY_NAMES,
    GGUF_READY,
    family_config,
    tiny_family,
    write_family_gguf,
)

ATOL = 1e-4
PROMPT = [72, 101, 108, 108, 111, 32, 258, 117, 115, 101, 114, 10, 87, 104, 97, 116, 63, 259]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))


def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_logits_match_transformers_in_chunks_and_ragged_batches(
    family: str, invariant: bool
) -> None:
    model = tiny_family(family, seed=1)
    weights = LlamaWeights.from_hf_state_dict(model.state_dict(), model.config, dtype=torch.float32)
    assert weights.family is FAMILIES[family]
    runtime = LlamaRuntime(weights, 3, 64, invariant_attention=invariant)
    expected = reference_logits(model, PROMPT)
    a, b = runtime.allocate(), runtime.allocate()
    first = runtime.forward(ForwardBatch.from_lists([a], [PROMPT[:5]])).logits
    ragged = runtime.forward(ForwardBatch.from_lists([b, a], [PROMPT[:3], PROMPT[5:]])).logits
    logits = torch.cat([first, ragged[3:]])
    assert (logits - expected).abs().max().item() <= ATOL
    torch.testing.assert_close(ragged[:3], expected[:3], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hf_state_dict_gives_the_family_layout_back(family: str) -> None:
    model = tiny_family(family, seed=2)
    state = model.state_dict()
    weights = LlamaWeights.from_hf_state_dict(state, model.config, dtype=torch.float32)
    back = weights.hf_state_dict()
    assert set(back) == set(state)
    for name, tensor in state.items():
        if weights.family.norm_offset and name.endswith("norm.weight"):  # held as 1 + w
            torch.testing.assert_close(back[name], tensor, atol=1e-7, rtol=0)
        else:
            assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_checkpoint_folder_loads_natively(family: str, tmp_path: Path) -> None:
    model = tiny_family(family, seed=3)
    model.save_pretrained(tmp_path / family)
    tiny_tokenizer().save_pretrained(tmp_path / family)
    loaded = load_model(ModelConfig(str(tmp_path / family), dtype="float32"))
    assert loaded.is_native and TINY_EOS in loaded.eos_token_ids
    runtime = loaded.create_runtime(1, 32)
    logits = runtime.forward(ForwardBatch.from_lists([runtime.allocate()], [PROMPT])).logits
    torch.testing.assert_close(logits, reference_logits(model, PROMPT), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gguf_file_loads_natively_and_from_the_weight_cache(family: str, tmp_path: Path) -> None:
    model = tiny_family(family, seed=4, **GGUF_READY.get(family, {}))
    path = write_family_gguf(tmp_path / f"{family}.gguf", model)
    for _ in range(2):  # the second load reads the weight cache
        loaded = load_model(ModelConfig(str(path), dtype="float32"))
        assert loaded.is_native and loaded.eos_token_ids == (TINY_EOS,)
        assert isinstance(loaded.weights, LlamaWeights)
        expected_family = "llama" if family == "mistral" else family  # llama.cpp: arch llama
        assert loaded.weights.family is FAMILIES[expected_family]
        assert loaded.hf_config.model_type == FAMILIES[expected_family].transformers_type
        runtime = loaded.create_runtime(1, 32)
        chunks = [PROMPT[:7], PROMPT[7:]]
        slot = runtime.allocate()
        logits = torch.cat(
            [runtime.forward(ForwardBatch.from_lists([slot], [c])).logits for c in chunks]
        )
        torch.testing.assert_close(logits, reference_logits(model, PROMPT), atol=ATOL, rtol=0)


def test_sliding_window_caps_the_context_length() -> None:
    model = tiny_family("mistral", seed=5, sliding_window=48)
    weights = LlamaWeights.from_hf_state_dict(model.state_dict(), model.config, dtype=torch.float32)
    assert weights.dims.max_position_embeddings == 48
    qwen = family_config("qwen2", 300, sliding_window=16, use_sliding_window=False)
    assert native_support_problem(qwen) is None


def test_unsupported_configurations_name_the_reason() -> None:
    assert "gelu" in str(native_support_problem(family_config("qwen3", 300, hidden_act="gelu")))
    assert "attention_bias" in str(
        native_support_problem(family_config("qwen3", 300, attention_bias=True))
    )
    phi = family_config("phi3", 300, partial_rotary_factor=0.5)
    assert "partial" in str(native_support_problem(phi))
    with pytest.raises(ValueError, match="model_type is 'gpt2'"):
        family_of(GPT2Config())


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_bench_transformers_baseline_is_the_familys_own_class(family: str) -> None:
    from hybridspec.bench.hf_baseline import hf_model_from_weights
    from hybridspec.model.loader import LoadedModel

    model = tiny_family(family, seed=6)
    weights = LlamaWeights.from_hf_state_dict(model.state_dict(), model.config, dtype=torch.float32)
    loaded = LoadedModel(weights, None, model.config, torch.float32, (TINY_EOS,), family)  # type: ignore[arg-type]
    baseline = hf_model_from_weights(loaded)
    assert type(baseline) is type(model)
    torch.testing.assert_close(
        reference_logits(baseline, PROMPT), reference_logits(model, PROMPT), atol=0, rtol=0
    )
