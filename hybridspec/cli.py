"""The ``hybridspec`` command line: generate, serve, bench and distill.

Every default is read from the configuration classes (``EngineConfig``, ``ModelConfig``,
``ServerConfig``, ``GenerationParams``), so a default changes in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridspec.bench.cli import add_bench_command
from hybridspec.config import (
    DTYPES,
    MAX_SPECULATIVE_TOKENS,
    MIN_SPECULATIVE_TOKENS,
    QUANTIZE,
    SUFFIX_ISOLATION,
    DraftConfig,
    EagleConfig,
    EngineConfig,
    ModelConfig,
    SuffixConfig,
)
from hybridspec.distill.cli import add_distill_command
from hybridspec.errors import HybridSpecError
from hybridspec.server.config import API_KEY_ENV, ServerConfig

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from hybridspec.engine import GenerationParams

_LOG_LEVELS = {
    "critical": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
}

# The defaults every option below takes: one instance of each configuration class.
ENGINE_DEFAULTS = EngineConfig()
SERVER_DEFAULTS = ServerConfig(engine=ENGINE_DEFAULTS)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Options that pick and size the target, the draft and the proposer defaults."""
    group = parser.add_argument_group("models")
    group.add_argument(
        "--target",
        default=None,
        help="hub id, local directory or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--draft",
        default=None,
        help="draft model for the 'draft' proposer (hub id, directory or .gguf)",
    )
    group.add_argument(
        "--draft-cost-per-token",
        type=float,
        default=ENGINE_DEFAULTS.draft.cost_per_token,
        help="time of one draft token relative to a target forward, for adaptive speculation "
        "(default: measured at start-up)",
    )
    group.add_argument(
        "--eagle-head",
        default=ENGINE_DEFAULTS.eagle.head,
        help="draft head directory of the 'eagle' and 'hybrid' proposers, as written by "
        "`hybridspec distill`, or a published EAGLE head (config.json and weights) "
        "(default: the head shipped for the target, if any)",
    )
    target = ENGINE_DEFAULTS.target
    group.add_argument(
        "--dtype",
        default=target.dtype,
        choices=DTYPES,
        help=f"dtype of the models (default {target.dtype}: fastest measured for the device)",
    )
    group.add_argument(
        "--quantize",
        default=target.quantize,
        choices=QUANTIZE,
        help="group-quantized weight matrices, multiplied in blocks on CPU in bfloat16: "
        "'gguf' keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks, 'int4'/'int8' also quantize dense "
        "matrices at load, 'auto' is 'gguf' for a GGUF file where the block kernel builds, "
        f"'none' dequantizes (default {target.quantize})",
    )
    group.add_argument("--device", default=target.device, help="torch device, e.g. cpu or cuda")
    group.add_argument(
        "--max-seq-len",
        type=int,
        default=target.max_seq_len,
        help="context length (default: the model's own)",
    )
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=target.max_num_seqs,
        help=f"sequences decoded together (KV-cache slots; default {target.max_num_seqs})",
    )
    group.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=ENGINE_DEFAULTS.prefix_cache_mb,
        help="megabytes of keys and values kept from finished requests for later ones that "
        "share a prefix (conversations, agents, retries); 0 turns it off (default: an eighth "
        "of the machine's memory, at most 4096, where reuse is exact: the native bfloat16 "
        "runtime on CPU; see docs/conversations.md)",
    )
    group.add_argument(
        "--suffix-cache-tokens",
        type=int,
        default=ENGINE_DEFAULTS.suffix.max_tokens,
        help="tokens of recent prompts and outputs the 'suffix' proposer drafts from, oldest "
        f"evicted (default {ENGINE_DEFAULTS.suffix.max_tokens})",
    )
    group.add_argument(
        "--suffix-isolation",
        default=ENGINE_DEFAULTS.suffix.isolation,
        choices=SUFFIX_ISOLATION,
        help="which requests the 'suffix' proposer drafts from: all (per-server), those of the "
        "same `user` (per-session), none (off); drafts never change output, only timing "
        f"(default {ENGINE_DEFAULTS.suffix.isolation})",
    )
    group.add_argument(
        "--fixed-k",
        action="store_true",
        help="always ask for K drafts (default: each round, as many as pay for their verification)",
    )
    group.add_argument(
        "--verify-token-cost",
        type=_cost,
        default=ENGINE_DEFAULTS.verify_token_cost,
        help="cost of verifying one more token relative to a forward, for adaptive speculation; "
        f"'auto' times it at start-up (default {ENGINE_DEFAULTS.verify_token_cost}, from a "
        "2-core CPU)",
    )
    group.add_argument(
        "-t",
        "--threads",
        type=int,
        default=ENGINE_DEFAULTS.num_threads,
        help="CPU threads of the forward (torch's and the kernels'), as llama.cpp's -t "
        "(default: OMP_NUM_THREADS, else the cores; on a machine busy with other work, fewer)",
    )
    group.add_argument(
        "--proposer",
        default=ENGINE_DEFAULTS.default_proposer,
        help="the proposer of requests that name none: one of the built-in proposers (none, "
        "ngram, draft, eagle, hybrid, grammar, or a composition such as grammar+ngram) or a "
        f"registered custom one (default {ENGINE_DEFAULTS.default_proposer})",
    )
    group.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=ENGINE_DEFAULTS.default_num_speculative_tokens,
        help=f"draft tokens per round, {MIN_SPECULATIVE_TOKENS}..{MAX_SPECULATIVE_TOKENS} "
        f"(default {ENGINE_DEFAULTS.default_num_speculative_tokens})",
    )


