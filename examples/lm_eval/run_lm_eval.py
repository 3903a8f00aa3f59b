"""Evaluate ``hybridspec serve`` with lm-evaluation-harness, then check lm-eval's figures
against the library's own.

From the repository root, with lm-eval installed (``make lm-eval`` installs it and runs this):

    .venv/bin/python examples/lm_eval/run_lm_eval.py [--port 8011] [--dtype bfloat16]

It exports the served model's tokenizer to a local directory (lm-eval tokenizes requests
itself, and the hub may be out of reach), starts ``hybridspec serve`` on the embedded model,
runs lm-eval's ``local-completions`` model on the two local tasks of ``examples/lm_eval/tasks``
(``hybridspec_mc``: multiple choice by loglikelihood; ``hybridspec_gen``: greedy generation
until a newline) with ``--log_samples``, and stops the server. Then, for every sample, it
computes with an ``Engine`` in this process what lm-eval got over HTTP: each choice's
loglikelihood from the prompt's logprobs (``prompt_logprobs``, ``max_new_tokens=0``), tokenized
as lm-eval tokenizes it, and each generation. It prints the accuracies, the largest absolute
difference between the loglikelihoods and how many generations are equal, and exits 1 when a
loglikelihood differs by more than ``--tolerance`` or a generation differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridspec import Engine, EngineConfig, ModelConfig

HERE = Path(__file__).resolve().parent
TASKS = ("hybridspec_mc", "hybridspec_gen")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--dtype", default=ModelConfig().dtype, help="the served model's dtype")
    parser.add_argument("--output-dir", type=Path, default=Path("lm-eval-results"))
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--limit", type=int, default=None, help="samples per task (all)")
    return parser.parse_args()


@contextlib.contextmanager
def serving(port: int, dtype: str, log: Path) -> Iterator[str]:
    """``hybridspec serve`` on the embedded model in a child process; yields the served name."""
    command = [sys.executable, "-m", "hybridspec.cli", "serve", "--port", str(port)]
    with log.open("w") as out:
        server = subprocess.Popen([*command, "--dtype", dtype], stdout=out, stderr=out)
    try:
        yield _served_model(port, server, log)
    finally:
        server.terminate()
        server.wait(30)


def _served_model(port: int, server: subprocess.Popen[bytes], log: Path) -> str:
    """Wait until the server answers (it warms up first); return its model's name."""
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as response:
                return str(json.load(response)["data"][0]["id"])
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {log}") from None
            time.sleep(1)


def run_lm_eval(args: argparse.Namespace, model: str, tokenizer: Path) -> Path:
    """Run lm-eval against the server; return the directory it wrote its results to."""
    model_args = ",".join(
        [
            f"base_url=http://127.0.0.1:{args.port}/v1/completions",
            f"model={model}",
            "tokenizer_backend=huggingface",
            f"tokenizer={tokenizer}",
            "tokenized_requests=True",
        ]
    )
    command = [
        *(sys.executable, "-m", "lm_eval", "--model", "local-completions"),
        *("--model_args", model_args, "--include_path", str(HERE / "tasks")),
        *("--tasks", ",".join(TASKS), "--batch_size", "1", "--log_samples"),
        *("--output_path", str(args.output_dir / "results")),
    ]
    if args.limit is not None:
        command += ["--limit", str(args.limit)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, **OFFLINE})
    return args.output_dir / "results"


def newest(results: Path, pattern: str) -> Path:
    return max(results.rglob(pattern), key=lambda path: path.stat().st_mtime)


def read_samples(results: Path, task: str) -> list[dict[str, Any]]:
    lines = newest(results, f"samples_{task}_*.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def encode_pair(engine: Engine, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's tokenization of a loglikelihood request (``TemplateLM._encode_pair``): the
    context's trailing spaces move to the continuation; the whole is encoded, then split."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = engine.tokenizer
    whole = encode(context + continuation, add_special_tokens=False).input_ids
    context_ids = encode(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids) :]


def loglikelihood(engine: Engine, context: str, continuation: str) -> float:
    """The continuation's log-probability after the context, from the engine's prompt logprobs."""
    context_ids, continuation_ids = encode_pair(engine, context, continuation)
    result = engine.generate(
        prompt_token_ids=context_ids + continuation_ids, max_new_tokens=0, prompt_logprobs=0
    )
    assert result.prompt_logprobs is not None
    return float(result.prompt_logprobs.logprobs[len(context_ids) - 1 :].double().sum())


def check_loglikelihoods(engine: Engine, samples: list[dict[str, Any]]) -> tuple[float, int]:
    """The largest |lm-eval's - the library's| over every choice of every sample, and the count."""
    worst, count = 0.0, 0
    for sample in samples:
        for arguments, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            served = float(response[0][0])
            direct = loglikelihood(engine, arguments["arg_0"], arguments["arg_1"])
            worst, count = max(worst, abs(served - direct)), count + 1
    return worst, count


def check_generations(engine: Engine, samples: list[dict[str, Any]]) -> tuple[int, int]:
    """How many of lm-eval's generations the library reproduces (greedy, the same stops)."""
    equal = 0
    for sample in samples:
        arguments = sample["arguments"]["gen_args_0"]
        context, options = arguments["arg_0"], arguments["arg_1"]
        stop = [*options["until"], engine.tokenizer.eos_token]
        ids = engine.tokenizer(context, add_special_tokens=False).input_ids
        result = engine.generate(
            prompt_token_ids=ids, max_new_tokens=options["max_gen_toks"], stop=stop
        )
        equal += result.text == sample["resps"][0][0]
    return equal, len(samples)


def main() -> int:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    engine = Engine(EngineConfig(target=ModelConfig(dtype=args.dtype)))
    tokenizer = args.output_dir / "tokenizer"
    engine.tokenizer.save_pretrained(tokenizer)  # what lm-eval loads instead of the hub's
    with serving(args.port, args.dtype, args.output_dir / "server.log") as model:
        served_at = time.perf_counter()
        results = run_lm_eval(args, model, tokenizer)
        eval_s = time.perf_counter() - served_at
    scores = json.loads(newest(results, "results_*.json").read_text())["results"]
    worst, count = check_loglikelihoods(engine, read_samples(results, TASKS[0]))
    equal, total = check_generations(engine, read_samples(results, TASKS[1]))
    print(
        f"{TASKS[0]}: acc {scores[TASKS[0]]['acc,none']:.4f}, "
        f"acc_norm {scores[TASKS[0]]['acc_norm,none']:.4f}; "
        f"{TASKS[1]}: exact_match {scores[TASKS[1]]['exact_match,none']:.4f}\n"
        f"loglikelihoods: {count} compared, max |lm-eval - library| = {worst:.3g}\n"
        f"generations: {equal} of {total} equal to the library's\n"
        f"lm-eval run {eval_s:.1f} s, all {time.perf_counter() - start:.1f} s"
    )
    return 0 if worst <= args.tolerance and equal == total else 1


if __name__ == "__main__":
    sys.exit(main())
