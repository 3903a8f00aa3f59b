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

So ``k`` is the largest ``j <= K`` with ``alpha ** j >= threshold``. A proposer may also cost a
fixed part per round that it drafts in (``cost_per_round``: the eagle head's first step, which
feeds the features it has not seen, the draft model's catch-up): ``k`` drafts are asked for only
when the tokens they are expected to add, ``alpha + ... + alpha ** k``, exceed what they cost in
tokens, ``k threshold`` plus the fixed part over the worth of a token; where they do not, the
request pauses as below (so that it probes, and the proposer's price is timed again, later).
A round without drafts costs the proposer nothing (it is not asked to draft, so the head and
the draft model do not run; they catch up on the committed tokens when they next draft).

Drafts that do not pay, paused: the model of acceptance cannot tell a proposer whose drafts
are never kept from one kept now and then (the prior keeps ``alpha`` at 1/7 or more), so each
request also counts what its drafting rounds actually earned: the drafts kept, less each
round's price in tokens as it was asked for, decayed by ``NET_DECAY`` a drafting round. When
that is below zero after ``MIN_ROUNDS`` drafting rounds, and (where measured seconds price
the round, below) the request's own evidence without the prior, its accepted drafts over its
accepted and rejected ones, is below the acceptance at which one draft pays
(``SpeculationState.pays_from``), the request asks for no drafts for a pause of ``pause``
rounds, then probes with one draft: a probe that is kept resumes
speculation (the estimate, which decayed toward the prior meanwhile, is learned again); one
that is not doubles the pause, up to the length at which probing costs at most
``PROBE_BUDGET`` tokens a round (cheap n-gram probes: ten rounds or so; the eagle head's: a
hundred or more).
A pause is never shorter than the length at which its probe costs at most
``FIRST_PROBE_BUDGET`` tokens a round (nor than ``MIN_PAUSE``): where a probe is dear (the eagle
head's, beside requests whose step its row and time delay), pauses that start at ``MIN_PAUSE``
would spend most of a token on each of several probes before they grow long. A request that
commits about one token a round beside others (a batch whose rows cost what their tokens are
worth: drafts there rarely pay) thus loses at most a hundredth of its tokens to probing, less
as its pauses grow. Example: a probe priced at 1 token pauses 100 rounds first, then 200; one
at 0.05 tokens (an n-gram's one row) pauses 5, then 10.
The evidence's test keeps luck from pausing a request whose drafts pay: at alpha 0.5, three
rounds in a row that keep nothing are common, and a pause then its probes cost more than they
save; drafts that are never kept have no accepted evidence, and pause as before.

Shadow probes: a proposer whose drafts cost next to nothing to make and whose ``propose``
changes nothing that its ``commit`` does not settle (``Proposer.shadow_checked``: ``ngram``,
``suffix``) is probed without a verify row. Each round of a pause, a request whose text does not
depend on its drafts (``by_step``, below) asks it for one draft that is never verified, and
checks it against the token the round commits, the target's own: greedy, that is exactly the
check verification makes; sampled, the target's token equals a deterministic draft ``x`` with
probability ``p(x)``, the chance that verification would keep it. A hit ends the pause as a kept
probe does; a miss is counted as a rejected draft, and the pause goes on: such a pause is not
counted down, and ends only on a hit. A request starts in such a pause, so that drafts that
never pay cost no verify row at all (the first hit costs one round's drafts where they pay).
The output is the target's whatever the shadows say: their drafts never reach a forward.
Shadows run only while the proposer's measured time per call stays within ``SHADOW_BUDGET`` of
a forward's fixed part (``engine.drafts``); beyond it pauses count down to probes as above.

Measured costs: where a request's text does not depend on its drafts (``by_step``), the engine
prices its round in measured seconds (``MeasuredPrice``): ``t(n)``, a target forward of ``n``
rows, from the engine's timed forwards (``engine.row_costs``; a row's cost depends on how many
rows the forward already has, so no constant ``c`` prices it), and the proposer's time per draft
``p`` and per round ``f`` (``engine.proposer_costs``). The request's batch neighbours are taken
as in the last step: ``V_o`` rows committing ``C_o`` tokens (the step's, less the request's own
last round). It asks for the ``k`` that makes the step commit the most tokens a second,
``(C_o + 1 + alpha + ... + alpha ** k) / (t(V_o + 1 + k) + f + p k)`` (``f`` and ``p`` only
when ``k > 0``): alone (``V_o = C_o = 0``) that is the ideal speedup of a round, its expected
tokens over its cost; beside others, a draft is asked for when its expected token is worth
the time it adds to every request of the step. Its realised price (for the pauses below) is
the seconds the drafts add over what a committed token was worth in the last step. Where no
draft pays, the request pauses and probes as below: one that never drafts would never time its
rows again nor learn its acceptance, so one stale price would hold it at no drafts. Where the
forwards timed so far cannot price the rows (none of so few rows yet), the constant ``c`` and
the proposer's measured time over a one-token forward price it as above. A request whose drafts
steer its random generator uses ``c`` and the proposer's own ``cost_per_token`` (fixed for the
run), so that its seeded text depends on its own rounds only.

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
from collections.abc import Callable
from dataclasses import dataclass

from hybridspec.config import MAX_VERIFY_TOKEN_COST
from hybridspec.model import ModelRuntime, median_forward_seconds
from hybridspec.verifier.estimate import AcceptanceEstimate, drafts_worth_asking

CALIBRATION_TOKENS = 16  # extra tokens of the calibration forward
NET_DECAY = 0.8  # weight of a drafting round's net tokens after each later one
MIN_ROUNDS = 3  # drafting rounds counted before a request may pause
MIN_PAUSE = 2  # rounds of the first pause; each failed probe doubles it
MAX_PAUSE = 256
SHADOW_BUDGET = 0.01  # a shadow-checking proposer's call, at most, over a forward's fixed part
PROBE_BUDGET = 0.005  # tokens a round that probing may cost at most, in the longest pause
FIRST_PROBE_BUDGET = 0.01  # tokens a round that probing may cost at most, in any pause


@dataclass(slots=True)
class SpeculationState(AcceptanceEstimate):
    """One request's evidence (``AcceptanceEstimate``: its ``rate``), and its own last round
    (see the module docstring)."""

    last_committed: int = 1  # before any round: as if one plain decoding step
    last_verified: int = 1
    draft_price: float = 0.0  # tokens each draft of the round asked for costs
    round_price: float = 0.0  # tokens the proposer's fixed part of that round costs
    net: float = 0.0  # decayed tokens earned by drafting rounds, less their price
    rounds: int = 0  # drafting rounds counted in ``net`` since the last pause
    paused: int = 0  # rounds left without drafts
    pause: int = MIN_PAUSE  # the next pause's length
    probing: bool = False  # the next drafting round is a probe after a pause
    pays_from: float = math.inf  # acceptance from which one draft pays (inf: the constant path)
    # pauses end on a shadow probe's hit, not counted down (module docstring, "Shadow probes");
    # set each round by ``engine.drafts``
    shadows: bool = False
    shadow: int | None = None  # this round's unverified draft, while paused
    begun: bool = False  # a round has been counted

    def update(
        self,
        num_drafts: int,
        num_accepted: int,
        num_committed: int,
        shadow_hit: bool | None = None,
    ) -> None:
        """Learn from a round that proposed, accepted and committed so many tokens;
        ``shadow_hit``: whether the round's token matched its unverified draft, None where it
        checked none."""
        self.begun, self.shadow = True, None
        if shadow_hit is not None:
            self.observe(1, int(shadow_hit))
        else:
            self.observe(num_drafts, num_accepted)
        if num_committed > 0:
            self.last_committed, self.last_verified = num_committed, num_drafts + 1
        if self.paused > 0:
            if shadow_hit:  # as a kept probe: draft again, the next pause the shortest
                self.paused, self.pause, self.probing = 0, MIN_PAUSE, False
                self.net, self.rounds = 0.0, 0
            elif not self.shadows:
                self.paused -= 1
        elif num_drafts > 0:
            self._earned(num_accepted - num_drafts * self.draft_price - self.round_price)

    def shadow_first(self) -> None:
        """Start paused, a request whose pauses end on a shadow probe's hit (module
        docstring, "Shadow probes")."""
        if not self.begun and self.paused == 0:
            self.paused = 1

    def _earned(self, tokens: float) -> None:
        """Count a drafting round's net tokens; pause where drafting does not pay (module
        docstring)."""
        self.net = NET_DECAY * self.net + tokens
        self.rounds += 1
        probe, self.probing = self.probing, False
        if probe and tokens >= 0:
            self.pause = MIN_PAUSE
        elif (probe or self.rounds >= MIN_ROUNDS) and self.net < 0 and self._unpaid():
            self.start_pause()

    def _unpaid(self) -> bool:
        """Whether the request's own evidence, without the prior, puts its acceptance below
        ``pays_from`` (module docstring, "Drafts that do not pay": a net loss that is only luck
        does not pause)."""
        seen = self.accepted + self.rejected
        return seen <= 0 or self.accepted / seen < self.pays_from

    def start_pause(self) -> None:
        """Ask for no drafts for the next ``pause`` rounds, but at least the rounds at which
        the probe costs ``FIRST_PROBE_BUDGET`` tokens a round, then probe (module docstring)."""
        probe_price = self.draft_price + self.round_price
        longest = min(MAX_PAUSE, max(MIN_PAUSE, int(probe_price / PROBE_BUDGET)))
        shortest = min(longest, max(MIN_PAUSE, int(probe_price / FIRST_PROBE_BUDGET)))
        self.paused = max(shortest, min(self.pause, longest))
        self.pause = min(2 * self.paused, longest)
        self.net, self.rounds, self.probing = 0.0, 0, True


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
        self.steps = 0  # steps recorded: a round's prices hold until the next (``drafts``)

    def record_step(self, committed: int, verified: int) -> None:
        """Remember a step that verified ``verified`` tokens and committed ``committed``."""
        self.steps += 1
        if committed > 0 and verified > 0:
            self._committed, self._verified = committed, verified

    def num_drafts(
        self,
        state: SpeculationState,
        max_drafts: int,
        *,
        by_step: bool,
        proposer_cost_per_token: float = 0.0,
        proposer_cost_per_round: float = 0.0,
        measured: MeasuredPrice | None = None,
    ) -> int:
        """Drafts to ask for; ``by_step``: priced by the last engine step, else by the
        request's own last round (module docstring, "Whose round"). The proposer's costs are
        relative to a target forward's fixed part: per draft, and per round it drafts in.
        ``measured``: the measured seconds of forwards and of the proposer, which price a
        ``by_step`` request where they can (module docstring, "Measured costs"). Remembers
        the round's price in ``state`` (what ``state.update`` counts it against)."""
        if state.paused > 0 or max_drafts <= 0:
            return 0
        committed, verified = (
            (self._committed, self._verified)
            if by_step
            else (state.last_committed, state.last_verified)
        )
        if by_step and measured is not None:
            k = self._by_rows(state, max_drafts, measured)
            if k is not None:
                return k
        c = self.verify_token_cost
        threshold = draft_threshold(c, committed, verified, proposer_cost_per_token)
        state.draft_price, state.pays_from = threshold, math.inf
        state.round_price = proposer_cost_per_round * committed / (1.0 + c * verified)
        if state.probing:
            return 1
        k = drafts_worth_asking(state.rate, threshold, max_drafts)
        gain = sum(state.rate**j for j in range(1, k + 1))
        if k > 0 and gain <= k * threshold + state.round_price:
            state.start_pause()  # the fixed part cannot pay: probe later, as prices change
            return 0
        return k

    def _by_rows(
        self, state: SpeculationState, max_drafts: int, measured: MeasuredPrice
    ) -> int | None:
        """The ``k <= max_drafts`` that makes the step commit the most tokens a second, priced
        by measured seconds (module docstring, "Measured costs"); None where the forwards
        measured so far cannot price one draft's row. Where no draft pays, the request pauses
        (it probes later: its rows are timed and its acceptance learned again)."""
        others_rows = max(0, self._verified - state.last_verified)
        others_tokens = max(0, self._committed - state.last_committed)
        forward_s = measured.forward_s
        base, last = forward_s(others_rows + 1), forward_s(self._verified)
        if base is None or last is None or base <= 0 or last <= 0:
            return None
        seconds = [base]  # seconds[k]: the step's forward with k drafts of this request
        for k in range(1, max_drafts + 1):
            step_s = forward_s(others_rows + 1 + k)
            if step_s is None:
                break
            seconds.append(step_s)
        if len(seconds) == 1:  # not one draft priced: the constant ``c`` prices them
            return None
        best = _fastest(state.rate, others_tokens, seconds, measured, measured.per_round_s)
        worth = last / self._committed  # seconds a committed token was worth last step
        k = 1 if state.probing or best == 0 else best
        state.draft_price = ((seconds[k] - base) / k + measured.per_draft_s) / worth
        state.round_price = measured.per_round_s / worth
        first_s = seconds[1] + measured.per_round_s + measured.per_draft_s
        state.pays_from = (others_tokens + 1) * (first_s / base - 1.0)
        if state.probing:
            return 1
        if best == 0:  # no draft pays: probe later, as prices and acceptance change (a request
            state.start_pause()  # that never drafts never times its rows nor learns its rate)
        return best


def _fastest(
    alpha: float, others_tokens: int, seconds: list[float], measured: MeasuredPrice, f: float
) -> int:
    """The ``k`` (up to ``len(seconds) - 1``) with the most tokens a second, ``(others_tokens
    + 1 + alpha + ... + alpha ** k) / (seconds[k] + f + p k)`` (``f`` and ``p`` from 1 draft).
    Example: alpha 0.5, alone, forwards of 1 / 2 / 3 rows taking 1 / 1.05 / 1.21 s, free
    drafts: 1 / 1.43 / 1.45 tokens a second: 2 drafts."""
    best_k, best_rate, gain, power = 0, (others_tokens + 1) / seconds[0], 1.0, 1.0
    for k in range(1, len(seconds)):
        power *= alpha
        gain += power
        rate = (others_tokens + gain) / (seconds[k] + f + k * measured.per_draft_s)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


@dataclass(frozen=True, slots=True)
class MeasuredPrice:
    """What a round costs in measured seconds: ``forward_s(n)``, a target forward of ``n``
    rows (None where it cannot tell; ``engine.row_costs``), and the proposer's time per draft
    and per round it drafts in (``engine.proposer_costs``)."""

    forward_s: Callable[[int], float | None]
    per_draft_s: float = 0.0
    per_round_s: float = 0.0


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
