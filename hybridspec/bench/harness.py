"""Running the benchmark: an interleaved schedule of trials, a warm-up, and the records.

Interleaving: machine speed drifts (other processes, thermal state), so methods never run in
long blocks. For each repeat and temperature, every prompt is run by every method back to
back, and the order of the methods rotates from one prompt to the next, so each method runs
first, second, ... equally often. Worked example, methods (a, b, c), prompts 0..3, one repeat:
prompt 0 runs a b c, prompt 1 b c a, prompt 2 c a b, prompt 3 a b c. A speedup is taken within
a repeat, between runs minutes apart at most, and the median is taken over repeats.

Concurrent trials (``concurrency`` N > 1) follow: per repeat and temperature, each method that
can batch (rotating which goes first) serves a closed loop (once per group of categories where
``concurrent_groups`` names them, over that group's prompts), like N clients each sending requests
back to back: the M requests are every prompt, in the order of ``mixed_prompts`` so that
categories alternate (cycled up to M = N when there are fewer than N prompts); the first N are
added at once and each finished request is replaced by the next, so at most N are in the engine.
Worked example, N = 2, prompts [x0, x1, y0]: M = 3 requests x0, y0, x1; x0 and y0 start, and x1
starts when the first of them finishes. The trial's time runs from the first request added to the
last one finished, and its aggregate tokens/s is compared with ``none`` run one request at a
time on the same prompts (``summary``).

Pairs: a trial is a few seconds at most, and a shared machine's speed moves within seconds by
more than a method's cost, so two trials run one after the other do not compare. Where the bench
has a twin (``none`` on a second engine over the same weights), each other engine method's trial
instead runs beside one of the twin's on the same requests, the two loops by turns of one step
(``methods.in_lockstep``), each timed by its own turns (its first-token times too): each pair is
two records that name each other (``Record.beside``), and a method's ratio to ``none`` is taken
within its pairs (``vs_none``). One at a time, a prompt's trials are then pairs in the rotation
above and ``none`` runs none of its own, its records being the twin's: methods (none, a, b), prompt
0 runs a|none b|none, prompt 1 b|none a|none. N at once, the pass's trials are pairs, rotating by
repeat. Served, the server runs the twin (``served``, "Pairs"). Without a twin (one request at a
time only, or no ``none`` to pair with), ``none`` runs its own one-at-a-time trials, and N at
once it runs before the first method's loop and again after each one (``none a none b none``), a
method's rate compared with the mean of the two beside it, which cancels a drift only as far as
it is linear.

Sampled trials seed every request from (repeat, prompt), the same for every method and for the
concurrent trials.

Passes: the trials of one (repeat, temperature, N) are a pass, and every request of a pass
names the pass as its session (``pass_session``), which the bench's engine and server isolate
text by (``suffix``'s per-session pools). A method that drafts from earlier requests' text
(``suffix``) so learns only from the pass's earlier prompts, each a different prompt: never
from its own answer to the same prompt in an earlier repeat, at another temperature or one at
a time, which would copy that answer whole and time a cache, not the method. The warm-up names
no session and feeds no pool.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hybridspec.bench.methods import BenchMethod, ConcurrentMethod, PairedMethod
from hybridspec.bench.names import BASELINE
from hybridspec.bench.records import Measurement, Record
from hybridspec.errors import check
from hybridspec.types import SamplingParams

SEED_STRIDE = 100_003  # a prime above any workload's prompt count: distinct seeds per repeat


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """A workload prompt, tokenized."""

    id: str
    category: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BenchConfig:
    temperatures: tuple[float, ...] = (0.0, 0.8)
    max_new_tokens: int = 128
    repeats: int = 1
    concurrency: int = 1  # N > 1 adds closed-loop trials, N requests at once, per method
    seed: int = 0  # base seed of sampled requests
    # Non-empty: the concurrent trials run once per group of categories, over that group's
    # prompts alone (``--vs-none``: open-ended and input-grounded apart), instead of once over
    # every prompt.
    concurrent_groups: tuple[frozenset[str], ...] = ()

    def __post_init__(self) -> None:
        check(bool(self.temperatures), "temperatures", "expected at least one temperature")
        check(
            self.max_new_tokens >= 1, "max_new_tokens", f"expected >= 1, got {self.max_new_tokens}"
        )
        check(self.repeats >= 1, "repeats", f"expected >= 1, got {self.repeats}")
        check(
            1 <= self.concurrency <= 64,
            "concurrency",
            f"expected an integer in [1, 64], got {self.concurrency}",
        )


@dataclass(frozen=True, slots=True)
class Trial:
    """One unit of the schedule: a method runs one prompt, or M prompts N at a time."""

    repeat: int
    temperature: float
    method: int  # index into the methods
    prompts: tuple[int, ...]  # [M] indices into the prompts, in the order they are sent
    concurrency: int = 1  # N: the most requests in the engine at once
    paired: bool = False  # the method's trial runs in lockstep beside the twin's (Pairs above)


def pass_session(trial: Trial) -> str:
    """The session that every request of ``trial``'s pass names (module docstring)."""
    return f"bench-r{trial.repeat}-t{trial.temperature:g}-x{trial.concurrency}"


