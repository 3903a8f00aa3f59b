"""Block-kernel time per GGUF type on Llama-3.2-1B's shapes: each matrix as the kernel holds it
against the same matrix without the narrowing (``Kernel.pack(w, narrow=False)``: 8-bit codes,
float32 scales), interleaved, one thread, one row (decoding) and 8 rows (verification).

Random blocks of each type (finite float16 factors), decoded exactly and packed; times are the
best of 3 x 5 batches of 5 calls (wall time). Run::

    python benchmarks/kquant_kernels.py Q4_K Q6_K Q8_0
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from hybridspec.model import qgemm
from hybridspec.model.gguf_blocks import GGUF_TYPES, from_gguf_blocks

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]  # (N, K): q/o, gate/up, down
F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}
F16_AT |= {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int) -> np.ndarray:
    per_block, block_bytes = GGUF_TYPES[kind][:2]
    count = rows * cols // per_block
    gen = np.random.default_rng(0)
    raw = gen.integers(0, 256, (count, block_bytes), dtype=np.uint8)
    for at in F16_AT[kind]:
        factor = (gen.standard_normal(count) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = factor.view(np.uint8).reshape(count, 2)
    return raw


def best_us(call: Callable[[], object]) -> float:
    call()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(5):
            call()
        best = min(best, (time.perf_counter() - start) / 5)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    kernel = qgemm.kernel()
    assert kernel is not None, "the block kernel does not build here"
    print("type  N     K     rows  held us (bpw)     wide us (bpw)     wide/held")
    for kind in sys.argv[1:] or ["Q4_K", "Q6_K", "Q8_0"]:
        for n, k in SHAPES:
            w = from_gguf_blocks(random_blocks(kind, n, k), kind, (n, k))
            held, wide = kernel.pack(w), kernel.pack(w, narrow=False)
            for rows in (1, 8):
                x = torch.randn(rows, k).bfloat16()
                assert torch.equal(kernel.qgemm(x, held), kernel.qgemm(x, wide))
                ours, theirs = float("inf"), float("inf")
                for _ in range(3):
                    ours = min(ours, best_us(lambda: kernel.qgemm(x, held)))  # noqa: B023
                    theirs = min(theirs, best_us(lambda: kernel.qgemm(x, wide)))  # noqa: B023
                print(
                    f"{kind:5} {n:<5} {k:<5} {rows:<5} {ours:7.0f} ({8 * held.nbytes / n / k:.2f})"
                    f"    {theirs:7.0f} ({8 * wide.nbytes / n / k:.2f})    {theirs / ours:.2f}"
                )


if __name__ == "__main__":
    main()
