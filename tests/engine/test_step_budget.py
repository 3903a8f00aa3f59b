"""Prefill chunks sized in time (``engine.step_budget``), with injected cost models: no timing."""

from __future__ import annotations

import random

import pytest

from hybridspec import Engine, GenerationParams
from hybridspec.config import EngineConfig
from hybridspec.engine.scheduler import Scheduler, StepPlan
from hybridspec.engine.step_budget import (
    GROWTH,
    LOAD_CHANGE,
    LOAD_WEIGHT,
    MIN_OBSERVATIONS,
    PRIOR_DOUBLING_CONTEXT,
    FittedForwardCost,
    StepBudget,
    attention_scores,
)
from hybridspec.model.loader import LoadedModel
from tests.engine.test_scheduler import make_request
from tests.engine.tiny import PROMPTS, VOCAB, make_engine


class LinearCost:
    """``fixed + per_row rows + per_score scores`` seconds, or None when ``known`` is False."""

    def __init__(self, fixed: float, per_row: float, per_score: float, known: bool = True):
        self.fixed, self.per_row, self.per_score, self.known = fixed, per_row, per_score, known

    def seconds(self, num_rows: int, num_scores: int) -> float | None:
        if not self.known:
            return None
        return self.fixed + self.per_row * num_rows + self.per_score * num_scores


# 10 ms per forward, 1 ms per row, and a row attending over 2,000 keys costs another 1 ms.
COST = LinearCost(0.010, 0.001, 0.001 / 2000)


def running(scheduler: Scheduler, *prompt_lengths: int) -> list:
    requests = [make_request(i, n) for i, n in enumerate(prompt_lengths)]
    for request in requests:
        scheduler.add(request, num_free_slots=len(requests))
    scheduler.admit(len(requests))
    return requests


def step_seconds(plan_decode_cached: list[tuple[int, int]], chunks: list[tuple[int, int]]) -> float:
    """COST of a step: decoding (cached, rows) spans plus prefill (cached, tokens) chunks."""
    spans = [*plan_decode_cached, *chunks]
    seconds = COST.seconds(sum(r for _, r in spans), sum(attention_scores(c, r) for c, r in spans))
    assert seconds is not None
    return seconds


def test_attention_scores_count_every_query_key_pair() -> None:
    assert attention_scores(10, 3) == 11 + 12 + 13
    assert attention_scores(0, 1) == 1
    assert attention_scores(5, 0) == 0


@pytest.mark.parametrize("depth", [0, 2000, 6000])
def test_chunk_is_the_most_that_keeps_the_step_within_the_bound(depth: int) -> None:
    """A decoding request (1 row after 100 cached) and a long prompt ``depth`` tokens in: the
    chunk keeps the step's cost within max(4 x the decode forward, 0.15 s), one more token
    would not, and deeper chunks are smaller."""
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=4.0, min_seconds=0.15))
    decoding, long_prompt = running(scheduler, 101, 8000)
    plan = scheduler.plan([100, depth])
    assert plan.decode == [decoding]
    [(request, tokens)] = plan.prefill
    assert request is long_prompt
    bound = max(4 * step_seconds([(100, 1)], []), 0.15)
    assert step_seconds([(100, 1)], [(depth, tokens)]) <= bound
    assert step_seconds([(100, 1)], [(depth, tokens + 1)]) > bound


def test_deeper_chunks_are_smaller_and_a_bigger_ratio_grants_more() -> None:
    def chunk(depth: int, ratio: float) -> int:
        scheduler = Scheduler(8, 4096, StepBudget(COST, ratio=ratio, min_seconds=0.0))
        running(scheduler, 101, 8000)
        return scheduler.plan([100, depth]).prefill[0][1]

    assert chunk(0, 20.0) > chunk(2000, 20.0) > chunk(6000, 20.0) > 32
    assert chunk(2000, 40.0) > chunk(2000, 20.0)


