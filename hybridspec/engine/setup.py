"""The engine's parts sized from its configuration and the loaded target: the prefix cache's
budget and slots, the time bound of shared prefill steps, adaptive speculation's policy
(``Engine.__init__`` builds its parts from these)."""

from __future__ import annotations

import logging

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
