"""The app's routers, one per endpoint group: ``completions`` (``/v1/completions``,
``/v1/chat/completions``), ``models`` (``/v1/models``), ``ops`` (``/health``, ``/metrics``,
and ``/bench/hold`` under ``--bench-twin``),
``tokenize`` (``/tokenize``, ``/detokenize``), ``responses`` (``/v1/responses``) and
``playground`` (the page at ``/`` and ``/playground``)."""

from __future__ import annotations

from hybridspec.server.routes import (
    completions,
    models,
    ops,
    playground,
    responses,
    tokenize,
)

ROUTERS = (
    completions.router,
    models.router,
    ops.router,
    tokenize.router,
    responses.router,
    playground.router,
)

__all__ = ["ROUTERS"]
