"""Phi-3 through llama.cpp's own converter and against llama.cpp, with Phi-3's kind of
vocabulary. llama.cpp sets token attributes by the model's name: for a ``general.name``
holding "phi3" or "phi-3" it looks up ``</s>``, ``<unk>``, ``<s>`` and ``<|endoftext|>`` by
text (``token_to_id.at``, llama-vocab.cpp) and fails to load a vocabulary without them
("unordered_map::at"), as SmolLM2's BPE one. So the tiny checkpoint carries what Phi-3-mini's
do: a SentencePiece model trained here (byte fallback; Llama's special ids: unk 0, bos 1,
eos 2) with Phi-3's added special tokens after the pieces (``<|endoftext|>`` the model's eos,
``<|assistant|>``, ``<|system|>``, ``<|end|>``, ``<|user|>``) and Phi-3's chat template.

As ``test_gemma_llamacpp``: F32 and Q8_0 by ``convert_hf_to_gguf.py``, Q4_K_M by
``llama_cpp.llama_model_quantize``; every file loads with default settings, and on F32 our
greedy tokens equal llama.cpp's for 4 raw prompts x 16 tokens (at least 3 of 4).

Needs the converter, ``llama_cpp`` and ``sentencepiece``; skipped without them (CI has none).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridspec.model.families import FAMILIES
from tests.model.spm_vocab import SPM_PIECES, SpmVocabulary, write_spm_tokenizer
from tests.model.test_families_llamacpp import assert_greedy_matches_llama_cpp, convert_and_load
from tests.model.tiny_families import tiny_family

pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")

# Phi-3-mini-instruct's template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI3_VOCABULARY = SpmVocabulary(
    special_ids={"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1},
    added_tokens=("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"),
    config={
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    },
)
ENDOFTEXT = SPM_PIECES  # the first added token


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(tmp_path / "cache"))


def test_converted_phi3_files_load_and_match_llama_cpp(tmp_path: Path) -> None:
    folder = tmp_path / "phi3"
    vocab = write_spm_tokenizer(folder, PHI3_VOCABULARY)
    model = tiny_family("phi3", seed=0, vocab_size=vocab)
    with torch.no_grad():  # sharper logits: fewer near ties between the two implementations
        model.lm_head.weight.mul_(4)
    model.config.bos_token_id, model.config.eos_token_id = 1, ENDOFTEXT
    model.config.pad_token_id = ENDOFTEXT
    model.save_pretrained(folder)
    f32, loaded = convert_and_load(folder)
    assert loaded.weights.family is FAMILIES["phi3"]  # type: ignore[union-attr]
    # the file's vocabulary and chat template
    tokenizer = loaded.tokenizer
    assert tokenizer is not None and ENDOFTEXT in loaded.eos_token_ids
    assert tokenizer.convert_tokens_to_ids("<|end|>") == ENDOFTEXT + 3
    chat = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert_greedy_matches_llama_cpp("phi3", f32, loaded)
