"""``hybridspec serve``: run the OpenAI-compatible server with uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from hybridspec.config import MAX_SPECULATIVE_TOKENS, MIN_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from hybridspec.server.config import ServerConfig


def add_serve_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` to the subcommands of the ``hybridspec`` parser (``add_subparsers()``)."""
    from hybridspec.cli import add_engine_options

    serve: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics. Requests may pick their proposer and K with the extension fields "
        "'proposer' and 'num_speculative_tokens'.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--proposer",
        default="ngram",
        help="default proposer of requests that name none (default: ngram)",
    )
    serve.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=8,
        help=f"default K, {MIN_SPECULATIVE_TOKENS}..{MAX_SPECULATIVE_TOKENS}",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model id in the API (default: derived from --target)",
    )
    serve.add_argument(
        "--max-queue-size",
        type=int,
        default=64,
        help="requests waiting for a batch slot before 503s (default: 64)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level",
    )
    add_engine_options(serve)
    serve.set_defaults(run=serve_main)


def server_config(args: argparse.Namespace) -> ServerConfig:
    from hybridspec.cli import engine_config
    from hybridspec.server.config import ServerConfig

    engine = engine_config(args, args.proposer, args.num_speculative_tokens)
    engine = dataclasses.replace(engine, max_queue_size=args.max_queue_size)
    return ServerConfig(
        engine=engine, host=args.host, port=args.port, served_model_name=args.served_model_name
    )


def serve_main(args: argparse.Namespace) -> int:
    import uvicorn

    from hybridspec.server.app import create_app

    config = server_config(args)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
    )
    server.run()
    return 0 if server.started else 1
