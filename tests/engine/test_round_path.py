"""A round's call path (ARCHITECTURE.md, "One round"): ``Engine.step`` enters each of the
engine's modules once, and each stage's collaborators are its own.

A profiler hook records, over every step of a few requests (several proposers, prompt and token
log-probabilities, a prompt's choices), which of ``hybridspec/engine/``'s modules each call
enters and under which stage (the module ``engine.py`` called into). The request and its parts
are the round's data and the cost models are its learned state: every stage reads or writes
them. ``model/`` below is the runtime every stage may use (its thread policy included).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from hybridspec import Engine, GenerationParams
from hybridspec.engine import RequestOutput

# Engine.step's stages, in order: the modules engine.py calls into during a round.
PATH = ("scheduler", "proposer_pool", "batch", "round", "speculation", "finish")
# The round's data (a request and its parts) and learned state (costs, adaptive speculation).
SHARED = {"request", "features", "logprobs", "stats", "detokenizer"} | {
    "speculation",
    "step_budget",
    "proposer_costs",
}
# What the finish stage gives back of what the schedule took: a slot, a place in the batch.
GIVEN_BACK = {"scheduler", "prefix_cache"}


def _engine_module(frame: FrameType) -> str | None:
    """``scheduler`` for hybridspec/engine/scheduler.py; None outside the engine's package."""
    path = frame.f_code.co_filename.replace("\\", "/")
    head, _, name = path.rpartition("/hybridspec/engine/")
    return name.removesuffix(".py") if head and "/" not in name else None


def _trace_step(engine: Engine) -> tuple[list[RequestOutput], list[tuple[str, set[str]]]]:
    """One step, and its stages: each module engine.py called into, with the engine modules
    entered beneath it (consecutive calls into one module are one stage)."""
    stages: list[tuple[str, set[str]]] = []
    stack: list[str | None] = []

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "return":
            if stack:
                stack.pop()
            return
        if event != "call":
            return
        module, caller = _engine_module(frame), stack[-1] if stack else None
        if caller == "engine" and module not in (None, "engine"):
            if not stages or stages[-1][0] != module:
                stages.append((module, set()))  # type: ignore[arg-type]
        elif module is not None and stages and caller != "engine":
            stages[-1][1].add(module)
        stack.append(module if module is not None else caller)

    profile: Callable[..., Any] | None = sys.getprofile()
    stack.append("engine")
    sys.setprofile(hook)
    try:
        outputs = engine.step()
    finally:
        sys.setprofile(profile)
    return outputs, stages


def test_a_round_enters_each_engine_module_in_one_stage(engine: Engine) -> None:
    for i, proposer in enumerate(["ngram", "draft", "none"]):
        params = GenerationParams(
            max_new_tokens=3 + 2 * i,
            proposer=proposer,
            logprobs=1,
            prompt_logprobs=1 if i == 0 else None,
        )
        engine.add_request([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], params)
    engine.add_choices([[7, 8, 9, 10]], GenerationParams(max_new_tokens=4), n=2)
    seen: set[str] = set()
    finished = 0
    for _ in range(40):
        if not engine.has_unfinished():
            break
        outputs, stages = _trace_step(engine)
        order = [module for module, _ in stages]
        assert len(order) == len(set(order)), f"a module entered twice from engine.py: {order}"
        assert order == [m for m in PATH if m in order], f"out of the path's order: {order}"
        for i, (module, entered) in enumerate(stages):
            for other, other_entered in stages[i + 1 :]:
                twice = ((entered | {module}) & (other_entered | {other})) - SHARED
                if "finish" in (module, other):
                    twice -= GIVEN_BACK
                assert not twice, f"{sorted(twice)} entered under {module!r} and {other!r}"
        seen.update(order)
        finished += sum(output.finished for output in outputs)
    assert not engine.has_unfinished() and finished == 5
    assert {"scheduler", "proposer_pool", "batch", "round", "finish"} <= seen
