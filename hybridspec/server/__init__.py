"""The OpenAI-compatible HTTP server: app factory, protocol (schemas), routes and streaming.

>>> from hybridspec.server import create_app
>>> app = create_app()  # loads nothing; the engine is built and warmed when the app starts

Names are imported on first use (``hybridspec.lazy``): ``hybridspec.server.config`` alone does
not import fastapi or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.lazy import lazy_exports

if TYPE_CHECKING:
    from hybridspec.server.app import create_app
    from hybridspec.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {"hybridspec.server.app": ("create_app",), "hybridspec.server.config": ("ServerConfig",)},
)
