"""The target's runtime: loading, the GGUF reader, the Llama forward, the KV cache, kernels.

``load_model(ModelConfig) -> LoadedModel`` is the entry point; a ``ModelRuntime`` runs one
``ForwardBatch`` per call and returns a ``ForwardOutput``. Nothing here imports the verifier,
the proposers or the engine. Names are imported on first use (``hybridspec.lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.lazy import lazy_exports

if TYPE_CHECKING:
    from hybridspec.model.gguf_file import GGUFFile
    from hybridspec.model.gguf_rows import MappedRows
    from hybridspec.model.llama_weights import LlamaWeights, dense
    from hybridspec.model.loader import LoadedModel, embedded_model_path, load_model
    from hybridspec.model.qgemm import BlockLinear, Kernel, block_kernel
    from hybridspec.model.quant import PackedWeight, QuantizedWeight, held_bytes, quantize
    from hybridspec.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
    from hybridspec.model.runtime import (
        ForwardBatch,
        ForwardOutput,
        ModelRuntime,
        ObserverHandle,
        synchronize,
    )
    from hybridspec.model.thread_policy import ThreadController
    from hybridspec.model.threads import (
        num_threads,
        openmp_defaults,
        prompt_step,
        set_num_threads,
        thread_controller,
        wait_mode,
    )
    from hybridspec.model.timing import (
        fastest_forward_seconds,
        median_forward_seconds,
    )
    from hybridspec.model.tokenizer import as_transformers

__all__ = [
    "BlockLinear",
    "ForwardBatch",
    "ForwardOutput",
    "GGUFFile",
    "Kernel",
    "LlamaWeights",
    "LoadedModel",
    "MappedRows",
    "ModelRuntime",
    "ObserverHandle",
    "PackedWeight",
    "QuantizedWeight",
    "ThreadController",
    "apply_rope",
    "as_transformers",
    "block_kernel",
    "dense",
    "embedded_model_path",
    "fastest_forward_seconds",
    "held_bytes",
    "load_model",
    "median_forward_seconds",
    "num_threads",
    "openmp_defaults",
    "prompt_step",
    "quantize",
    "rope_cos_sin",
    "rope_inv_freq",
    "set_num_threads",
    "synchronize",
    "thread_controller",
    "wait_mode",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "hybridspec.model.gguf_file": ("GGUFFile",),
        "hybridspec.model.gguf_rows": ("MappedRows",),
        "hybridspec.model.llama_weights": ("LlamaWeights", "dense"),
        "hybridspec.model.loader": ("LoadedModel", "embedded_model_path", "load_model"),
        "hybridspec.model.qgemm": ("BlockLinear", "Kernel", "block_kernel"),
        "hybridspec.model.quant": ("PackedWeight", "QuantizedWeight", "held_bytes", "quantize"),
        "hybridspec.model.rope": ("apply_rope", "rope_cos_sin", "rope_inv_freq"),
        "hybridspec.model.tokenizer": ("as_transformers",),
        "hybridspec.model.runtime": (
            "ForwardBatch",
            "ForwardOutput",
            "ModelRuntime",
            "ObserverHandle",
            "synchronize",
        ),
        "hybridspec.model.thread_policy": ("ThreadController",),
        "hybridspec.model.threads": (
            "num_threads",
            "openmp_defaults",
            "prompt_step",
            "set_num_threads",
            "thread_controller",
            "wait_mode",
        ),
        "hybridspec.model.timing": (
            "fastest_forward_seconds",
            "median_forward_seconds",
        ),
    },
)
