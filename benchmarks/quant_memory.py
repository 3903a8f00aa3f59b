"""Resident memory of one GGUF file loaded by hybridspec (library, default settings) or by
llama.cpp (llama-cpp-python), each in a fresh process, after decoding a few tokens.

Usage: python benchmarks/quant_memory.py FILE [--context 2048] [--threads 2]
Prints one line per engine: VmRSS and VmHWM in MB. hybridspec runs twice (the first run
converts the file and fills the weight cache; the second, reported, loads from it, as a restart
of ``serve`` does).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import sys, torch
torch.set_num_threads({threads})
which, path, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
if which == "hybridspec":
    from hybridspec.config import ModelConfig
    from hybridspec.model.loader import load_model
    from hybridspec.model.runtime import ForwardBatch
    model = load_model(ModelConfig(name_or_path=path))
    runtime = model.create_runtime(1, context)
    slot = runtime.allocate()
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    for _ in range(8):
        logits = runtime.forward(ForwardBatch.from_lists([slot], [ids])).logits
        ids = [int(logits[-1].argmax())]
else:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=context, n_threads={threads}, verbose=False)
    llm.create_completion("Hello there, how are", max_tokens=8, temperature=0.0)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
mb = lambda key: int(status[key].split()[0]) / 1024
print(f"{{which}} rss_mb={{mb('VmRSS'):.0f}} hwm_mb={{mb('VmHWM'):.0f}}")
"""


def measure(which: str, path: str, context: int, threads: int) -> str:
    code = CHILD.format(threads=threads)
    done = subprocess.run(
        [sys.executable, "-c", code, which, path, str(context)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    measure("hybridspec", args.file, args.context, args.threads)  # fills the weight cache
    for which in ("hybridspec", "llamacpp"):
        print(args.file, measure(which, args.file, args.context, args.threads), flush=True)


if __name__ == "__main__":
    main()
