"""Gemma 2 and Gemma 3 through llama.cpp's own converter and against llama.cpp, with Gemma's
kind of vocabulary: a tiny SentencePiece model trained here (byte fallback, Gemma's special
ids: pad 0, eos 1, bos 2, unk 3) and Gemma's chat template, both carried by the GGUF file.

As ``test_families_llamacpp`` (which this reuses): F32 and Q8_0 by ``convert_hf_to_gguf.py``,
Q4_K_M by ``llama_cpp.llama_model_quantize``; every file loads with default settings, and on
F32 our greedy tokens equal llama.cpp's for 4 raw prompts x 16 tokens (at least 3 of 4). The
models have the layer pattern llama.cpp assumes (Gemma 3: 5 local layers, then a global one;
Gemma 2: alternating) and a window of 8 keys, shorter than prompt plus generated tokens.

Needs the converter, ``llama_cpp`` and ``sentencepiece``; skipped without them (CI has none).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridspec.model.families import FAMILIES
from tests.model.spm_vocab import SpmVocabulary, write_spm_tokenizer
from tests.model.test_families_llamacpp import (
    NEW_TOKENS,
    PROMPTS,
    assert_greedy_matches_llama_cpp,
    convert_and_load,
)
from tests.model.tiny_families import GGUF_READY, tiny_family

pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")

# Gemma's own template (its chat turns; the system turn folded into the first user turn).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA_VOCABULARY = SpmVocabulary(
    special_ids={"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3},
    user_symbols=("<start_of_turn>", "<end_of_turn>"),
    config={
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    },
)


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_converted_gemma_files_load_and_match_llama_cpp(family: str, tmp_path: Path) -> None:
    folder = tmp_path / family
    vocab = write_spm_tokenizer(folder, GEMMA_VOCABULARY)
    layers = {"num_hidden_layers": 6, "layer_types": None} if family == "gemma3" else {}
    model = tiny_family(family, seed=0, vocab_size=vocab, **GGUF_READY.get(family, {}), **layers)
    with torch.no_grad():  # sharper logits: fewer near ties between the two implementations
        model.lm_head.weight.mul_(4)
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = 0, 1, 2
    model.save_pretrained(folder)
    f32, loaded = convert_and_load(folder)
    assert loaded.weights.family is FAMILIES[family]  # type: ignore[union-attr]
    windows = loaded.weights.dims.layer_windows  # type: ignore[union-attr]
    assert windows == ((8, 8, 8, 8, 8, 0) if family == "gemma3" else (8, 0))
    # the file's vocabulary and chat template
    tokenizer = loaded.tokenizer
    assert tokenizer is not None and 1 in loaded.eos_token_ids
    chat = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    for prompt in PROMPTS:  # each runs past the window
        assert len(tokenizer.encode(prompt, add_special_tokens=False)) + NEW_TOKENS > 8
    assert_greedy_matches_llama_cpp(family, f32, loaded)
