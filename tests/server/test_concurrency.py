"""Many clients at once over a real loopback socket: batching, cancellation, queue limits.

The server runs uvicorn in a thread of this process on the tiny model, so that the test can
look at the engine afterwards. A ``slow`` proposer (proposes nothing, but sleeps in each
round) makes requests last long enough for cancellation and queueing to be certain.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridspec.config import ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers import NoProposer
from hybridspec.server import ServerConfig, create_app
from hybridspec.types import Proposal, ProposeRequest
from tests.server.conftest import TINY_MODEL_NAME, serve_in_thread, tiny_engine_config
from tests.server.helpers import chunk_text, metric, parse_metrics, sse_chunks

TIMEOUT = httpx.Timeout(60.0)
SLOW_ROUND_S = 0.005


class SlowProposer(NoProposer):
    """Proposes nothing, slowly: each round takes at least SLOW_ROUND_S."""

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        time.sleep(SLOW_ROUND_S)
        return super().propose(requests)


@pytest.fixture
def serve(tiny_model: LoadedModel, tiny_model_dir: Path) -> Callable[..., Any]:
    """``serve(max_num_seqs, max_queue_size)``: context manager of (base URL, engine)."""
    import contextlib

    @contextlib.contextmanager
    def start(max_num_seqs: int = 4, max_queue_size: int = 64) -> Iterator[tuple[str, Engine]]:
        engines: list[Engine] = []

        def factory(config: Any) -> Engine:
            engine = Engine(config, target=tiny_model)
            engine.register_proposer("slow", SlowProposer)
            engines.append(engine)
            return engine

        target = ModelConfig(str(tiny_model_dir), dtype="float32", max_num_seqs=max_num_seqs)
        config = ServerConfig(
            engine=tiny_engine_config(tiny_model_dir, target=target, max_queue_size=max_queue_size),
            served_model_name=TINY_MODEL_NAME,
        )
        with serve_in_thread(create_app(config, engine_factory=factory)) as url:
            yield url, engines[0]

    return start


def scrape(url: str) -> dict[Any, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=TIMEOUT).text)


def wait_for(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def engine_idle(url: str) -> bool:
    samples = scrape(url)
    return (
        metric(samples, "hybridspec_num_running_requests") == 0
        and metric(samples, "hybridspec_num_waiting_requests") == 0
    )


def request_body(i: int) -> dict[str, Any]:
    return {
        "model": TINY_MODEL_NAME,
        "prompt": f"request {i}: the quick brown fox jumps over the lazy dog",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "proposer": ("none", "ngram")[i % 2],
        "num_speculative_tokens": 1 + i % 5,
    }


def run_client(url: str, i: int, role: str, start: threading.Barrier) -> dict[str, Any]:
    """One client: ``whole`` (non-streamed), ``stream`` or ``cancel`` (leaves mid-stream)."""
    body = request_body(i)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        start.wait(timeout=30)
        if role == "whole":
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return {"text": response.json()["choices"][0]["text"]}
        if role == "stream":
            response = client.post("/v1/completions", json={**body, "stream": True})
            assert response.status_code == 200, response.text
            return {"text": chunk_text(sse_chunks(response.text))}
        long = {**body, "stream": True, "proposer": "slow", "max_tokens": 200}
        seen: list[str] = []
        with client.stream("POST", "/v1/completions", json=long) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen.append(line)
                if len(seen) == 2:
                    break  # leaving the block closes the connection mid-stream
        return {"finished": any('"finish_reason":"' in s for s in seen)}


@pytest.mark.parametrize("num_clients", [16, 64])
def test_clients_streaming_and_cancelling(serve: Callable[..., Any], num_clients: int) -> None:
    """16, then 64 clients at once (the queue's size; 4 batch slots): a quarter leave
    mid-stream; every other text equals its solo run and the metrics add up."""
    roles = ["whole", "stream", "cancel", "whole"] * (num_clients // 4)
    with serve(max_num_seqs=4) as (url, engine):
        solo = {}
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            for i, role in enumerate(roles):
                if role != "cancel":
                    response = client.post("/v1/completions", json=request_body(i))
                    solo[i] = response.json()["choices"][0]["text"]
        start = threading.Barrier(len(roles))
        with ThreadPoolExecutor(len(roles)) as pool:
            futures = [pool.submit(run_client, url, i, r, start) for i, r in enumerate(roles)]
            results = [f.result(timeout=120) for f in futures]

        for i, (role, result) in enumerate(zip(roles, results, strict=True)):
            if role == "cancel":
                assert not result["finished"], "a 200-token slow request ended too early"
            else:
                assert result["text"] == solo[i], f"client {i} ({role}) differs from its solo run"
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200

        num_cancelled = roles.count("cancel")
        num_completed = len(roles) - num_cancelled + len(solo)
        finished = "hybridspec_requests_finished_total"
        wait_for(lambda: metric(scrape(url), finished) == len(roles) + len(solo))
        wait_for(lambda: engine_idle(url))
        samples = scrape(url)
        assert metric(samples, "hybridspec_http_requests_total", path="/v1/completions") == (
            len(roles) + len(solo)
        )
        assert metric(
            samples, "hybridspec_http_requests_total", path="/v1/completions", status="200"
        ) == len(roles) + len(solo)
        assert metric(samples, finished, finish_reason="abort") == num_cancelled
        assert metric(samples, finished, proposer="slow", finish_reason="abort") == num_cancelled
        assert metric(samples, finished, finish_reason="length") == num_completed
        assert metric(samples, "hybridspec_request_latency_seconds_count") == num_completed
        # Every completed request had exactly 12 tokens; cancelled ones stopped well short of 200.
        generated = metric(samples, "hybridspec_generated_tokens_total")
        assert 12 * num_completed < generated < 12 * num_completed + 100 * num_cancelled
        # Everything the cancelled requests held is back: all cache slots, no request left.
        assert engine.runtime.num_free_slots() == 4
        assert not engine.has_unfinished()


def test_client_leaving_a_non_streamed_request_aborts_it(serve: Callable[..., Any]) -> None:
    with serve(max_num_seqs=2) as (url, engine):
        body = {**request_body(0), "proposer": "slow", "max_tokens": 200}
        began = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
        finished = "hybridspec_requests_finished_total"
        wait_for(lambda: metric(scrape(url), finished, finish_reason="abort") == 1)
        assert time.monotonic() - began < 200 * SLOW_ROUND_S, "the request ran to its end"
        wait_for(lambda: engine_idle(url))
        samples = scrape(url)
        assert metric(samples, "hybridspec_http_requests_total", status="499") == 1
        assert metric(samples, finished, finish_reason="length") == 0
        assert engine.runtime.num_free_slots() == 2


def test_full_queue_is_503_with_retry_after(serve: Callable[..., Any]) -> None:
    body = {**request_body(0), "proposer": "slow", "max_tokens": 100}
    with serve(max_num_seqs=1, max_queue_size=1) as (url, _):
        start = threading.Barrier(4)

        def post(_: int) -> httpx.Response:
            start.wait(timeout=30)
            return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)

        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(post, range(4), timeout=120))
        statuses = sorted(r.status_code for r in responses)
        # One request runs and at most one waits while it runs; the others find the queue full.
        assert statuses.count(200) in (1, 2) and statuses.count(503) == 4 - statuses.count(200)
        for response in responses:
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                error = response.json()["error"]
                assert error["type"] == "server_error" and error["code"] == "overloaded"
            else:
                assert response.json()["usage"]["completion_tokens"] == 100
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200


def test_disconnect_while_queued_for_the_first_token(serve: Callable[..., Any]) -> None:
    """A streamed request still waiting for a slot is cancelled when its client leaves."""
    with serve(max_num_seqs=1) as (url, engine):
        blocker = {**request_body(0), "proposer": "slow", "max_tokens": 150}
        queued = {**request_body(1), "stream": True}
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{url}/v1/completions", json=blocker, timeout=TIMEOUT)
            wait_for(lambda: metric(scrape(url), "hybridspec_num_running_requests") == 1)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{url}/v1/completions", json=queued, timeout=httpx.Timeout(60, read=0.2)
                )
            finished = "hybridspec_requests_finished_total"
            wait_for(lambda: metric(scrape(url), finished, finish_reason="abort") == 1)
            assert first.result(timeout=60).status_code == 200
        wait_for(lambda: engine_idle(url))
        assert metric(scrape(url), "hybridspec_http_requests_total", status="499") == 1
        assert engine.runtime.num_free_slots() == 1
        assert not engine.has_unfinished()
