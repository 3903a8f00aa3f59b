"""Forwards priced by their measured row counts (``engine.row_costs``), and adaptive speculation
pricing a round with them (``engine.speculation``, "Measured costs"). Every time here is
injected: nothing depends on how fast this machine runs."""

from __future__ import annotations

import pytest

from hybridspec.bench.oracle_table import ideal_speedup
from hybridspec.engine.row_costs import MIN_FORWARDS, OUTLIER, WINDOW, RowCosts, TimedForwardCost
from hybridspec.engine.speculation import MeasuredPrice, SpeculationPolicy, SpeculationState
from hybridspec.model import LoadedModel
from tests.engine.tiny import PROMPTS, make_engine, plain


def measured(points: dict[int, float]) -> RowCosts:
    rows = RowCosts()
    for n, seconds in points.items():
        rows.observe(n, seconds)
    return rows


def test_rows_between_measured_counts_are_priced_on_a_straight_line() -> None:
    rows = measured({1: 1.0, 3: 2.0, 9: 5.0})
    assert rows.seconds(1) == 1.0 and rows.seconds(3) == 2.0
    assert rows.seconds(2) == pytest.approx(1.5)
    assert rows.seconds(5) == pytest.approx(3.0)
    assert rows.seconds(13) == pytest.approx(7.0)  # past the largest: its last stretch's slope


def test_nothing_measured_low_enough_prices_nothing() -> None:
    assert RowCosts().seconds(1) is None
    rows = measured({4: 2.0})
    assert rows.seconds(4) == 2.0
    assert rows.seconds(1) is None  # below every measured count
    assert rows.seconds(5) is None  # one count: no slope to extend
    rows.clear()
    assert rows.seconds(4) is None


def test_noise_never_makes_a_row_free_or_negative() -> None:
    rows = measured({1: 1.0, 2: 0.9, 3: 1.2, 4: 1.1})
    priced = [rows.seconds(n) or 0.0 for n in range(1, 7)]
    assert priced == sorted(priced) and min(priced) > 0  # non-decreasing in the rows
    assert priced[0] == priced[1] == pytest.approx(0.95)  # the pair out of order: pooled


def test_one_slow_count_does_not_make_the_rows_above_it_free() -> None:
    rows = RowCosts()
    for _ in range(WINDOW):
        for n in (*range(1, 9), *range(10, 41)):
            rows.observe(n, 1.0 + 0.1 * n)
    rows.observe(9, 50.0)  # the one forward of 9 rows, slow (a kernel compiled, or descheduled)
    low, high = rows.seconds(20), rows.seconds(30)
    assert low is not None and high is not None
    assert high - low == pytest.approx(1.0)  # ten more rows still cost ten rows' time
    assert rows.seconds(8) == pytest.approx(1.8)


def test_a_new_row_count_is_its_lesser_first_two_forwards() -> None:
    rows = measured({1: 1.0, 9: 40.0})  # the first forward at 9 rows compiled a kernel
    assert rows.seconds(9) == 40.0
    rows.observe(9, 1.6)
    assert rows.seconds(9) == 1.6
    rows.observe(9, 1.8)
    assert rows.seconds(9) == pytest.approx(1.6 + 0.2 / 3)


def test_a_row_count_follows_its_recent_forwards_and_clips_outliers() -> None:
    rows = measured({1: 1.0})
    for _ in range(MIN_FORWARDS):
        rows.observe(1, 1.0)
    rows.observe(1, 100.0)  # a forward descheduled by a busy neighbour
    assert rows.seconds(1) == pytest.approx(1.0 + (OUTLIER - 1.0) / (MIN_FORWARDS + 2))
    for _ in range(10 * WINDOW):
        rows.observe(1, 2.0)  # the machine got slower: the mean follows
    assert rows.seconds(1) == pytest.approx(2.0, rel=1e-3)


def test_the_engine_times_its_forwards_by_their_rows(target: LoadedModel) -> None:
    engine = make_engine(target)
    assert isinstance(engine.forward_cost, TimedForwardCost)
    assert engine.forward_cost.rows.seconds(1) is None
    plain(engine, PROMPTS[0], 8)
    assert engine.forward_cost.rows.seconds(1) is not None  # the decode rounds'
    assert engine.forward_cost.seconds(1, 1) is not None  # the fitted model learns too


# A forward at the 3B shape on 2 cores, in decodes: 1 row on the matrix-vector path, more rows
# on the block kernel at about 0.18 of a decode each.
SHAPE_3B = {1: 1.0, **{n: 0.70 + 0.177 * n for n in range(2, 18)}}


