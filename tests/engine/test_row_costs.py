"""Forwards priced by their measured row counts (``engine.row_costs``), and adaptive speculation
pricing a round with them (``engine.speculation``, "Measured costs"). Every time here is
injected: nothing depends on how fast this machine runs."""

from __future__ import annotations

import numpy as np
import pytest

from hybridspec.bench.oracle_table import ideal_speedup
from hybridspec.engine.row_costs import (
    LEVEL_RATE,
    MIN_FORWARDS,
    OUTLIER,
    STALE,
    WINDOW,
    RowCosts,
    TimedForwardCost,
)
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
    steps = np.diff(priced)
    assert min(priced) > 0 and np.all(steps > 0)  # every row costs something
    # each pair out of order priced on the line through it and its neighbour: 0.1 a row
    assert priced[:4] == pytest.approx([0.9 + 0.1 / 3, 1.0 + 0.1 / 3, 1.1 - 0.1 / 3, 1.2 - 0.1 / 3])


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
    rows.observe(9, 1.8)  # (a third forward: the level moves by its ratio too)
    level = (1.8 / 1.6) ** (LEVEL_RATE * 2 / WINDOW)  # (a count of 2 forwards: a small share)
    assert rows.seconds(9) == pytest.approx((1.6 + (1.8 / level - 1.6) / 3) * level)


def test_a_row_count_follows_its_recent_forwards_and_clips_outliers() -> None:
    rows = measured({1: 1.0})
    for _ in range(MIN_FORWARDS):
        rows.observe(1, 1.0)
    rows.observe(1, 100.0)  # a forward descheduled by a busy neighbour
    level = OUTLIER ** (LEVEL_RATE * (MIN_FORWARDS + 1) / WINDOW)  # its ratio clipped
    assert rows.seconds(1) == pytest.approx((1.0 + (OUTLIER - 1.0) / (MIN_FORWARDS + 2)) * level)
    for _ in range(10 * WINDOW):
        rows.observe(1, 2.0)  # the machine got slower: the mean follows
    assert rows.seconds(1) == pytest.approx(2.0, rel=1e-3)


def test_counts_timed_at_another_speed_are_priced_at_the_present_one() -> None:
    rows = RowCosts()
    for _ in range(WINDOW):
        for n in range(8, 17):
            rows.observe(n, 1.0 + 0.1 * n)  # every count timed at one speed
    for _ in range(WINDOW):
        rows.observe(8, 2.0 * 1.8)  # then the machine runs at half speed: only 8 rows timed
    assert rows.seconds(8) == pytest.approx(3.6, rel=0.01)
    one, eight = (rows.seconds(8 + k) - rows.seconds(8) for k in (1, 8))  # type: ignore[operator]
    # each row about twice its old time (the 8 rows' own mean takes a little of the change),
    # not free as where 8 rows' new time is set beside the others' old ones
    assert 0.1 < one <= 0.2 and eight == pytest.approx(1.6, rel=0.15)
    for _ in range(WINDOW):
        rows.observe(8, 1.8 / 2)  # and twice as fast as at first: rows not dear either
    eight = rows.seconds(16) - rows.seconds(8)  # type: ignore[operator]
    assert eight == pytest.approx(0.4, rel=0.15)


def test_neighbouring_counts_out_of_order_still_price_a_row() -> None:
    # 8 and 9 rows timed out of order by noise (the true gap about 1 ms), 7 and 10 about right
    rows = RowCosts()
    for _ in range(WINDOW):
        for n, ms in ((1, 6.0), (7, 14.9), (8, 17.9), (9, 17.1), (10, 19.0)):
            rows.observe(n, ms / 1000)
    first_row = (rows.seconds(9) or 0.0) - (rows.seconds(8) or 0.0)
    assert first_row > 0.0007  # the neighbourhood's slope, not pooling's zero
    policy = SpeculationPolicy(0.03)
    policy.record_step(8, 8)  # 8 requests without drafts
    assert asked(policy, rows, 0.05) == 0  # drafts hardly ever kept: asked for none


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


def test_a_count_not_timed_for_long_is_forgotten_and_drafts_are_asked_again() -> None:
    """A draft's row timed dear once (a busy neighbour, another thread count) priced every
    request at no drafts, and no request drafted again to time it anew: the count is
    forgotten after ``STALE`` forwards without it, and drafts are asked for again."""
    rows = measured({1: 1.0, 2: 4.0})  # one draft's row dearer than three tokens
    policy, alpha = SpeculationPolicy(0.03), 0.8
    assert asked(policy, rows, alpha) == 0
    for _ in range(STALE - 1):  # a count timed within the last STALE forwards is kept
        rows.observe(1, 1.0)
    assert rows.seconds(2) == pytest.approx(4.0) and asked(policy, rows, alpha) == 0
    rows.observe(1, 1.0)
    assert rows.seconds(2) is None  # one count left: no slope to price a draft's row
    assert asked(policy, rows, alpha) > 0  # the constant path: drafts are asked for again
    rows.observe(2, 1.1)  # and the count is timed afresh
    assert rows.seconds(2) == pytest.approx(1.1)


