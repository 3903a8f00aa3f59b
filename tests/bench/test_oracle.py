"""Oracle drafts (``bench.oracle``) and the oracle table (``bench.oracle_table``): the drafts are
the reference continuation, right with probability alpha by position whatever K asks, wrong ones
always rejected; the engine's greedy text with them equals plain decoding's; the ideal's
arithmetic; a whole table on a tiny model."""

from __future__ import annotations

import statistics

import pytest

from hybridspec.bench.oracle import OracleProposer, OracleReferences, oracle_factory
from hybridspec.bench.oracle_cli import format_oracle_table
from hybridspec.bench.oracle_table import (
    OraclePlan,
    best_ideal,
    expected_tokens,
    ideal_speedup,
    run_oracle_table,
)
from hybridspec.errors import HybridSpecError, InvalidRequestError
from hybridspec.proposers import ProposerContext, default_registry
from hybridspec.types import ProposeRequest, SamplingParams
from tests.engine.tiny import PROMPTS, make_engine, tiny_loaded

PROMPT = (5, 6, 7)
CONTINUATION = tuple(range(10, 210))


def _oracle(alpha: float, seed: int = 0) -> OracleProposer:
    references = OracleReferences()
    references.add(PROMPT, CONTINUATION)
    proposer = OracleProposer(
        ProposerContext(vocab_size=300, eos_token_ids=(0,)), references, alpha, seed
    )
    proposer.start(0, PROMPT)
    return proposer


def _drafts(proposer: OracleProposer, generated: int, k: int) -> tuple[int, ...]:
    context = PROMPT + CONTINUATION[:generated]
    request = ProposeRequest(0, context, k, SamplingParams(temperature=0.0))
    return proposer.propose([request])[0].token_ids


def test_alpha_one_drafts_the_continuation_and_zero_none_of_it() -> None:
    assert _drafts(_oracle(1.0), 4, 5) == CONTINUATION[4:9]
    wrong = _drafts(_oracle(0.0), 4, 5)
    assert all(w == c + 1 for w, c in zip(wrong, CONTINUATION[4:9], strict=True))


def test_right_drafts_by_position_whatever_k() -> None:
    proposer = _oracle(0.7, seed=3)
    long = _drafts(proposer, 0, 16)
    assert _drafts(proposer, 0, 4) == long[:4]
    assert _drafts(proposer, 4, 4) == long[4:8]
    right = [d == c for d, c in zip(_drafts(proposer, 0, 200), CONTINUATION, strict=True)]
    assert len(right) == 200 and sum(right) == 140  # alpha's share exactly, not by luck
    other = [d == c for d, c in zip(_drafts(_oracle(0.7, 4), 0, 200), CONTINUATION, strict=True)]
    assert sum(other) == 140 and other != right  # another seed: other positions


def test_no_drafts_past_the_continuation() -> None:
    assert _drafts(_oracle(1.0), 198, 8) == CONTINUATION[198:]


def test_unknown_prompt_and_bad_alpha_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="none"):
        _oracle(0.5).start(1, (1, 2))
    with pytest.raises(InvalidRequestError, match="alpha"):
        OracleProposer(ProposerContext(vocab_size=300, eos_token_ids=(0,)), OracleReferences(), 1.5)


def test_not_a_served_proposer() -> None:
    assert not any(name.startswith("oracle") for name in default_registry().names())


def test_ideal_arithmetic() -> None:
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    cost = {1: 1.0, 2: 1.0, 3: 1.25, 4: 2.0}
    assert ideal_speedup(0.5, 2, cost) == pytest.approx(1.4)
    assert ideal_speedup(0.5, 1, cost, draft_cost=0.5) == pytest.approx(1.0)
    assert best_ideal(0.5, (1, 2, 3), cost) == (1, pytest.approx(1.5))


def test_greedy_text_with_oracle_drafts_is_plain_decodings() -> None:
    engine = make_engine(tiny_loaded(0))
    references = OracleReferences()
    for prompt in PROMPTS:
        plain = engine.generate(prompt_token_ids=prompt, proposer="none", max_new_tokens=24)
        references.add(prompt, plain.token_ids)
    engine.register_proposer("oracle-a70", oracle_factory(references, 0.7))
    for prompt in PROMPTS:
        result = engine.generate(
            prompt_token_ids=prompt,
            proposer="oracle-a70",
            max_new_tokens=24,
            num_speculative_tokens=4,
        )
        assert tuple(result.token_ids) == references.get(prompt)
        assert 0 < result.stats.draft_tokens_accepted < result.stats.draft_tokens_proposed


