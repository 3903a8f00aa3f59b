"""Presenting a run: a text table for the terminal, a JSON document and a PNG chart.

The chart uses matplotlib's object API (``Figure``, Agg canvas): no pyplot global state, no
display needed.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from hybridspec.bench.hf_baseline import ParityResult
from hybridspec.bench.memory_bound import MemoryBound
from hybridspec.bench.names import BASELINE, HF_BASELINE, LLAMACPP_BASELINE
from hybridspec.bench.session import BenchOutcome
from hybridspec.bench.summary import GROUNDED, OPEN_ENDED, Agreement, Cell, Summary
from hybridspec.bench.targets import TargetResult
from hybridspec.bench.workload import Category

MAX_POSITIONS_SHOWN = 8
HEADERS = (
    "group",
    "method",
    "req",
    "tok/req",
    "tok/s",
    "vs none",
    "vs hf-plain",
    "vs llamacpp-plain",
    "accept",
    "acc.len",
    "outside",
    "ttft ms",
    "dec tok/s",
    "dec vs llamacpp-plain",
    "accept by position",
)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _positions(values: tuple[float, ...] | None) -> str:
    if not values:
        return "-"
    shown = " ".join(f"{v:.2f}" for v in values[:MAX_POSITIONS_SHOWN])
    return shown + (" ..." if len(values) > MAX_POSITIONS_SHOWN else "")


def cell_row(cell: Cell, group_label: str) -> list[str]:
    return [
        group_label,
        cell.method,
        str(cell.num_requests),
        f"{cell.mean_generated:.0f}",
        f"{cell.tokens_per_s:.1f}",
        _ratio(cell.speedup_vs_none),
        _ratio(cell.speedup_vs_hf_plain),
        _ratio(cell.speedup_vs_llamacpp_plain),
        _num(cell.acceptance_rate, ".2f"),
        _num(cell.mean_accepted_length, ".2f"),
        _num(cell.outside_forward_share, ".1%"),
        _num(cell.first_token_ms, ".0f"),
        _num(cell.decode_tokens_per_s, ".1f"),
        _ratio(cell.decode_vs_llamacpp_plain),
        _positions(cell.acceptance_per_position),
    ]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest entry; the first two left-aligned, the rest right."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        cells = [
            str(v).ljust(w) if i < 2 or i == len(widths) - 1 else str(v).rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "-" * len(line(headers))
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


CONCURRENT_NOTE = (
    "concurrent xN: every prompt, N requests in the engine at a time (closed loop); tok/s is\n"
    "their aggregate, 'vs none', 'vs hf-plain' and 'vs llamacpp-plain' its ratio to that\n"
    "method's tok/s one request at a time on the same prompts"
)


def format_summary(summary: Summary, categories: dict[str, Category]) -> str:
    """One table per temperature; rows grouped by category (marked [G] input-grounded, [O]
    open-ended), then the group aggregates and concurrent runs (with a note on reading them)."""
    grounded = {n: c.input_grounded for n, c in categories.items()}
    grounded |= {GROUNDED: True, OPEN_ENDED: False}
    parts = []
    for temperature in summary.temperatures:
        title = "greedy" if temperature == 0 else f"sampled, temperature {temperature:g}"
        rows = []
        for group in summary.group_names:
            mark = "" if group not in grounded else " [G]" if grounded[group] else " [O]"
            for i, method in enumerate(summary.methods):
                cell = summary.cell(method, temperature, group)
                if cell is not None:
                    rows.append(cell_row(cell, group + mark if i == 0 else ""))
        parts.append(f"== {title} ==\n{text_table(HEADERS, rows)}")
    if summary.concurrency_levels:
        parts.append(CONCURRENT_NOTE)
    return "\n\n".join(parts)


def format_targets(results: Sequence[TargetResult]) -> str:
    rows = []
    for r in results:
        value = "-" if r.value is None else f"{r.value:.3f}"
        rows.append([r.status.upper(), r.description, value])
    return "== targets ==\n" + text_table(("status", "target", "measured"), rows)


def format_parity(parity: ParityResult | None) -> str:
    if parity is None:
        return "parity: not checked (needs one engine method and one transformers method)"
    if parity.identical:
        return parity.message()
    bar = "!" * 100
    return f"{bar}\n{parity.message()}\n{bar}"


def format_agreement(agreement: dict[str, Agreement], reference: str | None) -> str:
    if not agreement:
        return ""
    parts = []
    for method, a in agreement.items():
        part = f"{method} {a.identical}/{a.compared}"
        if a.first_divergence:
            part += (
                f" (others diverge at token {statistics.median(a.first_divergence):.0f}, median)"
            )
        parts.append(part)
    return f"greedy outputs identical to {reference}'s (same prompt and repeat): " + "; ".join(
        parts
    )


def format_header(meta: dict[str, Any]) -> str:
    during = meta["load_average_during"] or {"min": float("nan"), "max": float("nan")}
    quantize = meta.get("quantize", "none")
    weights = "" if quantize == "none" else f" (quantize {quantize})"
    served = f"\nserved: every engine method through {meta['served']}" if meta.get("served") else ""
    return (
        f"hybridspec bench: {meta['target']} {meta['dtype']}{weights} on {meta['device']}, "
        f"K={meta['num_speculative_tokens']}, {meta['max_new_tokens']} new tokens, "
        f"{meta['num_prompts']} prompts, {meta['repeats']} repeat(s), {meta['wall_s']:.0f} s\n"
        f"load average (1 min) {meta['load_average_before'][0]:.2f} before, "
        f"{during['min']:.2f}..{during['max']:.2f} during, on {meta['cpu_count']} CPUs "
        f"({meta['torch_threads']} torch threads){served}"
    )


def format_outcome(outcome: BenchOutcome, categories: dict[str, Category]) -> str:
    """Everything the terminal shows after a run."""
    parts = [
        format_header(outcome.meta),
        format_parity(outcome.parity),
        format_agreement(outcome.agreement, outcome.reference),
        "",
        format_summary(outcome.summary, categories),
        "",
        format_targets(outcome.targets),
    ]
    bound = outcome.meta.get("memory_bound")
    if bound:
        parts += ["", MemoryBound.from_dict(bound).line()]
    return "\n".join(parts)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(value: object) -> object:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def plot_speedups(summary: Summary, path: Path) -> None:
    """Bars of speedup per group and method: vs our ``none`` (left), vs transformers' plain
    ``generate`` and vs llama.cpp's plain decoding (where run), one row per temperature; the
    dashed line marks 1x. The bars of a ``concurrent xN`` group are over the baseline run one
    request at a time."""
    peers = (BASELINE, HF_BASELINE, LLAMACPP_BASELINE)
    baselines = [b for b in peers if b in summary.methods] or [BASELINE]
    groups = summary.group_names
    temperatures = summary.temperatures
    figure = Figure(figsize=(max(8.0, 1.1 * len(groups)) * len(baselines), 4.0 * len(temperatures)))
    axes = figure.subplots(len(temperatures), len(baselines), squeeze=False)
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {m: palette[i % len(palette)] for i, m in enumerate(summary.methods)}
    for row, temperature in enumerate(temperatures):
        for col, baseline in enumerate(baselines):
            ax = axes[row][col]
            methods = [m for m in summary.methods if m != baseline]
            width = 0.8 / max(1, len(methods))
            for j, method in enumerate(methods):
                values = [summary.speedup(method, baseline, g, temperature) for g in groups]
                xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
                heights = [v if v is not None else 0.0 for v in values]
                ax.bar(xs, heights, width, label=method, color=colors[method])
            ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
            ax.set_xticks(range(len(groups)), groups, rotation=35, ha="right", fontsize=8)
            ax.set_ylabel(f"speedup vs {baseline}")
            title = "greedy" if temperature == 0 else f"T={temperature:g}"
            ax.set_title(f"{title}: tokens/s relative to {baseline}", fontsize=10)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
