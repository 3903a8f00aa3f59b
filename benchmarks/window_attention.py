"""The row-invariant attention kernel on a sliding-window layer against a global one: one decode
row per key/value head at the last position of a long bfloat16 cache, ``window`` keys against
all of them, timed interleaved, best of N (``python benchmarks/window_attention.py``)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from hybridspec.model.attention_kernels import attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    kv, rep, hd, length = 4, 2, 256, args.context  # Gemma 3 1B's heads
    keys_t = torch.randn(1, kv, hd, length).bfloat16().view(torch.uint16).numpy()
    values = torch.randn(1, kv, length, hd).bfloat16().view(torch.uint16).numpy()
    q = np.random.default_rng(0).standard_normal((1, kv * rep, hd)).astype(np.float32)
    items = np.array([(0, h, 0, length - 1, 1) for h in range(kv)], np.int32)
    out = np.empty_like(q)
    scale, cap = np.float32(hd**-0.5), np.float32(0)
    best = {0: float("inf"), args.window: float("inf")}
    for window in best:  # compile and warm
        attend(q, keys_t, values, items, scale, cap, window, out)
    for _ in range(args.rounds):
        for window in best:
            start = time.perf_counter()
            for _ in range(20):
                attend(q, keys_t, values, items, scale, cap, window, out)
            best[window] = min(best[window], (time.perf_counter() - start) / 20)
    full, local = best[0], best[args.window]
    print(
        f"context {length}: all keys {full * 1e6:.0f} us, window {args.window} "
        f"{local * 1e6:.0f} us: {full / local:.1f}x"
    )


if __name__ == "__main__":
    main()
