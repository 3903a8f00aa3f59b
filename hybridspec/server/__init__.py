"""The OpenAI-compatible HTTP server: app factory, schemas, routes and metrics.

>>> from hybridspec.server import create_app
>>> app = create_app()  # loads nothing; the engine is built when the app starts
"""

from hybridspec.server.app import create_app
from hybridspec.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
