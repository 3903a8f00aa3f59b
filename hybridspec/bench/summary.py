"""From records to figures: one ``Cell`` per (temperature, method, group of prompts).

A group is one category, all input-grounded categories, all open-ended ones, or all; the
closed-loop trials at concurrency N form a group of their own (``concurrent xN``). Within a group:

- tokens/s of a repeat = generated tokens / wall seconds (a trial's own turns' where it ran
  beside the twin's: ``harness``, "Pairs"), both summed over the group's requests (so long
  outputs weigh more than short ones); the cell holds the median over repeats. A speedup is
  the median over repeats of the ratio of two methods' rates in the same repeat (interleaved
  runs, so drift cancels).
- on a ``concurrent xN`` group, the speedup over a method is over that method run one request
  at a time: its sequential trials of the same repeat, temperature and prompts. Example: in a
  repeat, ngram x8 generates 2000 tokens in 10 s (200 tokens/s) over prompts a..h, and ``none``
  generated 1500 tokens in 30 s over the sequential trials of a..h (50 tokens/s): 4.0x.
- acceptance rate = accepted drafts / proposed drafts; mean accepted length = generated tokens
  / target forwards (the bonus or recovered token counted); acceptance per position i =
  rounds whose i-th draft was accepted / rounds that proposed an i-th draft. These are pooled
  over repeats: they do not depend on the machine's speed.
- outside-forward share = 1 - (seconds in the target forward / wall seconds): proposing,
  verifying, committing, scheduling and Python overhead; the median over repeats (none where
  the forward's time is not observed: served trials).
- time to first token (the prompt's prefill and the first token) and the decode rate after
  it: tokens after the first / seconds after the first token, summed over a repeat's requests,
  median over repeats; "decode vs" a method is the median over repeats of the ratio of decode
  rates. Methods that do not report their first token (``hf-*``), and concurrent groups, show
  none: their tokens/s include prefill.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridspec.bench.names import BASELINE, HF_BASELINE, LLAMACPP_BASELINE
from hybridspec.bench.records import Record, Speculation, first_difference
from hybridspec.bench.workload import Category

GROUNDED = "input-grounded"
OPEN_ENDED = "open-ended"
ALL = "all"


@dataclass(frozen=True, slots=True)
class Cell:
    """A group's figures for one method and temperature. On a ``concurrent xN`` group the
    speedups are over one request of ``none`` (``hf-plain``, ``llamacpp-plain``) at a time, on
    the same prompts."""

    method: str
    temperature: float
    group: str
    num_requests: int  # requests measured, over all repeats
    mean_generated: float  # generated tokens per request
    tokens_per_s: float
    speedup_vs_none: float | None  # None when `none` was not run
    speedup_vs_hf_plain: float | None  # None when `hf-plain` was not run
    speedup_vs_llamacpp_plain: float | None  # None when `llamacpp-plain` was not run
    acceptance_rate: float | None  # None when nothing was proposed
    mean_accepted_length: float | None  # None when no forward committed tokens
    acceptance_per_position: tuple[float, ...] | None  # [K]; None when not observable
    outside_forward_share: float | None  # None: the forward's time not observed (served)
    first_token_ms: float | None = None  # median over repeats of the mean; None: not observed
    decode_tokens_per_s: float | None = None  # after the first token; None: not observed
    decode_vs_llamacpp_plain: float | None = None  # ratio of decode rates


def category_groups(categories: dict[str, Category]) -> dict[str, frozenset[str]]:
    """Each category alone, then the input-grounded, open-ended and all categories."""
    groups = {name: frozenset([name]) for name in categories}
    grounded = frozenset(n for n, c in categories.items() if c.input_grounded)
    open_ended = frozenset(categories) - grounded
    if grounded:
        groups[GROUNDED] = grounded
    if open_ended:
        groups[OPEN_ENDED] = open_ended
    groups[ALL] = frozenset(categories)
    return groups


class Summary:
    """The records of a run, grouped; cells and speedups on demand."""

    def __init__(self, records: Sequence[Record], categories: dict[str, Category]) -> None:
        self.records = tuple(records)
        self.groups = category_groups(categories)
        self.methods = tuple(dict.fromkeys(r.method for r in records))
        self.temperatures = tuple(sorted({r.temperature for r in records}))
        concurrent = sorted({r.concurrency for r in records if r.category is None})
        self._concurrent = {concurrent_group(n): n for n in concurrent}

    @property
    def group_names(self) -> tuple[str, ...]:
        return (*self.groups, *self._concurrent)

    @property
    def concurrency_levels(self) -> tuple[int, ...]:
        """The N of every closed-loop group run, ascending."""
        return tuple(self._concurrent.values())

    def select(self, method: str, temperature: float, group: str) -> list[Record]:
        if group in self._concurrent:
            n = self._concurrent[group]
            return [
                r
                for r in self.records
                if r.method == method
                and r.temperature == temperature
                and r.category is None
                and r.concurrency == n
            ]
        members = self.groups[group]
        return [
            r
            for r in self.records
            if r.method == method and r.temperature == temperature and r.category in members
        ]

    def speedup(self, method: str, over: str, group: str, temperature: float) -> float | None:
        """Median over repeats of the ratio of tokens/s; None when either was not measured.

        On a concurrent group, ``over`` is run one request at a time (see the module docstring).
        """
        records = self.select(method, temperature, group)
        if group in self._concurrent:
            baseline = self.one_at_a_time(over, temperature, records)
        else:
            baseline = self.select(over, temperature, group)
        mine = rates_by_repeat(records)
        theirs = rates_by_repeat(baseline)
        ratios = [mine[r] / theirs[r] for r in mine if r in theirs and theirs[r] > 0]
        return statistics.median(ratios) if ratios else None

    def concurrent_speedup(
        self, method: str, concurrency: int, temperature: float, over: str = BASELINE
    ) -> float | None:
        """Aggregate tokens/s of ``concurrency`` requests of ``method`` at once over one request
        of ``over`` at a time, on the same prompts; None when either was not measured."""
        if concurrency not in self.concurrency_levels:
            return None
        return self.speedup(method, over, concurrent_group(concurrency), temperature)

    def one_at_a_time(
        self, method: str, temperature: float, concurrent: Sequence[Record]
    ) -> list[Record]:
        """``method``'s sequential trials of the prompts of ``concurrent``, repeat by repeat."""
        keys = {(r.repeat, p) for r in concurrent for p in r.prompt_ids}
        return [
            r
            for r in self.records
            if r.method == method
            and r.temperature == temperature
            and r.concurrency == 1
            and (r.repeat, r.prompt_ids[0]) in keys
        ]

    def cell(self, method: str, temperature: float, group: str) -> Cell | None:
        records = self.select(method, temperature, group)
        if not records:
            return None
        requests = [s for r in records for s in r.measurement.requests]
        return Cell(
            method=method,
            temperature=temperature,
            group=group,
            num_requests=len(requests),
            mean_generated=sum(s.num_generated for s in requests) / len(requests),
            tokens_per_s=statistics.median(rates_by_repeat(records).values()),
            speedup_vs_none=self.speedup(method, BASELINE, group, temperature),
            speedup_vs_hf_plain=self.speedup(method, HF_BASELINE, group, temperature),
            speedup_vs_llamacpp_plain=self.speedup(method, LLAMACPP_BASELINE, group, temperature),
            acceptance_rate=_ratio(
                sum(s.num_accepted_tokens for s in requests),
                sum(s.num_drafts for s in requests),
            ),
            mean_accepted_length=_ratio(
                sum(s.num_generated for s in requests), sum(s.target_forwards for s in requests)
            ),
            acceptance_per_position=acceptance_per_position(requests),
            outside_forward_share=_median_or_none(outside_forward_shares(records)),
            first_token_ms=_median_or_none(first_token_ms_by_repeat(records)),
            decode_tokens_per_s=_median_or_none(decode_rates_by_repeat(records)),
            decode_vs_llamacpp_plain=self.decode_speedup(
                method, LLAMACPP_BASELINE, group, temperature
            ),
        )

    def decode_speedup(
        self, method: str, over: str, group: str, temperature: float
    ) -> float | None:
        """Median over repeats of the ratio of decode rates (after the first token)."""
        if group in self._concurrent:
            return None
        mine = decode_rates_by_repeat(self.select(method, temperature, group))
        theirs = decode_rates_by_repeat(self.select(over, temperature, group))
        ratios = [mine[r] / theirs[r] for r in mine if r in theirs and theirs[r] > 0]
        return statistics.median(ratios) if ratios else None

    def cells(self) -> list[Cell]:
        """Every measured cell: by temperature, then group, then method."""
        out = []
        for temperature in self.temperatures:
            for group in self.group_names:
                for method in self.methods:
                    cell = self.cell(method, temperature, group)
                    if cell is not None:
                        out.append(cell)
        return out


