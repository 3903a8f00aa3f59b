"""What the benchmark compares: methods that turn prompt token ids into timed generations.

A method is either one of the engine's proposers (``none``, ``ngram``, ``draft`` or any
registered one), run through ``Engine.generate`` with a forward timer installed on the target
runtime, a transformers baseline (``hf-plain``, ``hf-prompt-lookup``; see ``hf_baseline``) or a
llama.cpp one (``llamacpp-plain``, ``llamacpp-prompt-lookup``; see ``llamacpp_baseline``), which
is skipped, with a warning, where llama.cpp cannot run. Names are resolved here, once; the
harness sees only the ``BenchMethod`` protocol.

Every method returns a ``records.Measurement``. Engine methods can also run a closed loop
(``ClosedLoop``): M requests with at most N in the engine at once, like N clients each sending
requests back to back; and one beside another method's on a second engine, the two loops by
turns (``in_lockstep``), which times both through the same seconds of the machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from transformers import LlamaForCausalLM

from hybridspec.bench.hf_baseline import HFMethod
from hybridspec.bench.names import HF_METHODS, HF_PROMPT_LOOKUP, LLAMACPP_METHODS
from hybridspec.bench.records import Measurement, Speculation
from hybridspec.bench.timing import EngineForwardTimer
from hybridspec.engine import (
    Engine,
    FinishReason,
    GenerationParams,
    GenerationResult,
    RequestOutput,
)
from hybridspec.errors import HybridSpecError, check
from hybridspec.types import SamplingParams

logger = logging.getLogger(__name__)


class BenchMethod(Protocol):
    """One prompt, timed. ``session``: the session the request names (``harness.pass_session``;
    None: none); a method that keeps no text from one request to the next ignores it."""

    name: str

    def run(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        session: str | None = None,
    ) -> Measurement: ...


@runtime_checkable
class ConcurrentMethod(Protocol):
    """A method that can also run several requests at once (the engine's continuous batching)."""

    name: str

    def run_concurrent(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        max_new_tokens: int,
        concurrency: int,
        session: str | None = None,
    ) -> Measurement:
        """Run every prompt, at most ``concurrency`` at once (see ``closed_loop``), each request
        naming ``session``."""
        ...


@runtime_checkable
class PairedMethod(Protocol):
    """A method whose closed loop can run beside ``none``'s on a second engine (its twin), the
    two by turns, each timed by its own turns (``harness``, "Pairs")."""

    name: str

    def run_beside(
        self,
        other: Any,  # a method of the same kind: an EngineMethod's, or a ServedMethod's
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        max_new_tokens: int,
        concurrency: int,
        session: str | None = None,
    ) -> tuple[Measurement, Measurement]:
        """This method's loop and ``other``'s over the same requests: their measurements."""
        ...


class SteppedEngine(Protocol):
    """What ``closed_loop`` drives: the part of ``Engine`` a server loop uses."""

    def add_request(self, prompt_token_ids: Sequence[int], params: GenerationParams) -> str: ...

    def step(self) -> list[RequestOutput]: ...


class ClosedLoop:
    """M requests through one engine with at most N = ``concurrency`` in it, as N clients
    would, advanced one engine step at a time (``turn``).

    The first N are added at once; each time a step finishes one, the next is added, and the
    engine admits it on its next step. Example, M = 5, N = 2, requests 0 and 1 running: 1
    finishes, 2 is added; 0 finishes, 3 is added; 2 and 3 finish in the same step, 4 is added
    and runs alone to the end. ``seconds`` sums the loop's own turns, and a request's first
    token time (``first_token_s``) counts them too: from the turn that added it to the end of
    the step that gave its first token.
    """

    def __init__(
        self,
        engine: SteppedEngine,
        prompts: Sequence[Sequence[int]],
        params: Sequence[GenerationParams],
        concurrency: int,
    ) -> None:
        check(concurrency >= 1, "concurrency", f"expected >= 1, got {concurrency}")
        check(len(prompts) == len(params), "params", f"expected {len(prompts)}, got {len(params)}")
        self.seconds = 0.0
        self._engine = engine
        self._prompts = prompts
        self._params = params
        self._concurrency = concurrency
        self._in_flight: dict[str, int] = {}  # request id -> index into prompts
        self._num_added = 0
        self._added_at: list[float] = []  # per request added: the loop's seconds then
        self._first_token_s: dict[int, float] = {}
        self._results: dict[int, GenerationResult] = {}

    @property
    def done(self) -> bool:
        return len(self._results) == len(self._prompts)

    def turn(self) -> None:
        """Add what the loop's clients would, run one engine step, collect what it finished."""
        start = time.perf_counter()
        prompts, in_flight = self._prompts, self._in_flight
        while self._num_added < len(prompts) and len(in_flight) < self._concurrency:
            request_id = self._engine.add_request(
                prompts[self._num_added], self._params[self._num_added]
            )
            in_flight[request_id] = self._num_added
            self._added_at.append(self.seconds)
            self._num_added += 1
        outputs = self._engine.step()
        self.seconds += time.perf_counter() - start
        for output in outputs:
            index = in_flight[output.request_id]
            if output.new_token_ids and index not in self._first_token_s:
                self._first_token_s[index] = self.seconds - self._added_at[index]
            if output.result is not None:
                self._results[index] = output.result
                del in_flight[output.request_id]

    def first_token_s(self, index: int) -> float | None:
        """The loop's seconds from adding request ``index`` to its first token; None: none yet."""
        return self._first_token_s.get(index)

    def results(self) -> list[GenerationResult]:
        """The M results, in request order (once ``done``)."""
        assert self.done, "the loop has requests left"
        return [self._results[i] for i in range(len(self._prompts))]


def closed_loop(
    engine: SteppedEngine,
    prompts: Sequence[Sequence[int]],
    params: Sequence[GenerationParams],
    concurrency: int,
) -> tuple[ClosedLoop, float]:
    """Run a ``ClosedLoop`` to its end; return it and the wall seconds from the first add to
    the last finish."""
    loop = ClosedLoop(engine, prompts, params, concurrency)
    start = time.perf_counter()
    while not loop.done:
        loop.turn()
    return loop, time.perf_counter() - start


def in_lockstep(loops: Sequence[ClosedLoop]) -> None:
    """Run closed loops on separate engines by turns until all are done, the next turn always
    the unfinished loop's with the fewest seconds so far (the first on a tie).

    A machine whose speed drifts within seconds (other processes, a shared host) moves the
    rate of a loop run a few seconds after another by more than the cost of what they differ
    in. By turns of one step each, the loops run through the same seconds of the machine in
    proportion to their own time, so each one's ``seconds`` sees the same speed, and a ratio of
    their rates cancels the drift. Example: loops a and b, steps of 10 ms in a and 20 ms in b:
    a, b, a, a, b, a, a, b, ...
    """
    while True:
        waiting = [loop for loop in loops if not loop.done]
        if not waiting:
            return
        min(waiting, key=lambda loop: loop.seconds).turn()


class EngineMethod:
    """One of the engine's proposers with a fixed K."""

    def __init__(self, engine: Engine, timer: EngineForwardTimer, proposer: str, k: int) -> None:
        engine.resolve_proposer(proposer)  # raises for unknown or unavailable ones
        self.name = proposer
        self._engine = engine
        self._timer = timer
        self._k = k

    def _params(
        self, sampling: SamplingParams, max_new_tokens: int, session: str | None
    ) -> GenerationParams:
        return GenerationParams(
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            proposer=self.name,
            num_speculative_tokens=self._k,
            session=session,
        )

    def run(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        session: str | None = None,
    ) -> Measurement:
        return self.run_concurrent([prompt_token_ids], [sampling], max_new_tokens, 1, session)

    def run_concurrent(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        max_new_tokens: int,
        concurrency: int,
        session: str | None = None,
    ) -> Measurement:
        """Every prompt through ``closed_loop``, at most ``concurrency`` in the engine at once."""
        params = self._ready(samplings, max_new_tokens, session)
        loop, elapsed = closed_loop(self._engine, prompts, params, concurrency)
        return self._measurement(loop, elapsed)

    def run_beside(
        self,
        other: EngineMethod,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        max_new_tokens: int,
        concurrency: int,
        session: str | None = None,
    ) -> tuple[Measurement, Measurement]:
        """This method's closed loop and ``other``'s (on another engine) over the same
        requests, by turns (``in_lockstep``); each measurement's times are its own loop's
        seconds (``ClosedLoop``)."""
        assert other._engine is not self._engine, "a loop beside another needs its own engine"
        mine, theirs = (
            ClosedLoop(
                m._engine, prompts, m._ready(samplings, max_new_tokens, session), concurrency
            )
            for m in (self, other)
        )
        in_lockstep([mine, theirs])
        return self._measurement(mine, mine.seconds), other._measurement(theirs, theirs.seconds)

    def _ready(
        self, samplings: Sequence[SamplingParams], max_new_tokens: int, session: str | None
    ) -> list[GenerationParams]:
        """Ready the engine and the timer for a loop; each request's parameters."""
        assert not self._engine.has_unfinished(), "the bench needs the engine to itself"
        self._timer.reset()
        return [self._params(s, max_new_tokens, session) for s in samplings]

    def _measurement(self, loop: ClosedLoop, elapsed: float) -> Measurement:
        results = loop.results()
        first = loop.first_token_s(0) if len(results) == 1 else None
        requests = tuple(_speculation(r) for r in results)
        return Measurement(requests, elapsed, self._timer.seconds, first)


def _speculation(result: GenerationResult) -> Speculation:
    if result.finish_reason is FinishReason.ERROR:
        raise HybridSpecError(f"bench request failed: {result.error}")
    stats = result.stats
    return Speculation(
        token_ids=tuple(result.token_ids),
        num_generated=stats.generated_tokens,
        target_forwards=stats.target_forwards,
        num_drafts=stats.draft_tokens_proposed,
        num_accepted_tokens=stats.draft_tokens_accepted,
        accepted_per_position=tuple(stats.accepted_per_position),
        proposed_per_position=tuple(stats.proposed_per_position),
    )


def build_methods(
    names: Sequence[str],
    engine: Engine,
    timer: EngineForwardTimer,
    k: int,
    hf_model: Callable[[], LlamaForCausalLM],
    llama_cpp: Callable[[str], BenchMethod] | str,
) -> list[BenchMethod]:
    """Resolve method names once: the baselines by name, anything else a proposer.

    ``hf_model`` is called (once) only when a transformers baseline is asked for; ``llama_cpp``
    builds a llama.cpp baseline by name, or is the reason they cannot run, and then those asked
    for are skipped with a warning. Raises when no method is left to run.
    """
    check(
        bool(names) and len(set(names)) == len(names),
        "methods",
        f"expected distinct method names, got {list(names)}",
    )
    known = [
        *engine.available_proposers(),
        *engine.unavailable_proposers(),
        *HF_METHODS,
        *LLAMACPP_METHODS,
    ]
    unknown = [n for n in names if n not in known]
    check(not unknown, "methods", f"unknown {unknown}; known: {sorted(set(known))}")
    skipped = [n for n in names if n in LLAMACPP_METHODS and isinstance(llama_cpp, str)]
    if skipped:
        logger.warning("skipping %s: %s", ", ".join(skipped), llama_cpp)
    methods: list[BenchMethod] = []
    model: LlamaForCausalLM | None = None
    eos = sorted(engine.eos_token_ids)
    for name in names:
        if name in HF_METHODS:
            model = model if model is not None else hf_model()
            methods.append(HFMethod(name, model, eos, k if name == HF_PROMPT_LOOKUP else None))
        elif name in LLAMACPP_METHODS:
            if not isinstance(llama_cpp, str):
                methods.append(llama_cpp(name))
        else:
            methods.append(EngineMethod(engine, timer, name, k))
    check(bool(methods), "methods", f"none of {list(names)} can run here (skipped {skipped})")
    return methods
