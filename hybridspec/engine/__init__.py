"""The engine: scheduling, requests, adaptive speculation and the speculative round.

Names are imported on first use (``hybridspec.lazy``), so that importing a light module of this
package (``hybridspec.engine.scheduler``) does not load the model runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.lazy import lazy_exports

if TYPE_CHECKING:
    from hybridspec.engine.engine import Engine
    from hybridspec.engine.logprobs import Logprobs
    from hybridspec.engine.loop import EngineLoop
    from hybridspec.engine.prefix_cache import kv_bytes_per_token
    from hybridspec.engine.request import (
        FinishReason,
        GenerationParams,
        GenerationResult,
        RequestOutput,
    )
    from hybridspec.engine.setup import freeze_heap, frozen_heap
    from hybridspec.engine.warmup import warm_up

__all__ = [
    "Engine",
    "EngineLoop",
    "FinishReason",
    "GenerationParams",
    "GenerationResult",
    "Logprobs",
    "RequestOutput",
    "freeze_heap",
    "frozen_heap",
    "kv_bytes_per_token",
    "warm_up",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "hybridspec.engine.engine": ("Engine",),
        "hybridspec.engine.logprobs": ("Logprobs",),
        "hybridspec.engine.loop": ("EngineLoop",),
        "hybridspec.engine.prefix_cache": ("kv_bytes_per_token",),
        "hybridspec.engine.request": (
            "FinishReason",
            "GenerationParams",
            "GenerationResult",
            "RequestOutput",
        ),
        "hybridspec.engine.setup": ("freeze_heap", "frozen_heap"),
        "hybridspec.engine.warmup": ("warm_up",),
    },
)
