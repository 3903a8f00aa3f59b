"""``bench --vs-none``: concurrent trials per group of categories, and each method's ratio to
``none`` per group, temperature and concurrency. Records are made up: nothing measures speed."""

from __future__ import annotations

import dataclasses

import pytest

from hybridspec.bench.harness import (
    BenchConfig,
    BenchPrompt,
    concurrent_schedule,
    plan,
    run_benchmark,
)
from hybridspec.bench.records import Record
from hybridspec.bench.summary import GROUNDED, OPEN_ENDED, Summary
from hybridspec.bench.vs_none import FLOOR, format_vs_none, vs_none
from tests.bench.test_concurrency import (
    CATEGORIES,
    FakeMethod,
    SequentialMethod,
    concurrent,
    single,
)


def test_concurrent_trials_run_once_per_group_over_its_prompts() -> None:
    prompts = [
        BenchPrompt("x0", "x", (10, 1)),
        BenchPrompt("y0", "y", (12, 1)),
        BenchPrompt("x1", "x", (11, 1)),
    ]
    batching = FakeMethod("batch")
    groups = (frozenset({"x"}), frozenset({"y"}), frozenset({"z"}))  # z: no prompt, no trial
    config = BenchConfig(temperatures=(0.0,), concurrency=2, concurrent_groups=groups)
    records = run_benchmark(config, [batching, SequentialMethod()], prompts)
    loops = [r.prompt_ids for r in records if r.category is None]
    assert loops == [("x0", "x1"), ("y0", "y0")]  # each group's prompts, cycled up to N
    assert [first for first, _, _ in batching.loops] == [[10, 11], [12, 12]]


def test_ratios_to_none_per_group_temperature_and_concurrency() -> None:
    records = [
        single("none", 0, "code-1", 100, 10.0),  # grounded: 10 tokens/s
        single("none", 0, "chat-1", 100, 10.0),  # open-ended: 10 tokens/s
        single("ngram", 0, "code-1", 100, 5.0),  # 2x
        single("ngram", 0, "chat-1", 100, 12.5),  # 0.8x
        concurrent("none", 0, ("chat-1", "chat-1"), 100, 10.0, 2),  # 20 tokens/s
        concurrent("ngram", 0, ("chat-1", "chat-1"), 100, 8.0, 2),  # 25 tokens/s: 1.25x
        concurrent("none", 0, ("code-1", "code-1"), 100, 4.0, 2),
        concurrent("ngram", 0, ("code-1", "code-1"), 100, 5.0, 2),  # 0.8x
    ]
    rows = vs_none(records, Summary(records, CATEGORIES), CATEGORIES)
    got = {(r.method, r.group, r.temperature, r.concurrency): r.ratio for r in rows}
    assert got == pytest.approx(
        {
            ("ngram", OPEN_ENDED, 0.0, 1): 0.8,
            ("ngram", OPEN_ENDED, 0.0, 2): 1.25,
            ("ngram", GROUNDED, 0.0, 1): 2.0,
            ("ngram", GROUNDED, 0.0, 2): 0.8,
        }
    )
    table = format_vs_none(rows)
    assert table.count("BELOW") == 3  # two rows, and the least named again
    assert f"2 of 4 below {FLOOR}" in table


def test_none_flanks_every_method_at_once_and_the_methods_rotate() -> None:
    def order(trials: list) -> list[tuple[int, int]]:
        return [(t.repeat, t.method) for t in trials]

    flanked = concurrent_schedule((0, 1), [0, 1, 2], [0.0], repeats=2, concurrency=2, baseline=0)
    assert order(flanked) == [
        *[(0, 0), (0, 1), (0, 0), (0, 2), (0, 0)],
        *[(1, 0), (1, 2), (1, 0), (1, 1), (1, 0)],
    ]
    plain = concurrent_schedule((0, 1), [1, 2], [0.0], repeats=2, concurrency=2, baseline=0)
    assert order(plain) == [(0, 1), (0, 2), (1, 2), (1, 1)]  # no none: each once, rotating
    assert not any(t.paired for t in [*flanked, *plain])


def test_with_a_twin_each_method_at_once_is_paired_and_none_runs_in_the_pairs() -> None:
    paired = concurrent_schedule(
        (0, 1), [0, 1, 2], [0.0], repeats=2, concurrency=2, baseline=0, paired=True
    )
    assert [(t.repeat, t.method, t.paired) for t in paired] == [
        *[(0, 1, True), (0, 2, True)],
        *[(1, 2, True), (1, 1, True)],
    ]
    alone = concurrent_schedule(
        (0, 1), [0], [0.0], repeats=1, concurrency=2, baseline=0, paired=True
    )
    assert [(t.method, t.paired) for t in alone] == [(0, False)]  # nothing to pair with


def test_a_paired_method_is_compared_with_its_pair_alone() -> None:
    """Each pair ran through the same seconds of a machine that changed speed between them:
    ngram at 22 beside none at 22, eagle at 26 beside none at 20. Within the pairs the ratios
    are 1.0 and 1.3; the mean of the none trials on either side of eagle's would make its ratio
    26 / 21 = 1.24."""
    pair = ("chat-1", "chat-1")

    def beside(record: Record, other: str) -> Record:
        return dataclasses.replace(record, beside=other)

    records = [
        single("none", 0, "chat-1", 100, 10.0),
        beside(concurrent("ngram", 0, pair, 100, 200 / 22, 2), "none"),
        beside(concurrent("none", 0, pair, 100, 200 / 22, 2), "ngram"),
        beside(concurrent("eagle", 0, pair, 100, 200 / 26, 2), "none"),
        beside(concurrent("none", 0, pair, 100, 10.0, 2), "eagle"),
    ]
    rows = vs_none(records, Summary(records, CATEGORIES), CATEGORIES)
    got = {(r.method, r.concurrency): r.ratio for r in rows if r.group == OPEN_ENDED}
    assert got[("ngram", 2)] == pytest.approx(1.0)
    assert got[("eagle", 2)] == pytest.approx(1.3)