def test_bound_is_capped_unless_decoding_alone_takes_the_whole_cap() -> None:
    """Decoding spans of 60 or 120 rows (0.074, 0.134 s: more than half the cap) leave the
    prompt what fits in ``max_seconds``, so their next tokens come no later; spans of 200 rows
    (0.23 s, past the cap) still leave it as much time as they take (twice their forward)."""
    for rows, bound in ((60, 0.18), (120, 0.18), (200, 2 * step_seconds([(100, 200)], []))):
        scheduler = Scheduler(8, 512, StepBudget(COST, 4.0, 0.15, max_seconds=0.18))
        decoding, long_prompt = running(scheduler, 101, 8000)
        decoding.speculation.last_verified = rows
        [(request, tokens)] = scheduler.plan([100, 0]).prefill
        assert request is long_prompt and tokens > 32
        assert step_seconds([(100, rows)], [(0, tokens)]) <= bound
        assert step_seconds([(100, rows)], [(0, tokens + 1)]) > bound


def test_prompt_alone_feeds_full_chunks_whatever_the_cost() -> None:
    """Nothing decodes: no time bound, ``prefill_chunk_size`` tokens, however deep."""
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=4.0, min_seconds=0.0))
    (long_prompt,) = running(scheduler, 8000)
    assert scheduler.plan([7000]).prefill == [(long_prompt, 512)]
    assert scheduler.plan([0]).prefill == [(long_prompt, 512)]


def test_unknown_cost_falls_back_to_counting_tokens() -> None:
    unknown = LinearCost(0.0, 0.0, 0.0, known=False)
    scheduler = Scheduler(8, 512, StepBudget(unknown, ratio=4.0, min_seconds=0.15))
    decoding, long_prompt = running(scheduler, 101, 8000)
    plan = scheduler.plan([100, 7000])
    assert plan.decode == [decoding]
    assert plan.prefill == [(long_prompt, 512)]


def test_floor_keeps_the_first_prompt_moving_when_decoding_fills_the_bound() -> None:
    """Decoding alone is already at the bound (``ratio`` 1): the first prefilling request still
    gets ``min_chunk`` tokens, the second none."""
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=1.0, min_seconds=0.0, min_chunk=32))
    decoding, first, _ = running(scheduler, 101, 8000, 8000)
    plan = scheduler.plan([100, 4000, 0])
    assert plan.decode == [decoding]
    assert plan.prefill == [(first, 32)]


def test_prompts_share_the_step_and_a_fitting_rest_decodes() -> None:
    """Two prompts after a decoding one: the first's 40 remaining tokens fit, so it decodes
    (feeding them with its drafts); the second gets what is left of the bound."""
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=4.0, min_seconds=0.15))
    decoding, finishing, second = running(scheduler, 101, 3041, 8000)
    plan = scheduler.plan([100, 3000, 0])
    assert plan.decode == [decoding, finishing]
    [(request, tokens)] = plan.prefill
    assert request is second
    bound = max(4 * step_seconds([(100, 1)], []), 0.15)
    assert step_seconds([(100, 1), (3000, 40)], [(0, tokens)]) <= bound
    assert step_seconds([(100, 1), (3000, 40)], [(0, tokens + 1)]) > bound


def test_a_short_prompt_beside_a_prompt_alone_is_fed_whole_in_a_bounded_step() -> None:
    """A long prompt prefills alone, 3,000 tokens in, and a 20-token prompt is admitted: it is
    fed whole (priced as decoding: 20 rows and its first drafts' one), so its first token comes
    after this step, and the long prompt gets what fits in 0.15 s, not a full chunk."""
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=4.0, min_seconds=0.15))
    long_prompt, short = running(scheduler, 8000, 21)
    plan = scheduler.plan([3000, 0])
    assert plan.decode == [short] and plan.feeds_prompt
    [(request, tokens)] = plan.prefill
    assert request is long_prompt and 32 < tokens < 512
    assert step_seconds([(0, 21)], [(3000, tokens)]) <= 0.15
    assert step_seconds([(0, 21)], [(3000, tokens + 1)]) > 0.15


