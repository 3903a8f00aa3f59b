"""Proposers priced by their measured drafting time, and requests whose drafts do not pay:
no drafts and none of the proposer's work, probes later, the same text. Every time here is
injected: nothing depends on how fast this machine runs."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest

from hybridspec import GenerationParams, Proposal, Proposer, ProposeRequest
from hybridspec.engine import Engine, speculation
from hybridspec.engine.proposer_costs import (
    DECAY,
    MIN_CALLS,
    OUTLIER,
    ProposerCosts,
    least_norm_2x2,
)
from hybridspec.engine.row_costs import RowCosts
from hybridspec.engine.speculation import (
    FIRST_PROBE_BUDGET,
    MAX_PAUSE,
    MIN_PAUSE,
    MIN_ROUNDS,
    PROBE_BUDGET,
    SpeculationPolicy,
    SpeculationState,
)
from hybridspec.engine.stats import GenerationStats
from hybridspec.model import LoadedModel
from hybridspec.proposers import NoProposer, ProposerContext
from hybridspec.types import CommitInfo
from tests.engine.tiny import PROMPTS, make_engine, plain


def test_fit_splits_a_call_into_its_requests_and_drafts() -> None:
    costs, proposer = ProposerCosts(), NoProposer(None)  # type: ignore[arg-type]
    for _ in range(MIN_CALLS - 1):
        costs.observe(proposer, 1, 1, 0.002)
    assert costs.price(proposer, 0.01) is None  # too few calls yet
    costs.observe(proposer, 1, 3, 0.004)  # 1 ms a request, 1 ms a draft
    costs.observe(proposer, 2, 2, 0.004)
    per_draft, per_round = costs.price(proposer, 0.01)  # type: ignore[misc]
    assert per_draft == pytest.approx(0.1) and per_round == pytest.approx(0.1)
    assert costs.price(proposer, None) is None  # no forward timed: no price
    costs.forget(proposer)
    assert costs.price(proposer, 0.01) is None


def test_fit_clamps_a_negative_part_and_ignores_calls_without_asks() -> None:
    costs, proposer = ProposerCosts(), NoProposer(None)  # type: ignore[arg-type]
    calls = [(1, 0.003), (2, 0.003), (4, 0.002), (8, 0.001)] * 2
    for drafts, seconds in calls:
        costs.observe(proposer, 1, drafts, seconds)  # more drafts, less time: p < 0
    costs.observe(proposer, 0, 0, 5.0)  # asked for nothing: carries no evidence
    per_draft, per_round = costs.price(proposer, 0.001)  # type: ignore[misc]
    weights = [DECAY ** (len(calls) - 1 - i) for i in range(len(calls))]
    mean = sum(w * s for w, (_, s) in zip(weights, calls, strict=True)) / sum(weights)
    assert per_draft == 0.0 and per_round == pytest.approx(mean / 0.001)  # the mean call, alone


def test_the_fit_solves_its_normal_equations_as_numpy_s_least_squares() -> None:
    """``least_norm_2x2`` against ``numpy.linalg.lstsq``: full rank, one rank (drafts always
    the same multiple of requests: the least-norm split), and nothing."""
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(200):
        x = rng.integers(0, 9, size=(int(rng.integers(1, 6)), 2)).astype(float)
        cases.append((x.T @ x, x.T @ rng.uniform(0.0, 0.01, len(x))))
    x = np.array([[1.0, 2.0], [3.0, 6.0], [2.0, 4.0]])  # one rank
    cases.append((x.T @ x, x.T @ np.array([0.002, 0.006, 0.004])))
    cases.append((np.zeros((2, 2)), np.zeros(2)))
    for gram, moment in cases:
        want = np.linalg.lstsq(gram, moment, rcond=1e-12)[0]
        got = least_norm_2x2(gram[0, 0], gram[0, 1], gram[1, 1], *moment)
        assert got == pytest.approx(tuple(want), rel=1e-6, abs=1e-12)
    assert least_norm_2x2(1.0, 1.0, 1.0, 2.0, 2.0) == pytest.approx((1.0, 1.0))
    assert least_norm_2x2(2.0, 0.0, 4.0, 2.0, 2.0) == pytest.approx((1.0, 0.5))


def priced(policy: SpeculationPolicy, state: SpeculationState, per_round: float = 0.0) -> int:
    return policy.num_drafts(state, 8, by_step=True, proposer_cost_per_round=per_round)


def test_a_fixed_cost_per_round_asks_for_no_drafts_where_they_cannot_pay() -> None:
    policy = SpeculationPolicy(0.03)
    state = SpeculationState()  # rate 0.5: 0.5 + 0.25 + ... at most 1 token expected
    assert priced(policy, state) == 5
    assert priced(policy, state, per_round=0.5) == 5  # 0.97 tokens expected > 0.14 + 0.5
    assert priced(policy, state, per_round=1.0) == 0


def test_rounds_that_do_not_pay_pause_and_failed_probes_pause_longer() -> None:
    policy, state = SpeculationPolicy(0.03), SpeculationState()
    asked = []
    for _ in range(160):
        k = priced(policy, state, per_round=0.2)
        asked.append(k)
        state.update(k, 0, 1)  # every draft rejected
    assert all(k > 0 for k in asked[:MIN_ROUNDS])
    probe = state.draft_price + state.round_price  # one draft's price, in tokens
    longest = min(MAX_PAUSE, int(probe / PROBE_BUDGET))
    shortest = int(probe / FIRST_PROBE_BUDGET)  # 0.22 tokens: 22 rounds, above MIN_PAUSE
    assert shortest > MIN_PAUSE
    pauses, gap = [], 0
    for k in asked[MIN_ROUNDS:]:
        if k:
            assert k == 1  # a probe asks for one draft
            pauses.append(gap)
            gap = 0
        else:
            gap += 1
    assert longest == 2 * shortest
    assert pauses[:3] == [shortest, longest, longest]


@pytest.mark.parametrize(
    ("draft_price", "round_price", "pauses"),
    [
        (0.02, 0.0, [MIN_PAUSE, 2 * MIN_PAUSE]),  # a cheap probe: from MIN_PAUSE, up to 4
        (0.05, 0.0, [5, 10, 10]),  # 0.05 / FIRST_PROBE_BUDGET, up to 0.05 / PROBE_BUDGET
        (0.2, 0.8, [100, 200, 200]),  # a dear probe: 1 / FIRST_PROBE_BUDGET first
        (10.0, 0.0, [MAX_PAUSE, MAX_PAUSE]),  # none beyond MAX_PAUSE
    ],
)
def test_a_pause_is_long_enough_for_its_probe_to_cost_little_a_round(
    draft_price: float, round_price: float, pauses: list[int]
) -> None:
    state = SpeculationState()
    state.draft_price, state.round_price = draft_price, round_price
    seen = []
    for _ in range(len(pauses)):
        state.start_pause()
        assert state.probing
        seen.append(state.paused)
    assert seen == pauses
    # a probe costs at most FIRST_PROBE_BUDGET tokens a round of the pause before it
    assert all(
        p == MAX_PAUSE or p * FIRST_PROBE_BUDGET >= draft_price + round_price - 1e-9 for p in seen
    )


def test_a_kept_dear_probe_resumes_then_pauses_from_its_shortest() -> None:
    """A kept probe resets the doubling; the next pause is again the probe's shortest."""
    state = SpeculationState()
    state.draft_price, state.round_price = 0.5, 0.5  # a probe of 1 token
    state.start_pause()
    assert state.paused == 100
    for _ in range(100):
        state.update(0, 0, 1)
    assert state.paused == 0 and state.probing
    state.update(1, 1, 2)  # the probe is kept
    assert not state.probing and state.pause == MIN_PAUSE
    state.start_pause()
    assert state.paused == 100


