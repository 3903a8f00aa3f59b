"""Sampling transforms applied alike to the target (p) and the draft (q): temperature, top-k,
min-p, top-p.

Rejection sampling is lossless with respect to the distribution it is given, so the verifier
applies these transforms to the target's logits itself, and a sampling proposer applies the same
functions to its own logits before drawing a draft token. Greedy decoding (``temperature == 0``)
never builds probabilities: it takes ``greedy_token_ids`` (the argmax of the logits).

The logits given here are the target's or the draft's after the request's sampling controls
(``controls``: logit bias, min_tokens, penalties), which come first. The order and the exact
semantics, for one row of logits ``z``:

1. **temperature**: ``s = z / temperature``.
2. **top-k**: keep every token whose ``s`` is ``>=`` the k-th largest ``s``; ties at the boundary
   are all kept (so more than k tokens survive when the k-th value is tied), as in Hugging Face's
   ``TopKLogitsWarper`` and vLLM. ``top_k >= vocab_size`` keeps everything.
   **min-p** (vLLM's): keep every token whose ``s >= max(s) + log(min_p)``, that is whose
   probability is at least ``min_p`` times the largest. Both keep the largest, so their order
   does not matter. ``min_p == 0`` keeps everything.
3. **softmax** over the survivors gives ``probs``.
4. **top-p** (nucleus, over the top-k survivors): sort ``probs`` descending and accumulate in
   float64; the nucleus is the shortest prefix whose mass is ``>= top_p``, always at least one
   token; then every token whose probability equals the last member's is kept too (ties at the
   boundary are all kept, so the result never depends on the order of tied tokens). The
   survivors are renormalised. ``top_p == 1`` keeps everything. The running mass is added up
   in float64, so only a prefix whose mass is within a rounding error of ``top_p`` can land on
   the other side of it.

Filtered tokens get probability exactly 0, so neither the draft nor the verifier can emit them.

Dimensions: ``num_rows`` positions whose logits are transformed (from one request or several),
``vocab_size`` the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from hybridspec.errors import check
from hybridspec.types import SamplingParams

# Top-p first looks for the nucleus among this many largest probabilities of each row.
_PREFIX_SIZE = 64
# Every non-negative float32 bit pattern (NaN included) shifted right by 20 is below this.
_NUM_BUCKETS = 2048

TransformKey = tuple[float, int | None, float, float]


def transform_key(params: SamplingParams) -> TransformKey:
    """What determines the transform: rows with equal keys are transformed identically."""
    return (float(params.temperature), params.top_k, float(params.top_p), float(params.min_p))


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: argmax of the raw logits, ties going to the lowest token id.

    ``logits`` [num_rows, vocab_size] -> [num_rows] int64. On CPU the argmax is numpy's over
    the rows widened to float32 where they are 16-bit (exactly: every bfloat16 and float16 is
    a float32), the same first maximum as torch's: torch's CPU argmax over a vocabulary takes
    several times as long, a share of every decoding step.
    """
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.shape[-1] == 0:
        return logits.argmax(dim=-1)
    rows = logits.detach()
    if rows.dtype in (torch.bfloat16, torch.float16):
        rows = rows.float()
    return torch.from_numpy(rows.numpy().argmax(axis=-1).astype(np.int64, copy=False))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply one request's temperature, top-k, min-p and top-p to every row.

    ``logits`` [num_rows, vocab_size] float -> probs [num_rows, vocab_size], float32 (float64
    stays float64), each row summing to 1. Requires ``temperature > 0``.
    """
    _check_logits(logits)
    _check_sampled(params, "params")
    return _transform(logits, [params])


def logits_to_probs_by_row(
    logits: torch.Tensor, row_params: Sequence[SamplingParams]
) -> torch.Tensor:
    """Like ``logits_to_probs``, with row i transformed under ``row_params[i]``.

    For a batch whose rows belong to requests with different sampling parameters; one
    vectorised pass, whatever the mix. Every row needs ``temperature > 0``.
    """
    _check_logits(logits)
    check(
        len(row_params) == logits.shape[0],
        "row_params",
        f"expected one SamplingParams per row ({logits.shape[0]}), got {len(row_params)}",
    )
    keys = {transform_key(params) for params in row_params}
    for params in row_params:
        _check_sampled(params, "row_params")
    return _transform(logits, [row_params[0]] if len(keys) == 1 else list(row_params))


def logits_to_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution one request's tokens are drawn from, every row.

    ``logits`` [num_rows, vocab_size] float -> [num_rows, vocab_size], float32 (float64 stays
    float64). Sampled (``temperature > 0``): the log of ``logits_to_probs``, so filtered tokens
    get ``-inf``. Greedy: that distribution is one-hot, which tells a caller nothing, so this
    is the plain log-softmax of the raw logits instead (temperature 1, nothing filtered), as
    the OpenAI API and vLLM report for greedy requests.
    """
    _check_logits(logits)
    if params.is_greedy:
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        return torch.log_softmax(logits, dim=-1)
    return _transform(logits, [params]).log()