def concurrent_group(concurrency: int) -> str:
    """The name of the group of closed-loop trials at ``concurrency``."""
    return f"concurrent x{concurrency}"


def by_repeat(records: Iterable[Record]) -> dict[int, list[Record]]:
    groups: dict[int, list[Record]] = {}
    for record in records:
        groups.setdefault(record.repeat, []).append(record)
    return groups


def _elapsed(records: Sequence[Record]) -> float:
    return sum(r.measurement.elapsed_s for r in records)


def rates_by_repeat(records: Iterable[Record]) -> dict[int, float]:
    """Tokens/s of each repeat: generated tokens over wall seconds, summed over the records."""
    return {
        repeat: sum(r.measurement.num_generated for r in rs) / _elapsed(rs)
        for repeat, rs in by_repeat(records).items()
        if _elapsed(rs) > 0
    }


def outside_forward_shares(records: Iterable[Record]) -> dict[int, float]:
    """1 - seconds in the target forward / wall seconds, of each repeat whose records all
    observed their forward's time."""
    shares = {}
    for repeat, rs in by_repeat(records).items():
        forward = [r.measurement.forward_s for r in rs]
        if all(f is not None for f in forward) and _elapsed(rs) > 0:
            shares[repeat] = 1 - sum(f or 0.0 for f in forward) / _elapsed(rs)
    return shares


