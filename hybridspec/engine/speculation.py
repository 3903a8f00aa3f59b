"""Adaptive speculation length: how many drafts each request asks for in a round.

A request's K (``num_speculative_tokens``) is an upper bound. Each round the engine asks for
the ``k <= K`` drafts that are expected to pay for themselves:

- Acceptance: a request's drafts are modelled as accepted one after another with a constant
  probability ``alpha`` each (Leviathan et al. 2023, section 3.3), so draft ``j`` (1-based) is
  kept with probability ``alpha ** j``. ``SpeculationState`` tracks ``alpha`` per request from
  its own recent rounds: a round that proposed drafts adds its accepted drafts to the accepted
  count and one to the rejected count if it stopped before the end of the proposal; both
  counts decay by ``DECAY`` every round, and a prior of one accept and one reject keeps the
  estimate defined (0.5 with no history).
- Cost: a target forward over ``T`` tokens costs about ``a (1 + c max(0, T - F))``: a fixed
  part (reading the weights), which covers the first ``F`` tokens (``free_verify_tokens``: on
  the development CPU a forward of up to 6 tokens costs what one of 1 does, the matmuls
  handling 6 rows in one pass), plus ``c`` (``verify_token_cost``) per token beyond. A
  proposer adds its own ``cost_per_token`` (relative to ``a``) for each draft it makes.
- Value: the last round committed ``n`` tokens over ``T`` verified tokens, so one committed
  token was worth ``a cost(T) / n`` of time. The token that would be row ``r`` of the forward
  is worth asking for when its chance of being kept is at least its cost over that worth:
  ``alpha ** j >= threshold(r)`` with ``threshold(r) = (c [r > F] + cost_per_token) n /
  cost(T)``. Rows are counted over the whole forward: prefill chunks and every request's
  committed tokens (its root, at least) come first, then the drafts of the requests asked
  before this one in the step. A request priced by its own round (below) counts its own
  committed tokens only.
- Whose round: a request whose text does not depend on its drafts uses the whole last engine
  step (every request verified in it), since batch neighbours share the forward's fixed cost
  and so make each token cheaper and drafts relatively dearer. That is every greedy request,
  and every sampled one whose proposer is deterministic (``Proposer.samples_drafts`` False:
  its tokens come from position-keyed uniforms, ``verifier.uniforms``). A sampled request
  whose proposer samples its drafts uses its own last round only: the drafts it asks for steer
  how its random generator is consumed, and its seeded output must not depend on its batch
  neighbours.

So ``k`` is the largest ``j <= K`` whose drafts ``1 .. j`` all pass. It may be 0: such a request
decodes plainly until its decayed history makes it try again (its estimate drifts back toward
the prior at 0.5). A draft in a free row costs nothing to verify, so it is always asked for.

``c`` and ``F`` default to ``config.DEFAULT_VERIFY_TOKEN_COST`` and
``config.DEFAULT_FREE_VERIFY_TOKENS``, measured on the development CPU; they are fixed numbers
rather than ones timed at start-up so that a seeded sampled request gives the same text on every
run. ``measure_verify_token_cost`` times ``c`` for another machine
(``EngineConfig(verify_token_cost=None)`` does so at start-up); ``F`` is set in the config
(``free_verify_tokens = 1`` gives the linear model ``1 + c (T - 1)``).

Why the free rows, measured on the development CPU (one sequence after 300 cached tokens, min of
12 forwards each, relative to one token): 2-6 tokens 0.98-1.04, 7: 1.08-1.10, 8: 1.09-1.24, 12:
1.26-1.37, 16: 1.44, 32: 2.07, 48: 2.95. The earlier linear model (``c`` = 0.03 from the first
token) priced drafts 2-5 as dear as later ones and drafts past 6 too cheaply.

Worked example (c = 0.043, F = 6): one request alone, the last round verified 9 tokens and
committed 4. Its root is row 1, so its drafts 1..5 (rows 2..6) are free; beyond them,
threshold = 0.043 * 4 / 1.129 = 0.152. With alpha = 0.8, 0.8 ** 8 = 0.168 >= 0.152 > 0.8 ** 9,
so it asks for min(K, 8) drafts; with alpha = 0.3, the 5 free ones. Eight greedy requests that
committed 16 tokens over 40 verified tokens: their 8 roots fill the free rows, and threshold =
0.043 * 16 / 2.462 = 0.279; alpha = 0.3 gives 1 draft, alpha = 0.2 none.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from hybridspec.engine.runtime import ForwardBatch, ModelRuntime

DECAY = 0.8  # weight of a round's evidence after each later round
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
CALIBRATION_TOKENS = 16  # extra tokens of the calibration forward
CALIBRATION_CONTEXT = 128  # tokens cached before the timed forwards
CALIBRATION_REPEATS = 3
# A measured cost above this is timing noise (a loaded machine); real ones are ~0.03 on CPU.
MAX_VERIFY_TOKEN_COST = 0.1


@dataclass(slots=True)
class SpeculationState:
    """One request's evidence: decayed counts of accepted and rejected drafts, and its own
    last round (see the module docstring)."""

    accepted: float = 0.0
    rejected: float = 0.0
    last_committed: int = 1  # before any round: as if one plain decoding step
    last_verified: int = 1

    @property
    def rate(self) -> float:
        """The estimated probability ``alpha`` that a draft is accepted, given its predecessor."""
        return (self.accepted + PRIOR_ACCEPTED) / (
            self.accepted + self.rejected + PRIOR_ACCEPTED + PRIOR_REJECTED
        )

    def update(self, num_proposed: int, num_accepted: int, num_committed: int) -> None:
        """Learn from a round that proposed, accepted and committed so many tokens."""
        self.accepted *= DECAY
        self.rejected *= DECAY
        if num_proposed > 0:
            self.accepted += num_accepted
            self.rejected += 1.0 if num_accepted < num_proposed else 0.0
        if num_committed > 0:
            self.last_committed, self.last_verified = num_committed, num_proposed + 1


def forward_cost(verify_token_cost: float, free_verify_tokens: int, num_tokens: int) -> float:
    """A forward of ``num_tokens`` tokens, relative to one of 1 (module docstring)."""
    return 1.0 + verify_token_cost * max(0, num_tokens - free_verify_tokens)


def draft_threshold(
    row_cost: float, committed: int, verified_cost: float, proposer_cost_per_token: float
) -> float:
    """The least chance of acceptance that pays for one more draft (module docstring): its
    row's cost ``row_cost`` (0 in a free row), when the last round committed ``committed``
    tokens for a forward costing ``verified_cost``."""
    return (row_cost + proposer_cost_per_token) * committed / verified_cost


class SpeculationPolicy:
    """Chooses each request's drafts for the round from its state and the last engine step."""

    def __init__(self, verify_token_cost: float, free_verify_tokens: int = 1) -> None:
        if not (math.isfinite(verify_token_cost) and verify_token_cost >= 0):
            raise ValueError(f"verify_token_cost: expected a number >= 0, got {verify_token_cost}")
        if free_verify_tokens < 1:
            raise ValueError(f"free_verify_tokens: expected >= 1, got {free_verify_tokens}")
        self.verify_token_cost = verify_token_cost
        self.free_verify_tokens = free_verify_tokens
        self._committed = 1  # what the last step committed and verified; one plain decode
        self._verified = 1

    def record_step(self, committed: int, verified: int) -> None:
        """Remember a step that verified ``verified`` tokens and committed ``committed``."""
        if committed > 0 and verified > 0:
            self._committed, self._verified = committed, verified

    def num_drafts(
        self,
        state: SpeculationState,
        max_drafts: int,
        *,
        by_step: bool,
        proposer_cost_per_token: float = 0.0,
        rows_before: int = 0,
    ) -> int:
        """Drafts to ask for; ``by_step``: priced by the last engine step, else by the
        request's own last round (module docstring, "Whose round"). ``rows_before``: rows of
        the forward taken before this request's first draft (module docstring, "Cost")."""
        committed, verified = (
            (self._committed, self._verified)
            if by_step
            else (state.last_committed, state.last_verified)
        )
        c, free = self.verify_token_cost, self.free_verify_tokens
        verified_cost = forward_cost(c, free, verified)
        rate = state.rate
        chance = 1.0
        for j in range(1, max_drafts + 1):
            row_cost = c if rows_before + j > free else 0.0
            chance *= rate
            cost = proposer_cost_per_token
            if chance < draft_threshold(row_cost, committed, verified_cost, cost):
                return j - 1
        return max(0, max_drafts)


