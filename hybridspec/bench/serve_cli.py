"""``hybridspec bench serve``: serving figures with guidellm, against llama.cpp's servers.

Starts each server on the same GGUF (the embedded SmolLM2-135M-Instruct Q4_1 by default) on a
free loopback port: ``hybridspec serve`` once per proposer, llama-cpp-python's server and
llama.cpp's ``llama-server`` where they are installed (skipped, and said so, where not). Runs
guidellm against each with streaming, at every concurrency, on two workloads: guidellm's
synthetic text and the bench workload's input-grounded prompts. Every server is driven through
its completions route (llama-cpp-python's chat route refuses content given as parts, which is
how guidellm sends it), with the grounded prompts rendered by the model's chat template; each
request asks for exactly ``--output-tokens`` tokens (``ignore_eos``), greedy by default. Writes
the tables, the JSON and a PNG of throughput and TTFT against concurrency to ``--output-dir``.
Before any server starts, the grounded requests of concurrency 1 also run through the library
in this process (``library_rate``), per proposer and thread count, so that the report shows
each server's rate beside the library's on the same requests. ``--threads 1 2`` runs every
server at each thread count, in one table.

Needs guidellm and llama-cpp-python: ``make bench-serve`` installs them (the ``bench`` extra)
and builds ``llama-server`` from llama-cpp-python's vendored llama.cpp, then runs this.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridspec.bench.serve_conversations import CONVERSATIONAL
from hybridspec.bench.workload import DEFAULT_WORKLOAD, load_workload

if TYPE_CHECKING:
    from hybridspec.bench.loadgen import LoadWorkload
    from hybridspec.bench.serve_conversations import ConversationPlan
    from hybridspec.bench.servers import ServerSpec
    from hybridspec.bench.serving_report import ServingResults

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCIES = (1, 2, 4, 8)
DEFAULT_PROPOSERS = ("none", "ngram")
GUIDELLM_WORKLOADS = ("synthetic", "grounded")
WORKLOADS = (*GUIDELLM_WORKLOADS, *CONVERSATIONAL)
# A multi-turn conversation's history reaches 1.5-3k tokens: the peers' slots must hold it.
CONVERSATION_CTX = 4096
PEERS = ("llama-cpp-python", "llama-server")
# One thread per server, as ``hybridspec bench`` defaults to: on a 2-core machine shared with
# other work, both runtimes' threads spin at every barrier waiting for a descheduled peer.
# Measured on the 2-core development VM at load average 4.7, llama-cpp-python, 64 greedy
# tokens: 28-42 tok/s with 1 thread, 0.4-11 tok/s with 2.
DEFAULT_THREADS = 1


def add_serve_command(bench_commands: Any) -> None:
    """Register ``serve`` under ``hybridspec bench``."""
    serve = bench_commands.add_parser(
        "serve",
        help="serving benchmark with guidellm: hybridspec serve vs llama.cpp's servers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = serve.add_argument
    add("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCIES))
    add("--requests", type=int, default=16, help="requests per concurrency (default 16)")
    add("--prompt-tokens", type=int, default=128, help="synthetic prompt length (default 128)")
    add("--output-tokens", type=int, default=64, help="tokens per request (default 64)")
    add(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="guidellm's (synthetic, grounded) and this process's conversational ones "
        "(multi-turn, repeat: see serve_conversations); default: all",
    )
    add("--turns", type=int, default=6, help="turns per multi-turn conversation (default 6)")
    add("--conversations", type=int, default=2, help="multi-turn conversations (default 2)")
    add(
        "--repeat-prompts",
        type=int,
        default=4,
        help="prompts of the repeat workload, and open-ended ones asked once (default 4)",
    )
    add("--workload", type=Path, default=DEFAULT_WORKLOAD, help="bench workload JSON (grounded)")
    add("--proposers", nargs="*", default=list(DEFAULT_PROPOSERS), help="one server each")
    add("--peers", nargs="*", choices=PEERS, default=list(PEERS), help="where installed")
    add("--gguf", type=Path, default=None, help="model file (default: the embedded one)")
    add("--llama-server", type=Path, default=None, help="llama-server binary (default: PATH)")
    add(
        "--threads",
        type=int,
        nargs="+",
        default=[DEFAULT_THREADS],
        help=f"CPU threads of every server (default {DEFAULT_THREADS}: see below); several "
        "values: every server at each, named with -tN, in one table",
    )
    add(
        "--no-library",
        dest="library",
        action="store_false",
        help="skip the library's rate on the grounded requests (default: measured per proposer "
        "and thread count, beside the server's)",
    )
    add("--temperature", type=float, default=0.0, help="of every request (default 0: greedy)")
    add("--seed", type=int, default=0)
    add("--busy", type=int, default=0, help="N CPU-spinning processes beside the run (default 0)")
    add("--output-dir", type=Path, default=Path("bench-results/serve"))
    serve.set_defaults(run=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    from hybridspec.bench.busy import busy_processes
    from hybridspec.bench.servers import ServerStartError
    from hybridspec.bench.serving_report import (
        ServingResults,
        format_results,
        plot_serving,
        write_json,
    )

    guidellm_runs = [w for w in args.workloads if w in GUIDELLM_WORKLOADS]
    if guidellm_runs and importlib.util.find_spec("guidellm") is None:
        print("guidellm is not installed: run `make bench-serve` (or pip install '.[bench]')")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from hybridspec.model import embedded_model_path

    gguf = (args.gguf or embedded_model_path()).resolve()
    out: Path = args.output_dir
    tokenizer_dir, workloads = _prepare(args, gguf, out)
    specs = _specs(args, gguf)
    plan = _conversation_plan(args)
    results = ServingResults(
        descriptions={w.name: w.description for w in workloads},
        notes={s.name: s.note for s in specs},
        ours=[s.name for s in specs if s.ours],
    )
    with busy_processes(args.busy):
        if args.library and "grounded" in args.workloads and 1 in args.concurrency:
            _measure_library(args, gguf, workloads, results)
        for spec in specs:
            try:
                _measure(spec, workloads, tokenizer_dir, args, out, results, plan)
            except ServerStartError as exc:
                if spec.ours:
                    raise
                logger.warning("skipping %s: it did not start: %s", spec.name, exc)
                results.notes[spec.name] = f"did not start ({out / 'logs'})"
            write_json(out / "serve.json", results)  # what ran so far survives a later failure
    text = format_results(results)
    (out / "serve.md").write_text(text, encoding="utf-8")
    plot_serving(results, out / "serve.png")
    print(text)
    print(f"wrote {out / 'serve.md'}, {out / 'serve.json'} and {out / 'serve.png'}")
    return 0


def _prepare(args: argparse.Namespace, gguf: Path, out: Path) -> tuple[Path, list[LoadWorkload]]:
    """The tokenizer guidellm counts with (saved from the GGUF) and the workloads."""
    from transformers import AutoTokenizer

    from hybridspec.bench.loadgen import grounded_workload, synthetic_workload

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer_dir = out / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    workloads = []
    if "synthetic" in args.workloads:
        load = synthetic_workload(args.prompt_tokens, args.output_tokens, args.concurrency)
        workloads.append(load)
    if "grounded" in args.workloads:
        workload = load_workload(args.workload)
        load = grounded_workload(
            workload, tokenizer, args.output_tokens, args.concurrency, out / "data"
        )
        workloads.append(load)
    return tokenizer_dir, workloads


def _conversation_plan(args: argparse.Namespace) -> ConversationPlan | None:
    """The conversational workloads' prompts, or None where none of them runs."""
    from hybridspec.bench.serve_conversations import ConversationPlan

    if not any(w in CONVERSATIONAL for w in args.workloads):
        return None
    workload = load_workload(args.workload)
    return ConversationPlan.from_workload(
        workload,
        args.conversations,
        args.turns,
        args.repeat_prompts,
        args.output_tokens,
        args.temperature,
        args.seed,
    )


