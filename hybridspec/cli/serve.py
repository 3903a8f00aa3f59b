"""``hybridspec serve``: its options (``ServerConfig``'s defaults), the ``ServerConfig`` and
uvicorn configuration built from them, and the command itself."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import time
from typing import TYPE_CHECKING

from hybridspec.cli.options import (
    _LOG_LEVELS,
    ENGINE_DEFAULTS,
    SERVER_DEFAULTS,
    add_engine_options,
    engine_config,
)
from hybridspec.config import TenantConfig
from hybridspec.server.config import API_KEY_ENV, API_KEYS_FILE_ENV, CACHE_ISOLATION, ServerConfig
from hybridspec.server.tenants import read_key_file

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI


def add_serve_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` to the subcommands of the ``hybridspec`` parser."""
    serve: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics. Requests may pick their proposer and K with the extension fields "
        "'proposer' and 'num_speculative_tokens'.",
    )
    serve.add_argument(
        "--host",
        default=SERVER_DEFAULTS.host,
        help=f"address to bind (default {SERVER_DEFAULTS.host}: loopback)",
    )
    serve.add_argument("--port", type=int, default=SERVER_DEFAULTS.port)
    serve.add_argument(
        "--served-model-name",
        default=SERVER_DEFAULTS.served_model_name,
        help="the model id in the API (default: derived from --target)",
    )
    serve.add_argument(
        "--max-queue-size",
        type=int,
        default=ENGINE_DEFAULTS.max_queue_size,
        help="requests waiting for a batch slot before 503s "
        f"(default {ENGINE_DEFAULTS.max_queue_size})",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help="require 'Authorization: Bearer KEY' on every route but GET /health "
        f"(default: ${API_KEY_ENV}, which keeps the key out of the process list; "
        "neither set: no authentication)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=SERVER_DEFAULTS.max_body_bytes,
        help="larger request bodies get a 413 before any work is queued "
        f"(default {SERVER_DEFAULTS.max_body_bytes}: 4 MiB)",
    )
    serve.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=SERVER_DEFAULTS.max_prompt_tokens,
        help="longer prompts get a 400, far longer ones before they are tokenized "
        "(default: the context but one token)",
    )
    serve.add_argument(
        "--bench-twin",
        action="store_true",
        help="for benchmarks (hybridspec bench --served): run the requests for 'none' on a "
        "second engine over the same weights, stepped by turns with the first; /metrics shows "
        "each engine's seconds of steps",
    )
    _add_reliability_options(serve)
    _add_tenant_options(serve)
    tls = serve.add_argument_group("TLS (passed to uvicorn; without a certificate: plain HTTP)")
    tls.add_argument("--ssl-certfile", default=None, help="certificate chain, PEM")
    tls.add_argument("--ssl-keyfile", default=None, help="its private key, PEM")
    tls.add_argument("--ssl-keyfile-password", default=None, help="the private key's password")
    serve.add_argument(
        "--log-level",
        default="info",
        choices=tuple(_LOG_LEVELS),
        help="uvicorn's log level, and the server's (its 'ready:' line at start is INFO)",
    )
    scale = serve.add_argument_group(
        "replicas (Ray Serve; needs the ray extra: pip install 'hybridspec[ray]')"
    )
    scale.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas behind one endpoint on Ray Serve, routed least-loaded "
        "(a request's X-Session-Id header sticks to one replica) (default: one server, no Ray)",
    )
    scale.add_argument(
        "--ray-address",
        default="local",
        help="with --replicas: 'local' starts a Ray instance on this machine (the default); "
        "'auto' or an address deploys onto a running Ray cluster",
    )
    add_engine_options(serve)
    serve.set_defaults(run=_serve)


def _add_reliability_options(serve: argparse.ArgumentParser) -> None:
    """Bounds in time and memory (docs/reliability.md)."""
    group = serve.add_argument_group("reliability (docs/reliability.md)")
    defaults = SERVER_DEFAULTS
    for flag, default, text in (
        ("--grammar-timeout", defaults.grammar_timeout_s, "a grammar compiling longer: 400"),
        (
            "--shutdown-timeout",
            defaults.shutdown_timeout_s,
            "at SIGTERM, running requests get this long to finish; then streams end with an "
            "error event and [DONE]",
        ),
        (
            "--stream-write-timeout",
            defaults.stream_write_timeout_s,
            "a stream whose client reads nothing this long is aborted, its slot freed",
        ),
        (
            "--request-read-timeout",
            defaults.request_read_timeout_s,
            "a request body not received within this: 408",
        ),
        ("--keep-alive-timeout", defaults.keep_alive_timeout_s, "idle connections are closed"),
    ):
        group.add_argument(flag, type=float, default=default, help=f"{text} (default {default} s)")
    group.add_argument(
        "--grammar-cache-mb",
        type=int,
        default=ENGINE_DEFAULTS.grammar_cache_mb,
        help="compiled grammars kept for reuse, in MiB, least recently used out "
        f"(default {ENGINE_DEFAULTS.grammar_cache_mb})",
    )


