"""What sharing a prompt's prefill among its ``n`` choices saves, against ``n`` requests.

On the embedded SmolLM2-135M (bfloat16 on CPU, or ``--device cuda``), for a prompt of
``--prompt-tokens`` tokens, it times interleaved runs (so that machine drift cancels) of

- ``shared``: ``Engine.generate_choices(n=N)``, the prompt prefilled once and its cache copied
  into the other choices' slots (``engine.choices``);
- ``separate``: ``N`` ordinary requests of the same prompt added together,

after a warm-up, each generating ``--max-new-tokens`` greedy tokens with ``none``, and reports
the median wall time of each, their ratio, the tokens the target was fed (counted by a forward
observer) and whether the texts are identical. Run from the repository root, after
``make install``::

    python benchmarks/experiments/engine/choices_prefill.py
    python benchmarks/experiments/engine/choices_prefill.py --prompt-tokens 256 --n 2 --repeats 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.engine import Engine, GenerationParams, warm_up


def run_separate(
    engine: Engine, prompt: list[int], params: GenerationParams, n: int
) -> list[list[int]]:
    ids = [engine.add_request(prompt, params) for _ in range(n)]
    results: dict[str, list[int]] = {}
    while len(results) < n:
        for output in engine.step():
            if output.result is not None:
                results[output.request_id] = output.result.token_ids
    return [results[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        target=ModelConfig(device=args.device, max_num_seqs=max(8, args.n), max_seq_len=4096),
        prefill_chunk_size=512,
        prefix_cache_mb=0,  # the separate requests must each prefill their prompt: no reuse
    )
    engine = Engine(config)
    warm_up(engine)  # kernels compiled (or loaded) before anything is timed
    fed: list[int] = []
    engine.runtime.add_forward_observer(lambda batch, _: fed.append(batch.token_ids.numel()))
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    params = GenerationParams(max_new_tokens=args.max_new_tokens, proposer="none")
    times: dict[str, list[float]] = {"shared": [], "separate": []}
    tokens: dict[str, int] = {}
    texts: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name in ("shared", "separate"):
            fed.clear()
            start = time.perf_counter()
            if name == "shared":
                results = engine.generate_choices(prompt_token_ids=prompt, n=args.n, params=params)
                texts[name] = [r.token_ids for r in results]
            else:
                texts[name] = run_separate(engine, prompt, params, args.n)
            times[name].append(time.perf_counter() - start)
            tokens[name] = sum(fed)
    shared, separate = (statistics.median(times[k]) for k in ("shared", "separate"))
    print(
        f"prompt {args.prompt_tokens} tokens, n={args.n}, {args.max_new_tokens} new tokens each, "
        f"{engine.runtime.device}, median of {args.repeats}"
    )
    for name, seconds in (("shared", shared), ("separate", separate)):
        print(f"{name:9} {seconds:7.3f} s  target fed {tokens[name]} tokens")
    print(f"separate / shared: {separate / shared:.2f}x")
    same = texts["shared"] == texts["separate"]
    print(f"texts identical: {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