def sequential_schedule(
    num_prompts: int, num_methods: int, temperatures: Sequence[float], repeats: int
) -> list[Trial]:
    """Every (repeat, temperature, prompt, method), methods rotating per prompt (see above)."""
    trials = []
    for repeat in range(repeats):
        for temperature in temperatures:
            for p in range(num_prompts):
                shift = repeat * num_prompts + p
                for j in range(num_methods):
                    trials.append(Trial(repeat, temperature, (shift + j) % num_methods, (p,)))
    return trials


def mixed_prompts(categories: Sequence[str], n: int) -> tuple[int, ...]:
    """``n`` prompt indices taking categories in turn (cycling when ``n`` exceeds the prompts).

    ``categories[i]`` is prompt i's category. Example: categories [x, x, y, z] and n = 5 give
    prompts 0 (x), 2 (y), 3 (z), 1 (x), 0 (x).
    """
    by_category: dict[str, list[int]] = {}
    for i, category in enumerate(categories):
        by_category.setdefault(category, []).append(i)
    order: list[int] = []
    for rank in range(max(len(v) for v in by_category.values())):
        order.extend(v[rank] for v in by_category.values() if rank < len(v))
    return tuple(order[i % len(order)] for i in range(n))


def concurrent_prompts(categories: Sequence[str], concurrency: int) -> tuple[int, ...]:
    """The M requests of a closed-loop trial: every prompt, categories alternating, M >= N.

    Example: categories [x, x, y] and N = 2 give (0, 2, 1); with N = 4, (0, 2, 1, 0).
    """
    return mixed_prompts(categories, max(len(categories), concurrency))


def concurrent_schedule(
    prompts: tuple[int, ...],
    methods: Sequence[int],
    temperatures: Sequence[float],
    repeats: int,
    concurrency: int,
    baseline: int | None = None,
    paired: bool = False,
) -> list[Trial]:
    """One closed-loop trial per (repeat, temperature, method), the methods' order rotating;
    where ``baseline`` is one of ``methods``, each other method's trial is ``paired`` with a
    twin's loop of it, or else the baseline runs first and again after each other one (module
    docstring). Example, methods (n, a, b), baseline n, repeat 1: b|n a|n paired, n b n a n not.
    """
    trials = []
    flank = baseline if baseline is not None and baseline in methods else None
    others = [m for m in methods if m != flank]
    for repeat in range(repeats):
        for temperature in temperatures:
            order = [others[(repeat + j) % len(others)] for j in range(len(others))]
            pairs = paired and flank is not None and bool(others)
            if flank is not None and not pairs:
                order = [flank, *(m for method in order for m in (method, flank))]
            trials += [Trial(repeat, temperature, m, prompts, concurrency, pairs) for m in order]
    return trials


def sampling_for(temperature: float, seed: int, repeat: int, prompt: int) -> SamplingParams:
    if temperature == 0:
        return SamplingParams()
    return SamplingParams(temperature=temperature, seed=seed + repeat * SEED_STRIDE + prompt)