def _cost(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the options of ``add_engine_options``."""
    target = ModelConfig(
        args.target,
        args.dtype,
        args.device,
        args.max_seq_len,
        args.max_num_seqs,
        quantize=args.quantize,
    )
    draft = None
    if args.draft is not None:
        # "gguf" keeps a file's blocks: a draft that is no GGUF file then loads as "auto" does
        quantize = "auto" if target.quantize == "gguf" else target.quantize
        draft = dataclasses.replace(target, name_or_path=args.draft, quantize=quantize)
    return dataclasses.replace(
        ENGINE_DEFAULTS,
        target=target,
        draft=DraftConfig(model=draft, cost_per_token=args.draft_cost_per_token),
        eagle=EagleConfig(head=args.eagle_head),
        default_proposer=args.proposer,
        default_num_speculative_tokens=args.num_speculative_tokens,
        adaptive_speculation=not args.fixed_k,
        verify_token_cost=args.verify_token_cost,
        num_threads=args.threads,
        prefix_cache_mb=args.prefix_cache_mb,
        suffix=SuffixConfig(args.suffix_cache_tokens, args.suffix_isolation),
    )


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    from hybridspec.engine import GenerationParams

    params = GenerationParams()
    sampling = params.sampling
    parser.add_argument("--max-new-tokens", type=int, default=params.max_new_tokens)
    parser.add_argument(
        "--temperature", type=float, default=sampling.temperature, help="0 means greedy"
    )
    parser.add_argument("--top-k", type=int, default=sampling.top_k)
    parser.add_argument("--top-p", type=float, default=sampling.top_p)
    parser.add_argument("--seed", type=int, default=sampling.seed)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=None,
        help="token id that ends the text as EOS does (repeatable)",
    )
    controls = parser.add_argument_group("sampling controls (the same under every proposer)")
    controls.add_argument("--presence-penalty", type=float, default=sampling.presence_penalty)
    controls.add_argument("--frequency-penalty", type=float, default=sampling.frequency_penalty)
    controls.add_argument(
        "--repetition-penalty",
        type=float,
        default=sampling.repetition_penalty,
        help="1 means off",
    )
    controls.add_argument(
        "--logit-bias",
        type=logit_bias,
        default=None,
        help="JSON object of token id -> bias in [-100, 100], e.g. '{\"13\": -100}'",
    )
    controls.add_argument("--min-p", type=float, default=sampling.min_p)
    controls.add_argument(
        "--min-tokens", type=int, default=sampling.min_tokens, help="EOS held back until then"
    )
    parser.add_argument(
        "-n",
        type=int,
        default=1,
        help="choices of the prompt, prefilled once (choice i seeded seed + i)",
    )


def logit_bias(text: str) -> dict[int, float]:
    """``--logit-bias``: a JSON object of token ids (as strings) to numbers."""
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return {int(key): float(bias) for key, bias in value.items()}
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object of token ids to biases, e.g. {{"13": -100}}: {exc}'
        ) from exc


def generation_params(args: argparse.Namespace) -> GenerationParams:
    """The ``generate`` command's options as GenerationParams (which checks their bounds)."""
    from hybridspec.engine import GenerationParams

    return GenerationParams.create(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=args.logit_bias,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        proposer=args.proposer,
        num_speculative_tokens=args.num_speculative_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_id or (),
    )


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
    _add_reliability_options(serve)
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


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration from the options of ``serve``."""
    engine = dataclasses.replace(
        engine_config(args),
        max_queue_size=args.max_queue_size,
        grammar_cache_mb=args.grammar_cache_mb,
    )
    return dataclasses.replace(
        SERVER_DEFAULTS,
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
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


def _generate(args: argparse.Namespace) -> int:
    from hybridspec.engine import Engine

    params = generation_params(args)
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
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args))
    except HybridSpecError as exc:
        print(f"hybridspec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
