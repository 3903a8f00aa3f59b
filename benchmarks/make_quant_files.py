"""Make the GGUF files of issue 33's table (not part of the package; needs llama-cpp-python).

- The embedded SmolLM2-135M (Q4_1) requantized to Q4_K_M, Q5_K_M and Q6_K.
- Random weights in Llama-3.2-1B's shapes (16 layers, hidden 2048, FFN 8192, 32 heads, 8 KV
  heads, vocabulary 128256, tied embeddings) written as F16 by ``hybridspec.bench.random_gguf``
  (the SmolLM2 vocabulary padded with unused tokens to 128256), then quantized to Q4_K_M and
  Q8_0 by llama.cpp (``hybridspec bench make-gguf`` writes such mixes directly).

Usage: python benchmarks/make_quant_files.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridspec.bench.random_gguf import write_random_gguf
from hybridspec.model.loader import embedded_model_path

FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}


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
    """F16 random weights (std 0.02; norms 1) in Llama-3.2-1B's shapes, SmolLM2's tokenizer
    padded to 128256 (``hybridspec bench make-gguf --shape 1b --type F16``)."""
    write_random_gguf(path, "1b", "F16", seed=seed)


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
