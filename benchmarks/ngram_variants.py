"""Compare ``ngram`` settings by their forwards, priced by one table of forward times.

Wall-clock comparisons of proposer settings on a shared CPU drift by more than the settings
differ (on the development machine a one-token forward went from 22 to 32 ms within an hour,
idle). This script instead records, per request, the number of tokens of every target forward
(prefill chunks included), and prices each forward by a table timed once at start-up: a
one-sequence forward of 1..MAX_TABLE_TOKENS tokens after a 300-token context, and prefill per
token beyond that. The speedups it prints therefore depend only on the outputs and on how many
tokens each round verified, never on when a setting ran. Time outside the forward (3-5%) is
not counted.

Run from the repository root, after ``make install``::

    python benchmarks/ngram_variants.py                       # greedy, the input-grounded prompts
    python benchmarks/ngram_variants.py --temperature 0.8 --seeds 2
    python benchmarks/ngram_variants.py --variants copy:1-8 frequency:2-4 frequency:1-4
    python benchmarks/ngram_variants.py --variants copy:1-8 -k 8 12 16     # K, same table

A variant is ``continuation:min-max`` (orders). The figures in ``hybridspec/proposers/ngram.py``
came from these settings on the development CPU (bfloat16, 256 new tokens, K = 8).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hybridspec.bench.timing import EngineForwardTimer
from hybridspec.bench.workload import DEFAULT_WORKLOAD, encode_prompt, load_workload
from hybridspec.config import EngineConfig, ModelConfig, NgramConfig
from hybridspec.engine import Engine, GenerationParams
from hybridspec.model.runtime import ForwardBatch, ModelRuntime

MAX_TABLE_TOKENS = 17
TABLE_CONTEXT = 300
PREFILL_PROBE = 256


def parse_variant(text: str) -> NgramConfig:
    continuation, _, orders = text.partition(":")
    low, _, high = orders.partition("-")
    try:
        return NgramConfig(min_order=int(low), max_order=int(high), continuation=continuation)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected continuation:min-max ({exc})"
        ) from exc


def _median_ms(run: Callable[[], None], repeats: int = 5) -> float:
    run()  # warm-up
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        timings.append((time.perf_counter() - start) * 1e3)
    return statistics.median(timings)


def forward_cost_table(runtime: ModelRuntime) -> Callable[[int], float]:
    """Milliseconds of a forward of ``n`` tokens: timed for n <= MAX_TABLE_TOKENS, else per
    prefill token times n."""
    slot = runtime.allocate()
    try:
        runtime.forward(ForwardBatch.from_lists([slot], [[5] * TABLE_CONTEXT], logits_indices=[]))
        table = {}
        for n in range(1, MAX_TABLE_TOKENS + 1):
            batch = ForwardBatch.from_lists([slot], [[7] * n])

            def run(batch: ForwardBatch = batch) -> None:
                runtime.forward(batch)
                runtime.truncate(slot, TABLE_CONTEXT)

            table[n] = _median_ms(run)
        runtime.truncate(slot, 0)
        prefill = ForwardBatch.from_lists(
            [slot], [[5] * PREFILL_PROBE], logits_indices=[PREFILL_PROBE - 1]
        )

        def run_prefill() -> None:
            runtime.forward(prefill)
            runtime.truncate(slot, 0)

        per_token = _median_ms(run_prefill) / PREFILL_PROBE
    finally:
        runtime.free(slot)
    print("forward ms: " + " ".join(f"{n}:{ms:.1f}" for n, ms in table.items()))
    print(f"prefill ms per token: {per_token:.2f}")
    return lambda n: table[n] if n in table else max(table[MAX_TABLE_TOKENS], per_token * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        nargs="+",
        type=parse_variant,
        default=[parse_variant("copy:1-8"), parse_variant("frequency:2-4")],
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seeds", type=int, default=1, help="sampled runs per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "-k",
        type=int,
        nargs="+",
        default=[8],
        help="K, the drafts per round at most; several values run every variant at each",
    )
    parser.add_argument("--prompts", type=int, default=None, help="first N prompts only")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    workload = load_workload(DEFAULT_WORKLOAD)
    grounded = {name for name, c in workload.categories.items() if c.input_grounded}
    prompts = [p for p in workload.prompts if p.category in grounded][: args.prompts]
    target = ModelConfig(None, "bfloat16", "cpu", max_num_seqs=1, max_seq_len=1024)
    engines = {"none": Engine(EngineConfig(target=target))}
    num_drafts = {"none": 0}
    for v in args.variants:
        for k in args.k:
            name = f"{v.continuation}:{v.min_order}-{v.max_order}"
            name += f" K={k}" if len(args.k) > 1 else ""
            engines[name] = Engine(EngineConfig(target=target, ngram=v))
            num_drafts[name] = k
    cost = forward_cost_table(engines["none"].runtime)
    timers = {name: EngineForwardTimer(engine.runtime) for name, engine in engines.items()}
    for timer in timers.values():
        timer.install()
    token_ids = [encode_prompt(engines["none"].tokenizer, p) for p in prompts]

    totals: dict[str, list[float]] = {}  # name -> [tokens, modelled ms, forwards]
    seeds = args.seeds if args.temperature > 0 else 1
    for seed in range(seeds):
        for name, engine in engines.items():
            total = totals.setdefault(name, [0, 0.0, 0])
            timer = timers[name]
            for i, ids in enumerate(token_ids):
                timer.reset()
                result = engine.generate(
                    prompt_token_ids=ids,
                    params=GenerationParams.create(
                        max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature,
                        seed=i + 1000 * seed,
                        proposer="none" if name == "none" else "ngram",
                        num_speculative_tokens=num_drafts[name] or None,
                    ),
                )
                total[0] += len(result.token_ids)
                total[1] += sum(cost(n) for n in timer.input_tokens)
                total[2] += timer.calls
            print(f"seed {seed} {name}: {total[0] / total[1] * 1e3:.1f} tok/s so far", flush=True)
    base = totals["none"][0] / totals["none"][1]
    print(f"\n{len(prompts)} input-grounded prompts, T = {args.temperature}, {seeds} seed(s)")
    for name, (tokens, ms, forwards) in totals.items():
        rate = tokens / ms
        print(
            f"{name:16s} {rate * 1e3:6.1f} tok/s (modelled)  {rate / base:.3f}x none  "
            f"{tokens / forwards:.2f} tokens per forward (prefill included)"
        )


if __name__ == "__main__":
    main()