def test_a_method_at_once_is_compared_with_the_none_trials_beside_it() -> None:
    """The machine speeds up through the repeat (none at 20, 24 then 28 tokens/s): each method
    ran at the rate of the none trials on either side of it, a ratio of 1, which none's rate
    over the whole repeat (24) would make 22/24 and 26/24."""
    pair = ("chat-1", "chat-1")
    records = [
        single("none", 0, "chat-1", 100, 10.0),
        concurrent("none", 0, pair, 100, 10.0, 2),  # 20 tokens/s
        concurrent("ngram", 0, pair, 100, 200 / 22, 2),  # 22
        concurrent("none", 0, pair, 100, 200 / 24, 2),  # 24
        concurrent("eagle", 0, pair, 100, 200 / 26, 2),  # 26
        concurrent("none", 0, pair, 100, 200 / 28, 2),  # 28
        concurrent("none", 1, pair, 100, 10.0, 2),  # repeat 1: 20, 20, and ngram at 30
        concurrent("ngram", 1, pair, 100, 200 / 30, 2),
        concurrent("none", 1, pair, 100, 10.0, 2),
    ]
    rows = vs_none(records, Summary(records, CATEGORIES), CATEGORIES)
    got = {(r.method, r.concurrency): r.ratio for r in rows if r.group == OPEN_ENDED}
    assert got[("ngram", 2)] == pytest.approx((1.0 + 1.5) / 2)  # median of the two repeats
    assert got[("eagle", 2)] == pytest.approx(1.0)


def test_with_a_twin_one_at_a_time_each_method_is_paired_and_none_runs_only_in_pairs() -> None:
    """Methods (batch, none, single), two prompts: the rotation of ``sequential_schedule``
    without ``none``'s own trials, ``batch`` in a pair; ``single`` (no engine) runs alone."""
    prompts = [BenchPrompt("x0", "x", (10, 1)), BenchPrompt("y0", "y", (12, 1))]
    methods = [FakeMethod("batch"), FakeMethod("none"), SequentialMethod()]
    config = BenchConfig(temperatures=(0.0,))
    trials = [(t.prompts, t.method, t.paired) for t in plan(config, methods, prompts, True)]
    assert trials == [((0,), 0, True), ((0,), 2, False), ((1,), 2, False), ((1,), 0, True)]
    unpaired = [(t.prompts, t.method) for t in plan(config, methods, prompts)]
    assert unpaired == [((0,), 0), ((0,), 1), ((0,), 2), ((1,), 1), ((1,), 2), ((1,), 0)]
    alone = [t.paired for t in plan(config, methods[1:], prompts, True)]
    assert alone == [False] * 4  # no other engine method: nothing to pair none with


def test_one_at_a_time_a_paired_method_is_compared_with_its_pairs() -> None:
    """Two prompts of a group per repeat, each method's run beside a none run of its own: in
    repeat 0 ngram made 200 tokens in 10 s beside none's 200 in 10 s (1.0), eagle 200 in 8 s
    beside none's 200 in 12 s (1.5); repeat 1 gives 1.0 and 1.1. Over all of a repeat's none
    runs (the summary's speedup) eagle's ratio would be 25 / 18.2 = 1.375 in repeat 0."""

    def pair(method: str, repeat: int, prompt: str, seconds: float, theirs: float) -> list[Record]:
        mine = dataclasses.replace(single(method, repeat, prompt, 100, seconds), beside="none")
        none = dataclasses.replace(single("none", repeat, prompt, 100, theirs), beside=method)
        return [mine, none]

    records = [
        *pair("ngram", 0, "chat-1", 5.0, 5.0),
        *pair("eagle", 0, "chat-1", 4.0, 6.0),
        *pair("eagle", 0, "chat-2", 4.0, 6.0),
        *pair("ngram", 0, "chat-2", 5.0, 5.0),
        *pair("ngram", 1, "chat-1", 6.0, 6.0),
        *pair("eagle", 1, "chat-1", 4.0, 4.4),
        *pair("eagle", 1, "chat-2", 4.0, 4.4),
        *pair("ngram", 1, "chat-2", 6.0, 6.0),
        *pair("ngram", 0, "code-1", 1.0, 4.0),  # another group: not counted
    ]
    summary = Summary(records, CATEGORIES)
    rows = vs_none(records, summary, CATEGORIES)
    got = {(r.method, r.group): r.ratio for r in rows if r.concurrency == 1}
    assert got[("ngram", OPEN_ENDED)] == pytest.approx(1.0)
    assert got[("eagle", OPEN_ENDED)] == pytest.approx((1.5 + 1.1) / 2)
    assert got[("ngram", GROUNDED)] == pytest.approx(4.0)
    assert summary.speedup("eagle", "none", OPEN_ENDED, 0.0) == pytest.approx((1.375 + 1.3) / 2)
