"""The figures of issue 39 on the embedded model: no request may stall, hang or grow the server.

Starts ``hybridspec serve`` (the embedded SmolLM2-135M, 2 torch threads) on a loopback port and
measures, in order:

1. ``canary_max_gap_*_s``: the largest gap between two events of a canary that streams
   400-token answers: alone with 200 plain requests (``baseline``), while the hostile corpus
   (``tests/server/test_hostile_inputs.CHAT_CASES``: the 10,000-property schema, 900 levels,
   20,000 alternatives, surrogates, ``$ref`` cycles, 65 tools...) arrives (``corpus``), and
   while the 200 distinct schemas of (3) arrive (``schemas``); ``ten_thousand_properties_s``:
   the time to that schema's answer (and its status);
2. ``load_5xx``: 5xx answers over the corpus and a 64-client load (streamed and not, a third of
   the streams dropped after their second event);
3. ``rss_growth_200_schemas_mb``: the server's resident memory after 200 distinct
   120-property schemas, less before, with ``--grammar-cache-mb 16`` (target: within 16 + 50
   MB); ``rss_growth_200_plain_mb``: the same over 200 requests without a grammar;
4. ``unread``: a stream whose client never reads (receive buffer 4 KiB): seconds until its slot
   is free again (``--stream-write-timeout 5``) and whether it was;
5. ``sigterm``: 8 streams and 8 queued requests, SIGTERM, ``--shutdown-timeout 3``: whether
   every stream ended with ``[DONE]``, whether the queued got JSON 503s, and the seconds to
   exit.

Run: ``python benchmarks/experiments/serving/robustness.py`` (about 6 minutes on a loaded 2-core
machine); prints one JSON object. ``--memory`` measures (1) and (3) only (about 2 minutes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from hybridspec.bench import free_port  # noqa: E402
from tests.server.test_hostile_inputs import CHAT_CASES, properties, schema_format  # noqa: E402

USER = [{"role": "user", "content": "Write a long story about a cat."}]
JSON_HEADERS = {"content-type": "application/json"}


def start_server(port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "hybridspec.cli", "serve", "--port", str(port)]
    command += ["--grammar-cache-mb", "16", "--shutdown-timeout", "3"]
    command += ["--stream-write-timeout", "5", "--log-level", "warning"]
    server = subprocess.Popen(command, env=env, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def post(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return client.post("/v1/chat/completions", content=json.dumps(body), headers=JSON_HEADERS)


class Canary(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.statuses = url, threading.Event(), []
        self.gaps: list[tuple[float, float]] = []  # (when, gap)

    def max_gap(self, start: float, end: float) -> float:
        return round(max((g for t, g in self.gaps if start <= t <= end), default=0.0), 3)

    def run(self) -> None:
        body = {"messages": USER, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set():
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    self.statuses.append(response.status_code)
                    last = time.perf_counter()
                    for line in response.iter_lines():
                        if line:
                            now = time.perf_counter()
                            self.gaps.append((now, now - last))
                            last = now


def corpus_and_schemas(url: str, pid: int) -> dict[str, Any]:
    canary = Canary(url)
    canary.start()
    statuses: list[int] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        time.sleep(2)
        phases = {"baseline": time.perf_counter()}
        plain_before = rss_mb(pid)
        for i in range(200):  # the same traffic without grammars: the baseline's growth
            body = {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 4}
            statuses.append(post(client, body).status_code)
        plain_growth = rss_mb(pid) - plain_before
        phases["corpus"] = start = time.perf_counter()
        big = post(client, {"messages": USER, "response_format": schema_format(properties(10_000))})
        ten_thousand = (time.perf_counter() - start, big.status_code)
        for _, body, _, _ in CHAT_CASES:
            statuses.append(post(client, {"max_tokens": 8, **body}).status_code)
        phases["schemas"] = time.perf_counter()
        before = rss_mb(pid)
        for i in range(200):
            schema = properties(120)
            schema["properties"] = {f"s{i}_{k}": v for k, v in schema["properties"].items()}
            body = {"messages": USER, "max_tokens": 4, "response_format": schema_format(schema)}
            statuses.append(post(client, body).status_code)
        time.sleep(1)
        after = rss_mb(pid)
        phases["end"] = time.perf_counter()
    canary.stop.set()
    canary.join(120)
    names = list(phases)
    gaps = {
        f"canary_max_gap_{name}_s": canary.max_gap(phases[name], phases[names[i + 1]])
        for i, name in enumerate(names[:-1])
    }
    return {
        **gaps,
        "canary_events": len(canary.gaps),
        "canary_5xx": sum(s >= 500 for s in canary.statuses),
        "ten_thousand_properties_s": round(ten_thousand[0], 3),
        "ten_thousand_properties_status": ten_thousand[1],
        "corpus_5xx": sum(s >= 500 for s in statuses),
        "schemas_200": sum(s == 200 for s in statuses[-200:]),
        "rss_growth_200_plain_mb": round(plain_growth, 1),
        "rss_before_schemas_mb": round(before, 1),
        "rss_growth_200_schemas_mb": round(after - before, 1),
    }


def load_64(url: str) -> dict[str, Any]:
    statuses: list[int] = []

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            for j in range(3):
                body = {"messages": USER, "max_tokens": 32, "stream": (i + j) % 2 == 0}
                if not body["stream"]:
                    statuses.append(post(client, body).status_code)
                    continue
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    statuses.append(response.status_code)
                    for k, _ in enumerate(response.iter_lines()):
                        if i % 3 == 0 and k == 2:
                            break  # drop the stream

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return {"load_requests": len(statuses), "load_5xx": sum(s >= 500 for s in statuses)}


def running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("hybridspec_num_running_requests"))
    return float(line.split()[-1])


def unread(url: str, port: int) -> dict[str, Any]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"messages": USER, "max_tokens": 3000, "ignore_eos": True, "stream": True})
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    sock.sendall(request.encode())
    start = time.monotonic()
    time.sleep(1)
    seen_running = running(url)
    while time.monotonic() - start < 60 and running(url) > 0:
        time.sleep(0.5)
    freed = running(url) == 0
    sock.close()
    return {"unread_running_at_1s": seen_running, "unread_slot_freed": freed,
            "unread_freed_after_s": round(time.monotonic() - start, 1)}  # fmt: skip


def sigterm(url: str, server: subprocess.Popen[bytes]) -> dict[str, Any]:
    results: list[tuple[int, str, str]] = []

    def one() -> None:
        body = {"messages": USER, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as client:
            try:
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    text = "\n".join(response.iter_lines())
                    results.append((response.status_code, response.headers["content-type"], text))
            except httpx.HTTPError as exc:
                results.append((0, "", repr(exc)))

    threads = [threading.Thread(target=one) for _ in range(16)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    time.sleep(3)
    start = time.monotonic()
    server.send_signal(signal.SIGTERM)
    server.wait(60)
    exit_s = time.monotonic() - start
    for thread in threads:
        thread.join(60)
    streams = [r for r in results if r[0] == 200]
    queued = [r for r in results if r[0] != 200]
    return {
        "sigterm_streams": len(streams),
        "sigterm_streams_done": sum(r[2].rstrip().endswith("data: [DONE]") for r in streams),
        "sigterm_queued": len(queued),
        "sigterm_queued_json_503": sum(r[0] == 503 and r[1] == "application/json" for r in queued),
        "sigterm_exit_s": round(exit_s, 2),
        "sigterm_exit_code": server.returncode,
    }


def main() -> None:
    memory_only = "--memory" in sys.argv[1:]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port)
    try:
        figures = corpus_and_schemas(url, server.pid)
        if memory_only:
            print(json.dumps(figures, indent=1))
            return
        figures.update(load_64(url))
        figures.update(unread(url, port))
        figures.update(sigterm(url, server))
    finally:
        if server.poll() is None:
            server.kill()
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