def test_a_kept_probe_resumes_speculation() -> None:
    policy, state = SpeculationPolicy(0.03), SpeculationState()
    for _ in range(MIN_ROUNDS):
        state.update(priced(policy, state), 0, 1)
    assert state.paused == MIN_PAUSE
    for _ in range(MIN_PAUSE):
        assert priced(policy, state) == 0
        state.update(0, 0, 1)
    assert priced(policy, state) == 1  # the probe
    state.update(1, 1, 2)  # kept
    assert not state.probing and state.pause == MIN_PAUSE
    assert priced(policy, state) > 1  # learning the rate again


class Counting(Proposer):
    """Proposes the target's own greedy continuation where it can (copies from the tiny
    model's plain run), recording what each round asked for at its commit (0 where no request
    asked: the engine then does not call ``propose``)."""

    def __init__(self, context: ProposerContext, answer: Sequence[int]) -> None:
        super().__init__(context)
        self.answer = list(answer)
        self.asked: list[int] = []
        self._asking: dict[int, int] = {}  # by seq_id: this round's ask

    def commit(self, info: CommitInfo) -> None:
        self.asked.append(self._asking.pop(info.seq_id, 0))

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        self._asking = {r.seq_id: r.max_num_drafts for r in requests}
        out = []
        for r in requests:
            at = len(r.token_ids) - r.num_prompt_tokens
            out.append(Proposal(tuple(self.answer[at : at + r.max_num_drafts])))
        return out


class FixedRows(RowCosts):
    """A forward of ``n`` rows takes ``1 + 0.03 (n - 1)`` seconds, whatever was timed."""

    def observe(self, num_rows: int, seconds: float) -> None:
        pass

    def seconds(self, num_rows: int) -> float | None:
        return 1.0 + 0.03 * (num_rows - 1)


