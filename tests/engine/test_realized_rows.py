"""Drafting rounds' measured cost checked against the row table (``engine.realized_rows``), and
adaptive speculation pricing drafts with what the table leaves out (``engine.drafts``). Every
time here is injected: nothing depends on how fast this machine runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hybridspec.engine.drafts import DraftCounts
from hybridspec.engine.realized_rows import MIN_DRAFTS, OUTLIER, STALE, RealizedRows
from hybridspec.engine.row_costs import WINDOW, TimedForwardCost
from hybridspec.engine.speculation import MeasuredPrice, SpeculationPolicy, SpeculationState

MS = 0.001


def interleaved(realized: RealizedRows, rounds: int, drafting_s: float, modelled_s: float) -> None:
    """``rounds`` pairs: 8 requests without drafts in 20 ms, then 8 requests and 2 drafts in
    ``drafting_s``, which the table priced at ``modelled_s`` over the 8 requests."""
    for _ in range(rounds):
        realized.observe(8, 0, 20 * MS, None)
        realized.observe(8, 2, drafting_s, modelled_s)


def test_drafts_dearer_than_the_table_says_cost_the_difference() -> None:
    realized = RealizedRows()
    interleaved(realized, 40, 24 * MS, 2 * MS)  # took 4 ms more, priced at 2 ms more
    assert realized.extra_per_draft() == pytest.approx(1 * MS)


def test_a_table_that_prices_drafts_dearer_adds_nothing() -> None:
    realized = RealizedRows()
    interleaved(realized, 40, 21 * MS, 3 * MS)
    assert realized.extra_per_draft() == 0.0


def test_a_few_drafts_add_nothing() -> None:
    realized = RealizedRows()
    interleaved(realized, int(MIN_DRAFTS / 2), 30 * MS, 0.0)  # the first before a baseline
    assert realized.extra_per_draft() == 0.0
    interleaved(realized, 3, 30 * MS, 0.0)
    assert realized.extra_per_draft() == pytest.approx(5 * MS)


def test_a_step_without_drafts_seen_long_ago_prices_nothing() -> None:
    realized = RealizedRows()
    for _ in range(4):
        realized.observe(8, 0, 20 * MS, None)
    for _ in range(STALE):  # drafting rounds at 7 requests: not the 8 requests' baseline
        realized.observe(7, 2, 40 * MS, 0.0)
    for _ in range(20):
        realized.observe(8, 2, 40 * MS, 0.0)  # the 8 requests' baseline is stale by now
    assert realized.extra_per_draft() == 0.0


def test_a_descheduled_round_counts_within_outlier_times_what_was_expected() -> None:
    realized = RealizedRows()
    interleaved(realized, 40, 20 * MS * 100, 2 * MS)  # every drafting round descheduled
    expected = (OUTLIER * 22 - 20 - 2) * MS / 2  # each at most OUTLIER times 20 + 2 ms
    assert realized.extra_per_draft() == pytest.approx(expected)
    calm = RealizedRows()
    interleaved(calm, 40, 24 * MS, 2 * MS)
    before = calm.extra_per_draft()
    calm.observe(8, 0, 20 * MS * 100, None)  # one step without drafts descheduled
    calm.observe(8, 0, 0.2 * MS, None)  # and one that ran while a neighbour slept
    calm.observe(8, 2, 24 * MS, 2 * MS)
    assert calm.extra_per_draft() == pytest.approx(before, rel=0.15)


def test_the_extra_follows_the_machine() -> None:
    realized = RealizedRows()
    interleaved(realized, 200, 26 * MS, 2 * MS)
    assert realized.extra_per_draft() == pytest.approx(2 * MS)
    interleaved(realized, 200, 22 * MS, 2 * MS)  # the table is right now
    assert realized.extra_per_draft() < 0.01 * MS


def test_rounds_learn_the_check_from_the_row_table_before_the_table_learns_them() -> None:
    cost = TimedForwardCost()
    for _ in range(WINDOW):
        cost.observe_round(8, 8, 20 * MS)
        cost.observe_round(9, 9, 21 * MS)  # the table: a 9th row costs 1 ms
    assert cost.realized.extra_per_draft() == 0.0  # no drafts said so: nothing checked
    for _ in range(20):
        cost.observe_round(8, 8, 20 * MS)
        cost.observe_round(9, 9, 23 * MS, num_drafts=1)  # a draft's round took 3 ms more
    assert 1 * MS < cost.realized.extra_per_draft() < 2 * MS
    cost.observe_round(27, 1, 5.0)  # a prompt's chunk beside a request: checks nothing
    assert cost.realized._rounds == 2 * 20 + 2 * WINDOW


def measured_draft_counts(forward_cost: TimedForwardCost) -> DraftCounts:
    pool: Any = SimpleNamespace(costs=SimpleNamespace(price=lambda proposer, scale: None))
    return DraftCounts(SpeculationPolicy(0.03), forward_cost, pool, 1024, True)


def test_adaptive_speculation_adds_the_extra_to_every_draft() -> None:
    cost = TimedForwardCost()
    for _ in range(WINDOW):
        cost.observe_round(1, 1, 10 * MS)
        cost.observe_round(8, 8, 20 * MS)
        cost.observe_round(9, 9, 21 * MS)
    proposer: Any = SimpleNamespace(cost_per_token=0.0)
    counts = measured_draft_counts(cost)
    before = counts._measured(proposer, None)
    assert before is not None and before.per_draft_s == 0.0
    for _ in range(20):
        cost.observe_round(8, 8, 20 * MS)
        cost.observe_round(9, 9, 23 * MS, num_drafts=1)  # a draft's round took 3 ms more
    after = counts._measured(proposer, (0.5 * MS, 0.0))
    assert after is not None
    extra = cost.realized.extra_per_draft()
    assert after.per_draft_s == pytest.approx(0.5 * MS + extra) and extra > 1 * MS
    # the table took most of the 9th row's 3 ms for the machine slowing down and back
    assert (cost.rows.seconds(9) or 0.0) - (cost.rows.seconds(8) or 0.0) < 2 * MS
    # 8 requests, each draft kept 4 times in 5: at the table's price it pays, at the realised
    # one (3.5 ms a draft, a token worth 2.5 ms) it does not
    policy = SpeculationPolicy(0.03)
    policy.record_step(8, 8)
    table_only = MeasuredPrice(cost.rows.seconds, 0.5 * MS)
    state = SpeculationState(accepted=800.0, rejected=200.0)
    assert policy.num_drafts(state, 8, by_step=True, measured=table_only) > 0
    state = SpeculationState(accepted=800.0, rejected=200.0)
    assert policy.num_drafts(state, 8, by_step=True, measured=after) == 0
