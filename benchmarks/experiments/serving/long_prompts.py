"""Issue 49's figures: long prompts beside streams, on the embedded model, default settings.

Starts ``python -m hybridspec.cli serve`` from the repository given (its own .venv) on a
loopback port and measures, in order:

1. ``decode_tok_s``: one stream alone, 256 tokens (ignore_eos): completion tokens after the
   first over the seconds from the first to the last event; the median of 3.
2. ``alone_s`` / ``alone_ttft_s`` / ``prefill_tok_s``: a prompt of ``--tokens`` random token ids
   (distinct each time: no prefix-cache hit), 16 new tokens, nothing else running: its time,
   its time to the first token, and prompt tokens per second of that; the median of 2. One
   such prompt is sent first, untimed: the first long prompt a server prefills touches its
   cache's memory for the first time (on a VM whose memory went cold, seconds).
3. ``canary_max_gap_s`` / ``shared_s``: the same prompt while a canary streams (400-token
   answers, back to back): the canary's largest gap between two tokens of one answer while the
   long prompt runs, and the long prompt's time; ``shared_over_alone`` = shared_s / alone_s.
   Each run of (2) is followed by one of (3), so that a machine whose speed drifts during the
   run weighs on both sides of the ratio alike.
   The worst of 2 runs; ``canary_max_gap_at_s``: when its largest gap began, in seconds after
   the long prompt was sent. ``canary_max_text_gap_s``: the largest gap between two events that
   carry text; a token without text of its own (a special token, part of a character) makes
   it span two tokens or more. ``canary_max_first_s``: the longest a canary's answer that
   began while the long prompt ran waited for its first token (its next request is sent as
   one answer ends: the wait between answers).
4. ``ten_max_gap_s``: 8 streams run (400-token answers, back to back) and 10 such long prompts
   arrive at once: the largest gap between two tokens of one stream's answer while any long
   prompt runs (``ten_max_text_gap_s``: between texts; ``ten_max_gap_at_s``: when it began,
   after the prompts were sent); ``ten_long_s_median`` /
   ``ten_long_s_max``: the long prompts' times.

5. ``short_first_s_max``: while such a long prompt prefills with nothing else running, 3 short
   requests (16 tokens) are sent one after another: the longest wait for a first token. A
   short prompt is fed whole in the first step after it arrives, so this is at most the step
   in flight then (one full chunk: nothing was decoding) and one bounded step.

The streams ask for ``stream_options.include_drafts``, so that every output, with text or not,
is an event that lists its tokens: a gap between tokens is then seen as the server makes it.

Run: ``python benchmarks/experiments/serving/long_prompts.py REPO [--tokens 7800] [--skip-ten]``
(REPO: the checkout to serve, e.g. ``.``; about 6-10 minutes on a quiet 2-core machine); prints
each part's figures on stderr as it ends, then all of them as one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

NEW_TOKENS = 16
STREAM_TOKENS = 400


def start_server(repo: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``hybridspec serve`` of ``repo`` (its .venv's Python where it has one), once ready."""
    from hybridspec.bench import wait_ready

    python = repo / ".venv" / "bin" / "python"
    command = [str(python if python.exists() else sys.executable), "-m", "hybridspec.cli"]
    command += ["serve", "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    with log.open("wb") as out:
        server = subprocess.Popen(command, cwd=repo, env=env, stdout=out, stderr=out)
    wait_ready(f"http://127.0.0.1:{port}", server, 600, log)
    return server


def long_prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(tokens)]


def timed_completion(
    url: str, prompt: list[int] | str, max_tokens: int, client: httpx.Client | None = None
) -> dict[str, float]:
    """Stream one completion; its events' times (first, last) from its start, and tokens.
    ``client``: one made beforehand (else one is made here: tens of milliseconds of this
    process's CPU, which a timed window on a 2-core machine would count against the server)."""
    if client is None:
        with httpx.Client(base_url=url, timeout=1200) as own:
            return timed_completion(url, prompt, max_tokens, own)
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    completion_tokens = 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                now = time.perf_counter() - start
                first = now if first is None else first
                last = now
    assert first is not None and last is not None
    return {"first": first, "last": last, "tokens": completion_tokens}


class Streams:
    """``count`` clients streaming 400-token answers back to back; every gap between two
    tokens of one answer is kept with its time, and every gap between two texts."""

    def __init__(self, url: str, count: int) -> None:
        self.url, self.stop = url, threading.Event()
        self.gaps: list[tuple[float, float]] = []  # (when, gap)
        self.text_gaps: list[tuple[float, float]] = []
        self.firsts: list[tuple[float, float]] = []  # (when, an answer's wait for its first token)
        self.errors = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]

    def __enter__(self) -> Streams:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(600)

    def max_gap(self, start: float, end: float, text: bool = False) -> float:
        gaps = self.text_gaps if text else self.gaps
        return max((g for t, g in gaps if start <= t <= end), default=0.0)

    def max_gap_at(self, start: float, end: float) -> float:
        """When the largest gap between ``start`` and ``end`` began, in seconds after ``start``
        (near 0: as the long prompt arrived; near the end: its last chunks or first tokens)."""
        gap, when = max(((g, t) for t, g in self.gaps if start <= t <= end), default=(0.0, start))
        return when - gap - start

    def max_first(self, start: float, end: float) -> float:
        """The longest wait for a first token among answers sent between ``start`` and
        ``end``."""
        return max((w for t, w in self.firsts if start <= t - w <= end), default=0.0)

    def _run(self) -> None:
        body = {
            "prompt": "Write a long story about a cat.",
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_drafts": True},
        }
        with httpx.Client(base_url=self.url, timeout=1200) as client:
            while not self.stop.is_set():
                sent = time.perf_counter()
                with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        self.errors += 1
                        time.sleep(0.2)
                        continue
                    last: dict[str, float] = {}  # gaps within an answer, not its queueing
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        choice = json.loads(line[6:])["choices"][0]
                        if not last and choice.get("tokens"):
                            self.firsts.append((now, now - sent))
                        for kind, gaps, seen in (
                            ("token", self.gaps, choice.get("tokens")),
                            ("text", self.text_gaps, choice.get("text")),
                        ):
                            if seen:
                                if kind in last:
                                    gaps.append((now, now - last[kind]))
                                last[kind] = now


