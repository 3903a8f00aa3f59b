"""``hybridspec bench oracle``: the oracle table (``oracle_table``) on a target, and with
``--draft`` what a draft model gives by the same cost model.

Example, the seeds' pair of random files (``hybridspec bench make-gguf``)::

    hybridspec bench oracle --target llama-3b-Q4_K_M.gguf --draft llama-1b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridspec.bench.workload import DEFAULT_WORKLOAD, load_workload

if TYPE_CHECKING:
    from hybridspec.bench.oracle_table import OracleTable, Run


def add_oracle_command(bench_commands: Any) -> None:
    """Register ``oracle`` under ``hybridspec bench``."""
    oracle = bench_commands.add_parser(
        "oracle",
        help="speedup over none of oracle drafts at given acceptance rates, beside the ideal",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = oracle.add_argument
    add("--target", default=None, help="target model (default: embedded SmolLM2-135M-Instruct)")
    add("--draft", default=None, help="draft model: also run 'draft' and model it at each alpha")
    add("--alphas", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    add("-k", "--ks", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16], help="fixed Ks")
    add("--prompts", type=int, default=2, help="workload prompts (default 2)")
    add("--prompt-tokens", type=int, default=128, help="each prompt cut to its first N tokens")
    add("--max-new-tokens", type=int, default=64)
    add("--threads", type=int, default=None, help="the forward's CPU threads (default: all)")
    add("--seed", type=int, default=0, help="seed of the oracle's right and wrong drafts")
    add(
        "--repeats",
        type=int,
        default=1,
        help="sweeps of the table's runs, each run between two none runs, sweep r with the "
        "oracle's seed + r; medians (default 1)",
    )
    add(
        "--verify-token-cost",
        type=_cost,
        default=None,
        help="adaptive speculation's cost of one more verified row ('auto': timed at start-up; "
        "default: the engine's)",
    )
    add("--workload", type=Path, default=DEFAULT_WORKLOAD)
    add("--output-dir", type=Path, default=Path("bench-results"), help="where oracle.json goes")
    oracle.set_defaults(run=run_oracle)


def run_oracle(args: argparse.Namespace) -> int:
    from hybridspec.bench.oracle_table import OraclePlan, run_oracle_table
    from hybridspec.bench.workload import encode_prompt
    from hybridspec.config import DraftConfig, EngineConfig, ModelConfig
    from hybridspec.engine import Engine
    from hybridspec.model import load_model

    plan = OraclePlan(
        tuple(args.alphas),
        tuple(sorted(set(args.ks))),
        args.max_new_tokens,
        args.seed,
        args.draft is not None,
        args.repeats,
    )
    if args.repeats < 1:
        print(f"error: --repeats: expected at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    max_seq_len = args.prompt_tokens + args.max_new_tokens + max(plan.ks) + 1
    target = load_model(ModelConfig(args.target, max_seq_len=max_seq_len, max_num_seqs=1))
    workload = load_workload(args.workload)
    prompts = [
        encode_prompt(target.tokenizer, p)[: args.prompt_tokens]
        for p in workload.prompts[: args.prompts]
    ]
    draft = ModelConfig(args.draft, max_seq_len=max_seq_len, max_num_seqs=1) if args.draft else None
    cost = args.verify_token_cost
    priced = {} if cost is None else {"verify_token_cost": None if cost == "auto" else cost}
    config = EngineConfig(
        target=ModelConfig(args.target, max_seq_len=max_seq_len, max_num_seqs=1),
        draft=DraftConfig(draft),
        default_num_speculative_tokens=max(plan.ks),
        num_threads=args.threads,
        **priced,  # type: ignore[arg-type]
    )
    engine = Engine(config, target=target)
    try:
        if args.draft is not None:  # a draft that cannot run says why before the long run
            engine.resolve_proposer("draft")
        table = run_oracle_table(engine, prompts, plan, lambda line: print(line, file=sys.stderr))
    finally:
        engine.close()
    print(format_oracle_table(table, plan.ks, args.target or "embedded SmolLM2-135M"))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "oracle.json"
    path.write_text(json.dumps(table.to_json(), indent=1))
    print(f"\nwrote {path}")
    identical = all(r.identical for runs in table.runs.values() for r in runs)
    return 0 if identical and (table.draft_run is None or table.draft_run.identical) else 1


def _cost(text: str) -> float | str:
    """A cost, or 'auto' (``EngineConfig.verify_token_cost`` None: timed at start-up)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def _priced(table: OracleTable) -> str:
    """This run's measured cost of one more verified row (the slope over the sweep's rows),
    beside adaptive speculation's constant one, which prices rows only where no forward of so
    few rows is timed yet (``engine.speculation``, "Measured costs")."""
    slope = table.row_cost
    policy = "off" if table.policy_cost is None else f"{table.policy_cost:.3f}"
    return (
        f"cost of one more verified row: measured {slope:.3f} (adaptive speculation prices "
        f"rows by the timed forwards; its constant, before any: {policy})"
    )


