"""hybridspec: lossless speculative decoding with per-request pluggable proposers.

>>> from hybridspec import Engine
>>> engine = Engine()  # the embedded SmolLM2-135M-Instruct
>>> engine.generate("Say hi", proposer="ngram", max_new_tokens=16).text  # doctest: +SKIP

Importing the package loads nothing heavy: each public name is imported on first use (torch
and transformers come with ``Engine``, not with ``import hybridspec``; numba with the first
request that drafts with n-grams, or the numba attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.lazy import lazy_exports

if TYPE_CHECKING:
    from hybridspec.config import DraftConfig, EngineConfig, ModelConfig, NgramConfig
    from hybridspec.engine import (
        Engine,
        FinishReason,
        GenerationParams,
        GenerationResult,
        Logprobs,
    )
    from hybridspec.errors import (
        CapacityError,
        ContextLengthError,
        HybridSpecError,
        InvalidRequestError,
        ModelLoadError,
        UnknownModelError,
    )
    from hybridspec.proposers import Proposer, ProposerContext, register_proposer
    from hybridspec.types import CommitInfo, Proposal, ProposeRequest, SamplingParams, Session

__all__ = [
    "CapacityError",
    "CommitInfo",
    "ContextLengthError",
    "DraftConfig",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "GenerationParams",
    "GenerationResult",
    "HybridSpecError",
    "InvalidRequestError",
    "Logprobs",
    "ModelConfig",
    "ModelLoadError",
    "NgramConfig",
    "Proposal",
    "ProposeRequest",
    "Proposer",
    "ProposerContext",
    "SamplingParams",
    "Session",
    "UnknownModelError",
    "register_proposer",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "hybridspec.config": ("DraftConfig", "EngineConfig", "ModelConfig", "NgramConfig"),
        "hybridspec.engine": (
            "Engine",
            "FinishReason",
            "GenerationParams",
            "GenerationResult",
            "Logprobs",
        ),
        "hybridspec.errors": (
            "CapacityError",
            "ContextLengthError",
            "HybridSpecError",
            "InvalidRequestError",
            "ModelLoadError",
            "UnknownModelError",
        ),
        "hybridspec.proposers": ("Proposer", "ProposerContext", "register_proposer"),
        "hybridspec.types": (
            "CommitInfo",
            "Proposal",
            "ProposeRequest",
            "SamplingParams",
            "Session",
        ),
    },
)
