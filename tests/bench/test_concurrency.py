"""The closed-loop concurrency measurement: the loop on a fake engine and on a tiny engine, the
schedule and records it makes, the ratio over one ``none`` request at a time, and its targets.

Kept apart from ``test_bench`` so that each file stays short; nothing here measures speed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from hybridspec.bench import methods
from hybridspec.bench.harness import (
    BenchConfig,
    BenchPrompt,
    concurrent_prompts,
    run_benchmark,
)
from hybridspec.bench.methods import ClosedLoop, EngineMethod, closed_loop, in_lockstep
from hybridspec.bench.records import Measurement, Record, Speculation
from hybridspec.bench.summary import ALL, Summary
from hybridspec.bench.targets import CONCURRENCY_TARGETS, evaluate_targets
from hybridspec.bench.timing import EngineForwardTimer
from hybridspec.bench.workload import Category
from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.engine import (
    Engine,
    FinishReason,
    GenerationParams,
    GenerationResult,
    RequestOutput,
)
from hybridspec.engine.stats import GenerationStats
from hybridspec.model.loader import load_model
from hybridspec.model.runtime import ForwardBatch
from hybridspec.types import SamplingParams
from tests.conftest import TinyLlamaFactory

# --------------------------------------------------------------------------- the loop


class StepsEngine:
    """A fake engine: a request runs for as many steps as its prompt has tokens, and its
    result's token ids are its prompt (so results can be matched to requests)."""

    def __init__(self, silent_steps: int = 0) -> None:
        self.silent_steps = silent_steps  # each request's first steps give no token (a prefill)
        self.ids = (f"request-{i}" for i in itertools.count())
        self.running: dict[str, list[int]] = {}  # id -> [steps left, *prompt]
        self.added: list[int] = []  # prompt[0] of each request, in the order added
        self.finished: list[int] = []  # prompt[0], in the order finished
        self.in_flight: list[int] = []  # requests in the engine at each step
        self.finished_per_step: list[int] = []

    def add_request(self, prompt_token_ids: Sequence[int], params: GenerationParams) -> str:
        request_id = next(self.ids)
        self.running[request_id] = [len(prompt_token_ids), *prompt_token_ids]
        self.added.append(prompt_token_ids[0])
        return request_id

    def step(self) -> list[RequestOutput]:
        self.in_flight.append(len(self.running))
        outputs = []
        for request_id, state in list(self.running.items()):
            state[0] -= 1
            result = None
            if state[0] == 0:
                del self.running[request_id]
                self.finished.append(state[1])
                stats = GenerationStats(generated_tokens=len(state) - 1)
                result = GenerationResult(request_id, "", state[1:], FinishReason.LENGTH, stats)
            tokens = [] if len(state) - 1 - state[0] <= self.silent_steps else [0]
            outputs.append(RequestOutput(request_id, tokens, "", result is not None, result=result))
        self.finished_per_step.append(sum(o.finished for o in outputs))
        return outputs


DURATIONS = (3, 1, 2, 2, 1)  # steps each request runs: request i's prompt is [i] * DURATIONS[i]
PROMPTS = [[i] * d for i, d in enumerate(DURATIONS)]


def test_closed_loop_replaces_each_finished_request_with_the_next() -> None:
    # N = 2: 0 and 1 start; 1 ends at step 1 and 2 starts; 0 and 2 end at step 3, 3 and 4
    # start; 4 ends at step 4, 3 at step 5 (the docstring's example).
    engine = StepsEngine()
    loop, elapsed = closed_loop(engine, PROMPTS, [GenerationParams()] * 5, concurrency=2)
    assert engine.in_flight == [2, 2, 2, 2, 1]
    assert engine.finished == [1, 0, 2, 4, 3]
    assert engine.added == [0, 1, 2, 3, 4]
    assert [r.token_ids for r in loop.results()] == PROMPTS  # request order, not finishing order
    assert elapsed >= loop.seconds >= 0


