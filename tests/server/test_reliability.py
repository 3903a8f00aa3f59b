"""No request may stall, hang or grow the server (issue 39): a canary stream keeps its pace
while hostile requests arrive, shutdown ends every request cleanly, and the connection
deadlines hold. Served by uvicorn on a loopback port, on the shared tiny model; the canary's
server by ``hybridspec serve`` in a process of its own, so that the test's clients share neither
its interpreter lock nor its event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridspec.bench import stop, wait_ready
from hybridspec.config import EngineConfig, ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel
from hybridspec.server import ServerConfig, create_app
from hybridspec.server.connections import (
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    header_deadline_protocol,
)
from hybridspec.server.middleware import TimeoutMiddleware
from hybridspec.server.shutdown import draining_server
from tests.conftest import TINY_VOCAB_SIZE
from tests.server.conftest import TINY_MAX_SEQ_LEN, TINY_MODEL_NAME, free_port
from tests.server.test_hostile_inputs import CHAT_CASES

# Each test times something (a gap, an exit, a deadline): run in make test's second pass, alone.
pytestmark = pytest.mark.serial

USER = [{"role": "user", "content": "Hi"}]
SERVE_READY_TIMEOUT_S = 120.0  # a cold start loads torch and compiles the kernels
# The canary's largest gap while hostile requests arrive: a step of the tiny model takes
# milliseconds, so a gap is the longest the server's event loop is held by one request's parsing
# and checks (CI: 2 busy cores, the test's clients on one of them)
CANARY_MAX_GAP_S = 0.5


class SlowEngine(Engine):
    """The tiny model's engine at a pace a test can watch (a real model's rounds take ms)."""

    pause_s = 0.02

    def step(self) -> list[Any]:
        time.sleep(self.pause_s)
        return super().step()


@contextlib.contextmanager
def serving(
    model: LoadedModel,
    directory: Path,
    engine: type[Engine] = Engine,
    cache_mb: int = 64,
    **options: Any,
) -> Iterator[tuple[str, uvicorn.Server, threading.Thread]]:
    target = ModelConfig(str(directory), dtype="float32", max_num_seqs=4)
    config = ServerConfig(
        # torch's thread count, fixed: these tests time the server's answers to hostile input,
        # not --threads auto's probes (tests/model/test_thread_policy.py, tests/engine)
        engine=EngineConfig(
            target=target,
            default_num_speculative_tokens=4,
            grammar_cache_mb=cache_mb,
            num_threads=None,
        ),
        served_model_name=TINY_MODEL_NAME,
        **options,
    )
    app = create_app(config, engine_factory=lambda cfg: engine(cfg, target=model))
    port = free_port()
    timeout = int(config.shutdown_timeout_s) + 1
    server = draining_server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="error",
            timeout_graceful_shutdown=timeout,
            http=header_deadline_protocol(config.request_read_timeout_s),
        ),
        app,
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(30)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response: its head and its body may arrive in separate reads."""
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
        head, blank, body = answer.partition(b"\r\n\r\n")
        if blank:
            lengths = [
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ]
            if len(body) >= (lengths[0] if lengths else 0):
                break
    return answer


def stream_gaps(url: str, stop: threading.Event, gaps: list[float], errors: list[str]) -> None:
    """The canary: stream answers one after another until ``stop``; every gap between two
    events (and before a first one) goes to ``gaps``."""
    body = {"messages": USER, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            last = time.perf_counter()
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    errors.append(f"canary: {response.status_code}")
                    return
                for line in response.iter_lines():
                    if line:
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now


SCHEMAS = st.recursive(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]),
    lambda inner: st.one_of(
        st.builds(lambda items: {"type": "array", "items": items, "maxItems": 3}, inner),
        st.builds(
            lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1]},
            st.dictionaries(st.text("abcxyz", min_size=1, max_size=4), inner, max_size=4),
        ),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(inner, min_size=1, max_size=3)),
    ),
    max_leaves=12,
)
REGEXES = st.text("ab01|()[]{}*+?.\\-^$,5", min_size=1, max_size=24)
# Texts for /tokenize, some with a lone surrogate; token id lists for /detokenize, some with ids
# outside the vocabulary or more ids than the context.
TEXTS = st.text(max_size=40) | st.builds(
    lambda a, b, c: a + chr(c) + b,
    st.text(max_size=8),
    st.text(max_size=8),
    st.integers(0xD800, 0xDFFF),
)
TOKEN_LISTS = st.lists(st.integers(-3, TINY_VOCAB_SIZE + 3), max_size=40) | st.integers(
    TINY_MAX_SEQ_LEN - 1, TINY_MAX_SEQ_LEN + 2
).map(lambda n: [1] * n)
TOKENIZER_CASES = [
    ("a 1 MB prompt", {"prompt": "word " * 200_000}, "/tokenize"),
    ("a surrogate to tokenize", {"prompt": "\ud800"}, "/tokenize"),
    ("ten contexts of ids", {"tokens": [1] * (10 * TINY_MAX_SEQ_LEN)}, "/detokenize"),
]


