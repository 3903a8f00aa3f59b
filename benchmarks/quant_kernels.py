"""One matmul per SmolLM2-135M shape: dense bfloat16 (oneDNN prepacked, as the runtime runs it)
against the quantized kernels (4-bit ``Int4Linear``, 8-bit ``Int8Linear``), on one thread.

Times are the thread's CPU time (``time.thread_time``), the fastest of 7 batches, so that other
processes on the machine inflate them less than wall time; each weight is re-read from cache
after the first call, so this compares compute and dispatch, not memory bandwidth (a forward
streams every weight from memory once per call). Run::

    .venv/bin/python benchmarks/quant_kernels.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hybridspec.model.linear import PackedLinear
from hybridspec.model.quant import quantize
from hybridspec.model.quant_linear import quantized_linear

# (in features K, out features N) of the embedded target: q/k/v, o, gate/up, down, LM head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def cpu_microseconds(call: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(7):
        start = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, (time.thread_time() - start) / calls)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print("rows  K     N      bf16 us  int4 us  int8 us  bf16/int4  bf16/int8")
    for rows in (1, 4):
        for k, n in SHAPES:
            weight = torch.randn(n, k, generator=gen) * 0.05
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            dense = PackedLinear(weight.to(torch.bfloat16), prepack=True)
            int4 = quantized_linear(quantize(weight, 4))
            int8 = quantized_linear(quantize(weight, 8))
            calls = 10 if n > 10_000 else 100
            t_dense = cpu_microseconds(lambda: dense(x), calls)  # noqa: B023
            t_int4 = cpu_microseconds(lambda: int4(x), calls)  # noqa: B023
            t_int8 = cpu_microseconds(lambda: int8(x), calls)  # noqa: B023
            print(
                f"{rows:<5} {k:<5} {n:<6} {t_dense:8.1f} {t_int4:8.1f} {t_int8:8.1f} "
                f"{t_dense / t_int4:10.2f} {t_dense / t_int8:10.2f}"
            )


if __name__ == "__main__":
    main()
