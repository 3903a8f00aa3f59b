"""The target's runtime: loading, the GGUF reader, the Llama forward, the KV cache, kernels.

``load_model(ModelConfig) -> LoadedModel`` is the entry point; a ``ModelRuntime`` runs one
``ForwardBatch`` per call and returns a ``ForwardOutput``. Nothing here imports the verifier,
the proposers or the engine.
"""

from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.loader import LoadedModel, load_model
from hybridspec.model.runtime import (
    ForwardBatch,
    ForwardObserver,
    ForwardOutput,
    ModelRuntime,
    ObserverHandle,
)
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
    "ForwardObserver",
    "ForwardOutput",
    "LlamaWeights",
    "LoadedModel",
    "ModelRuntime",
    "ObserverHandle",
    "fastest_forward_seconds",
    "load_model",
    "median_forward_seconds",
]
