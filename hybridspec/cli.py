"""The ``hybridspec`` command line: generate, serve and bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from hybridspec.config import (
    DEFAULT_VERIFY_TOKEN_COST,
    DTYPES,
    MAX_SPECULATIVE_TOKENS,
    MIN_SPECULATIVE_TOKENS,
    DraftConfig,
    EngineConfig,
    ModelConfig,
)
from hybridspec.errors import HybridSpecError


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
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="dtype of the models (auto: fastest measured for the device)",
    )
    group.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    group.add_argument(
        "--max-seq-len", type=int, default=None, help="context length (default: the model's own)"
    )
    group.add_argument(
        "--max-num-seqs", type=int, default=8, help="sequences decoded together (KV-cache slots)"
    )
    group.add_argument(
        "--fixed-k",
        action="store_true",
        help="always ask for K drafts (default: each round, as many as pay for their verification)",
    )
    group.add_argument(
        "--verify-token-cost",
        type=_cost,
        default=DEFAULT_VERIFY_TOKEN_COST,
        help="cost of verifying one more token relative to a forward, for adaptive speculation; "
        f"'auto' times it at start-up (default {DEFAULT_VERIFY_TOKEN_COST}, from a 2-core CPU)",
    )


def _cost(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def engine_config(args: argparse.Namespace, default_proposer: str, default_k: int) -> EngineConfig:
    target = ModelConfig(args.target, args.dtype, args.device, args.max_seq_len, args.max_num_seqs)
    draft = None
    if args.draft is not None:
        draft = ModelConfig(
            args.draft, args.dtype, args.device, args.max_seq_len, args.max_num_seqs
        )
    return EngineConfig(
        target=target,
        draft=DraftConfig(model=draft),
        default_proposer=default_proposer,
        default_num_speculative_tokens=default_k,
        adaptive_speculation=not args.fixed_k,
        verify_token_cost=args.verify_token_cost,
    )


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--proposer",
        default="ngram",
        help="none, ngram, draft or a registered custom proposer (default: ngram)",
    )
    parser.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=8,
        help=f"draft tokens per round, {MIN_SPECULATIVE_TOKENS}..{MAX_SPECULATIVE_TOKENS}",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _generate(args: argparse.Namespace) -> int:
    from hybridspec.engine import Engine, GenerationParams

    params = GenerationParams.create(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        proposer=args.proposer,
        num_speculative_tokens=args.num_speculative_tokens,
        stop=args.stop,
    )
    engine = Engine(engine_config(args, args.proposer, args.num_speculative_tokens))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages = None if args.raw else [{"role": "user", "content": prompt}]
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

    from hybridspec.server.cli import add_serve_command

    add_serve_command(commands)
    from hybridspec.bench.cli import add_bench_command

    add_bench_command(commands)
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
