"""``hybridspec serve --replicas N``: N replicas on Ray Serve behind one HTTP endpoint.

Starts a Ray instance of its own on this machine (or joins the cluster at ``ray_address``),
starts Serve's HTTP proxy on the server's host and port (TLS included), deploys the
application and blocks until SIGINT or SIGTERM, then stops the local instance, replicas and
all (on a cluster: deletes the application and leaves). Each replica
reserves an equal share of the machine's CPUs (``num_cpus``), so on one machine the replicas
split the cores between their torch threads rather than oversubscribe them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import ray
from ray import serve

from hybridspec.deploy.app import application
from hybridspec.errors import check
from hybridspec.server.config import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "hybridspec"
LOCAL = "local"  # ray.init's address for a new instance of our own, never someone else's
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_MIDDLEWARES = "hybridspec.deploy.proxy:middlewares"


def replica_cpus(replicas: int, cpus: int | None = None) -> float:
    """Each replica's share of ``cpus`` (default: this machine's), at most 1 if fewer."""
    total = cpus if cpus is not None else os.cpu_count() or 1
    return max(total // replicas, 1) if total >= replicas else total / replicas


def serve_replicas(
    config: ServerConfig, replicas: int, *, ray_address: str = LOCAL, log_level: str = "info"
) -> int:
    """Serve ``config`` with ``replicas`` replicas until a signal stops it; 0 once stopped."""
    check(
        isinstance(replicas, int) and replicas >= 1,
        "replicas",
        f"expected an integer >= 1, got {replicas!r}",
    )
    start = time.perf_counter()
    level = getattr(logging, log_level.upper(), logging.INFO)
    if ray_address == LOCAL:
        # Serve's proxy reads this when it starts (a cluster's nodes set it before ray start).
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_MIDDLEWARES)
        ray.init(address=LOCAL, include_dashboard=False, logging_level=level)
        num_cpus: float | None = replica_cpus(replicas, int(ray.cluster_resources()["CPU"]))
    else:  # a cluster's own config decides what a replica reserves
        ray.init(address=ray_address, logging_level=level)
        num_cpus = None
    stop = _stop_on_signals()
    try:
        serve.start(
            http_options={
                "host": config.host,
                "port": config.port,
                "ssl_certfile": config.ssl_certfile,
                "ssl_keyfile": config.ssl_keyfile,
                "ssl_keyfile_password": config.ssl_keyfile_password,
            }
        )
        app = application(config, num_replicas=replicas, num_cpus=num_cpus)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        scheme = "https" if config.ssl_certfile else "http"
        logger.info(
            "ready: %d replicas of %s at %s://%s:%d, %s CPUs each; %.1f s",
            replicas,
            config.model_names()[0],
            scheme,
            config.host,
            config.port,
            "the cluster's" if num_cpus is None else f"{num_cpus:g}",
            time.perf_counter() - start,
        )
        stop.wait()
    finally:
        if ray_address != LOCAL:  # leave the cluster as it was; a local instance just stops
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handle(signum: int, _frame: object) -> None:
        logger.info("signal %d: stopping the replicas", signum)
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    return stop
