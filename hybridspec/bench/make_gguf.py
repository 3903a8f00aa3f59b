"""``hybridspec bench make-gguf``: a random-weight GGUF file in a model's shape and a llama.cpp
mix (``random_gguf``), for measuring load, memory and speed at sizes no test downloads."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

# Names only: the writer (numpy, gguf) is imported when the command runs.
SHAPE_NAMES = ("tiny", "135m", "1b", "3b", "8b")
FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3")
MIX_NAMES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K")


def add_make_gguf_command(bench_commands: Any) -> None:
    """Register ``make-gguf`` under ``hybridspec bench``."""
    make = bench_commands.add_parser(
        "make-gguf",
        help="write a random-weight GGUF file in a model's shape (135m, 1b, 3b, 8b)",
        description=__doc__,
    )
    add = make.add_argument
    add("output", type=Path, help="the .gguf file to write")
    add(
        "--shape",
        required=True,
        choices=SHAPE_NAMES,
        help="SmolLM2-135M, Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, or a tiny test shape",
    )
    add("--type", default="Q4_K_M", choices=MIX_NAMES, help="llama.cpp's file type (mix)")
    add("--family", default="llama", choices=FAMILY_NAMES)
    add("--seed", type=int, default=0, help="seed of the random codes and scales")
    make.set_defaults(run=run_make_gguf)


def run_make_gguf(args: argparse.Namespace) -> int:
    from hybridspec.bench.random_gguf import write_random_gguf

    started = time.perf_counter()
    path = write_random_gguf(args.output, args.shape, args.type, family=args.family, seed=args.seed)
    seconds = time.perf_counter() - started
    print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB in {seconds:.1f} s")
    return 0
