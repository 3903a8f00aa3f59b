"""Adaptive speculation: the choice of drafts per round, and its effect inside the engine."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridspec import EngineConfig, Proposal, Proposer, ProposeRequest
from hybridspec.config import DEFAULT_VERIFY_TOKEN_COST
from hybridspec.engine.speculation import (
    MAX_VERIFY_TOKEN_COST,
    SpeculationPolicy,
    SpeculationState,
    draft_threshold,
    forward_cost,
    measure_verify_token_cost,
)
from tests.engine.test_engine import PROMPTS, VOCAB, make_engine, plain, target  # noqa: F401


def policy_state(rate_accepted: float, rate_rejected: float) -> SpeculationState:
    """A state whose rate is (accepted + 1) / (accepted + rejected + 2)."""
    return SpeculationState(accepted=rate_accepted, rejected=rate_rejected)


@pytest.mark.parametrize(
    ("accepted", "rejected", "free", "last", "max_drafts", "expected"),
    [
        # the module docstring's example: c = 0.043, F = 6, 4 committed over 9 verified
        (7.0, 1.0, 6, (4, 9), 16, 8),  # rate 0.8: 0.8 ** 8 = 0.168 >= 0.152 > 0.8 ** 9
        (2.0, 8.0, 6, (4, 9), 16, 5),  # rate 0.25: only the free drafts (rows 2..6)
        (2.0, 8.0, 6, (4, 9), 3, 3),  # capped by K
        (7.0, 1.0, 1, (4, 9), 16, 9),  # linear: threshold 0.043 * 4 / 1.344 = 0.128
        (2.0, 8.0, 1, (4, 9), 16, 1),  # rate 0.25 >= 0.128 > 0.0625
        (7.0, 1.0, 6, (4, 9), 0, 0),
    ],
)
def test_num_drafts_examples(
    accepted: float,
    rejected: float,
    free: int,
    last: tuple[int, int],
    max_drafts: int,
    expected: int,
) -> None:
    policy = SpeculationPolicy(0.043, free)
    policy.record_step(*last)
    state = policy_state(accepted, rejected)
    assert policy.num_drafts(state, max_drafts, by_step=True, rows_before=1) == expected


@given(
    st.floats(0.0, 40.0),
    st.floats(0.0, 40.0),
    st.floats(0.0, 0.2),
    st.integers(1, 12),
    st.integers(0, 16),
    st.integers(1, 20),
    st.integers(1, 40),
    st.integers(0, 16),
)
def test_num_drafts_is_the_longest_paying_prefix(
    accepted: float,
    rejected: float,
    cost: float,
    free: int,
    rows_before: int,
    committed: int,
    verified: int,
    max_drafts: int,
) -> None:
    policy = SpeculationPolicy(cost, free)
    policy.record_step(committed, verified)
    state = policy_state(accepted, rejected)
    k = policy.num_drafts(state, max_drafts, by_step=True, rows_before=rows_before)
    verified_cost = forward_cost(cost, free, verified)

    def pays(j: int) -> bool:
        row_cost = cost if rows_before + j > free else 0.0
        return state.rate**j >= draft_threshold(row_cost, committed, verified_cost, 0.0)

    assert 0 <= k <= max_drafts
    assert all(pays(j) for j in range(1, k + 1))
    if k < max_drafts:
        assert not pays(k + 1)
    # drafts in free rows cost nothing, so they are always asked for
    assert k >= min(max_drafts, max(0, free - rows_before))


def test_state_learns_and_decays_back_to_the_prior() -> None:
    state = SpeculationState()
    assert state.rate == 0.5
    state.update(num_proposed=8, num_accepted=8, num_committed=9)  # all kept
    high = state.rate
    assert high == pytest.approx(9 / 10)
    assert (state.last_committed, state.last_verified) == (9, 9)
    state.update(num_proposed=8, num_accepted=0, num_committed=1)  # first draft rejected
    assert state.rate < high
    assert (state.last_committed, state.last_verified) == (1, 9)
    for _ in range(60):  # rounds that proposed nothing carry no evidence: back to 0.5
        state.update(num_proposed=0, num_accepted=0, num_committed=1)
    assert state.rate == pytest.approx(0.5, abs=1e-4)


def test_drafts_priced_by_the_step_or_by_the_request_own_round() -> None:
    policy = SpeculationPolicy(0.03)  # one free row: the linear model 1 + c (T - 1)
    state = SpeculationState(accepted=3.0, rejected=3.0)
    state.update(num_proposed=2, num_accepted=0, num_committed=1)  # rate 3.4 / 7.8 = 0.436
    policy.record_step(committed=16, verified=40)  # eight busy neighbours
    assert draft_threshold(0.03, 16, forward_cost(0.03, 1, 40), 0.0) == pytest.approx(0.221, 1e-3)
    by_step = policy.num_drafts(state, 8, by_step=True)
    own = policy.num_drafts(state, 8, by_step=False)
    # by step: 0.436 >= 0.221 > 0.436 ** 2; own round (1 committed over 3 verified):
    # threshold 0.03 / 1.06 = 0.0283, 0.436 ** 4 = 0.036 passes, 0.436 ** 5 = 0.016 does not
    assert (by_step, own) == (1, 4)
    # A costly proposer is asked for fewer drafts.
    assert policy.num_drafts(state, 8, by_step=False, proposer_cost_per_token=0.3) < own


def test_policy_rejects_a_bad_cost() -> None:
    with pytest.raises(ValueError, match="verify_token_cost"):
        SpeculationPolicy(float("nan"))
    with pytest.raises(ValueError, match="verify_token_cost"):
        EngineConfig(verify_token_cost=-0.1)
    with pytest.raises(ValueError, match="adaptive_speculation"):
        EngineConfig(adaptive_speculation="yes")  # type: ignore[arg-type]


def test_measured_cost_is_bounded_and_leaves_the_cache_as_it_was(target) -> None:  # noqa: F811
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
    output), recording how many drafts each round asked for."""

    asked: ClassVar[list[int]] = []

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        Wrong.asked.extend(r.num_tokens for r in requests)
        return [Proposal(token_ids=(VOCAB - 1,) * r.num_tokens) for r in requests]


@pytest.mark.parametrize(("adaptive", "free"), [(True, 1), (True, 6), (False, 1)])
def test_rejected_drafts_shrink_what_a_request_asks_for(target, adaptive: bool, free: int) -> None:  # noqa: F811
    engine = make_engine(target, adaptive_speculation=adaptive, free_verify_tokens=free)
    engine.register_proposer("wrong", Wrong)
    Wrong.asked = []
    result = engine.generate(
        prompt_token_ids=PROMPTS[0], proposer="wrong", num_speculative_tokens=8, max_new_tokens=30
    )
    assert result.token_ids == plain(engine, PROMPTS[0], 30)  # lossless either way
    asked = Wrong.asked[:20]
    if adaptive and free == 1:
        # The prior (rate 0.5) asks for log(0.043) / log(0.5) = 4 drafts; every rejection
        # lowers the rate until one draft a round remains worth its verification.
        threshold = draft_threshold(DEFAULT_VERIFY_TOKEN_COST, 1, 1.0, 0.0)
        assert asked[0] == math.floor(math.log(threshold) / math.log(0.5)) == 4
        assert asked[-1] == 1 and sorted(asked, reverse=True) == asked
    elif adaptive:
        # The first round's forward carries the prompt, which fills the free rows: priced
        # drafts, as in the linear case. Later ones fill rows 2..6 after the root: never fewer.
        assert asked == [4] + [5] * 19
    else:
        assert asked == [8] * 20
