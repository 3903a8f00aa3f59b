"""Presenting ``hybridspec bench serve``: Markdown tables per workload, ratios to each peer,
the issue's goals, a JSON document and a PNG of throughput and TTFT against concurrency.

The goals (issue 24), per workload and per pair of one of ours and one peer: output tok/s at
concurrency 1 at least 1.0x the peer's, at every concurrency >= 2 at least 2.0x; TTFT p95 no
worse than the peer's at every concurrency.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from hybridspec.bench.loadgen import ServingPoint
from hybridspec.bench.serve_conversations import ConversationServing

GOAL_AT_ONE = 1.0  # output tok/s ratio at concurrency 1
GOAL_ABOVE_ONE = 2.0  # at every concurrency >= 2
POINT_HEADERS = (
    "server",
    "concurrency",
    "output tok/s",
    "TTFT p50 ms",
    "TTFT p95 ms",
    "ITL p50 ms",
    "ITL p95 ms",
    "errors",
)


@dataclass(slots=True)
class ServingResults:
    """Every point of a run: ``points[workload][server]``, in the order they ran."""

    descriptions: dict[str, str] = field(default_factory=dict)  # workload -> what it is
    notes: dict[str, str] = field(default_factory=dict)  # server -> how it was driven
    ours: list[str] = field(default_factory=list)  # our servers' names; the rest are peers
    points: dict[str, dict[str, list[ServingPoint]]] = field(default_factory=dict)
    # workload -> our server -> the library's output tok/s for its requests (``library_rate``)
    library: dict[str, dict[str, float]] = field(default_factory=dict)
    # server -> its figures on the multi-turn and repeat workloads (``serve_conversations``)
    conversations: dict[str, ConversationServing] = field(default_factory=dict)

    def add(self, workload: str, server: str, points: Sequence[ServingPoint]) -> None:
        self.points.setdefault(workload, {})[server] = list(points)

    def peers(self, workload: str) -> list[str]:
        return [s for s in self.points.get(workload, {}) if s not in self.ours]

    def to_json(self) -> dict[str, Any]:
        return {
            "descriptions": self.descriptions,
            "notes": self.notes,
            "ours": self.ours,
            "points": {
                w: {s: [p.to_json() for p in pts] for s, pts in servers.items()}
                for w, servers in self.points.items()
            },
            "library": self.library,
            "conversations": {s: f.to_json() for s, f in self.conversations.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServingResults:
        results = cls(dict(data["descriptions"]), dict(data["notes"]), list(data["ours"]))
        for workload, servers in data["points"].items():
            for server, points in servers.items():
                results.add(workload, server, [ServingPoint.from_json(p) for p in points])
        results.library = {w: dict(rates) for w, rates in data.get("library", {}).items()}
        results.conversations = {
            s: ConversationServing.from_json(f) for s, f in data.get("conversations", {}).items()
        }
        return results


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def points_table(servers: dict[str, list[ServingPoint]]) -> str:
    rows = [
        [
            server,
            str(p.concurrency),
            f"{p.output_tokens_per_s:.1f}",
            f"{p.ttft_p50_ms:.0f}",
            f"{p.ttft_p95_ms:.0f}",
            f"{p.itl_p50_ms:.1f}",
            f"{p.itl_p95_ms:.1f}",
            f"{p.errored + p.incomplete}/{p.successful + p.errored + p.incomplete}",
        ]
        for server, points in servers.items()
        for p in points
    ]
    return _table(POINT_HEADERS, rows)


@dataclass(frozen=True, slots=True)
class Ratio:
    """One of ours against one peer at one concurrency."""

    concurrency: int
    throughput: float | None  # ours / peer output tok/s; None where the peer had none
    ttft_p95: float | None  # ours / peer TTFT p95 (lower is better)

    @property
    def throughput_goal(self) -> float:
        return GOAL_AT_ONE if self.concurrency == 1 else GOAL_ABOVE_ONE

    @property
    def met(self) -> bool:
        return (
            self.throughput is not None
            and self.throughput >= self.throughput_goal
            and self.ttft_p95 is not None
            and self.ttft_p95 <= 1.0
        )


def ratios(ours: Sequence[ServingPoint], peer: Sequence[ServingPoint]) -> list[Ratio]:
    """Ratios at the concurrencies both were measured at."""
    theirs = {p.concurrency: p for p in peer}
    found = []
    for mine in ours:
        other = theirs.get(mine.concurrency)
        if other is None:
            continue
        found.append(
            Ratio(
                mine.concurrency,
                _over(mine.output_tokens_per_s, other.output_tokens_per_s),
                _over(mine.ttft_p95_ms, other.ttft_p95_ms),
            )
        )
    return found


def _over(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def ratios_table(results: ServingResults, workload: str) -> str:
    """One row per (ours, peer): tok/s and TTFT p95 ratios per concurrency, goals met."""
    servers = results.points[workload]
    concurrencies = sorted({p.concurrency for points in servers.values() for p in points})
    headers = ["ours / peer"]
    headers += [f"c={c} tok/s, TTFT p95" for c in concurrencies]
    headers += ["goals met"]
    rows = []
    for mine in (s for s in results.ours if s in servers):
        for peer in results.peers(workload):
            by_c = {r.concurrency: r for r in ratios(servers[mine], servers[peer])}
            cells = [
                f"{_x(by_c[c].throughput)}, {_x(by_c[c].ttft_p95)}" if c in by_c else "-"
                for c in concurrencies
            ]
            met = sum(r.met for r in by_c.values())
            rows.append([f"{mine} / {peer}", *cells, f"{met} of {len(by_c)}"])
    return _table(headers, rows)


def library_table(results: ServingResults, workload: str) -> str:
    """Per server of ours with a library figure: the library's and the server's output tok/s
    at concurrency 1 on the same requests, and served / library."""
    rows = []
    for server, rate in results.library.get(workload, {}).items():
        one = [p for p in results.points[workload].get(server, []) if p.concurrency == 1]
        served = one[0].output_tokens_per_s if one else None
        cells = ["-", "-"] if served is None else [f"{served:.1f}", _x(_over(served, rate))]
        rows.append([server, f"{rate:.1f}", *cells])
    return _table(["server", "library tok/s", "served tok/s (c=1)", "served / library"], rows)


def conversational_table(results: dict[str, ConversationServing], peers: list[str]) -> str:
    """Markdown: each server's figures, and ours over each peer's."""
    headers = ["server", "history (tokens)", "TTFT p50 turns 2+", "cold", "cached / cold"]
    headers += [f"TTFT vs {p}" for p in peers]
    headers += ["repeat tok/s", "first-time tok/s"]
    headers += [f"repeat vs {p}" for p in peers]
    rows = []
    for name, figures in results.items():
        s = figures.summary()
        row = [
            name,
            f"{s['max_prompt_tokens']:.0f}",
            _seconds(s["ttft_p50_cached_s"]),
            _seconds(s["ttft_p50_cold_s"]),
            _ratio(s["ttft_p50_cached_s"], s["ttft_p50_cold_s"]),
        ]
        row += [
            _ratio(s["ttft_p50_cached_s"], results[p].summary()["ttft_p50_cached_s"]) for p in peers
        ]
        row += [_rate(s["repeat_tok_s"]), _rate(s["first_time_tok_s"])]
        row += [_ratio(s["repeat_tok_s"], results[p].summary()["repeat_tok_s"]) for p in peers]
        rows.append(row)
    return _table(headers, rows) + "\n"


def _seconds(value: float) -> str:
    return "-" if value != value else f"{value:.3f} s"


def _rate(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"


def _ratio(numerator: float, denominator: float) -> str:
    """``_x`` of the ratio; "-" where either side was not measured (NaN)."""
    if numerator != numerator or denominator != denominator:
        return "-"
    return _x(_over(numerator, denominator))


def format_results(results: ServingResults) -> str:
    """The Markdown of a run: per workload, its points and its ratios to each peer."""
    parts = []
    for workload, servers in results.points.items():
        parts.append(f"### {workload}: {results.descriptions.get(workload, '')}\n")
        parts.append(points_table(servers) + "\n")
        if results.peers(workload) and any(s in servers for s in results.ours):
            parts.append(
                f"Ratios to each peer (output tok/s, goal >= {GOAL_AT_ONE:g}x at c=1 and "
                f">= {GOAL_ABOVE_ONE:g}x above; TTFT p95, goal <= 1x):\n"
            )
            parts.append(ratios_table(results, workload) + "\n")
        if results.library.get(workload):
            parts.append("The library on the same requests, one at a time, in one process:\n")
            parts.append(library_table(results, workload) + "\n")
    if results.conversations:
        parts.append(
            "### multi-turn and repeat: time to first token of a conversation's turns 2+ (ours "
            "with the prefix cache, and cold with `cache_prompt: false`; peers with their prompt "
            "cache on), and the output tok/s of a prompt's second asking and of open-ended "
            "prompts asked once\n"
        )
        peers = [s for s in results.conversations if s not in results.ours]
        parts.append(conversational_table(results.conversations, peers) + "\n")
    if results.notes:
        parts.append("Servers: " + "; ".join(f"{s}: {n}" for s, n in results.notes.items()))
    return "\n".join(parts).rstrip() + "\n"


def write_json(path: Path, results: ServingResults) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results.to_json(), indent=2) + "\n", encoding="utf-8")


def plot_serving(results: ServingResults, path: Path) -> None:
    """Per workload (rows): output tok/s (left) and TTFT p95 (right) against concurrency,
    one line per server; log-2 concurrency axis."""
    workloads = list(results.points)
    figure = Figure(figsize=(11.0, 3.8 * max(1, len(workloads))))
    axes = figure.subplots(max(1, len(workloads)), 2, squeeze=False)
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(s for w in workloads for s in results.points[w]))
    colors = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    for row, workload in enumerate(workloads):
        throughput_ax, ttft_ax = axes[row]
        for server, points in results.points[workload].items():
            xs = [p.concurrency for p in points]
            style = {"color": colors[server], "marker": "o", "label": server}
            style["linestyle"] = "-" if server in results.ours else "--"
            throughput_ax.plot(xs, [p.output_tokens_per_s for p in points], **style)
            ttft_ax.plot(xs, [p.ttft_p95_ms for p in points], **style)
        concurrencies = sorted(
            {p.concurrency for ps in results.points[workload].values() for p in ps}
        )
        for ax, label in ((throughput_ax, "output tok/s"), (ttft_ax, "TTFT p95 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_title(f"{workload}: {label}", fontsize=10)
            ax.grid(True, alpha=0.3)
        ttft_ax.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