def test_table_on_a_tiny_model() -> None:
    engine = make_engine(tiny_loaded(0), max_num_seqs=1)
    plan = OraclePlan(alphas=(0.5, 0.9), ks=(1, 2, 4), max_new_tokens=16)
    table = run_oracle_table(engine, PROMPTS[:2], plan)
    assert set(table.verify_cost) == {1, 2, 3, 4, 5} and table.verify_cost[1] == 1.0
    assert table.none_tokens_per_s > 0
    for runs in table.runs.values():
        assert [r.k for r in runs] == [None, 1, 2, 4] and all(r.identical for r in runs)
    high = table.runs[0.9][3]  # K=4 at alpha 0.9 commits more per round than K=1 at 0.5
    assert high.tokens_per_round > table.runs[0.5][1].tokens_per_round
    # K=4: fewer at the budget's end, and each prompt's prefill forward drafts none
    assert 2.0 < high.drafts_per_round <= 4.0
    # one sweep: every cell's run sits between two none runs, its speedup over their mean
    cells = [run for runs in table.runs.values() for run in runs]
    assert len(table.none_runs) == len(cells) + 1 and table.repeats == 1
    for i, run in enumerate(cells):
        around = (table.none_runs[i] + table.none_runs[i + 1]) / 2
        assert run.speedup == pytest.approx(run.tokens_per_s / around)
    text = format_oracle_table(table, plan.ks, "tiny")
    assert "best K=" in text and "adaptive / best fixed K" in text and "spread" in text
    assert "cost of one more verified row: measured" in text and "before any: 0.030" in text
    assert engine.forward_cost.rows.seconds(5) is not None  # the table's timings price rows
    # the int8 peak beside a row's measured cost, t(1) from the same timings
    assert table.compute is not None and table.compute.peak_macs_per_s > 0
    assert len(table.decode_seconds) == len(table.verify_costs)
    assert table.compute.row_seconds == pytest.approx(
        table.row_cost * statistics.median(table.decode_seconds)
    )
    assert "compute bound (measured)" in text and "the ideal would be alpha 0.50" in text
    # timed at the start and before each adaptive cell; the table's cost is the median
    assert len(table.verify_costs) == 1 + len(plan.alphas) and "median of 3 timings" in text
    for n, cost in table.verify_cost.items():
        assert cost == pytest.approx(sorted(c[n] for c in table.verify_costs)[1])


def test_adaptive_cells_are_priced_by_fresh_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row prices learned before an adaptive cell (here absurd ones) are replaced by timings
    taken just before it, and the realised extra learned against them is dropped: the cell is
    priced at the machine's present speed."""
    engine = make_engine(tiny_loaded(0), max_num_seqs=1)
    generate, priced = engine.generate, []

    def generate_seeing_prices(*args: object, **kwargs: object) -> object:
        rows, realized = engine.forward_cost.rows, engine.forward_cost.realized
        priced.append((engine.speculation is not None, rows.seconds(3), realized.extra_per_draft()))
        for _ in range(20):  # a stale price: 3 rows a thousand seconds
            rows.observe(3, 1000.0)
        realized.clear()  # and a stale realised extra: drafting rounds dearer than priced
        for _ in range(3):
            realized.observe(1, 0, 0.01, None)
        for _ in range(10):
            realized.observe(1, 2, 0.014, 0.001)
        assert realized.extra_per_draft() > 0
        return generate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "generate", generate_seeing_prices)
    table = run_oracle_table(engine, PROMPTS[:1], OraclePlan((0.7,), (1, 2), 8, repeats=2))
    assert len(table.verify_costs) == 3 and all(r.identical for r in table.runs[0.7])
    adaptive = [(seconds, extra) for adaptive, seconds, extra in priced if adaptive][1:]
    assert adaptive and all(s is not None and s < 1.0 and extra == 0 for s, extra in adaptive)


def test_repeated_sweeps_take_medians() -> None:
    engine = make_engine(tiny_loaded(0), max_num_seqs=1)
    plan = OraclePlan(alphas=(0.7,), ks=(1, 2), max_new_tokens=12, repeats=3)
    table = run_oracle_table(engine, PROMPTS[:1], plan)
    assert len(table.none_runs) == 1 + 3 * 3 and table.repeats == 3
    nones = sorted(table.none_runs)  # 10 runs: the median is the mean of the middle two
    assert table.none_tokens_per_s == pytest.approx((nones[4] + nones[5]) / 2)
    assert all(r.identical and r.speedup > 0 for r in table.runs[0.7])
    oracle = engine.resolve_proposer("oracle-a70")  # the last sweep drew with seed 0 + 2
    assert isinstance(oracle, OracleProposer) and oracle._seed == 2
    with pytest.raises(ValueError, match="repeats"):
        run_oracle_table(engine, PROMPTS[:1], OraclePlan(repeats=0))


def test_prompts_the_target_ends_at_once_are_refused_by_name() -> None:
    engine = make_engine(tiny_loaded(0), max_num_seqs=1)
    plan = OraclePlan(alphas=(0.5,), ks=(1,), max_new_tokens=1)  # one token: nothing to draft
    with pytest.raises(HybridSpecError, match="no continuation to draft"):
        run_oracle_table(engine, PROMPTS[:1], plan)
