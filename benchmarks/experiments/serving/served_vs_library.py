"""The same request through the library and through ``hybridspec serve``: tok/s and their ratio.

Run from the repository root with the environment's interpreter, e.g.::

    .venv/bin/python benchmarks/experiments/serving/served_vs_library.py  # --threads auto 2
    .venv/bin/python benchmarks/experiments/serving/served_vs_library.py --threads 2 --repeats 5

For each ``--threads`` setting (default: ``auto``, what both sides run by default, then a fixed
2), one run starts ``hybridspec serve --threads T`` (a child process, on a free loopback port)
and builds an ``Engine`` in this process from the configuration that the same ``serve`` command
line gives (``cli.serve.server_config``), so that both sides have the same model, thread
setting, proposers, K and adaptive speculation. Both are warmed up alike: the server's
lifespan runs ``engine.warm_up`` and so does this process on its engine, and then each side
serves one untimed request of every proposer.

Then it times one request at a time, interleaved: for each repeat and proposer, the library
(``Engine.generate``), the server without streaming and the server streamed (SSE, read to
``[DONE]``), in an order that rotates from one repeat to the next. Every request is the same
token-id prompt, greedy, ``--tokens`` tokens with ``ignore_eos``. Only one side is ever busy:
the server's engine thread waits on its inbox between requests, and the library's engine is
idle while the server runs.

The measure is the same on both sides: generated tokens over the wall time of the whole
request, first token included (the library: the ``generate`` call; the server: from sending
the request to its last byte, client side). The table gives the median of ``--repeats`` of
each, the ratios of those medians (served / library) and the range of the per-repeat ratios
(each served run over the library run of the same repeat); ``TEXT DIFFERS`` marks a proposer
whose texts were not identical on all three paths.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridspec.bench import free_port, wait_ready

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the weather and the keeper's daily routine."
)
PATHS = ("library", "served", "streamed")


def post(base: str, body: dict[str, Any]) -> tuple[float, str]:
    """Wall seconds and the text of one completion request, streamed or not."""
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        if not body.get("stream"):
            text = json.loads(response.read())["choices"][0]["text"]
            return time.perf_counter() - start, text
        pieces = []
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            pieces += [c.get("text", "") for c in choices]
    return time.perf_counter() - start, "".join(pieces)


def serve_arguments(port: int, threads: str) -> list[str]:
    """The ``serve`` command line of one setting; the library's engine is configured from it."""
    return ["serve", "--port", str(port), "--threads", threads]


def start_server(arguments: list[str], log: Any) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "hybridspec.cli", *arguments]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@dataclass
class Runs:
    """One proposer's timed runs: seconds per path, and whether every text was the same."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})
    same: bool = True


class Sides:
    """The library's engine and the server, each running one request of a proposer."""

    def __init__(self, engine: Any, base: str, prompt_ids: list[int], tokens: int) -> None:
        self.engine, self.base, self.prompt_ids, self.tokens = engine, base, prompt_ids, tokens

    def run(self, path: str, proposer: str) -> tuple[float, str]:
        """Wall seconds and text of one request on ``path`` (one of ``PATHS``)."""
        if path == "library":
            start = time.perf_counter()
            result = self.engine.generate(
                prompt_token_ids=self.prompt_ids,
                max_new_tokens=self.tokens,
                ignore_eos=True,
                proposer=proposer,
            )
            return time.perf_counter() - start, str(result.text)
        body = {
            "prompt": self.prompt_ids,
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "temperature": 0,
            "proposer": proposer,
            "stream": path == "streamed",
        }
        return post(self.base, body)


def measure(sides: Sides, proposers: list[str], repeats: int) -> dict[str, Runs]:
    """One untimed request of each proposer on each path, then ``repeats`` timed rounds,
    interleaved, the paths' order rotating from one repeat to the next."""
    for proposer in proposers:
        for path in PATHS:
            sides.run(path, proposer)
    runs = {p: Runs() for p in proposers}
    for repeat in range(repeats):
        order = PATHS[repeat % 3 :] + PATHS[: repeat % 3]
        for proposer in proposers:
            texts = set()
            for path in order:
                seconds, text = sides.run(path, proposer)
                runs[proposer].seconds[path].append(seconds)
                texts.add(text)
            runs[proposer].same &= len(texts) == 1
    return runs


def one_setting(threads: str, args: argparse.Namespace) -> tuple[dict[str, Runs], str, int]:
    """Start the server and build the library's engine at ``threads``; measure both; return
    the runs, the server's ``ready:`` line and the library's thread count at the end."""
    from hybridspec.cli import build_parser, server_config
    from hybridspec.engine import Engine, warm_up
    from hybridspec.model import num_threads

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    arguments = serve_arguments(port, threads)
    with tempfile.NamedTemporaryFile() as log:
        server = start_server(arguments, log)
        try:
            engine = Engine(server_config(build_parser().parse_args(arguments)).engine_config())
            try:
                warm_up(engine)  # as the server's lifespan does
                prompt_ids = engine.encode(PROMPT, None, None)
                wait_ready(base, server, args.timeout, Path(log.name))
                sides = Sides(engine, base, prompt_ids, args.tokens)
                runs = measure(sides, args.proposers, args.repeats)
                library_threads = num_threads()
            finally:
                engine.close()
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        log.seek(0)
        lines = log.read().decode(errors="replace").splitlines()
    ready = next((line.split("ready: ", 1)[1] for line in lines if "ready: " in line), "?")
    return runs, ready, library_threads


def table(runs: dict[str, Runs], tokens: int) -> list[str]:
    """The markdown rows of one setting: median tok/s per path, the ratios of the medians
    and the range of the per-repeat ratios."""
    rows = [
        "| proposer | library tok/s | served tok/s | streamed tok/s | served / library "
        "| streamed / library |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for proposer, run in runs.items():
        rates = {p: [tokens / s for s in run.seconds[p]] for p in PATHS}
        median = {p: statistics.median(rates[p]) for p in PATHS}
        cells = []
        for path in ("served", "streamed"):
            paired = [a / b for a, b in zip(rates[path], rates["library"], strict=True)]
            cells.append(
                f"**{median[path] / median['library']:.2f}x** ({min(paired):.2f}-{max(paired):.2f})"
            )
        rows.append(
            f"| {proposer} | {median['library']:.1f} | {median['served']:.1f} | "
            f"{median['streamed']:.1f} | {cells[0]} | {cells[1]} |"
            + ("" if run.same else " TEXT DIFFERS")
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proposers", nargs="+", default=["none", "ngram"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each path")
    parser.add_argument(
        "--threads",
        nargs="+",
        default=["auto", "2"],
        help="serve --threads of each setting, and the library's (default: auto, then 2)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on a timeout too
    print(
        f"{args.tokens} tokens, greedy, one request at a time; tok/s = tokens over the whole "
        f"request's wall time, first token included; median of {args.repeats}; ratios: of "
        "the medians (range of the per-repeat ratios)"
    )
    for threads in args.threads:
        runs, ready, library_threads = one_setting(threads, args)
        load = os.getloadavg()
        print(f"\n--threads {threads} (library and server); server ready: {ready}")
        print(f"the library's engine ended at {library_threads} threads")
        print(f"load average {load[0]:.2f} {load[1]:.2f}\n")
        print("\n".join(table(runs, args.tokens)))


if __name__ == "__main__":
    main()