def decode_rate(url: str) -> float:
    rates = []
    for _ in range(3):
        t = timed_completion(url, "Write a long story about a dog.", 256)
        rates.append((t["tokens"] - 1) / (t["last"] - t["first"]))
    return statistics.median(rates)


def alone_and_shared(url: str, tokens: int) -> dict[str, float]:
    """Parts 2 and 3, their runs interleaved, after one untimed long prompt."""
    timed_completion(url, long_prompt(99, tokens), NEW_TOKENS)
    runs: list[dict[str, float]] = []
    shared: list[dict[str, float]] = []
    for i in range(2):
        runs.append(timed_completion(url, long_prompt(100 + i, tokens), NEW_TOKENS))
        shared.append(with_canary(url, tokens, i))
    ttft = statistics.median(r["first"] for r in runs)
    worst = max(shared, key=lambda run: run["canary_max_gap_s"])
    return {
        "alone_s": statistics.median(r["last"] for r in runs),
        "alone_ttft_s": ttft,
        "prefill_tok_s": tokens / ttft,
        "canary_max_gap_s": worst["canary_max_gap_s"],
        "canary_max_gap_at_s": worst["canary_max_gap_at_s"],
        "canary_max_text_gap_s": max(run["canary_max_text_gap_s"] for run in shared),
        "canary_max_first_s": max(run["canary_max_first_s"] for run in shared),
        "shared_s": max(run["shared_s"] for run in shared),
    }


def with_canary(url: str, tokens: int, i: int) -> dict[str, float]:
    """One run of part 3, with the ``i``-th prompt."""
    with Streams(url, 1) as canary, httpx.Client(base_url=url, timeout=1200) as client:
        prompt = long_prompt(200 + i, tokens)  # made before the window, as the client
        time.sleep(3)
        start = time.perf_counter()
        run = timed_completion(url, prompt, NEW_TOKENS, client)
        end = time.perf_counter()
        time.sleep(1)
    return {
        "canary_max_gap_s": canary.max_gap(start, end),
        "canary_max_gap_at_s": canary.max_gap_at(start, end),
        "canary_max_text_gap_s": canary.max_gap(start, end, text=True),
        "canary_max_first_s": canary.max_first(start, end),
        "shared_s": run["last"],
    }


def short_beside_long(url: str, tokens: int) -> dict[str, float]:
    done: list[float] = []
    thread = threading.Thread(
        target=lambda: done.append(
            timed_completion(url, long_prompt(400, tokens), NEW_TOKENS)["last"]
        )
    )
    thread.start()
    firsts = []
    for _ in range(3):
        time.sleep(2.0)
        firsts.append(timed_completion(url, "Write a long story about a cat.", NEW_TOKENS)["first"])
    thread.join()
    return {"short_first_s_max": max(firsts), "short_beside_long_s": done[0]}


def ten_long(url: str, tokens: int) -> dict[str, float]:
    """The prompts and their clients are made before the window: making 10 clients at once
    takes a core of this process for about half a second, which the server's forward (its
    threads on every core) would wait for."""
    times: list[float] = []
    prompts = [long_prompt(300 + i, tokens) for i in range(10)]
    clients = [httpx.Client(base_url=url, timeout=1200) for _ in prompts]

    def one(i: int) -> None:
        times.append(timed_completion(url, prompts[i], NEW_TOKENS, clients[i])["last"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    with Streams(url, 8) as streams:
        time.sleep(5)
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        end = time.perf_counter()
    for client in clients:
        client.close()
    return {
        "ten_max_gap_s": streams.max_gap(start, end),
        "ten_max_gap_at_s": streams.max_gap_at(start, end),
        "ten_max_text_gap_s": streams.max_gap(start, end, text=True),
        "ten_long_s_median": statistics.median(times),
        "ten_long_s_max": max(times),
        "ten_stream_errors": streams.errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repo", type=Path)
    parser.add_argument("--tokens", type=int, default=7800)
    parser.add_argument("--skip-ten", action="store_true", help="leave out (4)")
    args = parser.parse_args()
    repo = args.repo.resolve()
    sys.path.insert(0, str(repo))  # the served checkout's bench helpers
    from hybridspec.bench import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(repo, port, Path(tempfile.gettempdir()) / f"long_prompts_{port}.log")
    try:
        timed_completion(url, "Hello", 8)  # first request's one-off costs
        figures: dict[str, Any] = {}
        parts: list[Callable[[], dict[str, float]]] = [
            lambda: {"decode_tok_s": decode_rate(url)},
            lambda: alone_and_shared(url, args.tokens),
            lambda: {"shared_over_alone": figures["shared_s"] / figures["alone_s"]},
            lambda: short_beside_long(url, args.tokens),
        ]
        if not args.skip_ten:
            parts.append(lambda: ten_long(url, args.tokens))
        for part in parts:  # each part's figures as it ends, on stderr: a long run shows progress
            found = part()
            figures.update(found)
            print(json.dumps({k: round(v, 3) for k, v in found.items()}), file=sys.stderr)
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}, indent=1))


if __name__ == "__main__":
    main()
