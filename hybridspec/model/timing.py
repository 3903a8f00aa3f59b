"""Timing a runtime's forwards in place, for the cost models that price drafts.

Adaptive speculation prices verifying one more token (``engine.speculation``) and a model-based
proposer prices its own drafts (``Proposer.cost_per_token``) relative to a one-token forward of
the target; both time the runtime they will run on, on a scratch cache slot.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from hybridspec.model.runtime import ForwardBatch, ModelRuntime, synchronize

REPEATS = 3  # timings per size, after one warm-up; the median is kept
TIMING_CONTEXT = 128  # cached tokens before the timed forwards: a short chat turn
COST_REPEATS = 7  # timings of each model when a proposer's cost is priced (the fastest is kept)


def median_forward_seconds(
    runtime: ModelRuntime,
    num_tokens: Sequence[int],
    context: int = TIMING_CONTEXT,
    every_row: bool = False,
) -> list[float] | None:
    """Median seconds of a one-sequence forward of each of ``num_tokens`` new tokens, after
    ``context`` cached tokens (token id 0 throughout; fewer where the context length leaves
    less room); logits of the last token only, or with ``every_row`` of every token, as a
    round that verifies them all computes (the LM head over each row: at the 3B shape 9 rows
    cost about a tenth more so).

    Takes a free cache slot for the duration and leaves the cache as it was; None when no slot
    is free or the sizes do not fit the context length.
    """
    timings = forward_seconds(runtime, num_tokens, context, REPEATS, every_row)
    if timings is None:
        return None
    return [sorted(ts)[len(ts) // 2] for ts in timings]


def fastest_forward_seconds(
    runtime: ModelRuntime, context: int = TIMING_CONTEXT, repeats: int = COST_REPEATS
) -> float | None:
    """The fastest of ``repeats`` one-token forwards after ``context`` cached tokens: the
    forward's own cost, for ratios of two models' forwards taken on a machine that other work
    interrupts (an interruption only ever adds time)."""
    timings = forward_seconds(runtime, (1,), context, repeats)
    return None if timings is None else min(timings[0])


def forward_seconds(
    runtime: ModelRuntime,
    num_tokens: Sequence[int],
    context: int,
    repeats: int,
    every_row: bool = False,
) -> list[list[float]] | None:
    """``repeats`` timings (after one warm-up) of a forward of each of ``num_tokens``; see
    ``median_forward_seconds``."""
    context = min(context, runtime.max_seq_len - max(num_tokens))
    if runtime.num_free_slots() == 0 or context < 0:
        return None
    slot = runtime.allocate()
    try:
        if context > 0:
            runtime.forward(ForwardBatch.from_lists([slot], [[0] * context], logits_indices=[]))
        return [_timings(runtime, slot, context, n, repeats, every_row) for n in num_tokens]
    finally:
        runtime.free(slot)


def _timings(
    runtime: ModelRuntime, slot: int, context: int, num_tokens: int, repeats: int, every_row: bool
) -> list[float]:
    rows = list(range(num_tokens)) if every_row else [num_tokens - 1]
    batch = ForwardBatch.from_lists([slot], [[0] * num_tokens], logits_indices=rows)
    timings = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        logits = runtime.forward(batch).logits
        synchronize(logits.device)
        if i > 0:  # the first is a warm-up
            timings.append(time.perf_counter() - start)
        runtime.truncate(slot, context)
    return timings
