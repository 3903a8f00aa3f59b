"""What the Ray Serve path costs: replicas behind Ray's proxy against one plain server.

Run from the repository root after ``make ray-install``::

    .venv/bin/python benchmarks/ray_overhead.py                  # ~10 min on a busy 2-core CPU
    .venv/bin/python benchmarks/ray_overhead.py --rounds 5 --requests 48

Three servers run side by side on the embedded model, each given the machine's cores and 16
batch slots in all: ``hybridspec serve`` (``--max-num-seqs 16``, a thread per core);
``hybridspec serve --replicas 1`` (the same engine behind Ray's proxy: the Ray path's own
cost); and ``--replicas 2`` (8 slots and half the cores per replica: the issue's equal total
load). Each round sends ``--requests`` greedy chat requests of the workload's prompts from
``--concurrency`` closed-loop clients to each server in turn (the order rotates by round), so
a load that changes over the run falls on all alike. The figure is output tokens per second
over each batch (wall time from the first request sent to the last answer), with request
latency percentiles; ratios are per round, over plain, and their medians are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from hybridspec.bench.servers import ServerSpec, running
from hybridspec.bench.workload import DEFAULT_WORKLOAD, load_workload

ROOT = Path(__file__).resolve().parents[1]


def specs(cores: int, proposer: str) -> list[tuple[ServerSpec, int]]:
    """(server, replicas) for plain, one replica and two on Ray."""
    serve = [sys.executable, "-m", "hybridspec.cli", "serve", "--proposer", proposer]
    threads = {"OMP_NUM_THREADS": str(cores), "NUMBA_NUM_THREADS": str(cores)}
    plain = ServerSpec(
        "plain",
        lambda port: [*serve, "--port", str(port), "--max-num-seqs", "16"],
        ours=True,
        note=f"16 slots, {cores} threads",
        env=threads,
    )
    result = [(plain, 0)]
    for replicas in (1, 2):
        slots = str(16 // replicas)
        result.append(
            (
                ServerSpec(  # each replica's threads come from its CPU share (deploy.app)
                    f"ray-{replicas}",
                    lambda port, n=replicas, s=slots: [
                        *serve,
                        "--port",
                        str(port),
                        "--max-num-seqs",
                        s,
                        "--replicas",
                        str(n),
                    ],
                    ours=True,
                    note=f"{replicas} replica(s) x {slots} slots, {cores // replicas} threads each",
                ),
                replicas,
            )
        )
    return result


def wait_for_replicas(url: str, count: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=10).json().get("replicas") != count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: {count} replicas not up in {timeout_s:.0f} s")
        time.sleep(1.0)


def batch(url: str, bodies: list[dict[str, object]], concurrency: int) -> dict[str, float]:
    """Send ``bodies`` from ``concurrency`` clients; tokens/s over the batch, latencies."""

    def one(body: dict[str, object]) -> tuple[int, float]:
        start = time.perf_counter()
        reply = client.post(f"{url}/v1/chat/completions", json=body)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"]), time.perf_counter() - start

    with httpx.Client(timeout=600.0) as client, ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        results = list(pool.map(one, bodies))
        wall = time.perf_counter() - start
    latencies = sorted(seconds for _, seconds in results)
    return {
        "output_tok_s": sum(tokens for tokens, _ in results) / wall,
        "wall_s": wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="requests per batch")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--proposer", default="ngram")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "ray_overhead.json")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    prompts = load_workload(DEFAULT_WORKLOAD).prompts
    bodies = [
        {
            "messages": list(prompts[i % len(prompts)].messages),
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        for i in range(args.requests)
    ]
    servers = specs(cores, args.proposer)
    names = [spec.name for spec, _ in servers]
    logs = args.out.parent / "ray_overhead_logs"
    rows: list[dict[str, object]] = []
    with contextlib.ExitStack() as stack:
        urls = {}
        for spec, replicas in servers:
            urls[spec.name] = stack.enter_context(running(spec, logs / f"{spec.name}.log", 300.0))
            if replicas:
                wait_for_replicas(urls[spec.name], replicas)
        for name in names:  # warm every path (first-request costs) before timing
            batch(urls[name], bodies[: args.concurrency], args.concurrency)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                result = batch(urls[name], bodies, args.concurrency)
                rows.append({"round": round_, "server": name, **result})
                print(json.dumps(rows[-1]), flush=True)
    ratios = {
        name: [
            _pick(rows, r, name)["output_tok_s"] / _pick(rows, r, "plain")["output_tok_s"]
            for r in range(args.rounds)
        ]
        for name in names[1:]
    }
    summary = {
        "servers": {spec.name: spec.note for spec, _ in servers},
        "cores": cores,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "proposer": args.proposer,
        "rows": rows,
        "output_tok_s_over_plain": ratios,
        "median_over_plain": {name: statistics.median(r) for name, r in ratios.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    for name, values in ratios.items():
        print(
            f"{name} / plain output tok/s per round: {', '.join(f'{v:.3f}' for v in values)}; "
            f"median {statistics.median(values):.3f}"
        )
    print(f"written to {args.out}")
    return 0


def _pick(rows: list[dict[str, object]], round_: int, server: str) -> dict[str, float]:
    (row,) = [r for r in rows if r["round"] == round_ and r["server"] == server]
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}


if __name__ == "__main__":
    sys.exit(main())
