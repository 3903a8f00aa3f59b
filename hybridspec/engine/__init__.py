"""The engine: scheduling, requests, adaptive speculation and the speculative round."""

from hybridspec.engine.engine import Engine
from hybridspec.engine.loop import EngineLoop
from hybridspec.engine.request import (
    FinishReason,
    GenerationParams,
    GenerationResult,
    RequestOutput,
)

__all__ = [
    "Engine",
    "EngineLoop",
    "FinishReason",
    "GenerationParams",
    "GenerationResult",
    "RequestOutput",
]