def fixed_rows(engine: Engine) -> Engine:
    """``engine`` with its forwards priced by ``FixedRows``: nothing here depends on timing."""
    engine.forward_cost.rows = FixedRows()
    return engine


class FixedCosts(ProposerCosts):
    """Prices every proposer as given: (per draft, per round) over a forward's fixed part (in
    seconds where the forward is priced at 1 s, as ``FixedRows`` prices one row)."""

    def __init__(self, per_draft: float, per_round: float) -> None:
        super().__init__()
        self.fixed = (per_draft, per_round)

    def price(self, proposer: Proposer, forward_s: float | None) -> tuple[float, float] | None:
        return self.fixed


@pytest.mark.parametrize(("per_round", "drafts"), [(0.0, True), (1.5, False), (50.0, False)])
def test_measured_costs_decide_whether_a_greedy_request_drafts(
    target: LoadedModel, per_round: float, drafts: bool
) -> None:
    engine = fixed_rows(make_engine(target, measure_proposer_costs=True))
    max_new_tokens = 100
    answer = plain(engine, PROMPTS[1], max_new_tokens)
    proposer: Counting | None = None

    def build(context: ProposerContext) -> Counting:
        nonlocal proposer
        proposer = Counting(context, answer)
        return proposer

    engine.register_proposer("counting", build)
    engine.proposers.costs = FixedCosts(0.0, per_round)
    params = GenerationParams(
        max_new_tokens=max_new_tokens, proposer="counting", num_speculative_tokens=4
    )
    result = engine.generate(prompt_token_ids=PROMPTS[1], params=params)
    assert result.token_ids == answer
    assert proposer is not None
    if drafts:
        assert max(proposer.asked) > 1
        return
    # A price no draft can pay: only probes of one draft, ever rarer, the first after a pause
    # at which it costs FIRST_PROBE_BUDGET tokens a round (a probe of 1.53 tokens or of 50: a
    # pause longer than the request).
    probes = [i for i, k in enumerate(proposer.asked) if k]
    probe = 0.03 + per_round  # a draft's row and the round, over a 1-token round's 1 s
    assert max(proposer.asked, default=0) <= 1
    shortest = min(MAX_PAUSE, int(probe / FIRST_PROBE_BUDGET))
    assert (probes[0] if probes else max_new_tokens) >= min(shortest, max_new_tokens)
    assert bool(probes) == (shortest < max_new_tokens)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps) and len(set(gaps)) == len(gaps)


