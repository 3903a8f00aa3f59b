"""Adaptive speculation length: how many drafts each request asks for in a round.

A request's K (``num_speculative_tokens``) is an upper bound. Each round the engine asks for
the ``k <= K`` drafts that are expected to pay for themselves:

- Acceptance: a request's drafts are modelled as accepted one after another with a constant
  probability ``alpha`` each (Leviathan et al. 2023, section 3.3), so draft ``j`` (1-based) is
  kept with probability ``alpha ** j``. ``SpeculationState`` tracks ``alpha`` per request from
  its own recent rounds (``verifier.estimate.AcceptanceEstimate``): a round that proposed
  drafts adds its accepted drafts to the accepted count and one to the rejected count if it
  stopped before the end of the proposal; both counts decay by 0.8 every round, and a prior of
  one accept and one reject keeps the estimate defined (0.5 with no history).
- Cost: a target forward over ``T`` tokens costs about ``a (1 + c T)``: a fixed part (reading
  the weights) plus ``c`` per token, ``c`` being ``verify_token_cost``. A proposer adds its own
  ``cost_per_token`` (relative to ``a``) for each draft it makes.
- Value: the last round committed ``n`` tokens over ``T`` verified tokens, so one committed
  token was worth ``a (1 + c T) / n`` of time. A draft is worth asking for when its chance of
  being kept is at least its cost over that worth: ``alpha ** j >= threshold`` with
  ``threshold = (c + cost_per_token) n / (1 + c T)``.
- Whose round: a request whose text does not depend on its drafts uses the whole last engine
  step (every request verified in it), since batch neighbours share the forward's fixed cost
  and so make each token cheaper and drafts relatively dearer. That is every greedy request,
  and every sampled one whose proposer is deterministic (``Proposer.samples_drafts`` False:
  its tokens come from position-keyed uniforms, ``verifier.uniforms``). A sampled request
  whose proposer samples its drafts uses its own last round only: the drafts it asks for steer
  how its random generator is consumed, and its seeded output must not depend on its batch
  neighbours.

So ``k`` is the largest ``j <= K`` with ``alpha ** j >= threshold``. It may be 0: such a request
decodes plainly until its decayed history makes it try again (its estimate drifts back toward
the prior at 0.5).

``c`` defaults to ``config.DEFAULT_VERIFY_TOKEN_COST``, measured on the development CPU; it is
a fixed number rather than one timed at start-up so that a seeded sampled request gives the
same text on every run. ``measure_verify_token_cost`` times it for another machine
(``EngineConfig(verify_token_cost=None)`` does so at start-up).

Worked example (c = 0.03): one request alone, the last round verified 9 tokens and committed
4: threshold = 0.03 * 4 / 1.27 = 0.094. With alpha = 0.8, 0.8 ** 10 = 0.107 >= 0.094, so it
asks for min(K, 10) drafts; with alpha = 0.3, 1 draft (0.3 >= 0.094 > 0.09). Eight greedy
requests that committed 16 tokens over 40 verified tokens: threshold = 0.03 * 16 / 2.2 = 0.218;
alpha = 0.3 gives 1 draft, alpha = 0.2 none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridspec.config import MAX_VERIFY_TOKEN_COST
from hybridspec.model import ModelRuntime, median_forward_seconds
from hybridspec.verifier.estimate import AcceptanceEstimate, drafts_worth_asking

CALIBRATION_TOKENS = 16  # extra tokens of the calibration forward


@dataclass(slots=True)
class SpeculationState(AcceptanceEstimate):
    """One request's evidence (``AcceptanceEstimate``: its ``rate``), and its own last round
    (see the module docstring)."""

    last_committed: int = 1  # before any round: as if one plain decoding step
    last_verified: int = 1

    def update(self, num_drafts: int, num_accepted: int, num_committed: int) -> None:
        """Learn from a round that proposed, accepted and committed so many tokens."""
        self.observe(num_drafts, num_accepted)
        if num_committed > 0:
            self.last_committed, self.last_verified = num_committed, num_drafts + 1


def draft_threshold(
    verify_token_cost: float, committed: int, verified: int, proposer_cost_per_token: float
) -> float:
    """The least chance of acceptance that pays for one more draft (module docstring)."""
    c = verify_token_cost
    return (c + proposer_cost_per_token) * committed / (1.0 + c * verified)


class SpeculationPolicy:
    """Chooses each request's drafts for the round from its state and the last engine step."""

    def __init__(self, verify_token_cost: float) -> None:
        if not (math.isfinite(verify_token_cost) and verify_token_cost >= 0):
            raise ValueError(f"verify_token_cost: expected a number >= 0, got {verify_token_cost}")
        self.verify_token_cost = verify_token_cost
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
    ) -> int:
        """Drafts to ask for; ``by_step``: priced by the last engine step, else by the
        request's own last round (module docstring, "Whose round")."""
        committed, verified = (
            (self._committed, self._verified)
            if by_step
            else (state.last_committed, state.last_verified)
        )
        threshold = draft_threshold(
            self.verify_token_cost, committed, verified, proposer_cost_per_token
        )
        return drafts_worth_asking(state.rate, threshold, max_drafts)


def measure_verify_token_cost(runtime: ModelRuntime, max_drafts: int) -> float:
    """``c`` of the module docstring, timed on ``runtime``: one sequence with a short cached
    context, a forward of 1 token against one of ``1 + m`` (``m = min(16, max_drafts)``).

    Takes a free cache slot for the duration (none free: returns 0, i.e. drafts cost nothing
    to verify). Medians of a few timings after a warm-up (``model.median_forward_seconds``);
    the result is clamped to ``[0, MAX_VERIFY_TOKEN_COST]``.
    """
    extra = min(CALIBRATION_TOKENS, max(1, max_drafts))
    timings = median_forward_seconds(runtime, (1, 1 + extra))
    if timings is None or timings[0] <= 0:
        return 0.0
    one, many = timings
    return min(MAX_VERIFY_TOKEN_COST, max(0.0, (many - one) / (extra * one)))