@pytest.mark.parametrize(("concurrency", "steps"), [(1, 9), (2, 5), (3, 3), (5, 3), (8, 3)])
def test_closed_loop_never_exceeds_n_in_flight(concurrency: int, steps: int) -> None:
    engine = StepsEngine()
    loop, _ = closed_loop(engine, PROMPTS, [GenerationParams()] * 5, concurrency)
    assert len(engine.in_flight) == steps
    assert max(engine.in_flight) == min(concurrency, len(PROMPTS))
    # Refilled before the next step: the engine stays full until fewer than N remain.
    remaining = len(PROMPTS)
    for in_flight, finished in zip(engine.in_flight, engine.finished_per_step, strict=True):
        assert in_flight == min(concurrency, remaining)
        remaining -= finished
    assert remaining == 0 and engine.added == [0, 1, 2, 3, 4]
    assert [r.token_ids for r in loop.results()] == PROMPTS


class Clock:
    """A fake ``time`` module whose ``perf_counter`` reads what the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedStepsEngine(StepsEngine):
    """A ``StepsEngine`` whose every step takes ``seconds`` of ``clock`` and is logged under
    ``name`` in ``log``."""

    def __init__(
        self, name: str, seconds: float, clock: Clock, log: list[str], silent_steps: int = 0
    ) -> None:
        super().__init__(silent_steps)
        self.name, self.seconds, self.clock, self.log = name, seconds, clock, log

    def step(self) -> list[RequestOutput]:
        self.clock.now += self.seconds
        self.log.append(self.name)
        return super().step()


def test_loops_in_lockstep_take_turns_by_their_own_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    # The docstring's example, in seconds that add up exactly: a's steps take 1 and b's 2; a
    # runs PROMPTS 2 at a time (5 steps), b all 5 at once (3 steps).
    clock, log = Clock(), []
    monkeypatch.setattr(methods, "time", clock)
    engines = [TimedStepsEngine("a", 1.0, clock, log), TimedStepsEngine("b", 2.0, clock, log)]
    params = [GenerationParams()] * 5
    loops = [ClosedLoop(e, PROMPTS, params, n) for e, n in zip(engines, (2, 5), strict=True)]
    in_lockstep(loops)
    assert log == ["a", "b", "a", "a", "b", "a", "a", "b"]
    assert [loop.seconds for loop in loops] == [5.0, 6.0]
    assert all(loop.done and [r.token_ids for r in loop.results()] == PROMPTS for loop in loops)
    assert engines[0].in_flight == [2, 2, 2, 2, 1] and engines[1].in_flight == [5, 3, 1]


def test_a_first_token_time_counts_the_loops_own_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair one request at a time (N = 1): a's steps take 1 s and b's 2, and each request's
    first step gives no token (a prompt prefilled in two steps). Turns: a b a a b a a b; a's
    first request gives its token at 2 s of a's own (the wall clock read 4), b's at 4 (wall 7),
    and a's second, added when a had run 3 s, at 2 s after that (a at 5, wall 9)."""
    clock, log = Clock(), []
    monkeypatch.setattr(methods, "time", clock)
    a, b = (TimedStepsEngine(n, s, clock, log, silent_steps=1) for n, s in (("a", 1.0), ("b", 2.0)))
    loops = [
        ClosedLoop(a, [[7, 7, 7], [8, 8]], [GenerationParams()] * 2, 1),
        ClosedLoop(b, [[7, 7, 7]], [GenerationParams()], 1),
    ]
    in_lockstep(loops)
    assert log == ["a", "b", "a", "a", "b", "a", "a", "b"] and clock.now == 11.0
    assert [loops[0].first_token_s(i) for i in (0, 1)] == [2.0, 2.0]
    assert loops[1].first_token_s(0) == 4.0 and loops[1].first_token_s(1) is None