def _check_logits(logits: torch.Tensor) -> None:
    check(
        logits.dim() == 2 and logits.is_floating_point(),
        "logits",
        f"expected a float tensor [num_rows, vocab_size], got {logits.dtype} {tuple(logits.shape)}",
    )


def _check_sampled(params: SamplingParams, param: str) -> None:
    check(
        not params.is_greedy,
        param,
        "temperature 0 is greedy decoding: take greedy_token_ids(logits), not probabilities",
    )


def _transform(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, min-p, softmax, top-p; ``params`` has one entry, or one per row."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # half-precision softmax sums would miss 1 by ~1e-3
    # A temperature past the dtype's largest number would become inf, and a masked logit
    # (-inf: a grammar's, min_tokens') NaN; at the largest one, every finite logit is ~0 alike.
    largest = torch.finfo(logits.dtype).max
    temperatures = [min(p.temperature, largest) for p in params]
    # Dividing makes a new tensor, so the in-place steps below never touch the caller's logits.
    if len(temperatures) == 1:
        scaled = logits / temperatures[0]
    else:
        temperature = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
        scaled = logits / temperature.unsqueeze(1)
    top_k_index = _apply_top_k_(scaled, [p.top_k for p in params])
    _apply_min_p_(scaled, [p.min_p for p in params])
    probs = torch.softmax(scaled, dim=-1)
    _apply_top_p_(probs, [p.top_p for p in params], top_k_index)
    return probs


def _apply_min_p_(scaled: torch.Tensor, min_ps: list[float]) -> None:
    """Set to -inf every logit below its row's largest plus ``log(min_p)``, in place."""
    if not any(min_ps):
        return
    offsets = [math.log(m) if m > 0 else float("-inf") for m in min_ps]
    offset = torch.tensor(offsets, dtype=scaled.dtype, device=scaled.device).unsqueeze(1)
    floor = scaled.amax(dim=-1, keepdim=True) + offset  # [num_rows, 1]
    scaled.masked_fill_(scaled < floor, float("-inf"))


def _apply_top_k_(scaled: torch.Tensor, top_ks: list[int | None]) -> torch.Tensor | None:
    """Set to -inf every logit below its row's k-th largest (ties with it survive), in place.

    Returns the top-k token ids [num_rows, k_max], largest first, when every row has a top-k
    (top-p then looks for the nucleus among them), else None.
    """
    vocab_size = scaled.shape[-1]
    ks = [vocab_size if k is None else min(k, vocab_size) for k in top_ks]
    k_max = max((k for k in ks if k < vocab_size), default=0)
    if k_max == 0:
        return None
    top = scaled.topk(k_max, dim=-1)  # [num_rows, k_max], descending
    if len(ks) == 1:
        kth = top.values[:, k_max - 1 :]
    else:
        index = torch.tensor([min(k, k_max) - 1 for k in ks], device=scaled.device)
        kth = top.values.gather(-1, index.unsqueeze(1))
        unfiltered = torch.tensor([k >= vocab_size for k in ks], device=scaled.device)
        kth.masked_fill_(unfiltered.unsqueeze(1), float("-inf"))
    scaled.masked_fill_(scaled < kth, float("-inf"))
    return top.indices if max(ks) < vocab_size else None


def _apply_top_p_(
    probs: torch.Tensor, top_ps: list[float], top_k_index: torch.Tensor | None
) -> None:
    """Zero every probability outside its row's nucleus and renormalise the rest, in place."""
    active = [top_p < 1.0 for top_p in top_ps]
    if not any(active):
        return
    top_p = torch.tensor(top_ps, dtype=torch.float64, device=probs.device).unsqueeze(1)
    threshold = _nucleus_threshold(probs, top_p, active, top_k_index)  # [num_rows, 1]
    probs.masked_fill_(probs < threshold, 0.0)
    probs.div_(probs.sum(dim=-1, keepdim=True))


def _nucleus_threshold(
    probs: torch.Tensor, top_p: torch.Tensor, active: list[bool], top_k_index: torch.Tensor | None
) -> torch.Tensor:
    """The smallest probability in each row's nucleus; 0 for rows without top-p.

    ``probs`` [num_rows, vocab_size], ``top_p`` [num_rows or 1, 1] float64 -> [num_rows, 1].

    Sorting 17 rows of 49152 floats costs tens of milliseconds on a CPU, so this never sorts a
    whole row. The nucleus is looked for among a prefix of each row's largest probabilities,
    descending: those at ``top_k_index`` (the top-k survivors, when every row has a top-k), or
    else the largest ``_PREFIX_SIZE``. When a prefix's mass falls short of top_p (a flat
    distribution, or ties beyond the top-k ids), ``_bucketed_threshold`` finds it in a few passes.
    """
    if top_k_index is not None:
        top = probs.gather(1, top_k_index)  # descending, as softmax keeps the order of logits
    else:
        top = probs.topk(min(_PREFIX_SIZE, probs.shape[1]), dim=-1).values
    running = top.to(torch.float64).cumsum(dim=1)
    last = (running < top_p).sum(dim=1, keepdim=True)  # == prefix size where not reached
    threshold = top.gather(1, last.clamp(max=top.shape[1] - 1))
    short = last.squeeze(1) == top.shape[1]
    if len(active) > 1:
        inactive = ~torch.tensor(active, device=probs.device)
        threshold.masked_fill_(inactive.unsqueeze(1), 0.0)
        short &= ~inactive
    if bool(short.any()):  # only the rows whose prefix falls short pay for the buckets
        rows = short.nonzero().squeeze(1)
        row_top_p = top_p if top_p.shape[0] == 1 else top_p[rows]
        threshold[rows] = _bucketed_threshold(probs[rows], row_top_p)
    return threshold


def _bucketed_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_nucleus_threshold`` in a few passes over the vocabulary, sorting only one bucket.

    A probability's bucket is the top 11 bits of its float32 bit pattern (sign, exponent, 3
    mantissa bits): a value range 1/8 of an octave wide, higher buckets holding higher values.
    The buckets' float64 masses, accumulated from the top, locate the crossing bucket, where the
    running mass reaches top_p; the largest members of that bucket then finish the count.
    """
    num_rows = probs.shape[0]
    buckets = probs.float().view(torch.int32) >> 20  # [num_rows, vocab_size]
    mass = torch.zeros(num_rows, _NUM_BUCKETS, dtype=torch.float64, device=probs.device)
    mass.scatter_add_(1, buckets.long(), probs.to(torch.float64))
    above = mass.flip(1).cumsum(dim=1)  # [:, j]: mass of the buckets >= _NUM_BUCKETS - 1 - j
    # A row whose total rounds below top_p keeps every positive probability.
    goal = torch.minimum(top_p, above[:, -1:])  # [num_rows, 1]
    j = (above < goal).sum(dim=1, keepdim=True)
    crossing = ((_NUM_BUCKETS - 1) - j).to(torch.int32)  # [num_rows, 1]
    mass_above = above.gather(1, (j - 1).clamp(min=0)).masked_fill_(j == 0, 0.0)
    member = buckets == crossing  # [num_rows, vocab_size]
    count = torch.count_nonzero(member, dim=1).unsqueeze(1)
    top = torch.where(member, probs, 0.0).topk(max(int(count.max()), 1), dim=-1).values
    running = mass_above + top.to(torch.float64).cumsum(dim=1)
    last = torch.minimum((running < goal).sum(dim=1, keepdim=True), (count - 1).clamp(min=0))
    return top.gather(1, last)