@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_a_proposer_skipping_rounds_catches_up_losslessly(
    target: LoadedModel, draft: LoadedModel, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prices that swing between free and prohibitive make the draft model and the eagle head
    skip runs of rounds; each catches up on the committed tokens when it drafts again. (Pauses
    start at MIN_PAUSE whatever a probe costs, so that the prohibitive price's pauses end within
    the request.)"""
    from hybridspec.config import EagleConfig
    from tests.proposers.eagle_helpers import random_head, use_head

    monkeypatch.setattr(speculation, "FIRST_PROBE_BUDGET", math.inf)

    free = EagleConfig(cost_per_token=0.0)
    engine = fixed_rows(make_engine(target, draft, measure_proposer_costs=True, eagle=free))
    if name == "eagle":
        use_head(engine, random_head(target, 48))

    class Swinging(FixedCosts):
        calls = 0

        def price(self, proposer: Proposer, forward_s: float | None) -> tuple[float, float]:
            Swinging.calls += 1
            return (0.0, 0.0) if (Swinging.calls // 4) % 2 else (0.0, 50.0)

    engine.proposers.costs = Swinging(0.0, 0.0)
    for prompt in PROMPTS[:3]:
        params = GenerationParams(max_new_tokens=40, proposer=name, num_speculative_tokens=4)
        result = engine.generate(prompt_token_ids=prompt, params=params)
        assert result.token_ids == plain(engine, prompt, 40)
        stats = result.stats
        drafting_rounds = stats.proposed_per_position[0]
        assert 0 < drafting_rounds < stats.target_forwards  # it drafted in some rounds only


def test_an_outlying_call_counts_at_most_a_few_times_the_fit_and_reset_forgets() -> None:
    costs, proposer = ProposerCosts(), NoProposer(None)  # type: ignore[arg-type]
    for _ in range(MIN_CALLS):
        costs.observe(proposer, 1, 2, 0.003)
    costs.observe(proposer, 1, 2, 30.0)  # a call that compiled something
    per_draft, per_round = costs.price(proposer, 0.001)  # type: ignore[misc]
    assert 2 * per_draft + per_round <= OUTLIER * 3.0
    costs.clear()
    assert costs.price(proposer, 0.001) is None


def test_engine_reset_forgets_the_measured_costs(target: LoadedModel) -> None:
    engine = make_engine(target, measure_proposer_costs=True)
    proposer = engine.resolve_proposer("ngram")
    for _ in range(MIN_CALLS):
        engine.proposers.costs.observe(proposer, 1, 1, 0.001)
    assert engine.proposers.costs.price(proposer, 0.01) is not None
    engine.reset()
    assert engine.proposers.costs.price(proposer, 0.01) is None


def test_a_paused_request_reads_no_price(target: LoadedModel) -> None:
    """A paused request whose proposer is not shadow-checked asks for no drafts without
    pricing its round: its pause is all that decides it."""
    engine = fixed_rows(make_engine(target, measure_proposer_costs=True))
    answer = plain(engine, PROMPTS[0], 20)
    engine.register_proposer("counting", lambda context: Counting(context, answer))
    counting = engine.resolve_proposer("counting")

    class Counted(FixedCosts):
        calls = 0

        def price(self, proposer: Proposer, forward_s: float | None) -> tuple[float, float]:
            Counted.calls += proposer is counting
            return self.fixed

    engine.proposers.costs = Counted(0.0, 50.0)  # the first round pauses past the request's end
    params = GenerationParams(max_new_tokens=20, proposer="counting", num_speculative_tokens=4)
    result = engine.generate(prompt_token_ids=PROMPTS[0], params=params)
    assert result.token_ids == answer
    assert result.stats.draft_tokens_proposed == 0
    assert Counted.calls == 1


class Shadowed(Counting):
    """``Counting`` checked in shadow: its drafts are the target's own (``hits``) or a token
    the target never commits there; each commit's ``num_accepted`` is kept."""

    shadow_checked = True

    def __init__(self, context: ProposerContext, answer: Sequence[int], hits: bool) -> None:
        super().__init__(
            context, answer if hits else [(t + 1) % context.vocab_size for t in answer]
        )
        self.kept: list[int] = []

    def commit(self, info: CommitInfo) -> None:
        super().commit(info)
        self.kept.append(info.num_accepted)


def shadowed_request(
    engine: Engine, max_new_tokens: int, hits: bool
) -> tuple[Shadowed, list[int], list[int], GenerationStats]:
    """Run PROMPTS[1] greedily with a ``Shadowed`` proposer: the proposer, the request's
    tokens, the target's own and the request's statistics."""
    answer = plain(engine, PROMPTS[1], max_new_tokens)
    built: list[Shadowed] = []

    def build(context: ProposerContext) -> Shadowed:
        built.append(Shadowed(context, answer, hits))
        return built[-1]

    engine.register_proposer("shadowed", build)
    params = GenerationParams(
        max_new_tokens=max_new_tokens, proposer="shadowed", num_speculative_tokens=4
    )
    result = engine.generate(prompt_token_ids=PROMPTS[1], params=params)
    return built[-1], result.token_ids, answer, result.stats


@pytest.mark.parametrize("hits", [True, False])
def test_shadow_probes_verify_no_draft_until_one_would_be_kept(
    target: LoadedModel, hits: bool
) -> None:
    """A shadow-checked proposer's request starts paused and asks for one unverified draft a
    round; its commit says whether the target's token was that draft. Drafts that would be kept
    end the pause at once and are verified from the next round on; drafts never kept cost no
    verify row in the whole request. The text is the target's either way."""
    engine = fixed_rows(make_engine(target, measure_proposer_costs=True))
    engine.proposers.costs = FixedCosts(0.0, 0.0)
    proposer, tokens, answer, stats = shadowed_request(engine, 40, hits)
    assert tokens == answer
    assert proposer.asked[0] == 1 and proposer.kept[0] == int(hits)  # the first round: a shadow
    if hits:
        assert max(proposer.asked[1:]) > 1  # drafting, verified, from the second round on
        assert stats.draft_tokens_accepted == stats.draft_tokens_proposed > 0
        return
    assert stats.draft_tokens_proposed == 0  # never a verify row
    assert proposer.asked[:-1] == [1] * (len(proposer.asked) - 1)  # a shadow each round
    assert not any(proposer.kept)


def test_a_proposer_dearer_than_the_shadow_budget_is_probed_with_verify_rows(
    target: LoadedModel,
) -> None:
    """Where a shadow-checked proposer's call costs more than ``SHADOW_BUDGET`` of a forward,
    its pauses count down to probes of one verified draft, as any proposer's do."""
    engine = fixed_rows(make_engine(target, measure_proposer_costs=True))
    engine.proposers.costs = FixedCosts(0.0, 2 * speculation.SHADOW_BUDGET)
    proposer, tokens, answer, stats = shadowed_request(engine, 60, False)
    assert tokens == answer
    assert stats.draft_tokens_proposed > 0  # verified: its first rounds, then probes
    assert 0 in proposer.asked  # paused rounds asked it for nothing
