"""``hybridspec bench``: run a workload through every method and report the speedups.

The default run (2 prompts of each of the 7 categories, greedy and temperature 0.8, 128 new
tokens, 4 methods, 1 repeat: 112 trials) took 9 minutes on the 2-core development CPU with the
embedded SmolLM2-135M in bfloat16, at load average 3-5. Where llama-cpp-python is installed
(``make bench-peers``), the default methods add llama.cpp's plain and prompt-lookup decoding of
the same GGUF file (6 methods, 168 trials). The full run, every prompt with the
issue's budget and medians of three repeats, is about 12 times that (2-3 hours)::

    hybridspec bench --prompts-per-category 4 --max-new-tokens 256 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hybridspec.bench.conversations import add_conversations_command
from hybridspec.bench.make_gguf import add_make_gguf_command
from hybridspec.bench.names import DEFAULT_METHODS, LIBRARY_ONLY, LLAMACPP_METHODS
from hybridspec.bench.oracle_cli import add_oracle_command
from hybridspec.bench.serve_cli import add_serve_command
from hybridspec.bench.workload import DEFAULT_WORKLOAD, load_workload
from hybridspec.config import (
    DTYPES,
    MAX_SPECULATIVE_TOKENS,
    MIN_SPECULATIVE_TOKENS,
    QUANTIZE,
    EngineConfig,
    parse_num_threads,
)

if TYPE_CHECKING:
    from hybridspec.bench.harness import BenchConfig
    from hybridspec.bench.session import ModelOptions
    from hybridspec.bench.workload import Workload

DEFAULT_PROMPTS_PER_CATEGORY = 2
DEFAULT_MAX_NEW_TOKENS = 128  # the 256 doubles the run; pass it for the full one


def add_bench_command(commands: Any) -> None:
    """Register ``bench`` on the ``hybridspec`` subcommand parsers."""
    bench = commands.add_parser(
        "bench",
        help="benchmark every method against transformers on a workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = bench.add_argument
    add("--workload", type=Path, default=DEFAULT_WORKLOAD, help="workload JSON file")
    add("--categories", nargs="+", default=None, help="categories to run (default: all)")
    add(
        "--prompts-per-category",
        type=int,
        default=DEFAULT_PROMPTS_PER_CATEGORY,
        help=f"first N prompts of each category (default {DEFAULT_PROMPTS_PER_CATEGORY})",
    )
    add(
        "--methods",
        nargs="+",
        default=None,
        help="engine proposers (none, ngram, draft, ...), transformers baselines (hf-plain, "
        "hf-prompt-lookup) and llama.cpp ones on the target's GGUF (llamacpp-plain, "
        f"llamacpp-prompt-lookup); default: {' '.join(DEFAULT_METHODS)}, plus "
        f"{' '.join(LLAMACPP_METHODS)} where llama_cpp is installed and draft with --draft",
    )
    add("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    add("--repeats", type=int, default=1, help="repetitions; figures are medians over them")
    add(
        "--temperature",
        type=float,
        nargs="+",
        default=None,
        help="temperatures to run (default: the workload's variants, greedy and 0.8)",
    )
    add(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=EngineConfig().default_num_speculative_tokens,
        help=f"drafts per round, also transformers' prompt_lookup_num_tokens "
        f"({MIN_SPECULATIVE_TOKENS}..{MAX_SPECULATIVE_TOKENS})",
    )
    add("--target", default=None, help="target model (default: embedded SmolLM2-135M-Instruct)")
    add("--draft", default=None, help="draft model of the 'draft' method")
    add("--dtype", default="bfloat16", choices=DTYPES, help="dtype of every model")
    add("--device", default="cpu")
    add(
        "--quantize",
        default="auto",
        choices=QUANTIZE,
        help="the target's weight matrices group-quantized, as serve's default keeps a GGUF "
        "file's blocks (see hybridspec serve --help)",
    )
    add(
        "--concurrency",
        type=int,
        default=1,
        help="N > 1: also serve every prompt, categories alternating, with N requests in the "
        "engine at once (a closed loop: each finished request is replaced by the next), per "
        "engine method; reported as aggregate tokens/s and its ratio to one none request",
    )
    add("--seed", type=int, default=0, help="base seed of sampled requests")
    add(
        "--vs-none",
        action="store_true",
        help="print each method's tokens/s over none's, open-ended and input-grounded prompts "
        "apart, per temperature, alone and (with --concurrency N) N at once, the concurrent "
        "trials run per group (speculation that never costs: each at least 0.97)",
    )
    add(
        "--threads",
        type=parse_num_threads,
        default="auto",
        help="CPU threads of every method; 'auto' (default): the engine's forward on the cores "
        "the process may use, adapted to the load from step times, llama.cpp's on those cores; "
        "N: that many, fixed; 0: torch's default",
    )
    add(
        "--busy",
        type=int,
        default=0,
        help="N CPU-spinning processes beside the run, stopped when it ends: decoding on a "
        "machine busy with other work (default 0)",
    )
    add(
        "--served",
        action="store_true",
        help="run the engine methods' trials through a hybridspec serve that the bench starts "
        "on a free loopback port (the same target and options, its prefix cache off), each "
        "request streamed and naming its proposer, N client threads at once with --concurrency "
        "N; its log goes to OUTPUT_DIR/serve.log. The transformers and llama.cpp baselines run "
        "only unserved",
    )
    add("--output-dir", type=Path, default=Path("bench-results"), help="where JSON and PNG go")
    bench.set_defaults(run=run_bench)
    subcommands = bench.add_subparsers(title="subcommands", dest="bench_command")
    add_serve_command(subcommands)
    add_conversations_command(subcommands)
    add_make_gguf_command(subcommands)
    add_oracle_command(subcommands)


def default_methods(with_draft: bool, served: bool = False) -> list[str]:
    """The default methods, with llama.cpp's where ``llama_cpp`` can be imported; served, the
    engine's alone."""
    peers = LLAMACPP_METHODS if importlib.util.find_spec("llama_cpp") is not None else ()
    methods = [*DEFAULT_METHODS, *peers, *(["draft"] if with_draft else [])]
    return [m for m in methods if m not in LIBRARY_ONLY] if served else methods


