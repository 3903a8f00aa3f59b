"""``hybridspec bench --vs-none``: every proposer's tokens/s over ``none``'s, open-ended and
input-grounded prompts apart, at each temperature, one request at a time and N at once.

The bar is that speculation never costs: each ratio at least ``FLOOR``. One request at a time,
a ratio is the method's rate over that of the ``none`` runs beside its own where the schedule
pairs them (both summed over the group's prompts in a repeat, median over repeats), else
``Summary.speedup`` over ``none`` in the group (the same over interleaved runs). N at once,
the concurrent trials run once per group (``BenchConfig.concurrent_groups``) and a ratio is the
method's aggregate rate over ``none``'s at the same N, on the same prompts, in the same repeat
(median over repeats): over the rate of the ``none`` loop run in lockstep beside it where the
schedule pairs them, else over the mean of the ``none`` trials just before and after it
(``harness``, "Pairs").

Example row: ``eagle  open-ended  T=0.8  x8  0.985  ok``: eight eagle requests at a time
generated 0.985 times the tokens per second of eight ``none`` requests on the open-ended
prompts.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hybridspec.bench.names import BASELINE
from hybridspec.bench.records import Record
from hybridspec.bench.summary import GROUNDED, OPEN_ENDED, Summary, rates_by_repeat
from hybridspec.bench.workload import Category

FLOOR = 0.97  # the least ratio to none that counts as "never costs"


@dataclass(frozen=True, slots=True)
class Ratio:
    """One method's rate over ``none``'s in one group, temperature and concurrency."""

    method: str
    group: str
    temperature: float
    concurrency: int
    ratio: float | None  # None: not measured

    def line(self) -> str:
        figure = "-" if self.ratio is None else f"{self.ratio:.3f}"
        verdict = "-" if self.ratio is None else ("ok" if self.ratio >= FLOOR else "BELOW")
        return (
            f"{self.method:<10} {self.group:<15} T={self.temperature:<4g} "
            f"x{self.concurrency:<3} {figure:>6}  {verdict}"
        )


def concurrent_ratio(
    records: Sequence[Record], method: str, temperature: float, concurrency: int, group: frozenset
) -> float | None:
    """``method``'s aggregate rate over ``none``'s, both ``concurrency`` at once on the prompts
    of ``group`` (categories), median over repeats: each of the method's trials over the rate
    of the ``none`` loop that ran beside it, or where none did, over the mean rate of the
    nearest ``none`` trials before and after it in the same repeat (``records`` in the order
    they ran)."""
    categories = {p: r.category for r in records if r.category is not None for p in r.prompt_ids}
    trials = [
        r
        for r in records
        if r.method in (method, BASELINE)
        and r.temperature == temperature
        and r.concurrency == concurrency
        and r.category is None
        and r.prompt_ids
        and all(categories.get(p) in group for p in r.prompt_ids)
    ]
    rates = [rates_by_repeat([r]).get(r.repeat, 0.0) for r in trials]
    ratios = []
    for i, trial in enumerate(trials):
        if trial.method != method or rates[i] <= 0:
            continue
        if trial.beside == BASELINE:  # its pair: the twin's loop, recorded right after it
            pair = trials[i + 1] if i + 1 < len(trials) else None
            assert pair is not None and pair.beside == method, "a pair's records run together"
            theirs = [rates[i + 1]]
        else:
            flanks = [
                next((j for j in sides if trials[j].method == BASELINE), None)
                for sides in (range(i - 1, -1, -1), range(i + 1, len(trials)))
            ]
            theirs = [
                rates[j] for j in flanks if j is not None and trials[j].repeat == trial.repeat
            ]
        if theirs and all(rate > 0 for rate in theirs):
            ratios.append(rates[i] / statistics.fmean(theirs))
    return statistics.median(ratios) if ratios else None


def paired_ratio(
    records: Sequence[Record], method: str, temperature: float, group: frozenset
) -> float | None:
    """``method``'s rate one request at a time over that of the ``none`` runs paired with its
    own, on the prompts of ``group`` (categories), median over repeats; None where none of its
    trials ran in a pair (``records`` in the order they ran: a pair's ``none`` right after)."""
    mine: list[Record] = []
    theirs: list[Record] = []
    for i, r in enumerate(records):
        if (
            r.method == method
            and r.beside == BASELINE
            and r.temperature == temperature
            and r.concurrency == 1
            and r.category in group
        ):
            pair = records[i + 1] if i + 1 < len(records) else None
            assert pair is not None and pair.beside == method, "a pair's records run together"
            mine.append(r)
            theirs.append(pair)
    rates, baseline = rates_by_repeat(mine), rates_by_repeat(theirs)
    ratios = [rate / baseline[k] for k, rate in rates.items() if baseline.get(k, 0.0) > 0]
    return statistics.median(ratios) if ratios else None


def vs_none(
    records: Sequence[Record], summary: Summary, categories: dict[str, Category]
) -> list[Ratio]:
    """Every (method, group, temperature, concurrency) the records hold, ``none`` excluded."""
    grounded = frozenset(n for n, c in categories.items() if c.input_grounded)
    groups = {OPEN_ENDED: frozenset(categories) - grounded, GROUNDED: grounded}
    methods = sorted(
        {r.method for r in records} - {BASELINE}, key=[r.method for r in records].index
    )
    temperatures = sorted({r.temperature for r in records})
    levels = sorted({r.concurrency for r in records if r.concurrency > 1})
    rows = []
    for method in methods:
        for name, members in groups.items():
            if not members:
                continue
            for t in temperatures:
                alone = paired_ratio(records, method, t, members)
                if alone is None:
                    alone = summary.speedup(method, BASELINE, name, t)
                rows.append(Ratio(method, name, t, 1, alone))
                for n in levels:
                    rows.append(
                        Ratio(method, name, t, n, concurrent_ratio(records, method, t, n, members))
                    )
    return rows


def format_vs_none(rows: Sequence[Ratio]) -> str:
    """The table, and the least ratio measured."""
    header = f"{'method':<10} {'group':<15} {'T':<6} {'N':<4} {'vs none':>6}"
    lines = [f"== vs none (speculation never costs: each >= {FLOOR:.2f}) ==", header]
    lines += [row.line() for row in rows]
    measured = [row for row in rows if row.ratio is not None]
    if measured:
        worst = min(measured, key=lambda row: row.ratio or 0.0)
        below = sum(1 for row in measured if (row.ratio or 0.0) < FLOOR)
        lines.append(f"least: {worst.line().strip()}; {below} of {len(measured)} below {FLOOR}")
    return "\n".join(lines)