def plan(
    config: BenchConfig,
    methods: Sequence[BenchMethod],
    prompts: Sequence[BenchPrompt],
    paired: bool = False,
) -> list[Trial]:
    """The whole schedule: sequential trials, then concurrent ones when ``concurrency > 1``,
    ``paired`` with a twin's where there is one (module docstring)."""
    trials = sequential_schedule(len(prompts), len(methods), config.temperatures, config.repeats)
    batching = [i for i, m in enumerate(methods) if isinstance(m, ConcurrentMethod)]
    baseline = next((i for i in batching if methods[i].name == BASELINE), None)
    if paired and baseline is not None and len(batching) > 1:
        trials = [replace(t, paired=t.method in batching) for t in trials if t.method != baseline]
    if config.concurrency > 1:
        groups = config.concurrent_groups or (frozenset(p.category for p in prompts),)
        for group in groups if batching else ():
            members = [i for i, p in enumerate(prompts) if p.category in group]
            if not members:
                continue
            chosen = concurrent_prompts([prompts[i].category for i in members], config.concurrency)
            trials += concurrent_schedule(
                tuple(members[i] for i in chosen),
                batching,
                config.temperatures,
                config.repeats,
                config.concurrency,
                baseline,
                paired,
            )
    return trials


def num_records(trials: Sequence[Trial]) -> int:
    """How many records ``trials`` make: two for each pair, one for any other trial."""
    return sum(2 if trial.paired else 1 for trial in trials)


def run_trial(
    trial: Trial,
    config: BenchConfig,
    methods: Sequence[BenchMethod],
    prompts: Sequence[BenchPrompt],
    twin: PairedMethod | None = None,
) -> list[Record]:
    """The trial's record; a paired trial's two, the method's and then the twin's."""
    method = methods[trial.method]
    samplings = [
        sampling_for(trial.temperature, config.seed, trial.repeat, p) for p in trial.prompts
    ]
    chosen = [prompts[p] for p in trial.prompts]
    session = pass_session(trial)
    token_ids = [p.token_ids for p in chosen]
    n, max_new_tokens = trial.concurrency, config.max_new_tokens
    measured: list[tuple[str, Measurement, str | None]]
    if trial.paired:
        assert isinstance(method, PairedMethod) and twin is not None, "a pair needs a twin"
        mine, theirs = method.run_beside(twin, token_ids, samplings, max_new_tokens, n, session)
        measured = [(method.name, mine, twin.name), (twin.name, theirs, method.name)]
    elif n == 1:
        assert len(chosen) == 1, "a sequential trial runs one prompt"
        measured = [
            (method.name, method.run(token_ids[0], samplings[0], max_new_tokens, session), None)
        ]
    else:
        assert isinstance(method, ConcurrentMethod)
        measurement = method.run_concurrent(token_ids, samplings, max_new_tokens, n, session)
        measured = [(method.name, measurement, None)]
    load = os.getloadavg()[0]
    return [
        Record(
            method=name,
            temperature=trial.temperature,
            repeat=trial.repeat,
            prompt_ids=tuple(p.id for p in chosen),
            category=chosen[0].category if n == 1 else None,
            measurement=measurement,
            load_average=load,
            concurrency=n,
            beside=beside,
        )
        for name, measurement, beside in measured
    ]


def warm_up(
    config: BenchConfig, methods: Sequence[BenchMethod], prompt: BenchPrompt
) -> dict[str, Measurement]:
    """Run every method once, greedy, on ``prompt`` (not recorded as a trial).

    The first calls pay one-time costs (allocator growth, kernel selection, JIT compilation of
    the n-gram kernels, transformers' generation setup); the greedy outputs double as the
    transformers parity check. Methods that batch also run N copies of ``prompt`` at once.
    """
    outputs = {}
    n = config.concurrency
    for method in methods:
        outputs[method.name] = method.run(prompt.token_ids, SamplingParams(), config.max_new_tokens)
        if n > 1 and isinstance(method, ConcurrentMethod):
            method.run_concurrent(
                [prompt.token_ids] * n, [SamplingParams()] * n, min(config.max_new_tokens, 16), n
            )
    return outputs


def run_benchmark(
    config: BenchConfig,
    methods: Sequence[BenchMethod],
    prompts: Sequence[BenchPrompt],
    on_trial: Callable[[Record], None] | None = None,
    twin: PairedMethod | None = None,
) -> list[Record]:
    """Run the planned trials in order, beside ``twin`` where given (``none`` on an engine of
    its own; module docstring); ``on_trial`` sees each record as it is made."""
    records = []
    for trial in plan(config, methods, prompts, paired=twin is not None):
        for record in run_trial(trial, config, methods, prompts, twin):
            records.append(record)
            if on_trial is not None:
                on_trial(record)
    return records