def _median_or_none(values: dict[int, float]) -> float | None:
    return statistics.median(values.values()) if values else None


def _observed(records: Iterable[Record]) -> dict[int, list[Record]]:
    """Repeats whose records are all single requests with their first token timed."""
    return {
        repeat: rs
        for repeat, rs in by_repeat(records).items()
        if all(r.measurement.first_token_s is not None and r.concurrency == 1 for r in rs)
    }


def first_token_ms_by_repeat(records: Iterable[Record]) -> dict[int, float]:
    """Mean milliseconds to the first token of each repeat's requests."""
    return {
        repeat: 1e3 * sum(r.measurement.first_token_s or 0.0 for r in rs) / len(rs)
        for repeat, rs in _observed(records).items()
    }


def decode_rates_by_repeat(records: Iterable[Record]) -> dict[int, float]:
    """Tokens/s after the first token of each repeat: (generated - 1) over (wall - first
    token), both summed over the repeat's requests. Example: 64 tokens in 4.0 s, the first
    after 0.85 s: 63 / 3.15 = 20 tokens/s."""
    rates = {}
    for repeat, rs in _observed(records).items():
        seconds = sum(r.measurement.elapsed_s - (r.measurement.first_token_s or 0.0) for r in rs)
        tokens = sum(max(0, r.measurement.num_generated - 1) for r in rs)
        if seconds > 0:
            rates[repeat] = tokens / seconds
    return rates


def acceptance_per_position(requests: Sequence[Speculation]) -> tuple[float, ...] | None:
    """Pooled acceptance of the i-th draft of a round; None when a request did not record it.

    Example: requests with accepted [3, 1] of proposed [4, 2] and accepted [1] of proposed [2]
    pool to [4/6, 1/2].
    """
    if any(s.accepted_per_position is None for s in requests):
        return None
    accepted: list[int] = []
    proposed: list[int] = []
    for s in requests:
        assert s.accepted_per_position is not None and s.proposed_per_position is not None
        for i, (a, p) in enumerate(
            zip(s.accepted_per_position, s.proposed_per_position, strict=True)
        ):
            if i == len(proposed):
                accepted.append(0)
                proposed.append(0)
            accepted[i] += a
            proposed[i] += p
    return tuple(a / p if p else 0.0 for a, p in zip(accepted, proposed, strict=True))


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator > 0 else None


@dataclass(frozen=True, slots=True)
class Agreement:
    """How often one method's greedy outputs equal the reference method's (same prompt and
    repeat). The engine's methods must give identical outputs, one at a time or N at once: its
    runtime computes a token's logits bit-identically however the token is batched. A baseline
    of another runtime (llama.cpp, transformers) rounds differently, and a near-tie of the
    argmax can flip, after which the texts go separate ways."""

    identical: int
    compared: int
    first_divergence: tuple[int, ...]  # index of the first differing token, per differing pair

    def to_dict(self) -> dict[str, object]:
        return {
            "identical": self.identical,
            "compared": self.compared,
            "first_divergence": list(self.first_divergence),
        }


def greedy_agreement(records: Sequence[Record], reference: str) -> dict[str, Agreement]:
    """Each method's greedy outputs compared with ``reference``'s single-prompt ones (same
    prompt and repeat; the first where a pair's twin ran it beside several methods): its
    single-prompt trials under its name, the reference's own beside other methods among them,
    and every request of its trials N at once under ``"{method} xN"``, the reference's own among
    them (plain decoding must not depend on what shares its forwards)."""
    ref: dict[tuple[str, int], tuple[int, ...]] = {}
    for r in records:
        if r.method == reference and r.temperature == 0 and r.category is not None:
            ref.setdefault((r.prompt_ids[0], r.repeat), r.measurement.requests[0].token_ids)
    compared: dict[str, list[int | None]] = {}
    for r in records:
        if r.temperature != 0:
            continue
        if r.concurrency > 1:
            name = f"{r.method} x{r.concurrency}"
            outputs = list(
                zip(r.prompt_ids, [q.token_ids for q in r.measurement.requests], strict=True)
            )
        elif r.category is not None and (r.method != reference or r.beside is not None):
            name, outputs = r.method, [(r.prompt_ids[0], r.measurement.requests[0].token_ids)]
        else:
            continue
        for prompt_id, ours in outputs:
            theirs = ref.get((prompt_id, r.repeat))
            if theirs is not None:
                compared.setdefault(name, []).append(first_difference(ours, theirs))
    return {
        method: Agreement(
            sum(d is None for d in diffs), len(diffs), tuple(d for d in diffs if d is not None)
        )
        for method, diffs in compared.items()
    }