def test_a_method_beside_the_twin_generates_what_each_does_alone(
    make_tiny_llama_dir: TinyLlamaFactory,
) -> None:
    path = str(make_tiny_llama_dir())
    loaded = load_model(ModelConfig(path, dtype="float32"))
    config = EngineConfig(ModelConfig(path, dtype="float32", max_seq_len=64, max_num_seqs=2))
    engines = [Engine(config, target=loaded) for _ in range(2)]  # one set of weights
    timers = [EngineForwardTimer(e.runtime) for e in engines]
    for timer in timers:
        timer.install()
    method, twin = (
        EngineMethod(e, t, p, 4) for e, t, p in zip(engines, timers, ("ngram", "none"), strict=True)
    )
    prompts = [[256, *range(72, 72 + n)] for n in (3, 9, 5, 12, 4)]
    greedy = [SamplingParams()] * 5
    alone = [m.run_concurrent(prompts, greedy, 6, 2) for m in (method, twin)]
    mine, theirs = method.run_beside(twin, prompts, greedy, 6, 2)
    forward_s = [t.seconds for t in timers]
    one_at_a_time = method.run_beside(twin, prompts[:1], greedy[:1], 6, 1)
    for engine in engines:
        engine.close()
    for measured in one_at_a_time:  # first tokens timed by the loop's own turns
        assert measured.requests[0].token_ids == mine.requests[0].token_ids
        assert measured.first_token_s is not None
        assert 0 < measured.first_token_s <= measured.elapsed_s
    assert mine.first_token_s is None  # several requests: no one first token
    texts = {tuple(r.token_ids for r in m.requests) for m in (*alone, mine, theirs)}
    assert len(texts) == 1  # lossless, and the same requests on both engines
    assert len(mine.requests) == 5 and mine.num_generated == theirs.num_generated
    for measured, seconds in zip((mine, theirs), forward_s, strict=True):
        assert 0 < measured.forward_s == seconds <= measured.elapsed_s


def test_engine_method_holds_at_most_n_sequences(make_tiny_llama_dir: TinyLlamaFactory) -> None:
    path = str(make_tiny_llama_dir())
    loaded = load_model(ModelConfig(path, dtype="float32"))
    config = ModelConfig(path, dtype="float32", max_seq_len=64, max_num_seqs=4)
    engine = Engine(EngineConfig(target=config), target=loaded)  # room for 4; N = 2
    timer = EngineForwardTimer(engine.runtime)
    timer.install()
    batch_sizes: list[int] = []
    batch_tokens: list[int] = []

    def count(batch: ForwardBatch, seconds: float) -> None:
        batch_sizes.append(len(batch.slots))
        batch_tokens.append(len(batch.token_ids))

    engine.runtime.add_forward_observer(count)
    prompts = [[256, *range(72, 72 + n)] for n in (3, 9, 5, 12, 4)]
    method = EngineMethod(engine, timer, "ngram", 4)
    measurement = method.run_concurrent(prompts, [SamplingParams()] * 5, 6, 2)
    engine.close()
    assert len(measurement.requests) == 5
    assert all(1 <= r.num_generated <= 6 for r in measurement.requests)
    assert max(batch_sizes) == 2
    assert 0 < measurement.forward_s <= measurement.elapsed_s
    assert timer.input_tokens == batch_tokens and timer.calls == len(batch_tokens)


# ------------------------------------------------------------------------ the schedule


def test_concurrent_prompts_alternate_categories_and_cycle_up_to_n() -> None:
    assert concurrent_prompts(["x", "x", "y"], 2) == (0, 2, 1)  # every prompt, M = 3 > N
    assert concurrent_prompts(["x", "x", "y"], 4) == (0, 2, 1, 0)  # cycled up to M = N


