"""What the runtime turns a given acceptance into: oracle drafts (``oracle``) at several alpha,
with adaptive K and every fixed K of a sweep, beside the ideal (``hybridspec bench oracle``).

One run, one engine over the target, greedy requests only:

1. ``none`` on each prompt: the reference continuation (the oracle's drafts) and the decode rate.
2. The forward's cost of verifying ``n`` rows, ``t(n) / t(1)``, timed in the same process
   (``model.median_forward_seconds``, one sequence, a short cached context, logits of every
   row as verifying them computes), at the start and
   again just before every adaptive cell; the table's cost is each ``n``'s median over these
   timings. Before each adaptive cell the engine's measured row costs (``engine.row_costs``)
   are set to that cell's fresh timings, as an engine that has served for a while has timed
   forwards of every row count at the machine's present speed: what adaptive K is measured on
   is its choice at the prices of the moment, not prices of row counts last timed minutes
   earlier at another speed (its own forwards keep teaching it during the run).
3. The cells: per alpha, oracle drafts with adaptive K (up to the largest K of the sweep), then
   with each fixed K (adaptive speculation off); with a draft model, ``draft`` with adaptive K.
   Every cell's run is followed by a ``none`` run, so that each cell sits between two ``none``
   runs, and its speedup is its rate over their mean: on a shared machine the rate drifts with
   the load over a table's minutes, and a ratio to the neighbouring ``none`` runs cancels the
   drift that one ``none`` rate for the whole table would count as speedup. ``repeats`` sweeps
   the cells that many times (every other sweep in reverse order, so that no cell always runs
   first), sweep ``r`` with the oracle's seed ``seed + r``: every K of a sweep meets the same
   luck, and the sweeps meet different luck, so that the best fixed K is not picked in
   hindsight of one draw of right and wrong drafts (with one short prompt, a fixed K that
   happens to suit its draw beats any K chosen as the draws come). A cell's speedup and rate
   are the medians over its sweeps. Every run's text must equal the first ``none``'s, token
   for token.
4. With a draft model: its cost per token relative to the target's forward
   (``Proposer.cost_per_token``, what adaptive speculation charges it).
5. The compute bound (``compute_bound``): the int8 multiply-accumulate peak measured at the
   end of the run on the engine's threads, beside the rate one more verified row's measured
   cost implies, and the ideal if a row cost only its multiplies at that peak.

Rates are decode rates: tokens after the first over the time after the first (the prompt's
prefill is not what speculation speeds up). The ideal at K drafts per round is the expected
tokens of a round, ``E(K) = (1 - alpha ** (K + 1)) / (1 - alpha)``, over the round's measured
cost in plain decodes, ``t(K + 1) / t(1)`` (plus ``K c`` for a draft model of relative cost
``c``); the adaptive row is set against the best ideal of the sweep.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hybridspec.bench import compute_bound
from hybridspec.bench.compute_bound import ComputeBound
from hybridspec.bench.oracle import OracleReferences, oracle_factory
from hybridspec.engine import Engine, GenerationParams, GenerationResult
from hybridspec.errors import HybridSpecError
from hybridspec.model import median_forward_seconds
from hybridspec.types import SamplingParams

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True, slots=True)
class Run:
    """One method over every prompt: decode rate and what speculation did."""

    method: str
    k: int | None  # fixed K; None: adaptive (up to the sweep's largest)
    tokens_per_s: float
    tokens_per_round: float  # generated tokens per verification forward
    acceptance: float  # accepted drafts over proposed ones
    identical: bool  # every prompt's text equals none's
    drafts_per_round: float = 0.0  # drafts asked for per verification forward
    speedup: float = 0.0  # the rate over its neighbouring none runs' (median over sweeps)


@dataclass(slots=True)
class OracleTable:
    """A run's figures (``format_oracle_table`` prints them)."""

    none_tokens_per_s: float  # the median of every none run's rate
    verify_cost: dict[int, float]  # rows n -> t(n) / t(1), the median over ``verify_costs``
    verify_costs: list[dict[int, float]] = field(default_factory=list)  # each timing, in order
    none_runs: list[float] = field(default_factory=list)  # each none run's rate, in order
    repeats: int = 1  # sweeps of the cells
    runs: dict[float, list[Run]] = field(default_factory=dict)  # alpha -> adaptive, fixed Ks
    draft_cost_per_token: float | None = None  # the draft's forward over the target's
    draft_run: Run | None = None
    policy_cost: float | None = None  # adaptive speculation's verify cost per row (c)
    decode_seconds: list[float] = field(default_factory=list)  # each timing's t(1), seconds
    compute: ComputeBound | None = None  # the int8 peak beside a row's cost (compute_bound)

    @property
    def row_cost(self) -> float:
        """One more verified row's cost in one-row forwards: the slope of ``verify_cost`` from
        one row to the most timed."""
        rows = max(self.verify_cost)
        return (self.verify_cost[rows] - 1.0) / (rows - 1) if rows > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "none_tokens_per_s": self.none_tokens_per_s,
            "verify_cost": self.verify_cost,
            "verify_costs": self.verify_costs,
            "none_runs": self.none_runs,
            "repeats": self.repeats,
            "runs": {str(a): [asdict(r) for r in runs] for a, runs in self.runs.items()},
            "draft_cost_per_token": self.draft_cost_per_token,
            "draft_run": None if self.draft_run is None else asdict(self.draft_run),
            "policy_cost": self.policy_cost,
            "decode_seconds": self.decode_seconds,
            "compute": None if self.compute is None else self.compute.to_dict(),
        }


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of ``k`` drafts commits on average, each draft kept with ``alpha`` given
    its predecessors: ``1 + alpha + ... + alpha ** k``."""
    return float(sum(alpha**j for j in range(k + 1)))


def ideal_speedup(
    alpha: float, k: int, verify_cost: dict[int, float], draft_cost: float = 0.0
) -> float:
    """``E(k)`` over the round's cost in plain decodes (module docstring)."""
    return expected_tokens(alpha, k) / (verify_cost[k + 1] + k * draft_cost)


