"""The busy rows: ``none`` at ``--threads auto``, 1 and 2, and llama.cpp plain at 2 threads, with
0, 1 and 2 busy-looping processes beside each (``hybridspec bench --busy N``), each row a
``hybridspec bench`` process of its own, in turn.

Each cell is the bench's mean over the prompts of their tok/s, first token included (3 prompts:
one each of creative writing, math reasoning and multi-turn chat, greedy). It prints each row as
it ends and then, per load, ``auto`` over the best fixed count and over llama.cpp plain
(issue 46's rows: at least 0.85x and 2.5x beside busy processes; alone, ``auto`` within 3% of 2
threads). llama.cpp's rows need ``make bench-peers-install``; ``--rows`` picks rows
(``THREADS:METHOD``). Run from the repository root::

    python benchmarks/experiments/busy/busy_rows.py --target FILE.gguf --max-new-tokens 64
    python benchmarks/experiments/busy/busy_rows.py --max-new-tokens 96   # the embedded file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = ("auto:none", "2:none", "1:none", "2:llamacpp-plain")
CATEGORIES = ("creative_writing", "math_reasoning", "multi_turn_chat")


def run_row(args: argparse.Namespace, busy: int, threads: str, method: str) -> dict[str, float]:
    """One row's bench in a process of its own: its mean tok/s, decode tok/s and first token
    (ValueError where the bench ran none of it: llama.cpp not installed)."""
    out = args.output_dir / f"busy{busy}-{threads}-{method}"
    command = [sys.executable, "-m", "hybridspec.cli", "bench", "--busy", str(busy)]
    command += ["--threads", threads, "--methods", method, "--categories", *CATEGORIES]
    command += ["--prompts-per-category", "1", "--temperature", "0"]
    command += ["--max-new-tokens", str(args.max_new_tokens), "--output-dir", str(out)]
    if args.target:
        command += ["--target", args.target]
    log = out.with_suffix(".log")
    out.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, check=True)
    cells = json.loads((out / "bench.json").read_text())["cells"]
    if not cells:
        raise ValueError(f"{threads} {method}: the bench ran no trial (see {log})")
    return {
        "tok/s": statistics.fmean(cell["tokens_per_s"] for cell in cells),
        "decode tok/s": statistics.fmean(cell["decode_tokens_per_s"] for cell in cells),
        "first token ms": statistics.fmean(cell["first_token_ms"] for cell in cells),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="a GGUF file (default: the embedded one)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--rows", nargs="+", default=list(ROWS), help="THREADS:METHOD, each load in this order"
    )
    parser.add_argument(
        "--output-dir", type=Path, default=Path(f"busy-rows-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.2f}", flush=True)
    rates: dict[tuple[int, str], float] = {}
    for busy in args.busy:
        for row_name in args.rows:
            threads, _, method = row_name.partition(":")
            row = run_row(args, busy, threads, method)
            rates[busy, row_name] = row["tok/s"]
            cells = ", ".join(f"{name} {value:.1f}" for name, value in row.items())
            print(
                f"{time.strftime('%H:%M:%S')} busy {busy}, {threads} {method}: {cells}", flush=True
            )
    for busy in args.busy:
        print(summary(busy, {name: rate for (load, name), rate in rates.items() if load == busy}))


def summary(busy: int, rates: dict[str, float]) -> str:
    """``auto``'s rate and its ratios to the fixed counts' best, to 2 threads and to llama.cpp
    plain, those of them that ran."""
    auto = rates.get("auto:none")
    if auto is None:
        return f"busy {busy}: no auto row"
    fixed = [rate for name, rate in rates.items() if name.endswith(":none") and name != "auto:none"]
    parts = [f"busy {busy}: auto {auto:.2f} tok/s"]
    if fixed:
        parts.append(f"{auto / max(fixed):.3f}x the best fixed count")
    if "2:none" in rates:
        parts.append(f"{auto / rates['2:none']:.3f}x 2 threads")
    if "2:llamacpp-plain" in rates:
        parts.append(f"{auto / rates['2:llamacpp-plain']:.2f}x llama.cpp plain")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