@contextlib.contextmanager
def serving_process(directory: Path, log: Path) -> Iterator[tuple[str, int]]:
    """``hybridspec serve`` on the tiny model in a process of its own, on a free loopback port:
    its event loop and interpreter lock are not shared with the test's clients, so the gaps a
    client times are the server's. Yields its URL and process id."""
    port = free_port()
    command = [sys.executable, "-m", "hybridspec.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--target", str(directory), "--dtype", "float32"]
    command += ["--served-model-name", TINY_MODEL_NAME, "--max-num-seqs", "4", "-k", "4"]
    # one thread: the forward's pool leaves the other core to the clients (CI has 2)
    command += ["--grammar-cache-mb", "8", "--threads", "1", "--log-level", "warning"]
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process, SERVE_READY_TIMEOUT_S, log)
        yield url, process.pid
    finally:
        stop(process)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc for memory")
def test_the_canary_keeps_its_pace_through_hostile_requests(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    statuses: list[tuple[str, int]] = []
    with serving_process(tiny_model_dir, tmp_path / "serve.log") as (url, pid):
        stop_canary, gaps, errors = threading.Event(), [], []
        canary = threading.Thread(target=stream_gaps, args=(url, stop_canary, gaps, errors))
        with httpx.Client(base_url=url, timeout=30) as client:
            warm = {"messages": USER, "max_tokens": 8, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=warm) as response:
                response.read()
            before = rss_bytes(pid)
            canary.start()

            def send(name: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> int:
                fields = {"max_tokens": 8} if path.startswith("/v1") else {}
                data = json.dumps({**fields, **body})  # ASCII: lone surrogates escaped
                headers = {"content-type": "application/json"}
                response = client.post(path, content=data, headers=headers)
                statuses.append((name, response.status_code))
                return response.status_code

            for name, body, _, _ in CHAT_CASES:
                send(name, body)
            for name, body, path in TOKENIZER_CASES:
                assert send(name, body, path) == 400, name

            @settings(max_examples=25, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(schema=SCHEMAS, regex=REGEXES, text=TEXTS, tokens=TOKEN_LISTS)
            def fuzz(schema: dict[str, Any], regex: str, text: str, tokens: list[int]) -> None:
                form = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
                send("schema", {"messages": USER, "response_format": form})
                send("regex", {"messages": USER, "guided_regex": regex})
                surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in text)
                for body in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
                    status = send("tokenize", body, "/tokenize")
                    assert status == 400 if surrogate else status in (200, 400), (body, status)
                in_vocab = all(0 <= t < TINY_VOCAB_SIZE for t in tokens)
                fits = len(tokens) <= TINY_MAX_SEQ_LEN
                status = send("detokenize", {"tokens": tokens}, "/detokenize")
                assert status == (200 if in_vocab and fits else 400), (tokens[:8], status)

            try:
                fuzz()
                growth = rss_bytes(pid) - before
            finally:
                stop_canary.set()
                canary.join(30)
    assert not errors, errors
    assert [s for s in statuses if s[1] >= 500] == []
    assert len(gaps) > 50 and max(gaps) < CANARY_MAX_GAP_S, (
        gaps.index(max(gaps)),
        sorted(gaps)[-5:],
    )
    assert growth < 200 * 2**20, growth


def test_sigterm_ends_streams_with_done_and_queued_requests_with_json_503(
    tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    body = {"messages": USER, "max_tokens": 200, "ignore_eos": True, "stream": True}
    results: dict[int, tuple[int, str, str]] = {}

    def run(i: int, url: str) -> None:
        with (
            httpx.Client(base_url=url, timeout=30) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            text = "".join(f"{line}\n" for line in response.iter_lines())
            results[i] = (response.status_code, response.headers["content-type"], text)

    with serving(tiny_model, tiny_model_dir, SlowEngine, shutdown_timeout_s=1.0) as (
        url,
        server,
        thread,
    ):
        clients = [threading.Thread(target=run, args=(i, url)) for i in range(8)]
        for client in clients:
            client.start()
        time.sleep(1.0)  # four streaming, four waiting for a slot
        start = time.monotonic()
        server.should_exit = True  # as SIGTERM does
        thread.join(10)
        exit_s = time.monotonic() - start
        for client in clients:
            client.join(10)
    streams = [r for r in results.values() if r[0] == 200]
    refused = [r for r in results.values() if r[0] != 200]
    assert len(streams) == 4 and len(refused) == 4, [r[:2] for r in results.values()]
    for _, _, text in streams:
        lines = [line for line in text.splitlines() if line]
        assert lines[-1] == "data: [DONE]" and "shutdown timeout" in lines[-2]
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "overloaded"
    for status, content_type, text in refused:
        assert status == 503 and content_type == "application/json"
        assert json.loads(text)["error"]["code"] == "overloaded"
    assert exit_s < 1.0 + 1.5


def test_a_body_that_does_not_arrive_gets_a_408(
    tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    with serving(tiny_model, tiny_model_dir, request_read_timeout_s=0.5) as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt":'
            )
            start = time.monotonic()
            answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert b"request_timeout" in answer and time.monotonic() - start < 5


@pytest.mark.skipif(header_deadline_protocol(1) == "auto", reason="needs httptools")
def test_headers_that_do_not_arrive_close_the_connection(
    tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    with serving(tiny_model, tiny_model_dir, request_read_timeout_s=0.5) as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
            assert sock.recv(4096) == b""  # closed by the server
            assert time.monotonic() - start < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            assert idle.recv(4096) == b""  # a connection that sends nothing is closed too


def test_a_response_the_client_does_not_read_is_cut_and_its_stream_closed() -> None:
    closed = threading.Event()

    async def events() -> Any:
        try:
            for _ in range(1000):
                yield "data: x\n\n"
        finally:
            closed.set()

    app = FastAPI()
    app.get("/s")(lambda: StreamingResponse(events(), media_type="text/event-stream"))
    wrapped = TimeoutMiddleware(app, read_timeout_s=5, write_timeout_s=0.2)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) > 2:  # the client's buffers are full: sending blocks for good
            await asyncio.Event().wait()

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "GET", "path": "/s", "headers": [], "query_string": b""}
    start = time.monotonic()
    asyncio.run(asyncio.wait_for(wrapped(scope, receive, send), 5))  # type: ignore[arg-type]
    assert time.monotonic() - start < 2 and closed.is_set() and len(sent) == 3


def send_head(port: int, head: bytes) -> bytes:
    """Send a request's head (in pieces, as far as the server reads it) and read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            for start in range(0, len(head), 65536):
                sock.sendall(head[start : start + 65536])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the rest
        try:
            return read_response(sock)
        except ConnectionResetError:
            raise AssertionError("the server reset the connection without an answer") from None


@pytest.mark.skipif(header_deadline_protocol(1) == "auto", reason="needs httptools")
def test_headers_past_the_bounds_get_a_431_over_a_socket(
    tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    """A 1 MB or 16 MB header, or 1,000 headers, get a JSON 431 and a closed connection;
    headers within the bounds, two requests' together past them on one keep-alive
    connection included, are served."""
    with serving(tiny_model, tiny_model_dir) as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        request = b"GET /health HTTP/1.1\r\nHost: x\r\n"
        for size in (2**20, 16 * 2**20):
            answer = send_head(port, request + b"X-Big: " + b"a" * size + b"\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
            body = json.loads(answer.partition(b"\r\n\r\n")[2])
            assert body["error"]["code"] == "request_header_fields_too_large"
            assert str(MAX_HEADER_BYTES) in body["error"]["message"]
        many = b"".join(b"X-H%d: v\r\n" % i for i in range(1000))
        answer = send_head(port, request + many + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 431") and str(MAX_HEADERS).encode() in answer
        fine = request + b"Cookie: " + b"c" * (MAX_HEADER_BYTES // 2) + b"\r\n"
        fine += b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS - 2)) + b"\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for _ in range(2):  # each request's head within the bounds: both served
                sock.sendall(fine)
                assert read_response(sock).startswith(b"HTTP/1.1 200")
