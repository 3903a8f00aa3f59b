"""The engine on Ray Serve: many replicas behind one OpenAI endpoint (the ``ray`` extra).

>>> from hybridspec.deploy import build_app   # serve run hybridspec.deploy:build_app
>>> from hybridspec.deploy import application  # serve.run(application(ServerConfig(...)))

Each replica runs ``hybridspec.server``'s app over its own engine (``app``); the proxy routes
least-loaded, and a request with a session header to its session's replica (``routing``);
``/metrics`` and ``/health`` see every replica (``replicas``). ``hybridspec serve --replicas
N`` runs it on one machine (``local``). Names are imported on first use: importing the
package alone needs no Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.lazy import lazy_exports

if TYPE_CHECKING:
    from hybridspec.deploy.app import application, build_app
    from hybridspec.deploy.local import serve_replicas
    from hybridspec.deploy.options import server_config_from_args

__all__ = ["application", "build_app", "serve_replicas", "server_config_from_args"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "hybridspec.deploy.app": ("application", "build_app"),
        "hybridspec.deploy.local": ("serve_replicas",),
        "hybridspec.deploy.options": ("server_config_from_args",),
    },
)
