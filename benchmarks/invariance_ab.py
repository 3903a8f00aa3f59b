"""What the row-invariant CPU attention buys and costs, against PyTorch's SDPA, in one run.

Two engines on the same weights (the embedded SmolLM2-135M in bfloat16): the default runtime
(``LlamaRuntime(invariant_attention=True)``: every row, prompts included, through
``hybridspec.model.attention_kernels``) and one with ``invariant_attention=False`` (SDPA for
every row). For each, it

1. times forwards interleaved, so that machine drift cancels: prefill per token (300 tokens),
   and forwards of 1, 4 and 9 tokens after that context (medians of ``--repeats``);
2. decodes the 16 input-grounded bench prompts greedily with ``none`` and with ``ngram`` and
   counts the prompts whose two texts are identical token for token.

Run from the repository root, after ``make install``::

    python benchmarks/invariance_ab.py
    python benchmarks/invariance_ab.py --max-new-tokens 64 --prompts 4    # a quick look
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hybridspec.bench.workload import DEFAULT_WORKLOAD, encode_prompt, load_workload
from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.engine import Engine, GenerationParams
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.runtime import ForwardBatch

CONTEXT = 300
SIZES = (1, 4, 9)


def time_forwards(runtimes: dict[str, LlamaRuntime], repeats: int) -> None:
    ids = [random.Random(0).randrange(1000, 40000) for _ in range(CONTEXT)]
    slots = {name: rt.allocate() for name, rt in runtimes.items()}
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, rt in runtimes.items():
            slot = slots[name]
            rt.truncate(slot, 0)
            start = time.perf_counter()
            rt.forward(ForwardBatch.from_lists([slot], [ids], logits_indices=[CONTEXT - 1]))
            per_token = (time.perf_counter() - start) * 1e3 / CONTEXT
            samples.setdefault((name, "prefill"), []).append(per_token)
            for n in SIZES:
                start = time.perf_counter()
                rt.forward(ForwardBatch.from_lists([slot], [ids[:n]]))
                samples.setdefault((name, str(n)), []).append((time.perf_counter() - start) * 1e3)
                rt.truncate(slot, CONTEXT)
    for name, rt in runtimes.items():
        rt.free(slots[name])
        med = {
            key: statistics.median(samples[(name, key)]) for key in ("prefill", *map(str, SIZES))
        }
        sizes = "  ".join(f"{n} tokens {med[str(n)]:.2f} ms" for n in SIZES)
        print(
            f"{name:8s} prefill {med['prefill']:.3f} ms/token  {sizes}  "
            f"9/1: {med['9'] / med['1']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=None, help="first N prompts only")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = ModelConfig(None, "bfloat16", "cpu", max_num_seqs=1, max_seq_len=1024)
    # No prefix cache: each text is generated from a cold prompt.
    config = EngineConfig(target=target, prefix_cache_mb=0)
    engines = {"kernel": Engine(config)}
    sdpa = Engine(config)
    runtime = sdpa.runtime
    assert isinstance(runtime, LlamaRuntime)
    sdpa.runtime = LlamaRuntime(
        runtime.weights, runtime.max_num_seqs, runtime.max_seq_len, invariant_attention=False
    )
    sdpa.prefix_cache.runtime = sdpa.runtime  # the engine's slots come from the new runtime
    engines["sdpa"] = sdpa
    runtimes = {name: e.runtime for name, e in engines.items()}
    assert all(isinstance(rt, LlamaRuntime) for rt in runtimes.values())
    time_forwards(runtimes, args.repeats)  # type: ignore[arg-type]

    workload = load_workload(DEFAULT_WORKLOAD)
    grounded = {name for name, c in workload.categories.items() if c.input_grounded}
    prompts = [p for p in workload.prompts if p.category in grounded][: args.prompts]
    token_ids = [encode_prompt(engines["kernel"].tokenizer, p) for p in prompts]
    for name, engine in engines.items():
        same = 0
        for ids in token_ids:
            texts = [
                engine.generate(
                    prompt_token_ids=ids,
                    params=GenerationParams.create(
                        max_new_tokens=args.max_new_tokens, temperature=0.0, proposer=proposer
                    ),
                ).token_ids
                for proposer in ("none", "ngram")
            ]
            same += list(texts[0]) == list(texts[1])
        print(f"{name:8s} greedy ngram text == none text: {same} of {len(token_ids)} prompts")


if __name__ == "__main__":
    main()
