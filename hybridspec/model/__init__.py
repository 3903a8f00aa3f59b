"""The target's runtime: loading, the GGUF reader, the Llama forward, the KV cache, kernels.

``load_model(ModelConfig) -> LoadedModel`` is the entry point; a ``ModelRuntime`` runs one
``ForwardBatch`` per call. Nothing here imports the verifier, the proposers or the engine.
"""

from hybridspec.model.llama import LlamaWeights
from hybridspec.model.loader import LoadedModel, load_model
from hybridspec.model.runtime import ForwardBatch, ModelRuntime
from hybridspec.model.timing import (
    COST_REPEATS,
    TIMING_CONTEXT,
    fastest_forward_seconds,
    median_forward_seconds,
)

__all__ = [
    "COST_REPEATS",
    "TIMING_CONTEXT",
    "ForwardBatch",
    "LlamaWeights",
    "LoadedModel",
    "ModelRuntime",
    "fastest_forward_seconds",
    "load_model",
    "median_forward_seconds",
]