def test_a_short_prompt_is_priced_within_the_bound_not_raising_it() -> None:
    """A 31-token prompt starts (fed whole, 0.042 s) beside a stream decoding (0.011 s) and a
    long prompt: the bound stays the stream's (0.15 s), the long prompt gets what is left of it.
    Priced as decoding, the short prompt would have raised the bound to 0.17 s (4 x the forward
    of stream and short prompt), and the stream's gap with it."""
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=4.0, min_seconds=0.15, max_seconds=0.18))
    stream, short, long_prompt = running(scheduler, 101, 32, 8000)
    plan = scheduler.plan([100, 0, 3000])
    assert plan.decode == [stream, short]
    [(request, tokens)] = plan.prefill
    assert request is long_prompt and tokens > 8
    spans = [(100, 1), (0, 32)]
    assert step_seconds(spans, [(3000, tokens)]) <= 0.15 < step_seconds(spans, [(3000, tokens + 1)])


def test_a_long_prompts_deep_last_tokens_are_granted_what_fits() -> None:
    """A long prompt 7,800 tokens in with 31 left (0.152 s with the stream's row, past the
    0.15 s bound) does not start: it feeds what fits, and the rest next step."""
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=4.0, min_seconds=0.15, max_seconds=0.18))
    stream, ending = running(scheduler, 101, 7832)
    plan = scheduler.plan([100, 7800])
    assert plan.decode == [stream]
    [(request, tokens)] = plan.prefill
    assert request is ending and 8 < tokens < 31
    assert step_seconds([(100, 1)], [(7800, tokens)]) <= 0.15
    assert step_seconds([(100, 1)], [(7800, tokens + 1)]) > 0.15


def test_the_floor_is_small_and_only_where_no_prompt_is_fed_yet() -> None:
    """Decoding fills the bound (``ratio`` 1): a prompt alone in the step gets the 8-token
    floor; beside a short prompt fed whole (this step's progress) it gets nothing."""
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=1.0, min_seconds=0.0))
    stream, long_prompt = running(scheduler, 101, 8000)
    assert scheduler.plan([100, 7000]).prefill == [(long_prompt, 8)]
    scheduler = Scheduler(8, 512, StepBudget(COST, ratio=1.0, min_seconds=0.0))
    stream, short, long_prompt = running(scheduler, 101, 21, 8000)
    plan = scheduler.plan([100, 0, 7000])
    assert plan.decode == [stream, short] and plan.prefill == []


def test_steps_stay_bounded_for_a_while_after_the_last_decoding_request() -> None:
    """A stream's answer ended: for ``linger_s`` the prompt left alone still gets bounded
    chunks (its client's next request finds a short step), then full ones."""
    now = [0.0]
    budget = StepBudget(COST, 4.0, 0.15, linger_s=1.0, clock=lambda: now[0])
    scheduler = Scheduler(8, 512, budget)
    decoding, long_prompt = running(scheduler, 101, 8000)
    first = scheduler.plan([100, 3000]).prefill[0][1]
    scheduler.remove(decoding)  # its answer ended
    now[0] = 0.9
    [(request, tokens)] = scheduler.plan([3000 + first]).prefill
    assert request is long_prompt and 32 < tokens < 512
    assert step_seconds([], [(3000 + first, tokens)]) <= 0.15
    assert step_seconds([], [(3000 + first, tokens + 1)]) > 0.15
    now[0] = 1.1
    assert scheduler.plan([3000 + first + tokens]).prefill == [(long_prompt, 512)]