def test_counts_timed_now_and_then_are_kept() -> None:
    rows = measured({1: 1.0, 2: 1.1})
    for i in range(4 * STALE):
        rows.observe(2 if i % (STALE // 2) == 0 else 1, 1.1 if i % (STALE // 2) == 0 else 1.0)
    assert rows.seconds(1) == pytest.approx(1.0) and rows.seconds(2) == pytest.approx(1.1)


def test_rows_not_yet_measured_fall_back_to_the_constant_cost() -> None:
    policy, state = SpeculationPolicy(0.03), SpeculationState()
    constant = policy.num_drafts(state, 8, by_step=True)
    only_one = MeasuredPrice(measured({1: 1.0}).seconds)  # no slope yet
    assert policy.num_drafts(state, 8, by_step=True, measured=only_one) == constant
    sampled = MeasuredPrice(measured(SHAPE_3B).seconds)  # a seeded sampled request: fixed
    assert policy.num_drafts(state, 8, by_step=False, measured=sampled) == constant


def test_only_forwards_that_fed_no_prompt_price_rows() -> None:
    cost = TimedForwardCost()
    cost.observe_round(27, 1, 5.0)  # a prompt's chunk beside one decoding request's row
    assert cost.rows.seconds(27) is None and cost.rows.seconds(1) is None
    cost.observe_round(3, 3, 1.2)  # a round of 3 verified rows, nothing else
    assert cost.rows.seconds(3) == 1.2 and cost.rows._counts == {3: 1}


# The 3B shape's forward as timed on 2 cores (ms; 1, 2, 3, 5, 9, 17 rows), between the points a
# straight line as ``RowCosts`` prices it: a kinked curve, the block kernel's 4-row tiles.
TIMED_3B = {1: 66.7, 2: 80.5, 3: 88.1, 5: 98.8, 9: 165.9, 17: 273.8}


def simulated_rate(
    rows: RowCosts, alpha: float, k: int, adaptive: bool, tokens: int, seed: int
) -> float:
    """Tokens a second of one request of ``tokens`` tokens, drafts right by position with
    ``alpha`` (the oracle's model: the same luck whatever K asks), each round priced by
    ``rows``; adaptive K from a fresh request's state, or a fixed ``k``."""
    right = np.random.default_rng(seed).random(tokens + 1) < alpha
    policy, state, price = SpeculationPolicy(0.03), SpeculationState(), MeasuredPrice(rows.seconds)
    generated, seconds = 0, 0.0
    while generated < tokens:
        asks = max(0, min(k, tokens - generated - 1))
        if adaptive and asks > 0:
            asks = policy.num_drafts(state, asks, by_step=True, measured=price)
        kept = 0
        while kept < asks and right[generated + kept]:
            kept += 1
        seconds += rows.seconds(asks + 1) or 0.0
        state.update(asks, kept, kept + 1)
        policy.record_step(kept + 1, asks + 1)
        generated += kept + 1
    return generated / seconds


@pytest.mark.parametrize("curve", [SHAPE_3B, TIMED_3B], ids=["linear", "timed"])
@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.9])
def test_adaptive_k_is_within_a_tenth_of_the_best_fixed_k(
    curve: dict[int, float], alpha: float
) -> None:
    """From a fresh request's prior (learning included), 48 tokens as the 3B oracle table
    runs, averaged over seeds: adaptive K's rate at least 0.9 of the best fixed K's."""
    rows, seeds = measured(curve), range(40)

    def mean_rate(k: int, adaptive: bool) -> float:
        return float(np.mean([simulated_rate(rows, alpha, k, adaptive, 48, s) for s in seeds]))

    best = max(mean_rate(k, False) for k in (1, 2, 3, 4, 6, 8))
    assert mean_rate(8, True) >= 0.9 * best
    assert mean_rate(8, False) < 0.9 * best or alpha == 0.9  # K=8 alone would miss (can fail)


def test_a_loss_that_is_only_luck_does_not_pause() -> None:
    """Drafts kept half the time, priced by rows where a draft pays from about 0.21: three
    unlucky rounds (nothing kept) make the net negative, but the evidence still says drafting
    pays; drafts never kept pause as before."""
    policy, rows = SpeculationPolicy(0.03), measured(TIMED_3B)
    price = MeasuredPrice(rows.seconds)
    lucky = SpeculationState(accepted=5.0, rejected=5.0)
    for kept in (0, 0, 0):
        asks = policy.num_drafts(lucky, 8, by_step=True, measured=price)
        lucky.update(asks, kept, kept + 1)
    assert lucky.net < 0 and lucky.paused == 0 and 0.2 < lucky.pays_from < 0.25
    never = SpeculationState()
    for _ in range(3):
        asks = policy.num_drafts(never, 8, by_step=True, measured=price)
        never.update(asks, 0, 1)
    assert never.paused > 0