def _specs(args: argparse.Namespace, gguf: Path) -> list[ServerSpec]:
    from hybridspec.bench.servers import (
        LLAMA_CTX_PER_SLOT,
        hybridspec_spec,
        llama_cpp_python_spec,
        llama_server_spec,
    )

    slots = max(args.concurrency)
    conversational = any(w in CONVERSATIONAL for w in args.workloads)
    ctx = CONVERSATION_CTX if conversational else LLAMA_CTX_PER_SLOT
    specs = []
    for threads in args.threads:
        suffix = _suffix(args, threads)
        specs += [hybridspec_spec(p, gguf, threads, slots, suffix) for p in args.proposers]
        peers = []
        if "llama-cpp-python" in args.peers:
            found = llama_cpp_python_spec(gguf, threads, ctx)
            if found is None:
                logger.warning("skipping llama-cpp-python: not installed (make bench-serve)")
            else:
                peers.append(found)
        if "llama-server" in args.peers:
            server = llama_server_spec(args.llama_server, gguf, threads, slots, ctx)
            if server is None:
                logger.warning("skipping llama-server: not found (make bench-serve builds it)")
            else:
                peers.append(server)
        specs += [dataclasses.replace(peer, name=peer.name + suffix) for peer in peers]
    return specs


def _suffix(args: argparse.Namespace, threads: int) -> str:
    """After each server's name: its threads, where several thread counts run."""
    return f"-t{threads}" if len(args.threads) > 1 else ""


