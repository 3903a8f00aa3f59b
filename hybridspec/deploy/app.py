"""The Ray Serve deployment: one engine per replica behind the same FastAPI app.

Each replica builds the app of ``hybridspec.server`` (``create_app``: the same routes, schemas,
streaming and error mapping as ``hybridspec serve``) with a ``RayCluster`` for the replicas
beside it, and Ray Serve wraps it (``serve.ingress``, late-bound: the app is built in the
replica, from its ``ServerConfig``). The app's lifespan builds and warms the replica's engine,
on its own thread, before the replica reports healthy.

``build_app(args)`` is the application builder for ``serve run`` / ``serve deploy``
(``import_path: hybridspec.deploy:build_app``); ``application(config)`` the same from a
``ServerConfig``. Ray's config file sets the replica count and each replica's CPUs/GPUs
(``deployments: [{name: HybridSpec, num_replicas: .., ray_actor_options: ..}]``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from hybridspec.deploy.options import server_config_from_args
from hybridspec.deploy.replicas import RayCluster, board_name
from hybridspec.engine import Engine
from hybridspec.server.app import create_app
from hybridspec.server.config import API_KEY_ENV, ServerConfig
from hybridspec.server.state import ServerState

DEPLOYMENT_NAME = "HybridSpec"
# Requests a replica takes beyond its engine's capacity: /health and /metrics while the engine
# is full, and the generation requests its engine then refuses itself (503, Retry-After).
OPS_HEADROOM = 8
ROUTER = "hybridspec.deploy.routing:SessionAffinityRouter"
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0


def engine_capacity(config: ServerConfig) -> int:
    """Requests one replica's engine holds: a batch slot each, then its bounded queue."""
    return config.engine.target.max_num_seqs + config.engine.max_queue_size


@serve.ingress()
class EngineReplica:
    """One replica: the server's app over this replica's own engine."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        context = serve.get_replica_context()
        self._app: FastAPI | None = None
        self.cluster = RayCluster(
            board_name(context.app_name, context.deployment), context.replica_id.unique_id
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        # The replica's ``ready:`` line (load and warm-up times) to its stderr, which Ray
        # keeps in the worker's log and forwards to the driver's console.
        server_logger = logging.getLogger("hybridspec.server")
        server_logger.setLevel(logging.INFO)
        if not server_logger.handlers:
            server_logger.addHandler(logging.StreamHandler(sys.stderr))
        self._app = create_app(self.config, cluster=self.cluster)
        return self._app

    async def check_health(self) -> None:
        """Ray's periodic check (``HEALTH_CHECK_PERIOD_S``): the engine's thread answers
        between steps within ``health_timeout_s``, as ``/health`` asks; a replica that fails
        it repeatedly is replaced."""
        state = getattr(self._app.state, "server", None) if self._app is not None else None
        if isinstance(state, ServerState):
            await state.engine_call(_answer, self.config.health_timeout_s)


def _answer(engine: Engine) -> None:
    """Nothing: that the engine thread runs it is the answer."""


def application(
    config: ServerConfig, *, num_replicas: int | None = None, num_cpus: float | None = None
) -> Application:
    """The deployment bound to ``config``; ``num_replicas`` and ``num_cpus`` (per replica) as
    given, else Ray's defaults or the config file's."""
    capacity = engine_capacity(config)
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": capacity + OPS_HEADROOM,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "request_router_config": RequestRouterConfig(
            # Ray annotates every keyword of this pydantic model's __init__ as a dict.
            request_router_class=ROUTER,  # type: ignore[arg-type]
            request_router_kwargs={"capacity": capacity},
        ),
    }
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    if num_cpus is not None:
        options["ray_actor_options"] = actor_options(num_cpus)
    return serve.deployment(**options)(EngineReplica).bind(config)


def actor_options(num_cpus: float) -> dict[str, Any]:
    """A replica that reserves ``num_cpus`` CPUs and runs as many torch and numba threads
    (at least one): replicas sharing a machine split its cores instead of each taking all.
    The threads are set in the environment, which torch and numba read when imported."""
    threads = str(max(int(num_cpus), 1))
    env = {"OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads}
    return {"num_cpus": num_cpus, "runtime_env": {"env_vars": env}}


def build_app(args: dict[str, Any]) -> Application:
    """The application builder of ``serve run`` / ``serve deploy``: ``args`` are the
    ServerConfig's fields, nested or dotted (``hybridspec.deploy.options``). Without an
    ``api_key`` among them, ``HYBRIDSPEC_API_KEY`` in the environment sets it, as for
    ``hybridspec serve``, so that a key need not be written in the config file."""
    config = server_config_from_args(args)
    key = os.environ.get(API_KEY_ENV)
    if config.api_key is None and key:
        config = dataclasses.replace(config, api_key=key)
    return application(config)