def test_a_shared_steps_prompt_tokens_grow_at_most_by_growth_from_the_last() -> None:
    """A cost model that turns cheap all at once (its rows now priced at a tenth) lets the
    next shared step feed at most ``GROWTH`` times the last one's prompt tokens plus the floor,
    and each one after that as much again; after a step with nothing decoding (past
    ``linger_s``: no bound), or ``linger_s`` after the last shared step, the first shared step
    takes what fits."""
    now = [0.0]
    cost = LinearCost(0.010, 0.001, 0.001 / 2000)
    budget = StepBudget(cost, 4.0, 0.15, linger_s=1.0, clock=lambda: now[0])
    scheduler = Scheduler(8, 512, budget)
    decoding, long_prompt = running(scheduler, 101, 8000)
    first = scheduler.plan([100, 0]).prefill[0][1]
    cost.per_row /= 10
    second = scheduler.plan([100, first]).prefill[0][1]
    assert second == int(GROWTH * first) + budget.min_chunk
    third = scheduler.plan([100, first + second]).prefill[0][1]
    assert third == int(GROWTH * second) + budget.min_chunk
    scheduler.remove(decoding)
    now[0] = 2.0
    assert scheduler.plan([first + second + third]).prefill == [(long_prompt, 512)]
    assert budget.last_granted is None
    decoding = make_request(9, 101)
    scheduler.add(decoding, num_free_slots=1)
    scheduler.admit(1)
    depth = first + second + third + 512
    fresh = StepBudget(cost, 4.0, 0.15).start([(100, 1)], 512)
    assert fresh is not None
    assert scheduler.plan([depth, 100]).prefill == [(long_prompt, fresh.grant(depth, 8000))]
    last = budget.last_granted
    assert last is not None
    cost.per_score /= 10
    now[0] = 3.5  # no prompt fed for 1.5 s: the stream decoded alone
    assert scheduler.plan([depth + last, 100]).prefill[0][1] > int(GROWTH * last) + 8


def test_a_step_that_only_starts_a_short_prompt_sets_no_growth_cap() -> None:
    """A stream's next request (a short prompt, fed whole) starts beside the stream: no prompt
    chunk is granted, so a long prompt arriving in the next step still takes what fits."""
    budget = StepBudget(COST, 4.0, 0.15)
    scheduler = Scheduler(8, 512, budget)
    stream, short = running(scheduler, 101, 21)
    assert scheduler.plan([100, 0]).decode == [stream, short]
    assert budget.last_granted is None
    long_prompt = make_request(7, 8000)
    scheduler.add(long_prompt, num_free_slots=1)
    scheduler.admit(1)
    [(request, tokens)] = scheduler.plan([101, 21, 0]).prefill
    assert request is long_prompt and tokens > int(GROWTH * 0) + budget.min_chunk


def test_fitted_cost_follows_the_load_and_keeps_its_shape() -> None:
    """A linear machine timed over varied shapes, then twice as slow for 12 forwards all of
    one shape (steps sized to one bound): the prompt chunks it did not time lately are priced
    twice as high too (within 5%), and small forwards no more than 1.5x that. Refitting the
    parts to those 12 instead (a fast decay) priced 512-row chunks at half their time and a
    one-row forward at 4x: decoding looked dear and chunks cheap."""
    cost = FittedForwardCost()
    rng = random.Random(0)

    def machine(rows: int, scores: int) -> float:
        return 0.005 + 0.0008 * rows + 4e-7 * scores

    for _ in range(60):
        rows, depth = rng.choice([1, 4, 9, 64, 512]), rng.randrange(0, 8000)
        scores = attention_scores(depth, rows)
        cost.observe(rows, scores, machine(rows, scores))
    for _ in range(12):
        scores = attention_scores(6000, 30)
        cost.observe(30, scores, 2 * machine(30, scores))
    for rows, depth in [(512, 2000), (200, 500), (30, 7000), (60, 3000)]:
        scores = attention_scores(depth, rows)
        assert cost.seconds(rows, scores) == pytest.approx(2 * machine(rows, scores), rel=0.05)
    for rows, depth in [(1, 0), (9, 100)]:
        scores = attention_scores(depth, rows)
        assert 2 <= (cost.seconds(rows, scores) or 0.0) / machine(rows, scores) <= 3


