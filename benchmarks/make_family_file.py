"""Random weights in a real model's shapes as a Q4_K_M GGUF file, for ``hybridspec bench``
against llama.cpp on the same file: ``python benchmarks/make_family_file.py OUT_DIR``.

Qwen3-0.6B's shapes (28 layers, hidden 1024, 16 query and 8 key/value heads of 128, MLP 3072,
151,936 rows, tied embeddings) with SmolLM2's tokenizer (the embedded model's; rows past it are
padding); converted by llama.cpp's ``convert_hf_to_gguf.py`` to F16, then quantized to Q4_K_M
by ``llama_cpp.llama_model_quantize``. Needs llama-cpp-python and the converter
(``HYBRIDSPEC_CONVERTER``, as in tests/model/test_families_llamacpp.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from hybridspec.model.loader import embedded_model_path, load_gguf_tokenizer
from tests.model.test_families_llamacpp import convert, quantize_q4_k_m


def main(out: Path) -> None:
    tokenizer = load_gguf_tokenizer(embedded_model_path())
    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    folder = out / "qwen3-0.6b-random"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    f16 = convert(folder, "f16")
    print(quantize_q4_k_m(f16))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