def best_ideal(
    alpha: float, ks: Sequence[int], verify_cost: dict[int, float], draft_cost: float = 0.0
) -> tuple[int, float]:
    """The K of ``ks`` with the highest ideal speedup, and that speedup."""
    return max(
        ((k, ideal_speedup(alpha, k, verify_cost, draft_cost)) for k in ks), key=lambda x: x[1]
    )


def _decode_rate(results: Sequence[GenerationResult]) -> float:
    """Tokens after each request's first over the seconds after it, summed over requests."""
    tokens = sum(max(0, r.stats.generated_tokens - 1) for r in results)
    seconds = sum(r.stats.elapsed_s - (r.stats.time_to_first_token_s or 0.0) for r in results)
    return tokens / seconds if seconds > 0 else 0.0


def _run(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    proposer: str,
    k: int,
    max_new_tokens: int,
    references: OracleReferences | None,
    fixed: bool,
) -> tuple[Run, list[GenerationResult]]:
    """``proposer`` over every prompt with K = ``k`` (adaptive unless ``fixed``)."""
    policy = engine.speculation
    if fixed:  # the bench's own engine: adaptive speculation off for this run only
        engine.speculation = None
    try:
        results = [
            engine.generate(
                prompt_token_ids=p,
                params=GenerationParams(
                    max_new_tokens=max_new_tokens,
                    sampling=GREEDY,
                    proposer=proposer,
                    num_speculative_tokens=max(1, k),
                ),
            )
            for p in prompts
        ]
    finally:
        engine.speculation = policy
        engine.reset()
    identical = references is None or all(
        tuple(r.token_ids) == references.get(p) for p, r in zip(prompts, results, strict=True)
    )
    proposed = sum(r.stats.draft_tokens_proposed for r in results)
    accepted = sum(r.stats.draft_tokens_accepted for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    generated = sum(r.stats.generated_tokens for r in results)
    run = Run(
        proposer,
        k if fixed else None,
        _decode_rate(results),
        generated / forwards if forwards else 0.0,
        accepted / proposed if proposed else 0.0,
        identical,
        proposed / forwards if forwards else 0.0,
    )
    if not identical:
        logger.error("%s (K=%s): greedy text differs from none's", proposer, run.k or "adaptive")
    return run, results


@dataclass(frozen=True, slots=True)
class OraclePlan:
    alphas: tuple[float, ...] = (0.5, 0.7, 0.9)
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    max_new_tokens: int = 64
    seed: int = 0
    with_draft: bool = False
    repeats: int = 1  # sweeps of the cells (module docstring, 3.)


@dataclass(frozen=True, slots=True)
class _Cell:
    alpha: float | None  # None: the draft model's cell
    proposer: str
    k: int
    fixed: bool


def _cells(plan: OraclePlan) -> list[_Cell]:
    """Per alpha adaptive K then each fixed K; then the draft model's adaptive K."""
    top = max(plan.ks)
    cells = []
    for alpha in plan.alphas:
        name = _oracle_name(alpha)
        cells.append(_Cell(alpha, name, top, False))
        cells += [_Cell(alpha, name, k, True) for k in plan.ks]
    if plan.with_draft:
        cells.append(_Cell(None, "draft", top, False))
    return cells


def _oracle_name(alpha: float) -> str:
    return f"oracle-a{round(alpha * 100):02d}"


def _median_run(runs: Sequence[Run], speedups: Sequence[float]) -> Run:
    """One cell's sweeps as one run: median rate and speedup, mean round figures."""
    first = runs[0]
    return Run(
        first.method,
        first.k,
        statistics.median(r.tokens_per_s for r in runs),
        statistics.fmean(r.tokens_per_round for r in runs),
        statistics.fmean(r.acceptance for r in runs),
        all(r.identical for r in runs),
        statistics.fmean(r.drafts_per_round for r in runs),
        statistics.median(speedups),
    )


def run_oracle_table(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    plan: OraclePlan,
    progress: Callable[[str], None] | None = None,
) -> OracleTable:
    """Every run of the module docstring on ``engine`` (its own: it is reset between runs and
    oracle proposers are registered on it); ``progress`` hears of each run as it ends."""
    if plan.repeats < 1:
        raise ValueError(f"repeats: expected at least 1, got {plan.repeats}")
    engine.generate(prompt_token_ids=prompts[0], max_new_tokens=4, proposer="none")  # warm-up
    engine.reset()
    references = OracleReferences()

    def measure(name: str, k: int, fixed: bool) -> Run:
        known = references if references.continuations else None
        run, results = _run(engine, prompts, name, k, plan.max_new_tokens, known, fixed)
        if not references.continuations:
            for prompt, result in zip(prompts, results, strict=True):
                references.add(prompt, result.token_ids)
        if progress is not None:
            progress(
                f"{name} K={k if fixed else 'adaptive'}: {run.tokens_per_s:.2f} tok/s, "
                f"{run.tokens_per_round:.2f} tokens per round"
            )
        if name == "none" and not run.identical:
            raise HybridSpecError("none's greedy text changed between its runs")
        return run

    first = measure("none", 0, True)
    if max(len(t) for t in references.continuations.values()) < 2 or first.tokens_per_s <= 0:
        raise HybridSpecError(
            "the target ends every prompt within one token: no continuation to draft "
            "(longer or other prompts: --prompt-tokens, --prompts)"
        )
    max_rows = max(plan.ks) + 1
    table = OracleTable(0.0, {}, [], [first.tokens_per_s])
    _time_rows(engine, max_rows, table)
    table.repeats = plan.repeats
    if engine.speculation is not None:
        table.policy_cost = engine.speculation.verify_token_cost
    if plan.with_draft:
        table.draft_cost_per_token = engine.resolve_proposer("draft").cost_per_token
    cells = _cells(plan)
    sweeps: list[list[tuple[Run, float]]] = [[] for _ in cells]
    for repeat in range(plan.repeats):
        _register_oracles(engine, references, plan.alphas, plan.seed + repeat)
        order = range(len(cells)) if repeat % 2 == 0 else reversed(range(len(cells)))
        for i in order:
            cell = cells[i]
            if not cell.fixed:  # adaptive K priced at the machine's present speed (2.)
                _time_rows(engine, max_rows, table)
            run = measure(cell.proposer, cell.k, cell.fixed)
            table.none_runs.append(measure("none", 0, True).tokens_per_s)
            around = (table.none_runs[-2] + table.none_runs[-1]) / 2
            sweeps[i].append((run, run.tokens_per_s / around if around > 0 else 0.0))
    _assemble(table, cells, sweeps)
    decode = statistics.median(table.decode_seconds)
    table.compute = compute_bound.measure(engine.target.weights, decode, table.row_cost * decode)
    return table


def _assemble(
    table: OracleTable, cells: Sequence[_Cell], sweeps: Sequence[Sequence[tuple[Run, float]]]
) -> None:
    """Each cell's sweeps, (run, speedup) pairs, as one run of ``table``; the none median."""
    for cell, runs in zip(cells, sweeps, strict=True):
        run = _median_run([r for r, _ in runs], [s for _, s in runs])
        if cell.alpha is None:
            table.draft_run = run
        else:
            table.runs.setdefault(cell.alpha, []).append(run)
    table.none_tokens_per_s = statistics.median(table.none_runs)
    table.verify_cost = {
        n: statistics.median(costs[n] for costs in table.verify_costs)
        for n in table.verify_costs[0]
    }


def _register_oracles(
    engine: Engine, references: OracleReferences, alphas: Sequence[float], seed: int
) -> None:
    """Oracle drafts at each alpha on ``engine``, all drawing right and wrong by ``seed``
    (one sweep's luck, the same for every K of it: module docstring, 3.)."""
    for alpha in alphas:
        factory = oracle_factory(references, alpha, seed)
        engine.register_proposer(_oracle_name(alpha), factory, replace=True)


def _time_rows(engine: Engine, max_rows: int, table: OracleTable) -> None:
    """``t(n) / t(1)`` for ``n = 1 .. max_rows``, timed on the engine's runtime, to
    ``table.verify_costs`` (``t(1)`` to ``decode_seconds``); the engine's row costs become these
    seconds (module docstring, 2.), and its realised check of them (``engine.realized_rows``)
    starts over."""
    rows = range(1, max_rows + 1)
    timings = median_forward_seconds(engine.runtime, tuple(rows), every_row=True)
    if timings is None or timings[0] <= 0:
        raise HybridSpecError("no free cache slot to time the forward's cost per row")
    engine.forward_cost.rows.clear()
    # what the realised check learned was measured against the old prices: it starts again
    engine.forward_cost.realized.clear()
    for n, seconds in zip(rows, timings, strict=True):  # what a long-running engine knows now
        engine.forward_cost.rows.observe(n, seconds)
    table.decode_seconds.append(timings[0])
    table.verify_costs.append({n: t / timings[0] for n, t in zip(rows, timings, strict=True)})
