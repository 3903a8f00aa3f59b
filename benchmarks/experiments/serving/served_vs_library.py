"""The same request through the library and through ``hybridspec serve``: tok/s and their ratio.

Run from the repository root with the environment's interpreter, e.g.::

    .venv/bin/python benchmarks/experiments/serving/served_vs_library.py
    .venv/bin/python benchmarks/experiments/serving/served_vs_library.py --threads 1 --repeats 5

One run of this script starts ``hybridspec serve`` (a child process, on a free loopback port)
and builds an ``Engine`` in this process on the same model, then times one request at a time,
interleaved: for each proposer and repeat, the library (``Engine.generate``), the server
without streaming and the server streamed (SSE, read to ``[DONE]``). Every request is the same
token-id prompt, greedy, ``--tokens`` tokens with ``ignore_eos``; a run's tok/s is those tokens
over the request's wall time (client side for the server). The best of ``--repeats`` of each is
reported, with served / library, and whether the server's text equals the library's; and the
voluntary context switches per generated token of each process (all its threads, summed from
``/proc``, the mean over the runs): a kernel's worker that sleeps between parallel regions
instead of spinning shows there whatever the machine's load. Only one of
the two is ever busy: the server's engine thread waits on its inbox between requests, and the
library's engine is idle while the server runs.

``--threads N`` passes ``serve --threads N`` and builds the library's engine with
``EngineConfig(num_threads=N)``; 0 leaves both at their defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from hybridspec.bench import free_port

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the weather and the keeper's daily routine."
)


def get_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


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


def voluntary_switches(pid: int | str) -> int:
    """Voluntary context switches of every thread of process ``pid`` so far (Linux)."""
    total = 0
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        with contextlib.suppress(OSError), open(status) as lines:
            total += sum(int(line.split()[1]) for line in lines if line.startswith("voluntary_"))
    return total


def start_server(port: int, threads: int, log: Any) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "hybridspec.cli", "serve", "--port", str(port)]
    if threads > 0:
        command += ["--threads", str(threads)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(base: str, server: subprocess.Popen[bytes], timeout_s: float) -> None:
    start = time.perf_counter()
    while get_status(f"{base}/health") != 200:
        if server.poll() is not None or time.perf_counter() - start > timeout_s:
            raise RuntimeError("the server did not become ready")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proposers", nargs="+", default=["none", "ngram"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs of each")
    parser.add_argument("--threads", type=int, default=0, help="serve --threads, and ours")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready")
    args = parser.parse_args()

    import torch

    from hybridspec import Engine
    from hybridspec.config import EngineConfig

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on a timeout too
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = start_server(port, args.threads, log)
        try:
            engine = Engine(EngineConfig(num_threads=args.threads or None))
            prompt_ids = engine.encode(PROMPT, None, None)
            engine.generate(prompt_token_ids=prompt_ids, max_new_tokens=8)  # warm
            wait_ready(base, server, args.timeout)
            rows, switches = run(engine, base, prompt_ids, args, server.pid)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        log.seek(0)
        ready = [
            line for line in log.read().decode(errors="replace").splitlines() if "ready:" in line
        ]
    print(f"library: {torch.get_num_threads()} threads; server: {ready[0] if ready else '?'}")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    print(
        "| proposer | library tok/s | served tok/s | streamed tok/s | served/lib | streamed/lib "
        "| switches/token lib, served, streamed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for proposer, (lib, plain, streamed, same) in rows.items():
        per_token = ", ".join(f"{s:.0f}" for s in switches[proposer])
        print(
            f"| {proposer} | {lib:.1f} | {plain:.1f} | {streamed:.1f} | "
            f"{plain / lib:.2f}x | {streamed / lib:.2f}x | {per_token} |"
            + ("" if same else " TEXT DIFFERS")
        )


def run(
    engine: Any, base: str, prompt_ids: list[int], args: argparse.Namespace, server_pid: int
) -> tuple[dict[str, tuple[float, float, float, bool]], dict[str, list[float]]]:
    """Best tok/s per proposer: library, served, streamed; and whether the texts agreed. Then
    the mean voluntary context switches per token of each, library, served, streamed."""
    best: dict[str, list[float]] = {p: [0.0, 0.0, 0.0] for p in args.proposers}
    switches: dict[str, list[float]] = {p: [0.0, 0.0, 0.0] for p in args.proposers}
    same = dict.fromkeys(args.proposers, True)
    per_run = 1 / (args.tokens * args.repeats)
    for _ in range(args.repeats):
        for proposer in args.proposers:
            ours = voluntary_switches("self")
            start = time.perf_counter()
            result = engine.generate(
                prompt_token_ids=prompt_ids,
                max_new_tokens=args.tokens,
                ignore_eos=True,
                proposer=proposer,
            )
            lib_s = time.perf_counter() - start
            switches[proposer][0] += (voluntary_switches("self") - ours) * per_run
            body = {
                "prompt": prompt_ids,
                "max_tokens": args.tokens,
                "ignore_eos": True,
                "temperature": 0,
                "proposer": proposer,
            }
            theirs = voluntary_switches(server_pid)
            plain_s, plain_text = post(base, body)
            middle = voluntary_switches(server_pid)
            streamed_s, streamed_text = post(base, {**body, "stream": True})
            switches[proposer][1] += (middle - theirs) * per_run
            switches[proposer][2] += (voluntary_switches(server_pid) - middle) * per_run
            same[proposer] &= plain_text == result.text == streamed_text
            for i, seconds in enumerate((lib_s, plain_s, streamed_s)):
                best[proposer][i] = max(best[proposer][i], args.tokens / seconds)
    rates = {p: (best[p][0], best[p][1], best[p][2], same[p]) for p in args.proposers}
    return rates, switches


if __name__ == "__main__":
    main()
