"""The library's rate for the requests that ``hybridspec bench serve`` sends a server.

For the grounded workload, the prompts of concurrency 1 (the texts guidellm sends through the
completions route) go one at a time through an ``Engine`` in the bench's own process, built on
the same GGUF with the same threads, each asking for the workload's output tokens with
``ignore_eos`` at the bench's temperature and seed: output tokens over wall time, as guidellm
counts a server's output tok/s at concurrency 1. No server runs meanwhile. Beside the
server's figure it shows what serving costs (``serving_report``: served / library).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path


def grounded_prompts(path: Path, limit: int) -> tuple[list[str], int]:
    """The first ``limit`` prompts of a grounded workload file and its output tokens."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    rows = rows[:limit]
    if not rows:
        raise ValueError(f"workload file {path}: expected prompts, found none")
    return [str(r["prompt"]) for r in rows], int(rows[0]["output_tokens_count"])


def library_rates(
    gguf: Path,
    proposers: Sequence[str],
    threads: int,
    prompts: Sequence[str],
    output_tokens: int,
    temperature: float,
    seed: int,
) -> dict[str, float]:
    """Output tok/s of each proposer over ``prompts``, one request at a time, in this process
    (one warm-up request first, untimed)."""
    from hybridspec.config import EngineConfig, ModelConfig
    from hybridspec.engine import Engine

    # No prefix cache: every request prefills its whole prompt, as each server's first asking
    # does; with it, each proposer after the first would find every prompt cached.
    config = EngineConfig(target=ModelConfig(str(gguf)), num_threads=threads, prefix_cache_mb=0)
    engine = Engine(config)
    try:
        rates = {}
        for proposer in proposers:
            engine.generate(prompts[0], max_new_tokens=4, proposer=proposer)
            tokens, start = 0, time.perf_counter()
            for prompt in prompts:
                result = engine.generate(
                    prompt,
                    max_new_tokens=output_tokens,
                    ignore_eos=True,
                    temperature=temperature,
                    seed=seed,
                    proposer=proposer,
                )
                tokens += len(result.token_ids)
            rates[proposer] = tokens / (time.perf_counter() - start)
        return rates
    finally:
        engine.close()
