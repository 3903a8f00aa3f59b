"""Warm-up: run what compiles or allocates on first use before the first request does.

Without it the first request pays for numba compiling the attention and n-gram kernels on its
path (seconds after a fresh install). numba keeps what it compiles on disk (``cache=True``), so
a restart only loads it, but even loading, and torch's and oneDNN's first calls for a shape,
cost a first request tenths of a second.

``warm_up(engine)`` runs tiny requests through the engine's own ``step``, so that they take
every path a real request takes, on the model, dtype and device being served:

1. each built-in proposer that the engine has (``none``, ``ngram``; ``draft`` when a draft model
   is configured) alone, greedy, with K drafts every round: one sequence decoding and verifying;
2. all of them at once, each greedy and seeded-sampled: a batch of several sequences (the
   attention kernel's multi-sequence items), rejection sampling and the keyed uniforms.

Adaptive speculation is off meanwhile (it may ask for no drafts on a fresh request); the engine
is then left as built (``Engine.warm_up`` restores what the requests changed), so a request's
output does not depend on whether the engine was warmed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridspec.engine.request import FinishReason, GenerationParams
from hybridspec.errors import check

if TYPE_CHECKING:
    from hybridspec.engine.engine import Engine

logger = logging.getLogger(__name__)

BUILT_IN_PROPOSERS = ("none", "ngram", "draft")
PROMPT_PATTERN_TOKENS = 4  # distinct tokens, repeated, so that ngram finds matches to copy
PROMPT_TOKENS = 16
NEW_TOKENS = 3  # the prompt's forward, then rounds of decoding with drafts
SAMPLED_TEMPERATURE = 0.8


def warm_up(engine: Engine) -> float:
    """Run the warm-up requests (module docstring) on an engine that holds no request, then
    ``engine.reset()``; returns the seconds taken."""
    check(not engine.has_unfinished(), "engine", "warm up an engine before it takes requests")
    start = time.perf_counter()
    proposers = [name for name in BUILT_IN_PROPOSERS if name in engine.available_proposers()]
    prompt = warm_up_prompt(engine)
    room = engine.max_seq_len - len(prompt)
    greedy = [_params(name, None, room) for name in proposers]
    sampled = [_params(name, 0, room) for name in proposers]
    speculation, engine.speculation = engine.speculation, None  # K drafts every round
    try:
        for params in greedy:
            _run(engine, prompt, [params])
        _run(engine, prompt, [*greedy, *sampled])
    finally:
        engine.abort_all()  # only if a step raised
        engine.speculation = speculation
        engine.reset()
    elapsed = time.perf_counter() - start
    logger.debug("warmed up %s in %.2f s", ", ".join(proposers), elapsed)
    return elapsed


def warm_up_prompt(engine: Engine) -> list[int]:
    """``PROMPT_TOKENS`` ids repeating a pattern of non-EOS tokens, fitting the context."""
    pattern = [i for i in range(engine.vocab_size) if i not in engine.eos_token_ids]
    pattern = pattern[:PROMPT_PATTERN_TOKENS]
    length = max(1, min(PROMPT_TOKENS, engine.max_seq_len // 2))
    return [pattern[i % len(pattern)] for i in range(length)]


def _params(proposer: str, seed: int | None, room: int) -> GenerationParams:
    return GenerationParams.create(
        max_new_tokens=max(1, min(NEW_TOKENS, room)),
        temperature=0.0 if seed is None else SAMPLED_TEMPERATURE,
        seed=seed,
        proposer=proposer,
        ignore_eos=True,
    )


def _run(engine: Engine, prompt: list[int], requests: Sequence[GenerationParams]) -> None:
    """Run ``requests`` on ``prompt``, as many at once as the engine's slots and queue allow."""
    capacity = max(1, min(engine.config.target.max_num_seqs, engine.config.max_queue_size))
    for first in range(0, len(requests), capacity):
        for params in requests[first : first + capacity]:
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            for output in engine.step():
                if output.finish_reason is FinishReason.ERROR and output.result is not None:
                    logger.warning("a warm-up request failed: %s", output.result.error)
