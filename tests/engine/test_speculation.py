"""Adaptive speculation: the choice of drafts per round, and its effect inside the engine."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridspec import EngineConfig, Proposal, Proposer, ProposeRequest
from hybridspec.config import DEFAULT_VERIFY_TOKEN_COST, MAX_VERIFY_TOKEN_COST
from hybridspec.engine.speculation import (
    MAX_PAUSE,
    MIN_PAUSE,
    MIN_ROUNDS,
    PROBE_BUDGET,
    SpeculationPolicy,
    SpeculationState,
    draft_threshold,
    drafts_worth_asking,
    measure_verify_token_cost,
)
from hybridspec.types import CommitInfo
from tests.engine.tiny import PROMPTS, VOCAB, make_engine, plain


@pytest.mark.parametrize(
    ("rate", "threshold", "max_drafts", "expected"),
    [
        (0.8, 0.094, 8, 8),  # 0.8 ** 8 = 0.168 >= 0.094
        (0.8, 0.094, 16, 10),  # 0.8 ** 10 = 0.107 >= 0.094 > 0.8 ** 11 = 0.086
        (0.3, 0.094, 8, 1),  # 0.3 >= 0.094 > 0.09
        (0.2, 0.218, 8, 0),
        (1.0, 0.5, 5, 5),
        (0.5, 0.0, 5, 5),
        (0.9, 0.1, 0, 0),
    ],
)
def test_drafts_worth_asking_examples(
    rate: float, threshold: float, max_drafts: int, expected: int
) -> None:
    assert drafts_worth_asking(rate, threshold, max_drafts) == expected


@given(
    st.floats(0.01, 0.99),
    st.floats(0.001, 1.0),
    st.integers(0, 16),
)
def test_drafts_worth_asking_is_the_largest_paying_k(
    rate: float, threshold: float, max_drafts: int
) -> None:
    k = drafts_worth_asking(rate, threshold, max_drafts)
    assert 0 <= k <= max_drafts
    if k > 0:
        assert rate**k >= threshold * (1 - 1e-9)
    if k < max_drafts:
        assert rate ** (k + 1) < threshold * (1 + 1e-9)


def test_state_learns_and_decays_back_to_the_prior() -> None:
    state = SpeculationState()
    assert state.rate == 0.5
    state.update(num_drafts=8, num_accepted=8, num_committed=9)  # all kept
    high = state.rate
    assert high == pytest.approx(9 / 10)
    assert (state.last_committed, state.last_verified) == (9, 9)
    state.update(num_drafts=8, num_accepted=0, num_committed=1)  # first draft rejected
    assert state.rate < high
    assert (state.last_committed, state.last_verified) == (1, 9)
    for _ in range(60):  # rounds that proposed nothing carry no evidence: back to 0.5
        state.update(num_drafts=0, num_accepted=0, num_committed=1)
    assert state.rate == pytest.approx(0.5, abs=1e-4)


def test_a_shadow_checked_pause_ends_on_a_hit_only() -> None:
    """Shadow probes (``engine.speculation``): a fresh request starts paused; a miss is a
    rejected draft and the pause is not counted down; a hit ends it as a kept probe does.
    Without shadows the same pause counts down."""
    state = SpeculationState(shadows=True)
    state.shadow_first()
    assert state.paused > 0
    for _ in range(3 * MAX_PAUSE):
        state.update(0, 0, 1, shadow_hit=False)
    assert state.paused > 0 and state.rate < 0.2  # evidence of drafts that are not kept
    missed = state.rate
    state.update(0, 0, 1)  # a round without a shadow's draft (none matched): still paused
    assert state.paused > 0
    state.update(0, 0, 1, shadow_hit=True)
    assert state.paused == 0 and not state.probing and state.pause == MIN_PAUSE
    assert state.rate > missed
    state.shadow_first()  # only before its first round
    assert state.paused == 0
    state.start_pause()
    state.shadows = False  # the proposer's price went over the budget: counted down again
    for _ in range(state.paused):
        state.update(0, 0, 1)
    assert state.paused == 0 and state.probing


def test_drafts_priced_by_the_step_or_by_the_request_own_round() -> None:
    policy = SpeculationPolicy(0.03)
    state = SpeculationState(accepted=3.0, rejected=3.0)  # rate 0.5
    state.update(num_drafts=2, num_accepted=0, num_committed=1)
    policy.record_step(committed=16, verified=40)  # eight busy neighbours
    assert draft_threshold(0.03, 16, 40, 0.0) == pytest.approx(0.218, abs=1e-3)
    by_step = policy.num_drafts(state, 8, by_step=True)
    own = policy.num_drafts(state, 8, by_step=False)
    assert own == drafts_worth_asking(state.rate, draft_threshold(0.03, 1, 3, 0.0), 8)
    assert by_step < own
    # A costly proposer is asked for fewer drafts.
    assert policy.num_drafts(state, 8, by_step=False, proposer_cost_per_token=0.3) < own


def test_policy_rejects_a_bad_cost() -> None:
    with pytest.raises(ValueError, match="verify_token_cost"):
        SpeculationPolicy(float("nan"))
    with pytest.raises(ValueError, match="verify_token_cost"):
        EngineConfig(verify_token_cost=-0.1)
    with pytest.raises(ValueError, match="adaptive_speculation"):
        EngineConfig(adaptive_speculation="yes")  # type: ignore[arg-type]


def test_measured_cost_is_bounded_and_leaves_the_cache_as_it_was(target) -> None:
    engine = make_engine(target, verify_token_cost=None)
    assert engine.speculation is not None
    assert 0.0 <= engine.speculation.verify_token_cost <= MAX_VERIFY_TOKEN_COST
    free = engine.runtime.num_free_slots()
    cost = measure_verify_token_cost(engine.runtime, 8)
    assert 0.0 <= cost <= MAX_VERIFY_TOKEN_COST
    assert engine.runtime.num_free_slots() == free
    assert make_engine(target).speculation.verify_token_cost == DEFAULT_VERIFY_TOKEN_COST  # type: ignore[union-attr]


class Wrong(Proposer):
    """Always proposes what the target never picks (``VOCAB - 1`` is EOS, kept out of greedy
    output), recording how many drafts each round asked for at its commit (0 where no request
    asked: the engine then does not call ``propose``)."""

    asked: ClassVar[list[int]] = []
    asking: ClassVar[dict[int, int]] = {}  # by seq_id: this round's ask

    def commit(self, info: CommitInfo) -> None:
        Wrong.asked.append(Wrong.asking.pop(info.seq_id, 0))

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        Wrong.asking = {r.seq_id: r.max_num_drafts for r in requests}
        return [Proposal(token_ids=(VOCAB - 1,) * r.max_num_drafts) for r in requests]


@pytest.mark.parametrize("adaptive", [True, False])
def test_rejected_drafts_shrink_what_a_request_asks_for(target, adaptive: bool) -> None:
    engine = make_engine(target, adaptive_speculation=adaptive)
    engine.register_proposer("wrong", Wrong)
    Wrong.asked, Wrong.asking = [], {}
    result = engine.generate(
        prompt_token_ids=PROMPTS[0], proposer="wrong", num_speculative_tokens=8, max_new_tokens=30
    )
    assert result.token_ids == plain(engine, PROMPTS[0], 30)  # lossless either way
    asked = Wrong.asked[:20]
    if adaptive:
        # The prior (rate 0.5) asks for log(0.028) / log(0.5) = 5 drafts; every rejection
        # lowers the rate; after MIN_ROUNDS rounds that earned nothing the request pauses, then
        # probes with one draft, pausing twice as long after each failed probe, up to the
        # pause at which a probe (0.028 tokens) costs PROBE_BUDGET a round.
        threshold = draft_threshold(0.03, 1, 1, 0.0)
        assert asked[0] == math.floor(math.log(threshold) / math.log(0.5))
        first = asked[:MIN_ROUNDS]
        assert sorted(first, reverse=True) == first and min(first) > 0
        longest = int(threshold / PROBE_BUDGET)
        pauses = [MIN_PAUSE, 2 * MIN_PAUSE, longest, longest]
        expected = [n for pause in pauses for n in [0] * pause + [1]]
        assert asked[MIN_ROUNDS:] == expected[: 20 - MIN_ROUNDS]
    else:
        assert asked == [8] * 20
