"""The disk cache of converted GGUF weights: a second load reads it instead of the file and
gives the very same model; a stale, foreign or broken entry is never used."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from hybridspec.config import ModelConfig
from hybridspec.model import LlamaWeights, LoadedModel, load_model, weight_cache
from hybridspec.model.llama_weights import LlamaLayerWeights
from tests.conftest import tiny_llama
from tests.model.test_loader import write_tiny_gguf


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(cache))
    return cache


def tensors(weights: LlamaWeights) -> dict[str, torch.Tensor]:
    named = {"embed": weights.embed, "norm": weights.norm, "lm_head": weights.lm_head}
    named["inv_freq"] = weights.inv_freq
    for i, layer in enumerate(weights.layers):
        for field in dataclasses.fields(LlamaLayerWeights):
            if getattr(layer, field.name) is not None:  # a family's optional tensors
                named[f"{i}.{field.name}"] = getattr(layer, field.name)
    return named


def forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(path: object) -> None:
        raise AssertionError("the cached weights should have been used")

    monkeypatch.setattr("hybridspec.model.gguf_load.read_gguf", fail)


def load(path: Path, dtype: str = "bfloat16") -> LoadedModel:
    return load_model(ModelConfig(str(path), dtype=dtype, quantize="none"))  # dense: cached as is


@pytest.mark.parametrize("tied", [False, True])
def test_second_load_reads_the_cache_and_gives_identical_weights(
    tied: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf",
        tiny_llama(seed=1, tie_word_embeddings=tied),
        qtype=GGMLQuantizationType.Q8_0,
    )
    fresh = load(path)
    forbid_conversion(monkeypatch)
    cached = load(path)
    assert isinstance(fresh.weights, LlamaWeights) and isinstance(cached.weights, LlamaWeights)
    assert cached.weights.dims == fresh.weights.dims
    before, after = tensors(fresh.weights), tensors(cached.weights)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert (cached.weights.lm_head is cached.weights.embed) == tied
    assert cached.eos_token_ids == fresh.eos_token_ids
    assert cached.context_length == fresh.context_length
    assert cached.hf_config.to_dict() == fresh.hf_config.to_dict()
    assert type(cached.hf_config) is type(fresh.hf_config)


def test_an_edited_file_or_another_dtype_is_a_new_entry(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(seed=1))
    entry = weight_cache.entry_path(path, torch.bfloat16)
    assert weight_cache.entry_path(path, torch.float32) != entry
    first = load(path)
    assert entry.is_file()
    write_tiny_gguf(path, tiny_llama(seed=2))  # same name, new contents
    assert weight_cache.entry_path(path, torch.bfloat16) != entry
    second = load(path)
    assert isinstance(first.weights, LlamaWeights) and isinstance(second.weights, LlamaWeights)
    assert not torch.equal(second.weights.embed, first.weights.embed)  # not the stale entry
    names = sorted(p.name for p in entry.parent.glob("tiny-bfloat16-*.pt"))
    assert len(names) == weight_cache.KEEP_ENTRIES  # the older entry is kept, no more


def test_older_entries_beyond_the_limit_are_removed(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(seed=1))
    for seed in range(2, 2 + weight_cache.KEEP_ENTRIES + 2):
        write_tiny_gguf(path, tiny_llama(seed=seed))
        load(path)
    entries = list(weight_cache.entry_path(path, torch.bfloat16).parent.glob("tiny-*.pt"))
    assert len(entries) == weight_cache.KEEP_ENTRIES
    assert weight_cache.entry_path(path, torch.bfloat16) in entries


def test_a_broken_entry_is_ignored_and_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(seed=1))
    fresh = load(path)
    entry = weight_cache.entry_path(path, torch.bfloat16)
    entry.write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="hybridspec.model.weight_cache"):
        again = load(path)
    assert "ignoring unreadable weight cache" in caplog.text
    assert isinstance(again.weights, LlamaWeights) and isinstance(fresh.weights, LlamaWeights)
    assert torch.equal(again.weights.embed, fresh.weights.embed)
    assert entry.stat().st_size > len(b"not a torch file")  # converted and saved again