def measure_verify_token_cost(
    runtime: ModelRuntime, max_drafts: int, free_verify_tokens: int = 1
) -> float:
    """``c`` of the module docstring, timed on ``runtime``: one sequence with a short cached
    context, forwards of 1, ``F`` (``free_verify_tokens``) and ``F + m`` tokens (``m =
    min(16, max_drafts)``): the cost of the ``m`` tokens past ``F`` over ``m`` one-token ones.

    Takes a free cache slot for the duration (none free: returns 0, i.e. drafts cost nothing
    to verify). Medians of ``CALIBRATION_REPEATS`` timings after one warm-up each; the result
    is clamped to ``[0, MAX_VERIFY_TOKEN_COST]``.
    """
    extra = min(CALIBRATION_TOKENS, max(1, max_drafts))
    context = min(CALIBRATION_CONTEXT, runtime.max_seq_len - free_verify_tokens - extra)
    if runtime.num_free_slots() == 0 or context < 0:
        return 0.0
    slot = runtime.allocate()
    try:
        if context > 0:
            runtime.forward(ForwardBatch.from_lists([slot], [[0] * context], logits_indices=[]))
        one = _median_forward_s(runtime, slot, context, 1)
        free = (
            one
            if free_verify_tokens == 1
            else _median_forward_s(runtime, slot, context, free_verify_tokens)
        )
        many = _median_forward_s(runtime, slot, context, free_verify_tokens + extra)
    finally:
        runtime.free(slot)
    if one <= 0:
        return 0.0
    return min(MAX_VERIFY_TOKEN_COST, max(0.0, (many - max(one, free)) / (extra * one)))


def _median_forward_s(runtime: ModelRuntime, slot: int, context: int, num_tokens: int) -> float:
    batch = ForwardBatch.from_lists([slot], [[0] * num_tokens], logits_indices=[num_tokens - 1])
    timings = []
    for i in range(CALIBRATION_REPEATS + 1):
        start = time.perf_counter()
        logits = runtime.forward(batch)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        if i > 0:  # the first is a warm-up
            timings.append(time.perf_counter() - start)
        runtime.truncate(slot, context)
    return sorted(timings)[len(timings) // 2]