def _add_tenant_options(serve: argparse.ArgumentParser) -> None:
    """Tenants, their turns and their caches (docs/server.md, 'Tenants')."""
    group = serve.add_argument_group("tenants (docs/server.md)")
    group.add_argument(
        "--api-keys",
        metavar="FILE",
        default=os.environ.get(API_KEYS_FILE_ENV) or None,
        help="one 'TENANT KEY' pair a line ('#' comments): each key a bearer key, requests "
        "taking turns by tenant, cached text kept per tenant "
        f"(default: ${API_KEYS_FILE_ENV}; a bad line stops the start)",
    )
    group.add_argument(
        "--cache-isolation",
        choices=CACHE_ISOLATION,
        default=None,
        help="which requests reuse each other's cached text (prefix cache, suffix pools): "
        "per-tenant (the default with --api-keys), shared (the default without), off",
    )
    defaults = TenantConfig()
    for flag, default, text in (
        ("--tenant-max-running", defaults.max_running, "requests of one tenant in the batch"),
        ("--tenant-max-queued", defaults.max_queued, "requests of one tenant waiting; more: 429"),
    ):
        group.add_argument(flag, type=int, default=default, help=f"{text} (default: no bound)")
    group.add_argument(
        "--tenant-spare-slots",
        type=int,
        default=SERVER_DEFAULTS.tenant_spare_slots,
        help="with --api-keys, batch slots beyond --max-num-seqs kept for a tenant with "
        "nothing running, so another's burst never holds its first request "
        f"(default {SERVER_DEFAULTS.tenant_spare_slots})",
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration from the options of ``serve``; InvalidRequestError for a
    key file that does not parse (naming its line)."""
    tenants = TenantConfig(max_running=args.tenant_max_running, max_queued=args.tenant_max_queued)
    engine = dataclasses.replace(
        engine_config(args),
        max_queue_size=args.max_queue_size,
        grammar_cache_mb=args.grammar_cache_mb,
        tenants=tenants,
    )
    return dataclasses.replace(
        SERVER_DEFAULTS,
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        tenant_keys=read_key_file(args.api_keys) if args.api_keys is not None else (),
        tenant_spare_slots=args.tenant_spare_slots,
        cache_isolation=args.cache_isolation,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        freeze_heap=True,  # a process of its own (ServerConfig.freeze_heap)
        bench_twin=args.bench_twin,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_keyfile_password=args.ssl_keyfile_password,
        grammar_timeout_s=args.grammar_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        stream_write_timeout_s=args.stream_write_timeout,
        request_read_timeout_s=args.request_read_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
    )


def uvicorn_config(config: ServerConfig, app: FastAPI, log_level: str) -> uvicorn.Config:
    """uvicorn's configuration for serving ``app`` as ``config`` says (address, TLS)."""
    import uvicorn

    from hybridspec.server.connections import header_deadline_protocol

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        # The app ends its requests at shutdown_timeout_s (server.shutdown); this is a backstop.
        timeout_graceful_shutdown=math.ceil(config.shutdown_timeout_s) + 1,
        timeout_keep_alive=math.ceil(config.keep_alive_timeout_s),
        http=header_deadline_protocol(config.request_read_timeout_s),
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        ssl_keyfile_password=config.ssl_keyfile_password,
    )


def _serve(args: argparse.Namespace) -> int:
    start = time.perf_counter()

    from hybridspec.server.app import create_app
    from hybridspec.server.shutdown import draining_server

    import_s = time.perf_counter() - start
    # The server's own lines (the one ``ready:`` line at start) at uvicorn's level; the
    # engine's and the loader's stay at the command's (WARNING, or INFO with -v).
    for name in ("hybridspec.server", "hybridspec.deploy"):
        server_logger = logging.getLogger(name)
        server_logger.setLevel(min(server_logger.getEffectiveLevel(), _LOG_LEVELS[args.log_level]))
    config = server_config(args)
    if args.replicas is not None:
        from hybridspec.deploy.local import serve_replicas

        return serve_replicas(
            config, args.replicas, ray_address=args.ray_address, log_level=args.log_level
        )
    app = create_app(config, import_s=import_s)
    server = draining_server(uvicorn_config(config, app, args.log_level), app)
    server.run()
    return 0 if server.started else 1
