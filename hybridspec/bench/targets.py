"""The performance targets the runtime must meet, checked against a run's summary.

Speed targets compare two methods' tokens/s on a group of prompts at one temperature (the
median over repeats of per-repeat ratios, see ``summary``); concurrency targets compare the
aggregate tokens/s of N requests served at once (a closed loop, see ``harness``) with one
``none`` request at a time on the same prompts; the overhead target bounds the share of wall
time spent outside the target forward, in the worst category, for our plain and n-gram
decoding. A target whose methods, group or temperature were not run is "not measured".
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridspec.bench.names import (
    BASELINE,
    HF_BASELINE,
    HF_PROMPT_LOOKUP,
    LLAMACPP_BASELINE,
    LLAMACPP_PROMPT_LOOKUP,
)
from hybridspec.bench.summary import ALL, GROUNDED, OPEN_ENDED, Summary

NGRAM = "ngram"
MAX_OUTSIDE_FORWARD_SHARE = 0.10
OVERHEAD_METHODS = (BASELINE, NGRAM)  # a draft model's forwards are outside by design


@dataclass(frozen=True, slots=True)
class SpeedTarget:
    """``method`` reaches ``minimum`` times the tokens/s of ``over`` on ``group``."""

    method: str
    over: str
    group: str
    temperature: float
    minimum: float

    @property
    def description(self) -> str:
        return (
            f"{self.method} >= {self.minimum:g}x {self.over} tokens/s "
            f"({self.group}, T={self.temperature:g})"
        )


SPEED_TARGETS = (
    SpeedTarget(BASELINE, HF_BASELINE, ALL, 0.0, 1.3),
    SpeedTarget(NGRAM, HF_PROMPT_LOOKUP, GROUNDED, 0.0, 1.3),
    SpeedTarget(NGRAM, BASELINE, GROUNDED, 0.0, 2.5),
    SpeedTarget(NGRAM, BASELINE, OPEN_ENDED, 0.0, 1.0),
    SpeedTarget(NGRAM, BASELINE, GROUNDED, 0.8, 1.5),
    # Against llama.cpp on the same GGUF and threads (issue 18): its forward is 4-bit.
    SpeedTarget(BASELINE, LLAMACPP_BASELINE, ALL, 0.0, 1.0),
    SpeedTarget(NGRAM, LLAMACPP_BASELINE, GROUNDED, 0.0, 2.5),
    SpeedTarget(NGRAM, LLAMACPP_PROMPT_LOOKUP, GROUNDED, 0.0, 1.5),
)


@dataclass(frozen=True, slots=True)
class ConcurrencyTarget:
    """``method`` serving N requests at once reaches ``minimum`` times the tokens/s of one
    ``none`` request at a time (``Summary.concurrent_speedup``).

    The issue sets N = 8; a run at another N (``--concurrency``) is checked at the N it ran,
    against the same minimum, and says so in its description.
    """

    method: str
    temperature: float
    minimum: float
    concurrency: int = 8

    def description(self, concurrency: int) -> str:
        return (
            f"{concurrency} concurrent {self.method} requests (mixed categories, "
            f"T={self.temperature:g}) >= {self.minimum:g}x one {BASELINE} request tokens/s"
        )


CONCURRENCY_TARGETS = (
    ConcurrencyTarget(NGRAM, 0.0, 4.0),
    ConcurrencyTarget(BASELINE, 0.0, 3.0),
)


@dataclass(frozen=True, slots=True)
class TargetResult:
    description: str
    status: str  # "pass", "fail" or "not measured"
    value: float | None  # the measured ratio or share
    threshold: float

    def to_dict(self) -> dict[str, object]:
        return {
            "description": self.description,
            "status": self.status,
            "value": self.value,
            "threshold": self.threshold,
        }


def _status(value: float | None, ok: bool) -> str:
    if value is None:
        return "not measured"
    return "pass" if ok else "fail"


def evaluate_targets(summary: Summary) -> list[TargetResult]:
    results = []
    for target in SPEED_TARGETS:
        value = None
        if target.group in summary.groups:
            value = summary.speedup(target.method, target.over, target.group, target.temperature)
        results.append(
            TargetResult(
                target.description,
                _status(value, value is not None and value >= target.minimum),
                value,
                target.minimum,
            )
        )
    results += [_concurrency_result(summary, target) for target in CONCURRENCY_TARGETS]
    for method in OVERHEAD_METHODS:
        for temperature in summary.temperatures:
            results.append(_overhead_result(summary, method, temperature))
    return results


def _concurrency_result(summary: Summary, target: ConcurrencyTarget) -> TargetResult:
    """At the target's N when it was run, else at the largest N run; not measured if none."""
    levels = summary.concurrency_levels
    n = target.concurrency if target.concurrency in levels or not levels else levels[-1]
    value = summary.concurrent_speedup(target.method, n, target.temperature)
    return TargetResult(
        target.description(n),
        _status(value, value is not None and value >= target.minimum),
        value,
        target.minimum,
    )


def _overhead_result(summary: Summary, method: str, temperature: float) -> TargetResult:
    """The worst category's outside-forward share of ``method`` at ``temperature``."""
    worst: tuple[float, str] | None = None
    for group, members in summary.groups.items():
        if len(members) != 1 or group not in members:  # categories only, not unions
            continue
        cell = summary.cell(method, temperature, group)
        share = None if cell is None else cell.outside_forward_share
        if share is not None and (worst is None or share > worst[0]):
            worst = (share, group)
    limit = MAX_OUTSIDE_FORWARD_SHARE
    description = f"{method}: time outside the target forward < {limit:.0%} (T={temperature:g}"
    description += f", worst category: {worst[1]})" if worst else ")"
    value = worst[0] if worst else None
    return TargetResult(
        description, _status(value, value is not None and value < limit), value, limit
    )