def _measure_library(
    args: argparse.Namespace, gguf: Path, workloads: list[LoadWorkload], results: ServingResults
) -> None:
    """The library's rate on the grounded requests of concurrency 1, per proposer and thread
    count (``library_rate``), before any server starts."""
    from hybridspec.bench.library_rate import grounded_prompts, library_rates

    (grounded,) = [w for w in workloads if w.name == "grounded"]
    prompts, output_tokens = grounded_prompts(Path(grounded.data[1]["path"]), args.requests)
    for threads in args.threads:
        rates = library_rates(
            gguf, args.proposers, threads, prompts, output_tokens, args.temperature, args.seed
        )
        for proposer, rate in rates.items():
            name = f"hybridspec-{proposer}{_suffix(args, threads)}"
            results.library.setdefault("grounded", {})[name] = rate
            logger.info("library %s: %.1f output tok/s", name, rate)


def _measure(
    spec: ServerSpec,
    workloads: list[LoadWorkload],
    tokenizer_dir: Path,
    args: argparse.Namespace,
    out: Path,
    results: ServingResults,
    conversation: ConversationPlan | None = None,
) -> None:
    """Start ``spec`` once; run the conversational workloads (``conversation``) first, while
    neither its prefix cache nor its suffix pool holds guidellm's prompts, then guidellm on
    every other workload."""
    from hybridspec.bench.loadgen import COMPLETIONS_ROUTE, run_guidellm, scenario
    from hybridspec.bench.servers import running

    with running(spec, out / "logs" / f"{spec.name}.log") as url:
        if conversation is not None:
            _measure_conversational(spec, url, conversation, tokenizer_dir, args, results)
        for workload in workloads:
            points = []
            for concurrency in args.concurrency:
                name = f"{workload.name}-{spec.name}-c{concurrency}"
                plan = scenario(
                    url,
                    COMPLETIONS_ROUTE,
                    workload.data[concurrency],
                    tokenizer_dir,
                    concurrency,
                    args.requests,
                    args.temperature,
                    args.seed + concurrency,  # synthetic prompts of their own
                )
                (point,) = run_guidellm(plan, out / "guidellm", name)
                logger.info(
                    "%s: %.1f output tok/s, TTFT p95 %.0f ms, %d errors",
                    name,
                    point.output_tokens_per_s,
                    point.ttft_p95_ms,
                    point.errored,
                )
                points.append(point)
            results.add(workload.name, spec.name, points)


def _measure_conversational(
    spec: ServerSpec,
    url: str,
    plan: ConversationPlan,
    tokenizer_dir: Path,
    args: argparse.Namespace,
    results: ServingResults,
) -> None:
    """The multi-turn and repeat workloads against the running ``spec`` at ``url``."""
    from transformers import AutoTokenizer

    from hybridspec.bench.serve_conversations import run_conversational

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    chosen = [w for w in args.workloads if w in CONVERSATIONAL]

    def log(line: str) -> None:
        logger.info("%s %s", spec.name, line)

    figures = run_conversational(url, plan, tokenizer, chosen, spec.ours, log)
    results.conversations[spec.name] = figures
