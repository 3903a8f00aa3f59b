"""What the Ray Serve path costs: 2 replicas against one plain server at equal total load.

Run from the repository root after ``make ray-install``::

    .venv/bin/python benchmarks/ray_overhead.py                  # ~5 min on a 2-core CPU
    .venv/bin/python benchmarks/ray_overhead.py --rounds 5 --requests 48

Both run side by side on the embedded model, each with the machine's cores: ``hybridspec
serve`` with ``--max-num-seqs 16`` and all the cores' threads, and ``hybridspec serve
--replicas 2`` with 8 slots and half the cores per replica (Ray's proxy in front). Each round
sends ``--requests`` greedy chat requests of the workload's prompts from ``--concurrency``
closed-loop clients to one, then the other (the order alternates by round), so a load that
changes over the run falls on both alike. The figure is output tokens per second over each
batch (wall time from the first request sent to the last answer), with request latency
percentiles; the ratio is per round, Ray over plain, and its median is the overhead reported.
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
from hybridspec.bench.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "benchmarks" / "specbench_mini.json"
REPLICAS = 2


def specs(cores: int, proposer: str) -> tuple[ServerSpec, ServerSpec]:
    serve = [sys.executable, "-m", "hybridspec.cli", "serve", "--proposer", proposer]
    threads = {"OMP_NUM_THREADS": str(cores), "NUMBA_NUM_THREADS": str(cores)}
    plain = ServerSpec(
        "plain",
        lambda port: [*serve, "--port", str(port), "--max-num-seqs", "16"],
        ours=True,
        note=f"16 slots, {cores} threads",
        env=threads,
    )
    ray = ServerSpec(  # each replica's threads come from its CPU share (deploy.app)
        "ray",
        lambda port: [*serve, "--port", str(port), "--max-num-seqs", "8", "--replicas", "2"],
        ours=True,
        note=f"{REPLICAS} replicas x 8 slots, {cores // REPLICAS} threads each",
    )
    return plain, ray


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
    prompts = load_workload(WORKLOAD).prompts
    bodies = [
        {
            "messages": list(prompts[i % len(prompts)].messages),
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        for i in range(args.requests)
    ]
    plain_spec, ray_spec = specs(cores, args.proposer)
    logs = args.out.parent / "ray_overhead_logs"
    rows: list[dict[str, object]] = []
    with contextlib.ExitStack() as stack:
        urls = {
            "plain": stack.enter_context(running(plain_spec, logs / "plain.log", 300.0)),
            "ray": stack.enter_context(running(ray_spec, logs / "ray.log", 300.0)),
        }
        wait_for_replicas(urls["ray"], REPLICAS)
        for name in ("plain", "ray"):  # warm both paths (first-request costs) before timing
            batch(urls[name], bodies[: args.concurrency], args.concurrency)
        for round_ in range(args.rounds):
            order = ("plain", "ray") if round_ % 2 == 0 else ("ray", "plain")
            for name in order:
                result = batch(urls[name], bodies, args.concurrency)
                rows.append({"round": round_, "server": name, **result})
                print(json.dumps(rows[-1]), flush=True)
    ratios = [
        _pick(rows, r, "ray")["output_tok_s"] / _pick(rows, r, "plain")["output_tok_s"]
        for r in range(args.rounds)
    ]
    summary = {
        "servers": {s.name: s.note for s in (plain_spec, ray_spec)},
        "cores": cores,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "proposer": args.proposer,
        "rows": rows,
        "ratios_ray_over_plain": ratios,
        "median_ratio": statistics.median(ratios),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"ray / plain output tok/s per round: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"median {summary['median_ratio']:.3f}; written to {args.out}")
    return 0


def _pick(rows: list[dict[str, object]], round_: int, server: str) -> dict[str, float]:
    (row,) = [r for r in rows if r["round"] == round_ and r["server"] == server]
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}


if __name__ == "__main__":
    sys.exit(main())
