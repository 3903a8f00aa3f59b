"""Plain decoding's rate after the prompt, hybridspec against llama.cpp on the same GGUF file,
interleaved in one process, and hybridspec's share of the memory bound.

Each round times, for each engine in turn, ``--tokens`` one-token steps of greedy decoding
after an 8-token prompt (the prompt's prefill is not timed): hybridspec's runtime forward
(default settings, ``load_model``) and llama.cpp's ``Llama.eval`` (llama-cpp-python, same
threads). Rates are the best of ``--rounds`` rounds. The share of the memory bound is bytes
read per token (every matrix as held, read once) x tokens per second over the GB/s of a 1 GiB
read (``quant_bound.read_rate``). Needs llama-cpp-python (``pip install -e .[bench]``).

Usage: python benchmarks/decode_rate.py FILE [--threads 2] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from quant_bound import bytes_per_token, read_rate

from hybridspec.config import ModelConfig
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.loader import load_model
from hybridspec.model.runtime import ForwardBatch

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def hybridspec_round(runtime: object, tokens: int) -> float:
    slot = runtime.allocate()  # type: ignore[attr-defined]
    ids = list(PROMPT)
    runtime.forward(ForwardBatch.from_lists([slot], [ids]))  # type: ignore[attr-defined]
    start = time.perf_counter()
    for _ in range(tokens):
        batch = ForwardBatch.from_lists([slot], [ids[-1:]])
        logits = runtime.forward(batch).logits  # type: ignore[attr-defined]
        ids.append(int(logits[-1].argmax()))
    rate = tokens / (time.perf_counter() - start)
    runtime.free(slot)  # type: ignore[attr-defined]
    return rate


def llamacpp_round(llm: object, tokens: int) -> float:
    import numpy as np

    llm.reset()  # type: ignore[attr-defined]
    llm.eval(PROMPT)  # type: ignore[attr-defined]
    start = time.perf_counter()
    for _ in range(tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # type: ignore[attr-defined]
        llm.eval([token])  # type: ignore[attr-defined]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llama_cpp import Llama

    model = load_model(ModelConfig(name_or_path=args.file))
    assert isinstance(model.weights, LlamaWeights)
    runtime = model.create_runtime(1, 512)
    llm = Llama(args.file, n_ctx=512, n_threads=args.threads, logits_all=True, verbose=False)
    ours, theirs = 0.0, 0.0
    for _ in range(args.rounds):
        ours = max(ours, hybridspec_round(runtime, args.tokens))
        theirs = max(theirs, llamacpp_round(llm, args.tokens))
    per_token = bytes_per_token(model.weights)
    gbs = read_rate()
    print(
        f"{args.file}: decode {ours:.2f} tok/s vs llama.cpp {theirs:.2f} = {ours / theirs:.2f}x; "
        f"{per_token / 1e6:.1f} MB/token held: {per_token * ours / 1e9:.2f} GB/s of "
        f"{gbs:.2f} GB/s read = {per_token * ours / 1e9 / gbs:.0%} of the bound"
    )


if __name__ == "__main__":
    main()
