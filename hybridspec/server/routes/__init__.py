"""The app's routers, one per endpoint group: ``completions`` (``/v1/completions``,
``/v1/chat/completions``), ``models`` (``/v1/models``) and ``ops`` (``/health``, ``/metrics``)."""

from __future__ import annotations

from hybridspec.server.routes import completions, models, ops

ROUTERS = (completions.router, models.router, ops.router)

__all__ = ["ROUTERS"]
