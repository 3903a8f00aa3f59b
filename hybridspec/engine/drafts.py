"""How many drafts each decoding request asks for in a round (``DraftCounts.num_drafts``: its
K, the room left, adaptive speculation), and whether a paused one checks an unverified draft
(``DraftCounts.shadow``: ``engine.speculation``, "Shadow probes"). The proposer pool asks both
per request while drafting; ``Engine.step`` hands adaptive speculation the round's yield at the
round's end."""

from __future__ import annotations

from hybridspec.engine.proposer_pool import ProposerPool
from hybridspec.engine.request import Request
from hybridspec.engine.row_costs import TimedForwardCost
from hybridspec.engine.speculation import SHADOW_BUDGET, MeasuredPrice, SpeculationPolicy
from hybridspec.proposers import Proposer


class DraftCounts:
    """The per-round draft counts; ``speculation`` None: every request asks for its K."""

    def __init__(
        self,
        speculation: SpeculationPolicy | None,
        forward_cost: TimedForwardCost,
        proposers: ProposerPool,
        max_seq_len: int,
        measure_proposer_costs: bool,
    ) -> None:
        """``forward_cost``: the fitted target forward (``a`` of ``engine.speculation``) and
        its measured seconds by row count (``rows``);
        ``proposers``: the pool whose ``costs`` (the proposers' measured times) price them
        where ``measure_proposer_costs``."""
        self.speculation = speculation
        self.forward_cost = forward_cost
        self.proposers = proposers
        self.max_seq_len = max_seq_len
        self.measure_proposer_costs = measure_proposer_costs
        # this round's ``_priced``, by the proposer's identity, and the round they are of
        self._round_prices: dict[int, tuple[float, float, MeasuredPrice | None]] = {}
        self._priced_round: tuple[SpeculationPolicy, int] | None = None

    def num_drafts(self, request: Request, proposer: Proposer) -> int:
        """Drafts to ask for this round: the request's K, shrunk so that committing k + 1 tokens
        fits the context and budget, then to what pays off (adaptive speculation), the proposer
        priced by its measured time where the request's text allows (``engine.speculation``)."""
        k = self._max_drafts(request)
        if self.speculation is None or k == 0:
            return k
        state = request.speculation
        if state.paused > 0 and not proposer.shadow_checked:  # none, whatever the prices
            return 0
        by_step = request.params.sampling.is_greedy or not proposer.samples_drafts
        per_token, per_round, measured = proposer.cost_per_token, 0.0, None
        if by_step and self.measure_proposer_costs:  # (a seeded sampled request: fixed)
            per_token, per_round, measured = self._priced(proposer, self.speculation)
        # shadow probes, where the proposer's one-draft call costs next to a forward's fixed
        # part (its declared cost until its calls are timed)
        state.shadows = (
            by_step
            and proposer.shadow_checked
            and not proposer.samples_drafts
            and per_token + per_round <= SHADOW_BUDGET
        )
        if state.shadows:
            state.shadow_first()
        if state.paused > 0:
            return 0
        return self.speculation.num_drafts(
            request.speculation,
            k,
            by_step=by_step,
            proposer_cost_per_token=per_token,
            proposer_cost_per_round=per_round,
            measured=measured,
        )

    def _priced(
        self, proposer: Proposer, speculation: SpeculationPolicy
    ) -> tuple[float, float, MeasuredPrice | None]:
        """``proposer``'s measured time per draft and per round over a forward's fixed part
        (its ``cost_per_token`` and 0 until its calls are timed), and the round's price in
        measured seconds (``_measured``): the same for every request of the proposer in a
        round, so worked out once a round (until the policy records the round's step: the
        forwards and proposer calls timed since move them)."""
        this_round = self._priced_round
        if (
            this_round is None
            or this_round[0] is not speculation
            or this_round[1] != speculation.steps
        ):
            self._round_prices.clear()
            self._priced_round = (speculation, speculation.steps)
        key = id(proposer)
        priced = self._round_prices.get(key)
        if priced is None:
            per_token, per_round = proposer.cost_per_token, 0.0
            timed = self.proposers.costs.price(proposer, 1.0)  # (over 1 s: in seconds)
            fixed_s = self._forward_fixed_s(speculation)
            if timed is not None and fixed_s is not None and fixed_s > 0:
                per_token, per_round = timed[0] / fixed_s, timed[1] / fixed_s
            priced = (per_token, per_round, self._measured(proposer, timed))
            self._round_prices[key] = priced
        return priced

    def shadow(self, request: Request) -> bool:
        """Whether ``request`` asks its proposer for one unverified draft this round: it is
        paused, its pause ends on a shadow probe's hit (``num_drafts`` decided it this round),
        and it could ask for a draft (``_max_drafts``)."""
        state = request.speculation
        return (
            self.speculation is not None
            and state.shadows
            and state.paused > 0
            and self._max_drafts(request) > 0
        )

    def _max_drafts(self, request: Request) -> int:
        """The request's K, shrunk so that committing k + 1 tokens fits the context and the
        token budget."""
        room = self.max_seq_len - len(request.token_ids) - 1
        budget = request.params.max_new_tokens - request.num_generated - 1
        return max(0, min(request.num_speculative_tokens, room, budget))

    def _measured(
        self, proposer: Proposer, timed: tuple[float, float] | None
    ) -> MeasuredPrice | None:
        """The round's price in measured seconds (``engine.speculation``, "Measured costs"):
        the forwards by their rows, the proposer's ``timed`` seconds per draft and per round
        (before it has them, its ``cost_per_token`` times a one-row forward), and per draft
        the seconds drafting rounds took beyond the rows' price (``engine.realized_rows``);
        None before a one-row forward is timed."""
        rows = self.forward_cost.rows
        extra = self.forward_cost.realized.extra_per_draft()
        if timed is not None:
            return MeasuredPrice(rows.seconds, timed[0] + extra, timed[1])
        one = rows.seconds(1)
        if one is None:
            return None
        return MeasuredPrice(rows.seconds, proposer.cost_per_token * one + extra)

    def _forward_fixed_s(self, speculation: SpeculationPolicy) -> float | None:
        """Seconds of a target forward's fixed part, ``a`` of ``engine.speculation``: the
        fitted time of a one-token forward (``forward_cost``), less its one token's share."""
        one = self.forward_cost.seconds(1, 1)
        return None if one is None else one / (1.0 + speculation.verify_token_cost)
