"""The engine's parts sized from its configuration and the loaded target: the prefix cache's
budget and slots, the time bound of shared prefill steps, adaptive speculation's policy
(``Engine.__init__`` builds its parts from these); and the heap frozen once a process's
engines are built and warm (``freeze_heap``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridspec.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from hybridspec.engine.prefix_cache import (
    default_prefix_cache_mb,
    kv_bytes_per_token,
    num_slots_for,
    physical_memory_bytes,
)
from hybridspec.engine.speculation import SpeculationPolicy, measure_verify_token_cost
from hybridspec.engine.step_budget import FittedForwardCost, StepBudget
from hybridspec.model import LoadedModel, ModelRuntime

logger = logging.getLogger(__name__)


def prefix_cache_mb(config: EngineConfig, target: LoadedModel) -> int:
    """The prefix cache's budget of resident memory (0: off). By default it is on where
    reuse is exact to the bit: the native runtime in bfloat16 on CPU, row-invariant (in
    float32 a token decoded alone gets keys 1e-7 off its prefilled ones)."""
    budget = config.prefix_cache_mb
    if budget is None:
        exact = target.is_native and target.dtype == torch.bfloat16
        on_cpu = torch.device(config.target.device).type == "cpu"
        budget = default_prefix_cache_mb() if exact and on_cpu else 0
    return budget


def prefix_cache_slots(config: EngineConfig, target: LoadedModel, budget_mb: int) -> int:
    """Virtual slots the prefix cache gets beyond the running requests' (``num_slots_for``)."""
    max_seq_len = config.target.max_seq_len or target.max_seq_len or target.context_length
    per_token = kv_bytes_per_token(target)
    return num_slots_for(budget_mb, per_token, max_seq_len, physical_memory_bytes())


def step_budget(config: EngineConfig, forward_cost: FittedForwardCost) -> StepBudget | None:
    """The time bound of steps that prefill beside decoding requests (``step_budget``); None
    where the configuration turns it off."""
    ratio = config.prefill_step_ratio
    if ratio is None:
        return None
    return StepBudget(
        forward_cost, ratio, config.prefill_step_min_s, max_seconds=config.prefill_step_max_s
    )


def speculation_policy(config: EngineConfig, runtime: ModelRuntime) -> SpeculationPolicy | None:
    """Adaptive speculation's policy, its verify cost per token measured on ``runtime`` unless
    configured; None where it is off."""
    if not config.adaptive_speculation:
        return None
    cost = config.verify_token_cost
    if cost is None:
        cost = measure_verify_token_cost(runtime, MAX_SPECULATIVE_TOKENS)
        logger.info("verify cost per token: %.4f of a forward", cost)
    return SpeculationPolicy(cost)


def freeze_heap() -> float:
    """Collect, then move every object left to the permanent generation (``gc.freeze``), which
    no later collection visits: after start-up that is the model, torch's and the libraries'
    objects, hundreds of thousands, whose full collection (CPython runs one whenever a quarter
    more objects have survived since the last) holds the interpreter lock while it visits them
    all (tenths of a second quiet, seconds on a busy 2-core machine), a pause in whichever step
    it lands in. Requests' own objects are collected as before; a reference cycle among the
    frozen objects that later becomes garbage stays allocated, so this is for a process that
    keeps its engines to the end (``hybridspec serve``: ``ServerConfig.freeze_heap``), or for a
    while (``frozen_heap``). Returns the seconds it took."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - start


@contextmanager
def frozen_heap() -> Iterator[None]:
    """``freeze_heap`` for the block, then ``gc.unfreeze``: the objects frozen go back to the
    oldest generation, collected as before (the bench's trials, in a process that may go on to
    other work: a test suite's)."""
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()
