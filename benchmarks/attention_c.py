"""The row-invariant attention in C (csrc/attention.c) against the numba kernel of the same bits:
SmolLM2-135M's heads (9 query, 3 key/value, hd 64) over a bfloat16 cache, for a cached turn's
prefill (178 tokens after 889), a cold prompt chunk (512 after 512), a verify span (9 after
1,000) and a decode row (1 after 1,000); the C library as the runtime builds it (AVX-512 here)
and its AVX2 build, the calls interleaved, best of N, 2 threads
(``python benchmarks/attention_c.py``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from hybridspec.model import qgemm
from hybridspec.model.attention_kernels import ITEM_COLUMNS, attend
from hybridspec.model.qgemm import Kernel

CASES = {
    "cached turn": (889, 178),
    "prompt chunk": (512, 512),
    "verify": (1000, 9),
    "decode": (1000, 1),
}


def items_for(start: int, tokens: int, kv: int) -> np.ndarray:
    """As ``KernelAttention`` splits a span: items of at most 16 tokens (4 for short spans)."""
    limit = 16 if tokens > 16 else 4
    size = -(-tokens // -(-tokens // limit))
    rows = [
        (0, head, b, start + b, min(size, tokens - b))
        for b in range(0, tokens, size)
        for head in range(kv)
    ]
    return np.array(rows, dtype=np.int32).reshape(-1, ITEM_COLUMNS)


def best_of(calls: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    best = dict.fromkeys(calls, float("inf"))
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            began = time.perf_counter()
            for _ in range(reps):
                call()
            best[name] = min(best[name], (time.perf_counter() - began) / reps)
    return best


def calls_for(
    start: int, tokens: int, kernels: dict[str, Kernel], keys: torch.Tensor, values: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """One case's calls: the numba kernel and each C build, on the same inputs."""
    heads, kv, hd = 9, keys.shape[1], keys.shape[2]
    items = items_for(start, tokens, kv)
    q = torch.randn(tokens, heads, hd)
    out = np.empty((tokens, heads, hd), np.float32)
    layout = Kernel.cache_struct(keys, values)
    key_bits, value_bits = keys.view(torch.uint16).numpy(), values.view(torch.uint16).numpy()
    scale, zero, no_window = np.float32(hd**-0.5), np.float32(0.0), np.int64(0)
    calls: dict[str, Callable[[], object]] = {
        "numba": lambda: attend(q.numpy(), key_bits, value_bits, items, scale, zero, no_window, out)
    }
    for name, kernel in kernels.items():
        calls[name] = lambda k=kernel: k.attend_unchecked(
            q, kv, layout, False, items, float(scale), 0.0, 0
        )
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import numba

    numba.set_num_threads(args.threads)
    built = qgemm.kernel()
    if built is None:
        raise SystemExit("no C compiler: the kernel library does not build here")
    kernels = {"C": built, "C (AVX2 build)": qgemm.load(("-mno-avx512f",))}
    kv, hd, context = 3, 64, 4096
    keys = torch.randn(1, kv, hd, context).bfloat16()
    values = torch.randn(1, kv, context, hd).bfloat16()
    print(f"{'case':14} " + " ".join(f"{n:>16}" for n in ("numba", *kernels)) + "  numba / C")
    for case, (start, tokens) in CASES.items():
        calls = calls_for(start, tokens, kernels, keys, values)
        best = best_of(calls, args.rounds, max(1, 2000 // tokens))
        times = " ".join(f"{best[n] * 1e3:13.3f} ms" for n in calls)
        print(f"{case:14} {times}  {best['numba'] / best['C']:.2f}x")


if __name__ == "__main__":
    main()
