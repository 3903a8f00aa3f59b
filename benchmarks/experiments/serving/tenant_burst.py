"""One tenant's burst and another's single request: B's time to first token, A's tok/s.

Run from the repository root with the environment's interpreter, e.g.::

    .venv/bin/python benchmarks/experiments/serving/tenant_burst.py
    .venv/bin/python benchmarks/experiments/serving/tenant_burst.py --repo /work/main --no-keys

It starts ``hybridspec serve`` (a child process run in ``--repo``, so that checkout's package
is the one served; on a free loopback port; with an API key file naming tenants ``A`` and ``B``
unless ``--no-keys``, for a server without tenants), then tenant A streams ``--burst``
concurrent requests of ``--tokens`` tokens each (greedy, ``ignore_eos``), and ``--b-delay``
seconds after A's burst began, tenant B sends ``--b-requests`` streamed requests of
``--b-tokens`` tokens one after another, ``--b-gap`` seconds apart. Printed: each of B's times
to first token (client side: from sending to the first content chunk) and the largest; A's
aggregate tok/s (its tokens over the time from its first request sent to its last finished);
and B's and A's requests' wall times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from hybridspec.bench import free_port, stop

A_PROMPT = "Write a long story about a lighthouse keeper and the sea, in many chapters."
B_PROMPT = "Name three colors of the rainbow."
KEYS = {"A": "sk-tenant-a", "B": "sk-tenant-b"}


async def stream(
    client: httpx.AsyncClient, key: str | None, prompt: str, tokens: int
) -> tuple[float, float, int]:
    """(seconds to the first content chunk, seconds to the end, chunks of text) of one
    streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start = time.perf_counter()
    first, pieces = None, 0
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if any(c.get("text") for c in json.loads(line[6:])["choices"]):
                pieces += 1
                if first is None:
                    first = time.perf_counter() - start
    return (first if first is not None else float("nan")), time.perf_counter() - start, pieces


async def burst(base: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.burst + 8)
    timeout = httpx.Timeout(600.0)
    key_a = None if args.no_keys else KEYS["A"]
    key_b = None if args.no_keys else KEYS["B"]
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:
        await stream(client, key_a, A_PROMPT, 8)  # warm the connection path
        start = time.perf_counter()
        a_tasks = [
            asyncio.ensure_future(stream(client, key_a, A_PROMPT, args.tokens))
            for _ in range(args.burst)
        ]
        await asyncio.sleep(args.b_delay)
        b_runs = []
        for i in range(args.b_requests):
            if i:
                await asyncio.sleep(args.b_gap)
            b_runs.append(await stream(client, key_b, B_PROMPT, args.b_tokens))
        a_runs = await asyncio.gather(*a_tasks)
        a_wall = time.perf_counter() - start
    return {
        "b_ttft_s": [round(r[0], 3) for r in b_runs],
        "b_wall_s": [round(r[1], 3) for r in b_runs],
        "a_tok_s": args.burst * args.tokens / a_wall,
        "a_wall_s": a_wall,
        "a_max_wall_s": max(r[1] for r in a_runs),
    }


def start_server(args: argparse.Namespace, port: int, keys: str | None, log: Any) -> Any:
    command = [args.python, "-m", "hybridspec.cli", "serve", "--port", str(port)]
    if keys is not None:
        command += ["--api-keys", keys]
    command += args.serve_args
    env = {**os.environ, "PYTHONPATH": os.path.abspath(args.repo)}  # that checkout's package
    return subprocess.Popen(
        command,
        cwd=args.repo,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_ready(base: str, server: Any, timeout_s: float) -> None:
    start = time.perf_counter()
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.perf_counter() - start > timeout_s:
            raise RuntimeError("the server did not become ready")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=".", help="the checkout whose server runs")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--no-keys", action="store_true", help="a server without tenants")
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--b-delay", type=float, default=2.0)
    parser.add_argument("--b-requests", type=int, default=3)
    parser.add_argument("--b-gap", type=float, default=2.0)
    parser.add_argument("--b-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready")
    parser.add_argument("serve_args", nargs="*", help="more options of serve, after --")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on a timeout too
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        keys = None
        if not args.no_keys:
            keys = os.path.join(tmp, "keys")
            with open(keys, "w") as file:
                file.writelines(f"{tenant} {key}\n" for tenant, key in KEYS.items())
        log_path = Path(tmp, "serve.log")
        with log_path.open("wb") as log:
            server = start_server(args, port, keys, log)
            try:
                wait_ready(base, server, args.timeout)
                result = asyncio.run(burst(base, args))
            finally:
                stop(server)
        lines = log_path.read_text(errors="replace").splitlines()
        ready = [line for line in lines if "ready:" in line]
    print(f"server ({args.repo}{', no keys' if args.no_keys else ', tenants A, B'}): ", end="")
    print(ready[0] if ready else "?")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(
        f"B's time to first token: max {max(result['b_ttft_s']):.3f} s "
        f"(each {result['b_ttft_s']}; B's requests took {result['b_wall_s']} s)"
    )
    print(
        f"A's aggregate: {result['a_tok_s']:.1f} tok/s ({args.burst} x {args.tokens} tokens in "
        f"{result['a_wall_s']:.1f} s; its slowest request {result['a_max_wall_s']:.1f} s)"
    )


if __name__ == "__main__":
    main()
