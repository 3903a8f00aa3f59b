"""What the benchmark compares: methods that turn prompt token ids into timed generations.

A method is either one of the engine's proposers (``none``, ``ngram``, ``draft`` or any
registered one), run through ``Engine.generate`` with a forward timer installed on the target
runtime, a transformers baseline (``hf-plain``, ``hf-prompt-lookup``; see ``hf_baseline``) or a
llama.cpp one (``llamacpp-plain``, ``llamacpp-prompt-lookup``; see ``llamacpp_baseline``), which
is skipped, with a warning, where llama.cpp cannot run. Names are resolved here, once; the
harness sees only the ``BenchMethod`` protocol.

Every method returns a ``records.Measurement``. Engine methods can also run a closed loop
(``closed_loop``): M requests with at most N in the engine at once, like N clients each sending
requests back to back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

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


class SteppedEngine(Protocol):
    """What ``closed_loop`` drives: the part of ``Engine`` a server loop uses."""

    def add_request(self, prompt_token_ids: Sequence[int], params: GenerationParams) -> str: ...

    def step(self) -> list[RequestOutput]: ...


def closed_loop(
    engine: SteppedEngine,
    prompts: Sequence[Sequence[int]],
    params: Sequence[GenerationParams],
    concurrency: int,
) -> tuple[list[GenerationResult], float]:
    """Run M requests with at most N = ``concurrency`` in the engine, as N clients would.

    The first N are added at once; each time a step finishes one, the next is added, and the
    engine admits it on its next step. Returns the M results in request order and the wall
    seconds from the first add to the last finish. Example, M = 5, N = 2, requests 0 and 1
    running: 1 finishes, 2 is added; 0 finishes, 3 is added; 2 and 3 finish in the same step,
    4 is added and runs alone to the end.
    """
    check(concurrency >= 1, "concurrency", f"expected >= 1, got {concurrency}")
    check(len(prompts) == len(params), "params", f"expected {len(prompts)}, got {len(params)}")
    start = time.perf_counter()
    in_flight: dict[str, int] = {}  # request id -> index into prompts
    num_added = 0
    results: dict[int, GenerationResult] = {}
    while len(results) < len(prompts):
        while num_added < len(prompts) and len(in_flight) < concurrency:
            in_flight[engine.add_request(prompts[num_added], params[num_added])] = num_added
            num_added += 1
        for output in engine.step():
            if output.result is not None:
                results[in_flight.pop(output.request_id)] = output.result
    elapsed = time.perf_counter() - start
    return [results[i] for i in range(len(prompts))], elapsed


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
        engine = self._engine
        assert not engine.has_unfinished(), "the bench needs the engine to itself"
        self._timer.reset()
        params = [self._params(s, max_new_tokens, session) for s in samplings]
        results, elapsed = closed_loop(engine, prompts, params, concurrency)
        first = results[0].stats.time_to_first_token_s if len(results) == 1 else None
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
