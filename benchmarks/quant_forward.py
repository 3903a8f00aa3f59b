"""One forward of the embedded target with 1, 4 and 9 new tokens after a 200-token context:
``--quantize none`` (bfloat16) against ``gguf`` (the file's blocks through the block kernel) and
``gguf`` with a dense bfloat16 LM head, interleaved, medians of 15 rounds. Run::

    .venv/bin/python benchmarks/quant_forward.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridspec.config import ModelConfig
from hybridspec.model import ForwardBatch, ModelRuntime, dense, load_model
from hybridspec.model.linear import PackedLinear

CONTEXT = 200
NEW_TOKENS = (1, 4, 9)
ROUNDS = 15


def runtimes() -> dict[str, ModelRuntime]:
    built: dict[str, ModelRuntime] = {}
    for quantize in ("none", "gguf"):
        built[quantize] = load_model(ModelConfig(quantize=quantize)).create_runtime(1, 1024)
    model = load_model(ModelConfig(quantize="gguf"))
    runtime = model.create_runtime(1, 1024)
    assert not isinstance(model.weights, torch.nn.Module)
    head = dense(model.weights.lm_head, torch.bfloat16)
    runtime._lm_head = PackedLinear(head, prepack=True)  # type: ignore[attr-defined]  # a probe
    built["gguf, bf16 LM head"] = runtime
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(parser.parse_args().threads)
    built = runtimes()
    ids = torch.randint(0, 49152, (CONTEXT + max(NEW_TOKENS),), generator=torch.Generator())

    def batch(start: int, count: int) -> ForwardBatch:
        tokens = ids[start : start + count]
        return ForwardBatch(torch.tensor([0]), tokens, torch.tensor([0, count]))

    for runtime in built.values():
        runtime.allocate()
        runtime.forward(batch(0, CONTEXT))
    seconds: dict[str, dict[int, list[float]]] = {k: {n: [] for n in NEW_TOKENS} for k in built}
    for _ in range(ROUNDS):
        for name, runtime in built.items():
            for count in NEW_TOKENS:
                start = time.perf_counter()
                runtime.forward(batch(CONTEXT, count))
                seconds[name][count].append(time.perf_counter() - start)
                runtime.truncate(0, CONTEXT)
    for name, by_count in seconds.items():
        cells = "  ".join(
            f"T={n}: {statistics.median(s) * 1e3:6.2f} ms" for n, s in by_count.items()
        )
        print(f"{name:<20} {cells}")


if __name__ == "__main__":
    main()