def asked(
    policy: SpeculationPolicy,
    rows: RowCosts,
    alpha: float,
    max_drafts: int = 16,
    per_draft: float = 0.0,
    per_round: float = 0.0,
) -> int:
    state = SpeculationState(accepted=1000 * alpha, rejected=1000 * (1 - alpha))
    price = MeasuredPrice(rows.seconds, per_draft, per_round)
    return policy.num_drafts(state, max_drafts, by_step=True, measured=price)


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.9])
def test_alone_a_request_asks_for_the_k_of_the_best_ideal_speedup(alpha: float) -> None:
    rows = measured(SHAPE_3B)
    cost = {n: SHAPE_3B[n] for n in SHAPE_3B}
    best = max(range(17), key=lambda k: ideal_speedup(alpha, k, cost))
    assert asked(SpeculationPolicy(0.03), rows, alpha) == best
    # the constant 0.03 a row asks for more drafts than pay here
    constant = SpeculationPolicy(0.03).num_drafts(
        SpeculationState(accepted=1000 * alpha, rejected=1000 * (1 - alpha)), 16, by_step=True
    )
    assert constant > best


def test_beside_a_batch_whose_rows_are_no_longer_free_a_request_asks_for_fewer() -> None:
    # 8 rows nearly free beside one, each row past them 0.15 of a one-row forward
    rows = measured({1: 1.0, 8: 1.1, 64: 1.1 + 0.15 * 56})
    alone, batch = SpeculationPolicy(0.03), SpeculationPolicy(0.03)
    batch.record_step(16, 16)  # 8 requests, each a draft, each kept
    assert asked(alone, rows, 0.6) > 0
    assert asked(batch, rows, 0.6) < asked(alone, rows, 0.6)
    assert asked(batch, rows, 0.4) == 0


def test_rows_that_no_draft_pays_pause_and_probe() -> None:
    rows = measured({1: 1.0, 8: 1.1, 9: 2.0, 64: 60.0})  # (a stale price, say)
    policy = SpeculationPolicy(0.03)
    policy.record_step(8, 8)  # 8 requests without drafts
    state = SpeculationState()
    price = MeasuredPrice(rows.seconds)
    assert policy.num_drafts(state, 8, by_step=True, measured=price) == 0
    assert state.paused > 0 and state.probing  # paused, then a probe of one draft
    for _ in range(state.paused):
        assert policy.num_drafts(state, 8, by_step=True, measured=price) == 0
        state.update(0, 0, 1)
    assert policy.num_drafts(state, 8, by_step=True, measured=price) == 1


def test_a_proposer_time_per_round_that_no_draft_pays_pauses_and_probes() -> None:
    policy, rows = SpeculationPolicy(0.03), measured(SHAPE_3B)
    state = SpeculationState(accepted=900.0, rejected=100.0)
    price = MeasuredPrice(rows.seconds, per_round_s=5.0)
    assert policy.num_drafts(state, 8, by_step=True, measured=price) == 0
    assert state.paused > 0 and state.probing  # paused, then a probe of one draft
    while state.paused:
        assert policy.num_drafts(state, 8, by_step=True, measured=price) == 0
        state.update(0, 0, 1)
    assert policy.num_drafts(state, 8, by_step=True, measured=price) == 1
    assert state.round_price == pytest.approx(5.0)  # 5 s over a token worth 1 s


def test_rows_not_yet_measured_fall_back_to_the_constant_cost() -> None:
    policy, state = SpeculationPolicy(0.03), SpeculationState()
    constant = policy.num_drafts(state, 8, by_step=True)
    only_one = MeasuredPrice(measured({1: 1.0}).seconds)  # no slope yet
    assert policy.num_drafts(state, 8, by_step=True, measured=only_one) == constant
    sampled = MeasuredPrice(measured(SHAPE_3B).seconds)  # a seeded sampled request: fixed
    assert policy.num_drafts(state, 8, by_step=False, measured=sampled) == constant


def test_only_forwards_that_fed_no_prompt_price_rows() -> None:
    cost = TimedForwardCost()
    cost.observe_forward(27, 400, 1, 5.0)  # a prompt's chunk beside one decoding request's row
    assert cost.rows.seconds(27) is None and cost.rows.seconds(1) is None
    cost.observe_forward(3, 30, 3, 1.2)  # a round of 3 verified rows, nothing else
    assert cost.rows.seconds(3) == 1.2 and cost.rows._counts == {3: 1}
