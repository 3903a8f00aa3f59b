"""The ``hybridspec`` command line: generate, serve, bench and distill.

Every default is read from the configuration classes (``EngineConfig``, ``ModelConfig``,
``ServerConfig``, ``GenerationParams``), so a default changes in one place.

Start-up (``generate``, the user's wait for a first token): the garbage collector is off while
the engine is built (imports and the load allocate hundreds of thousands of objects that all
survive, so each full collection on the way only visits them again), then one collection and
``gc.freeze`` leave them in the permanent generation, out of every later collection's way. Run
as the program (``main()`` with no arguments), ``generate`` ends the process once its output is
flushed, without the interpreter's teardown (collecting and freeing every module's objects,
unregistering torch's operators: about a second after the text is out, for nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence

from hybridspec.bench.cli import add_bench_command
from hybridspec.cli.options import (
    ENGINE_DEFAULTS,
    SERVER_DEFAULTS,
    add_engine_options,
    add_generation_options,
    engine_config,
    generation_params,
    logit_bias,
)
from hybridspec.cli.serve import add_serve_command, server_config, uvicorn_config
from hybridspec.distill.cli import add_distill_command
from hybridspec.errors import HybridSpecError
from hybridspec.server.config import API_KEY_ENV, ServerConfig

__all__ = [
    "API_KEY_ENV",
    "ENGINE_DEFAULTS",
    "SERVER_DEFAULTS",
    "ServerConfig",
    "add_engine_options",
    "add_generation_options",
    "add_serve_command",
    "build_parser",
    "engine_config",
    "generation_params",
    "logit_bias",
    "main",
    "server_config",
    "uvicorn_config",
]


@contextlib.contextmanager
def _start_up() -> Iterator[None]:
    """No garbage collection inside the block (the engine's imports and load); after it, one
    collection and every surviving object frozen (module docstring). The collector is on
    again after the block whatever happens inside."""
    gc.disable()
    try:
        yield
        gc.collect()
        gc.freeze()
    finally:
        gc.enable()


def _generate(args: argparse.Namespace) -> int:
    params = generation_params(args)
    with _start_up():
        from hybridspec.engine import Engine

        engine = Engine(engine_config(args))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages = None if args.raw else [{"role": "user", "content": prompt}]
    if args.n != 1:
        results = engine.generate_choices(
            None if messages else prompt, n=args.n, messages=messages, params=params
        )
        for result in results:
            print(json.dumps(result.to_dict()) if args.json else result.text)
        return 0
    if args.json:
        result = engine.generate(None if messages else prompt, messages=messages, params=params)
        print(json.dumps(result.to_dict()))
        return 0
    final = None
    for output in engine.stream(None if messages else prompt, messages=messages, params=params):
        sys.stdout.write(output.new_text)
        sys.stdout.flush()
        final = output.result
    sys.stdout.write("\n")
    if final is not None:
        stats = final.stats
        print(
            f"[{final.finish_reason.value}] {stats.generated_tokens} tokens, "
            f"{stats.tokens_per_second:.1f} tokens/s, acceptance {stats.acceptance_rate:.2f}, "
            f"mean accepted length {stats.mean_accepted_length:.2f}, "
            f"{stats.target_forwards} target forwards",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for one prompt")
    generate.add_argument("prompt", help="the prompt ('-' reads standard input)")
    generate.add_argument(
        "--raw", action="store_true", help="use the prompt as is, without the chat template"
    )
    generate.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, token_ids, finish_reason, stats",
    )
    add_generation_options(generate)
    add_engine_options(generate)
    generate.set_defaults(run=_generate)

    add_serve_command(commands)

    add_bench_command(commands)
    add_distill_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names (default: the program's arguments) and return its exit
    status. With no ``argv`` (the program itself), ``generate`` ends the process instead of
    returning (module docstring), after flushing its output and the logs."""
    gc.enable()  # off while ``python -m hybridspec.cli`` imported this module (``__main__``)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        status = int(args.run(args))
    except HybridSpecError as exc:
        print(f"hybridspec: error: {exc}", file=sys.stderr)
        status = 2
    if argv is None and args.run is _generate:
        _exit_now(status)
    return status


def _exit_now(status: int) -> None:
    """End the process with ``status`` once standard output, standard error and the logging
    handlers are flushed, skipping the interpreter's teardown (``os._exit``)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)
