"""Make the GGUF files of issue 33's table (not part of the package; needs llama-cpp-python).

- The embedded SmolLM2-135M (Q4_1) requantized to Q4_K_M, Q5_K_M and Q6_K.
- Random weights in Llama-3.2-1B's shapes (16 layers, hidden 2048, FFN 8192, 32 heads, 8 KV
  heads, vocabulary 128256, tied embeddings) written as F16 with the ``gguf`` writer (the
  SmolLM2 vocabulary padded with unused tokens to 128256), then quantized to Q4_K_M and Q8_0.

Usage: python benchmarks/make_quant_files.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

from hybridspec.model.loader import embedded_model_path

FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}
SHAPE_1B = {"layers": 16, "hidden": 2048, "ffn": 8192, "heads": 32, "kv": 8, "vocab": 128256}


def quantize(source: Path, target: Path, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.allow_requantize = True
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize {kind} failed: {status}")


def write_random_1b(path: Path, seed: int = 0) -> None:
    """F16 random weights (std 0.02; norms 1) in Llama-3.2-1B's shapes, SmolLM2's tokenizer."""
    s = SHAPE_1B
    reader = GGUFReader(embedded_model_path())
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv"])
    writer.add_rope_dimension_count(s["hidden"] // s["heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s["vocab"])
    writer.add_file_type(1)  # F16
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    pad = s["vocab"] - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(str(reader.fields["tokenizer.ggml.pre"].contents()))
    writer.add_token_list(tokens + [f"<unused_{i}>" for i in range(pad)])
    writer.add_token_types(types + [5] * pad)  # 5: unused
    writer.add_token_merges(list(reader.fields["tokenizer.ggml.merges"].contents()))
    for key in ("bos", "eos", "padding"):
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", int(field.contents()))
    template = reader.fields.get("tokenizer.chat_template")
    if template is not None:
        writer.add_string("tokenizer.chat_template", str(template.contents()))
    gen = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (gen.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    d, kv = s["hidden"], s["kv"] * (s["hidden"] // s["heads"])
    writer.add_tensor("token_embd.weight", matrix(s["vocab"], d))
    writer.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(d, np.float32))
        writer.add_tensor(p + "attn_q.weight", matrix(d, d))
        writer.add_tensor(p + "attn_k.weight", matrix(kv, d))
        writer.add_tensor(p + "attn_v.weight", matrix(kv, d))
        writer.add_tensor(p + "attn_output.weight", matrix(d, d))
        writer.add_tensor(p + "ffn_gate.weight", matrix(s["ffn"], d))
        writer.add_tensor(p + "ffn_up.weight", matrix(s["ffn"], d))
        writer.add_tensor(p + "ffn_down.weight", matrix(d, s["ffn"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for kind in ("Q4_K_M", "Q5_K_M", "Q6_K"):
        target = out / f"smollm2-135m-{kind}.gguf"
        if not target.exists():
            quantize(embedded_model_path(), target, kind)
    f16 = out / "llama1b-random-F16.gguf"
    if not f16.exists():
        write_random_1b(f16)
    for kind in ("Q4_K_M", "Q8_0"):
        target = out / f"llama1b-random-{kind}.gguf"
        if not target.exists():
            quantize(f16, target, kind)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
