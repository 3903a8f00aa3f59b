"""Plain decoding's share of the memory bound for one GGUF file (hybridspec, default settings).

share = bytes read per token x tokens per second / GB/s of a 1 GiB read, all on the same
threads in one process: bytes per token are every matrix as held (the packed blocks) read once,
the embedding row aside; the read rate is the best of 5 sums over a 1 GiB float32 tensor;
tokens per second the best of 3 runs of 128 one-token forwards after an 8-token prompt.

Usage: python benchmarks/quant_bound.py FILE [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridspec.config import ModelConfig
from hybridspec.model.llama_weights import LlamaWeights, Matrix
from hybridspec.model.loader import load_model
from hybridspec.model.quant import PackedWeight, QuantizedWeight
from hybridspec.model.runtime import ForwardBatch


def held_bytes(matrix: Matrix) -> int:
    if isinstance(matrix, (PackedWeight, QuantizedWeight)):
        return matrix.nbytes
    return matrix.numel() * matrix.element_size()


def bytes_per_token(weights: LlamaWeights) -> int:
    total = held_bytes(weights.lm_head)
    for layer in weights.layers:
        total += sum(held_bytes(m) for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    return total


def read_rate() -> float:
    """GB/s of summing a 1 GiB float32 tensor, best of 5."""
    data = torch.ones(2**28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return 2**30 / best / 1e9


def decode_rate(path: str, tokens: int = 128) -> tuple[float, int]:
    model = load_model(ModelConfig(name_or_path=path))
    assert isinstance(model.weights, LlamaWeights)
    runtime = model.create_runtime(1, 512)
    best = 0.0
    for _ in range(3):
        slot = runtime.allocate()
        ids = [1, 2, 3, 4, 5, 6, 7, 8]
        runtime.forward(ForwardBatch.from_lists([slot], [ids]))
        start = time.perf_counter()
        for _ in range(tokens):
            logits = runtime.forward(ForwardBatch.from_lists([slot], [ids[-1:]])).logits
            ids.append(int(logits[-1].argmax()))
        best = max(best, tokens / (time.perf_counter() - start))
        runtime.free(slot)
    return best, bytes_per_token(model.weights)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rate, per_token = decode_rate(args.file)
    gbs = read_rate()
    share = per_token * rate / 1e9 / gbs
    print(
        f"{args.file}: {per_token / 1e6:.1f} MB/token x {rate:.1f} tok/s = "
        f"{per_token * rate / 1e9:.2f} GB/s of {gbs:.2f} GB/s read: {share:.0%} of the bound"
    )


if __name__ == "__main__":
    main()
