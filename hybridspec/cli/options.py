"""The command line's engine and generation options: each option's default read from the
configuration classes (``EngineConfig``, ``ModelConfig``, ``GenerationParams``), and the
configurations built back from the parsed arguments (``engine_config``, ``generation_params``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from typing import TYPE_CHECKING

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
    parse_num_threads,
)
from hybridspec.server.config import ServerConfig

if TYPE_CHECKING:
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
        help="megabytes of resident memory the prefix cache may hold: keys and values kept from "
        "finished requests for later ones that share a prefix (conversations, agents, "
        "retries); 0 turns it off (default: a thirty-second of the machine's memory, at most "
        "512, where reuse is exact: the native bfloat16 runtime on CPU; see "
        "docs/conversations.md)",
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
        type=parse_num_threads,
        default=ENGINE_DEFAULTS.num_threads,
        help="CPU threads of the forward (torch's and the kernels'), as llama.cpp's -t; 'auto' "
        "(default): the cores the process may use, adapted to the load from measured step "
        "times (fewer on a machine busy with other work)",
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