def _row(alpha: float, label: str, run: Run, ideal: float) -> str:
    return (
        f"{alpha:>5.2f}  {label:<12} {run.tokens_per_s:>7.2f} {run.speedup:>7.2f}x {ideal:>6.2f}x "
        f"{run.speedup / ideal:>6.2f} {run.tokens_per_round:>9.2f} {run.drafts_per_round:>6.2f} "
        f"{run.acceptance:>7.2f}  {'yes' if run.identical else 'NO'}"
    )


def _none_line(table: OracleTable, target: str) -> str:
    """The none runs' median and spread: the drift the neighbouring ratios take out."""
    runs = table.none_runs
    low, high = min(runs), max(runs)
    spread = (high - low) / table.none_tokens_per_s if table.none_tokens_per_s > 0 else 0.0
    return (
        f"oracle drafts on {target}: none decodes {table.none_tokens_per_s:.2f} tok/s (median "
        f"of {len(runs)} runs, {low:.2f} .. {high:.2f}: spread {spread:.0%}); each speedup is "
        f"a run's rate over the mean of the none runs just before and after it, the median of "
        f"{table.repeats} sweep{'s' if table.repeats != 1 else ''}"
    )


def format_oracle_table(table: OracleTable, ks: tuple[int, ...], target: str) -> str:
    """The table: per alpha, adaptive K and the best fixed K, each with its ideal and ratio; the
    sweep; then the draft model's figures."""
    from hybridspec.bench.oracle_table import best_ideal, ideal_speedup

    cost = table.verify_cost
    lines = [
        _none_line(table, target),
        f"verify cost t(n)/t(1), the median of {len(table.verify_costs)} timings (one before "
        "each adaptive run): " + ", ".join(f"n={n} {c:.2f}" for n, c in cost.items()),
        _priced(table),
        "alpha  K              tok/s  speedup  ideal  ratio tok/round drafts  accept  same text",
    ]
    for alpha, runs in table.runs.items():
        adaptive, fixed = runs[0], runs[1:]
        best = max(fixed, key=lambda r: r.speedup)
        assert best.k is not None
        top_k, top = best_ideal(alpha, ks, cost)
        lines.append(_row(alpha, "adaptive", adaptive, top))
        lines.append(_row(alpha, f"best K={best.k}", best, ideal_speedup(alpha, best.k, cost)))
        share = adaptive.speedup / best.speedup if best.speedup > 0 else 0.0
        sweep = ", ".join(f"K={r.k} {r.speedup:.2f}x" for r in fixed)
        lines.append(
            f"       adaptive / best fixed K: {share:.2f} (the ideal's best K={top_k}); "
            f"sweep: {sweep}"
        )
    if table.compute is not None:
        at_peak = table.compute.verify_cost(cost)
        lines.append(table.compute.line({a: best_ideal(a, ks, at_peak) for a in table.runs}))
    if table.draft_cost_per_token is not None and table.draft_run is not None:
        c, run = table.draft_cost_per_token, table.draft_run
        lines.append(
            f"draft: {c:.3f} of a target forward per drafted token; measured (adaptive): "
            f"{run.tokens_per_s:.2f} tok/s, {run.speedup:.2f}x none, acceptance "
            f"{run.acceptance:.2f}, same text {'yes' if run.identical else 'NO'}"
        )
        for alpha in table.runs:
            k, speedup = best_ideal(alpha, ks, cost, c)
            lines.append(f"draft by the cost model at alpha {alpha:.2f}: {speedup:.2f}x (K={k})")
    return "\n".join(lines)
