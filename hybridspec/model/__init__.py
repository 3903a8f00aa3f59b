"""The target's runtime: loading, the GGUF reader, the Llama forward, the KV cache, kernels.

``load_model(ModelConfig) -> LoadedModel`` is the entry point; a ``ModelRuntime`` runs one
``ForwardBatch`` per call. Nothing here imports the verifier, the proposers or the engine.
Names are imported on first use (``hybridspec.lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.lazy import lazy_exports

if TYPE_CHECKING:
    from hybridspec.model.llama import LlamaWeights
    from hybridspec.model.loader import LoadedModel, load_model
    from hybridspec.model.runtime import ForwardBatch, ModelRuntime

__all__ = ["ForwardBatch", "LlamaWeights", "LoadedModel", "ModelRuntime", "load_model"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "hybridspec.model.llama": ("LlamaWeights",),
        "hybridspec.model.loader": ("LoadedModel", "load_model"),
        "hybridspec.model.runtime": ("ForwardBatch", "ModelRuntime"),
    },
)