def test_one_slow_forward_moves_the_load_by_a_bounded_factor() -> None:
    """A forward descheduled for a second (100 x its time) raises the next estimate by at most
    ``LOAD_CHANGE ** LOAD_WEIGHT``, and the next forwards at the usual time bring it back."""
    cost = FittedForwardCost()
    for i in range(40):
        rows = 1 + i % 9
        cost.observe(rows, attention_scores(100, rows), 0.010 + 0.001 * rows)
    before = cost.seconds(5, attention_scores(100, 5))
    assert before is not None
    cost.observe(5, attention_scores(100, 5), 100 * before)
    after = cost.seconds(5, attention_scores(100, 5))
    assert after is not None
    assert before < after <= before * LOAD_CHANGE**LOAD_WEIGHT * 1.05
    for _ in range(10):
        cost.observe(5, attention_scores(100, 5), before)
    assert cost.seconds(5, attention_scores(100, 5)) == pytest.approx(before, rel=0.05)


def test_decoding_requests_are_priced_by_their_last_round() -> None:
    """A request that verified 9 rows last round makes a bigger decode forward, so a larger
    bound (4 x) and a larger chunk than one that verified 1."""

    def chunk(last_verified: int) -> int:
        scheduler = Scheduler(8, 4096, StepBudget(COST, ratio=4.0, min_seconds=0.0))
        decoding, _ = running(scheduler, 101, 8000)
        decoding.speculation.last_verified = last_verified
        return scheduler.plan([100, 1000]).prefill[0][1]

    assert chunk(9) > chunk(1)


def test_fitted_cost_recovers_a_linear_machine() -> None:
    """Timings of a machine costing exactly 5 ms + 0.8 ms/row + 0.4 us/score, over varied
    shapes, give back those costs; before ``MIN_OBSERVATIONS`` the model cannot tell."""
    cost = FittedForwardCost()
    rng = random.Random(0)
    for i in range(40):
        assert (cost.seconds(1, 1) is None) == (i < MIN_OBSERVATIONS)
        rows, depth = rng.choice([1, 4, 9, 64, 512]), rng.randrange(0, 8000)
        scores = attention_scores(depth, rows)
        cost.observe(rows, scores, 0.005 + 0.0008 * rows + 4e-7 * scores)
    for rows, depth in [(1, 0), (512, 0), (512, 7500), (30, 4000)]:
        scores = attention_scores(depth, rows)
        expected = 0.005 + 0.0008 * rows + 4e-7 * scores
        assert cost.seconds(rows, scores) == pytest.approx(expected, rel=0.05)