def run_bench(args: argparse.Namespace) -> int:
    # Imported here so that registering the command costs nothing to the other commands.
    import torch

    from hybridspec.bench.busy import busy_processes
    from hybridspec.bench.harness import BenchConfig
    from hybridspec.bench.session import ModelOptions

    workload = load_workload(args.workload).select(args.categories, args.prompts_per_category)
    methods = args.methods or default_methods(args.draft is not None, args.served)
    config = BenchConfig(
        temperatures=tuple(args.temperature or workload.temperatures),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        concurrency=args.concurrency,
        seed=args.seed,
        concurrent_groups=_groups(workload) if args.vs_none else (),
    )
    fixed = args.threads if args.threads != "auto" and args.threads > 0 else None
    engine_threads: int | Literal["auto"] | None = "auto" if args.threads == "auto" else fixed
    models = ModelOptions(
        args.target, args.draft, args.dtype, args.device, args.quantize, engine_threads
    )
    threads = torch.get_num_threads()
    if fixed is not None:
        torch.set_num_threads(fixed)
    try:
        with busy_processes(args.busy):
            _run(args, workload, methods, config, models)
    finally:
        torch.set_num_threads(threads)  # callers in the same process keep their setting
    return 0


def _groups(workload: Workload) -> tuple[frozenset[str], ...]:
    """The workload's open-ended and input-grounded categories, those it has."""
    grounded = frozenset(n for n, c in workload.categories.items() if c.input_grounded)
    groups = (frozenset(workload.categories) - grounded, grounded)
    return tuple(g for g in groups if g)


def _run(
    args: argparse.Namespace,
    workload: Workload,
    methods: list[str],
    config: BenchConfig,
    models: ModelOptions,
) -> None:
    from tqdm import tqdm

    from hybridspec.bench.harness import num_records, plan
    from hybridspec.bench.records import Record
    from hybridspec.bench.report import format_outcome, plot_speedups, write_json
    from hybridspec.bench.session import execute, open_session
    from hybridspec.bench.summary import concurrent_group

    server_log = args.output_dir / "serve.log" if args.served else None
    k = args.num_speculative_tokens
    session = open_session(workload, models, methods, k, config, server_log)
    try:
        trials = plan(config, session.methods, session.prompts, session.twin is not None)
        total = num_records(trials)
        with tqdm(total=total, desc="bench", unit="trial", file=sys.stderr) as bar:

            def on_trial(record: Record) -> None:
                m = record.measurement
                rate = m.num_generated / m.elapsed_s if m.elapsed_s > 0 else 0.0
                where = record.category or concurrent_group(record.concurrency)
                bar.set_postfix_str(
                    f"{record.method} {where} T={record.temperature:g} {rate:.1f} tok/s"
                )
                bar.update()

            bar.set_postfix_str("warming up")
            outcome = execute(session, config, on_trial)
    finally:
        session.close()
    print(format_outcome(outcome, workload.categories))
    if args.vs_none:
        from hybridspec.bench.vs_none import format_vs_none, vs_none

        rows = vs_none(outcome.records, outcome.summary, workload.categories)
        print("\n" + format_vs_none(rows))
    json_path = args.output_dir / "bench.json"
    png_path = args.output_dir / "bench.png"
    write_json(json_path, outcome.to_json())
    plot_speedups(outcome.summary, png_path)
    print(f"\nwrote {json_path} and {png_path}")
