"""Setting a benchmark up and running it end to end: models, engine, methods, outcome.

``open_session`` loads the target once, tokenizes the workload, sizes the engine's context
to the longest prompt plus the token budget (a full model context would allocate a KV cache
many times larger than needed) and its KV-cache slots to the concurrency (the closed loop holds
at most N requests), installs the forward timer and resolves the methods; the llama.cpp
baselines load the target's GGUF file with the same context and torch's thread count.

The engine keeps no prefix cache: every trial of every method prefills its whole prompt, as the
llama.cpp and transformers baselines do. With one, the first method to run a prompt would pay
its prefill and the methods after it would find it cached, so that a method's rate would
depend on its place in the rotation, and the engine's against the baselines' would compare a
cached prompt with a cold one.
Served (``bench --served``), the engine methods run in a ``hybridspec serve`` that the session
starts on the same options, its prefix cache off as well (``served``), and the session stops it.
Where the trials run in pairs (``pairs_none``), the twin is a second engine: in this process, or
the server's (``serve --bench-twin``).
Both keep the ``suffix`` proposer's pools per session, and every request names its pass as its
session (``harness``, "Passes"): no method finds an earlier answer to the prompt it is timed on.
``execute`` warms up, checks transformers parity, runs the schedule and summarises.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import transformers

from hybridspec.bench import memory_bound
from hybridspec.bench.harness import BenchConfig, BenchPrompt, run_benchmark, warm_up
from hybridspec.bench.hf_baseline import (
    HFMethod,
    ParityResult,
    check_parity,
    hf_model_from_weights,
)
from hybridspec.bench.llamacpp_baseline import (
    LlamaCppMethod,
    LlamaCppOptions,
    llama_cpp_method,
    unavailable_reason,
)
from hybridspec.bench.methods import BenchMethod, EngineMethod, build_methods
from hybridspec.bench.names import BASELINE, LIBRARY_ONLY
from hybridspec.bench.records import Record
from hybridspec.bench.served import (
    ServedMethod,
    check_served_methods,
    served_methods,
    threads_option,
)
from hybridspec.bench.servers import ServerSpec, hybridspec_server, running
from hybridspec.bench.summary import ALL, Agreement, Summary, greedy_agreement
from hybridspec.bench.targets import TargetResult, evaluate_targets
from hybridspec.bench.timing import EngineForwardTimer
from hybridspec.bench.workload import Workload, encode_prompt
from hybridspec.config import DraftConfig, EngineConfig, ModelConfig, SuffixConfig
from hybridspec.engine import Engine, frozen_heap
from hybridspec.errors import check
from hybridspec.model import LoadedModel, embedded_model_path, load_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelOptions:
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    draft: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    quantize: str = "none"  # ModelConfig.quantize of the target and the draft
    threads: int | Literal["auto"] | None = "auto"  # EngineConfig.num_threads


@dataclass(slots=True)
class BenchSession:
    workload: Workload
    prompts: list[BenchPrompt]
    target: LoadedModel
    models: ModelOptions
    methods: list[BenchMethod]
    num_speculative_tokens: int
    closing: contextlib.ExitStack  # closes the engine, or stops the server
    engine: Engine | None  # None: the trials are served
    server: str | None = None  # how the server that serves the trials runs; None: not served
    # ``none`` on a second engine over the same weights, which the other engine methods'
    # trials run beside (``harness``, "Pairs"): in this process, or served by the server's
    # twin (``served``); None: no such trials.
    twin: EngineMethod | ServedMethod | None = None

    def close(self) -> None:
        self.closing.close()


def open_session(
    workload: Workload,
    models: ModelOptions,
    method_names: Sequence[str],
    num_speculative_tokens: int,
    config: BenchConfig,
    server_log: Path | None = None,
) -> BenchSession:
    """Load the target, tokenize the workload and resolve the methods. ``server_log`` given:
    every engine method is served by a ``hybridspec serve`` started here (``served``), whose
    output goes to that file, until the session is closed."""
    if server_log is not None:
        check_served_methods(method_names)
        threads_option(models.threads)
    target_config = ModelConfig(
        models.target, models.dtype, models.device, quantize=models.quantize
    )
    target = load_model(target_config)
    prompts = [
        BenchPrompt(p.id, p.category, tuple(encode_prompt(target.tokenizer, p)))
        for p in workload.prompts
    ]
    longest = max(len(p.token_ids) for p in prompts)
    max_seq_len = longest + config.max_new_tokens + num_speculative_tokens + 1
    check(
        max_seq_len <= target.context_length,
        "max_new_tokens",
        f"the longest prompt ({longest} tokens) plus {config.max_new_tokens} new tokens exceeds "
        f"the model's context of {target.context_length}",
    )
    closing = contextlib.ExitStack()
    session = BenchSession(
        workload, prompts, target, models, [], num_speculative_tokens, closing, None
    )
    try:
        if server_log is None:
            engine = _engine(target, models, num_speculative_tokens, max_seq_len, config)
            closing.callback(engine.close)
            session.engine = engine
            session.methods = _engine_methods(session, engine, max_seq_len, method_names)
            if pairs_none(method_names, config):
                session.twin = _twin(session, max_seq_len, config)
        else:
            twin = pairs_none(method_names, config)
            spec = bench_server(
                models, num_speculative_tokens, max_seq_len, config.concurrency, twin
            )
            url = closing.enter_context(running(spec, server_log))
            encode = functools.partial(target.tokenizer.encode, add_special_tokens=False)
            k = num_speculative_tokens
            session.methods = list(served_methods(url, method_names, k, encode))
            session.server = f"hybridspec serve at {url} ({spec.note})"
            if twin:
                session.twin = ServedMethod(url, BASELINE, k, encode)
    except BaseException:
        closing.close()
        raise
    return session


def bench_server(
    models: ModelOptions,
    num_speculative_tokens: int,
    max_seq_len: int,
    max_num_seqs: int,
    twin: bool = False,
) -> ServerSpec:
    """``hybridspec serve`` on the bench's target and options, prefix cache off, a ``suffix``
    pool per session; ``twin``: with a twin engine for ``none`` (``--bench-twin``)."""
    threads = threads_option(models.threads)
    options = [
        *(["--target", models.target] if models.target is not None else []),
        *(["--draft", models.draft] if models.draft is not None else []),
        *["--dtype", models.dtype, "--device", models.device, "--quantize", models.quantize],
        *["--max-seq-len", str(max_seq_len), "--max-num-seqs", str(max_num_seqs)],
        *["--threads", threads, "-k", str(num_speculative_tokens)],
        *["--prefix-cache-mb", "0", "--suffix-isolation", "per-session"],
        *(["--bench-twin"] if twin else []),
    ]
    note = f"{max_num_seqs} slots, {threads} threads, prefix cache off"
    if twin:
        note += ", a twin engine for none"
    return hybridspec_server("hybridspec-bench", options, threads, note)


def _engine(
    target: LoadedModel,
    models: ModelOptions,
    num_speculative_tokens: int,
    max_seq_len: int,
    config: BenchConfig,
) -> Engine:
    def sized(name: str | None) -> ModelConfig:
        # Every slot holds the longest prompt plus the budget; one slot per request in flight.
        return ModelConfig(
            name,
            models.dtype,
            models.device,
            max_seq_len=max_seq_len,
            max_num_seqs=config.concurrency,
            quantize=models.quantize if name == models.target else "auto",
        )

    return Engine(
        EngineConfig(
            target=sized(models.target),
            draft=DraftConfig(sized(models.draft) if models.draft is not None else None),
            default_num_speculative_tokens=num_speculative_tokens,
            num_threads=models.threads,
            prefix_cache_mb=0,  # every trial prefills its whole prompt (module docstring)
            suffix=SuffixConfig(isolation="per-session"),  # a pool per pass (module docstring)
        ),
        target=target,
    )


def pairs_none(method_names: Sequence[str], config: BenchConfig) -> bool:
    """Whether the bench runs a twin (``harness``, "Pairs"): where it runs N-at-once trials and
    other engine methods to compare with ``none``."""
    engines = [n for n in method_names if n not in LIBRARY_ONLY]
    return config.concurrency > 1 and BASELINE in engines and len(engines) > 1


def _twin(session: BenchSession, max_seq_len: int, config: BenchConfig) -> EngineMethod:
    """``none`` on an engine of its own (``pairs_none``): its weights are the session's, its
    caches its own."""
    models = replace(session.models, draft=None)  # none loads no draft model
    engine = _engine(session.target, models, session.num_speculative_tokens, max_seq_len, config)
    session.closing.callback(engine.close)
    timer = EngineForwardTimer(engine.runtime)
    timer.install()
    session.closing.callback(timer.uninstall)
    return EngineMethod(engine, timer, BASELINE, session.num_speculative_tokens)


def _engine_methods(
    session: BenchSession, engine: Engine, max_seq_len: int, names: Sequence[str]
) -> list[BenchMethod]:
    """The methods on ``engine``, its forward timed while the session is open."""
    k = session.num_speculative_tokens
    gguf = target_gguf(session.models.target)

    def llama_cpp(name: str) -> BenchMethod:
        assert gguf is not None, "unavailable_reason says why there is no GGUF"
        eos = tuple(sorted(engine.eos_token_ids))
        threads = torch.get_num_threads()
        options = LlamaCppOptions(gguf, threads, max_seq_len, eos, k)
        return llama_cpp_method(name, options)

    timer = EngineForwardTimer(engine.runtime)
    timer.install()
    session.closing.callback(timer.uninstall)
    target = session.target
    return build_methods(
        names,
        engine,
        timer,
        k,
        lambda: hf_model_from_weights(target),
        unavailable_reason(gguf) or llama_cpp,
    )


def target_gguf(target: str | None) -> Path | None:
    """The GGUF file the target is loaded from (None: the embedded one), else None."""
    if target is None:
        return embedded_model_path()
    return Path(target) if target.endswith(".gguf") else None


@dataclass(slots=True)
class BenchOutcome:
    records: list[Record]
    summary: Summary
    targets: list[TargetResult]
    parity: ParityResult | None
    agreement: dict[str, Agreement]  # greedy outputs of each method vs the reference's
    reference: str | None  # the engine method whose greedy outputs the others are compared to
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "parity": None if self.parity is None else _parity_json(self.parity),
            "greedy_agreement": {
                "reference": self.reference,
                "methods": {m: a.to_dict() for m, a in self.agreement.items()},
            },
            "targets": [t.to_dict() for t in self.targets],
            "cells": [asdict(c) for c in self.summary.cells()],
            "records": [r.to_dict() for r in self.records],
        }


def _parity_json(parity: ParityResult) -> dict[str, Any]:
    return {
        "identical": parity.identical,
        "message": parity.message(),
        "num_compared": parity.num_compared,
        "first_mismatch": parity.first_mismatch,
        "our_token": parity.our_token,
        "their_token": parity.their_token,
        "logit_gap": parity.logit_gap,
    }


def execute(
    session: BenchSession,
    config: BenchConfig,
    on_trial: Callable[[Record], None] | None = None,
) -> BenchOutcome:
    """Warm up (with the parity check), run every trial, summarise and check the targets."""
    started = time.time()
    load_before = os.getloadavg()
    warm = warm_up(config, session.methods, session.prompts[0])
    if session.twin is not None:
        warm_up(config, [session.twin], session.prompts[0])
    parity = _parity(session, warm)
    if parity is not None and not parity.identical:
        logger.warning("%s", parity.message())
    with frozen_heap():  # no full collection walks the engines and libraries mid-trial
        records = run_benchmark(config, session.methods, session.prompts, on_trial, session.twin)
    summary = Summary(records, session.workload.categories)
    ours = (EngineMethod, ServedMethod)
    engine_names = [m.name for m in session.methods if isinstance(m, ours)]
    reference = BASELINE if BASELINE in engine_names else next(iter(engine_names), None)
    meta = _meta(session, config, started, load_before, records)
    greedy = summary.cell(BASELINE, 0.0, ALL) if 0.0 in summary.temperatures else None
    rate = None if greedy is None else greedy.decode_tokens_per_s
    bound = memory_bound.measure(session.target, rate)
    meta["memory_bound"] = None if bound is None else bound.to_dict()
    return BenchOutcome(
        records,
        summary,
        evaluate_targets(summary),
        parity,
        greedy_agreement(records, reference) if reference else {},
        reference,
        meta,
    )


def _parity(session: BenchSession, warm: dict[str, Any]) -> ParityResult | None:
    """Our first engine method against the first transformers method, on the warm-up run."""
    ours = next((m for m in session.methods if isinstance(m, EngineMethod)), None)
    theirs = next((m for m in session.methods if isinstance(m, HFMethod)), None)
    if ours is None or theirs is None:
        return None
    return check_parity(
        (ours.name, warm[ours.name].requests[0].token_ids),
        (theirs.name, warm[theirs.name].requests[0].token_ids),
        theirs.model,
        session.prompts[0].token_ids,
    )


def _meta(
    session: BenchSession,
    config: BenchConfig,
    started: float,
    load_before: tuple[float, float, float],
    records: Sequence[Record],
) -> dict[str, Any]:
    loads = [r.load_average for r in records]
    return {
        "workload": session.workload.name,
        "categories": {
            n: {"input_grounded": c.input_grounded} for n, c in session.workload.categories.items()
        },
        "num_prompts": len(session.prompts),
        "target": session.target.source,
        "draft": session.models.draft,
        "dtype": str(session.target.dtype).removeprefix("torch."),
        "quantize": session.models.quantize,
        "device": session.models.device,
        "methods": [m.name for m in session.methods],
        "num_speculative_tokens": session.num_speculative_tokens,
        "max_new_tokens": config.max_new_tokens,
        "repeats": config.repeats,
        "temperatures": list(config.temperatures),
        "concurrency": config.concurrency,
        "seed": config.seed,
        "served": session.server,
        "started_unix": started,
        "wall_s": time.time() - started,
        "load_average_before": list(load_before),
        "load_average_during": {"min": min(loads), "max": max(loads)} if loads else None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp": _llama_cpp_version(session.methods),
    }


def _llama_cpp_version(methods: Sequence[BenchMethod]) -> str | None:
    """llama-cpp-python's version where a llama.cpp baseline ran (it is imported then)."""
    if not any(isinstance(m, LlamaCppMethod) for m in methods):
        return None
    import llama_cpp

    return str(llama_cpp.__version__)