def test_fitted_cost_prices_at_most_twice_the_largest_forward_timed() -> None:
    """Timed forwards of up to 40 rows: 80 are priced, 81 are not, so a chunk beside decoding
    requests is at most 80 tokens until a larger forward has been timed."""
    cost = FittedForwardCost()
    for i in range(MIN_OBSERVATIONS):
        cost.observe(1 + i * 39 // (MIN_OBSERVATIONS - 1), 100, 0.01 + 0.001 * i)
    assert cost.seconds(80, 0) is not None and cost.seconds(81, 0) is None
    scheduler = Scheduler(8, 512, StepBudget(cost, ratio=1000.0, min_seconds=10.0))
    decoding, long_prompt = running(scheduler, 101, 8000)
    plan = scheduler.plan([100, 0])
    assert plan.decode == [decoding] and plan.prefill == [(long_prompt, 79)]  # 80 rows in all


def test_fitted_cost_without_deep_forwards_takes_the_prior_for_attention() -> None:
    """Only shallow decode forwards timed: a row's attention over ``PRIOR_DOUBLING_CONTEXT``
    keys is priced as that row's matmuls."""
    cost = FittedForwardCost()
    for i in range(30):
        rows = 1 + i % 9
        cost.observe(rows, attention_scores(50, rows), 0.010 + 0.001 * rows)
    shallow = cost.seconds(10, 0)
    deep = cost.seconds(10, 10 * PRIOR_DOUBLING_CONTEXT)
    assert shallow is not None and deep is not None
    per_row = (cost.seconds(11, 0) or 0.0) - shallow
    assert per_row == pytest.approx(0.001, rel=0.1)
    assert deep - shallow == pytest.approx(10 * per_row, rel=0.1)


def test_fitted_cost_ignores_impossible_timings() -> None:
    cost = FittedForwardCost()
    for _ in range(MIN_OBSERVATIONS):
        cost.observe(4, 10, float("nan"))
        cost.observe(0, 0, 0.01)
        cost.observe(4, 10, -1.0)
    assert cost.seconds(4, 10) is None


@pytest.mark.parametrize(
    ("ratio", "min_seconds", "min_chunk", "field"),
    [
        (0.5, 0.1, 32, "ratio"),
        (float("inf"), 0.1, 32, "ratio"),
        (4.0, -1.0, 32, "min_seconds"),
        (4.0, 0.1, 0, "min_chunk"),
    ],
)
def test_budget_rejects_bad_settings(
    ratio: float, min_seconds: float, min_chunk: int, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        StepBudget(COST, ratio, min_seconds, min_chunk)


@pytest.mark.parametrize("max_seconds", [0.1, float("nan")])
def test_budget_rejects_a_cap_below_its_floor(max_seconds: float) -> None:
    with pytest.raises(ValueError, match="max_seconds"):
        StepBudget(COST, 4.0, 0.15, max_seconds=max_seconds)


def test_engine_config_caps_the_step_within_its_floor_and_a_minute() -> None:
    assert EngineConfig().prefill_step_min_s <= EngineConfig().prefill_step_max_s
    for bad in (0.1, 61.0, float("nan"), "0.2"):
        with pytest.raises(ValueError, match="prefill_step_max_s"):
            EngineConfig(prefill_step_min_s=0.15, prefill_step_max_s=bad)  # type: ignore[arg-type]


def test_shared_step_never_prefills_more_than_a_step_alone() -> None:
    cheap = LinearCost(0.0, 1e-9, 0.0)
    scheduler = Scheduler(8, 64, StepBudget(cheap, ratio=4.0, min_seconds=1.0))
    _, first, _ = running(scheduler, 101, 8000, 8000)
    assert scheduler.plan([100, 0, 0]).prefill == [(first, 64)]


def test_engine_times_its_forwards_and_chunks_change_no_token(
    target: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's cost model learns from its own forwards; a long prompt prefilled in
    time-sized chunks beside a decoding request (here forced small) gives the same greedy text
    as with no time bound, and so does the request decoding beside it."""
    long_prompt = [(7 * i) % (VOCAB - 2) + 1 for i in range(150)]

    def outputs(engine: Engine) -> list[list[int]]:
        params = GenerationParams.create(max_new_tokens=12, proposer="ngram", ignore_eos=True)
        first = engine.add_request(PROMPTS[0], params)
        for _ in range(2):
            engine.step()  # the first request decodes before the long prompt arrives
        second = engine.add_request(long_prompt, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for output in engine.step():
                if output.result is not None:
                    done[output.request_id] = output.result.token_ids
        return [done[first], done[second]]

    untimed = make_engine(target, prefill_step_ratio=None)
    timed = make_engine(target)
    assert timed.forward_cost.seconds(1, 1) is None
    small = StepBudget(LinearCost(0.0, 1.0, 0.0), ratio=1.0, min_seconds=0.0, min_chunk=5)
    timed.scheduler.step_budget = small  # every shared step: the 5-token floor
    chunks: list[int] = []
    plan = timed.scheduler.plan
    monkeypatch.setattr(timed.scheduler, "plan", lambda cached: _recorded(plan(cached), chunks))
    assert outputs(timed) == outputs(untimed)
    assert 5 in chunks  # the long prompt did prefill in floor-sized chunks
    assert timed.forward_cost.seconds(1, 1) is not None  # it timed its forwards


def _recorded(plan: StepPlan, chunks: list[int]) -> StepPlan:
    chunks.extend(tokens for _, tokens in plan.prefill)
    return plan