class FakeMethod:
    """Answers at once: one token per prompt token; records the closed loops it is given and
    the (session, first prompt token) of every request."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loops: list[tuple[list[int], list[int | None], int]] = []  # first tokens, seeds, N
        self.requests: list[tuple[str | None, int]] = []

    def run(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        session: str | None = None,
    ) -> Measurement:
        self.requests.append((session, prompt_token_ids[0]))
        return _measurement([prompt_token_ids])

    def run_concurrent(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        max_new_tokens: int,
        concurrency: int,
        session: str | None = None,
    ) -> Measurement:
        self.loops.append(([p[0] for p in prompts], [s.seed for s in samplings], concurrency))
        self.requests += [(session, p[0]) for p in prompts]
        return _measurement(prompts)


class SequentialMethod:
    """Like a transformers baseline: no ``run_concurrent``, so no concurrent trials."""

    name = "single"

    def run(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        session: str | None = None,
    ) -> Measurement:
        return _measurement([prompt_token_ids])


def _measurement(prompts: Sequence[Sequence[int]]) -> Measurement:
    requests = tuple(Speculation(tuple(p), len(p), len(p), 0, 0) for p in prompts)
    return Measurement(requests, 1.0, 0.5)


def test_run_benchmark_records_one_closed_loop_per_batching_method() -> None:
    prompts = [
        BenchPrompt("x0", "x", (10, 1)),
        BenchPrompt("x1", "x", (11, 1)),
        BenchPrompt("y0", "y", (12, 1)),
    ]
    batching = FakeMethod("batch")
    config = BenchConfig(temperatures=(0.0, 0.8), concurrency=2, seed=7)
    records = run_benchmark(config, [batching, SequentialMethod()], prompts)
    concurrent = [r for r in records if r.category is None]
    assert len(records) == 3 * 2 * 2 + len(concurrent) and len(concurrent) == 2
    for r in concurrent:
        assert r.method == "batch" and r.concurrency == 2
        assert r.prompt_ids == ("x0", "y0", "x1")
        assert len(r.measurement.requests) == 3
    assert all(r.concurrency == 1 for r in records if r.category is not None)
    # The same seeds as the sequential trials of each prompt: seed + prompt index.
    assert batching.loops == [([10, 12, 11], [None] * 3, 2), ([10, 12, 11], [7, 9, 8], 2)]


def test_every_request_names_its_pass_and_no_pass_runs_a_prompt_twice() -> None:
    """A method that drafts from earlier requests' text of its session (``suffix``) must never
    find its own earlier answer to the prompt it is timed on: each (repeat, temperature, N) is
    a session of its own, and within one each prompt runs once per method."""
    prompts = [BenchPrompt(f"p{i}", "xy"[i % 2], (10 + i, 1)) for i in range(3)]
    method = FakeMethod("batch")
    config = BenchConfig(temperatures=(0.0, 0.8), repeats=2, concurrency=2, seed=7)
    run_benchmark(config, [method, SequentialMethod()], prompts)
    sessions = [session for session, _ in method.requests]
    assert None not in sessions
    assert len(set(sessions)) == 2 * 2 * 2  # repeats x temperatures x (one at a time, N = 2)
    for session in set(sessions):
        first_tokens = [token for s, token in method.requests if s == session]
        assert sorted(first_tokens) == [10, 11, 12], session  # every prompt, each once
    assert len(method.requests) == 8 * 3


# ------------------------------------------------------------ summary and targets


CATEGORIES = {"code": Category("code", True), "chat": Category("chat", False)}


def single(
    method: str, repeat: int, prompt: str, tokens: int, seconds: float, temperature: float = 0.0
) -> Record:
    """A sequential trial of ``prompt`` (its category is the id's part before the dash)."""
    speculation = Speculation(tuple(range(tokens)), tokens, tokens, 0, 0)
    measurement = Measurement((speculation,), seconds, seconds)
    return Record(method, temperature, repeat, (prompt,), prompt.split("-")[0], measurement, 0.0)


def concurrent(
    method: str, repeat: int, prompts: tuple[str, ...], tokens: int, seconds: float, n: int
) -> Record:
    """A closed-loop trial of ``prompts``, N at a time, ``tokens`` each, greedy."""
    requests = tuple(Speculation(tuple(range(tokens)), tokens, tokens, 0, 0) for _ in prompts)
    measurement = Measurement(requests, seconds, seconds / 2)
    return Record(method, 0.0, repeat, prompts, None, measurement, 0.0, concurrency=n)


def baseline_records() -> list[Record]:
    """``none`` one request at a time: 20 tokens/s in repeat 0, 10 in repeat 1 over code-1 and
    chat-1; code-2 (not in the concurrent trials) and T = 0.8 would change that if counted."""
    return [
        single("none", 0, "code-1", 100, 4.0),
        single("none", 0, "chat-1", 100, 6.0),  # 200 tokens / 10 s
        single("none", 1, "code-1", 100, 12.0),
        single("none", 1, "chat-1", 100, 8.0),  # 200 tokens / 20 s
        single("none", 0, "code-2", 100, 100.0),
        single("none", 1, "code-2", 100, 100.0),
        single("none", 0, "chat-1", 100, 1.0, temperature=0.8),
    ]


def test_concurrent_speedup_is_over_one_none_request_on_the_same_prompts() -> None:
    pair = ("code-1", "chat-1")
    records = [
        *baseline_records(),
        concurrent("ngram", 0, pair, 100, 2.0, 2),  # 100 tokens/s: 5x the 20 of repeat 0
        concurrent("ngram", 1, pair, 100, 5.0, 2),  # 40 tokens/s: 4x the 10 of repeat 1
        concurrent("none", 0, pair, 100, 5.0, 2),  # 40 tokens/s: 2x
    ]
    summary = Summary(records, CATEGORIES)
    assert summary.concurrency_levels == (2,)
    assert summary.concurrent_speedup("ngram", 2, 0.0) == pytest.approx((5.0 + 4.0) / 2)
    assert summary.concurrent_speedup("none", 2, 0.0) == pytest.approx(2.0)
    assert summary.concurrent_speedup("ngram", 8, 0.0) is None  # N = 8 was not run
    assert summary.concurrent_speedup("ngram", 2, 0.8) is None
    assert summary.concurrent_speedup("ngram", 2, 0.0, over="hf-plain") is None
    cell = summary.cell("ngram", 0.0, "concurrent x2")
    assert cell is not None and cell.num_requests == 4
    assert cell.tokens_per_s == pytest.approx((100 + 40) / 2)
    assert cell.speedup_vs_none == pytest.approx(4.5)
    assert cell.outside_forward_share == pytest.approx(0.5)
    assert summary.speedup("none", "none", ALL, 0.0) == pytest.approx(1.0)  # unchanged


def concurrency_results(records: list[Record]) -> list[tuple[str, str, float | None]]:
    by_description = {r.description: r for r in evaluate_targets(Summary(records, CATEGORIES))}
    results = [r for d, r in by_description.items() if "concurrent" in d]
    assert len(results) == len(CONCURRENCY_TARGETS)
    return [(r.description.split(" requests")[0], r.status, r.value) for r in results]


def test_concurrency_targets_pass_fail() -> None:
    pair = ("code-1", "chat-1")
    records = [
        *baseline_records(),
        concurrent("ngram", 0, pair, 100, 2.5, 8),  # 80 tokens/s: 4x the 20 of none
        concurrent("none", 0, pair, 100, 4.0, 8),  # 50 tokens/s: 2.5x
    ]
    assert concurrency_results(records) == [
        ("8 concurrent ngram", "pass", pytest.approx(4.0)),
        ("8 concurrent none", "fail", pytest.approx(2.5)),
    ]


def test_concurrency_targets_at_the_n_that_was_run_or_not_measured() -> None:
    pair = ("code-1", "chat-1")
    at_two = [*baseline_records(), concurrent("ngram", 0, pair, 100, 2.0, 2)]  # 5x
    assert concurrency_results(at_two) == [
        ("2 concurrent ngram", "pass", pytest.approx(5.0)),
        ("2 concurrent none", "not measured", None),  # none x2 was not run
    ]
    assert concurrency_results(baseline_records()) == [
        ("8 concurrent ngram", "not measured", None),
        ("8 concurrent none", "not measured", None),
    ]
