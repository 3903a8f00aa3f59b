"""``ServerConfig.max_body_bytes``: a larger body is a 413 before any route reads it, whether it
declares its length or arrives chunked, and refusing it holds up nobody else."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers import NoProposer
from hybridspec.server import ServerConfig, create_app
from hybridspec.server.config import DEFAULT_MAX_BODY_BYTES
from hybridspec.types import Proposal, ProposeRequest
from tests.server.conftest import TINY_MODEL_NAME, AppFactory, serve_in_thread, tiny_engine_config
from tests.server.helpers import metric, parse_metrics

LIMIT = 1000
SIXTEEN_MB = 16 * 1024 * 1024
JSON = {"Content-Type": "application/json"}


def completion_body(size: int) -> bytes:
    """A valid /v1/completions body of exactly ``size`` bytes (trailing whitespace pads it)."""
    body = json.dumps({"prompt": "hello", "max_tokens": 1, "temperature": 0}).encode()
    return body + b" " * (size - len(body))


def chunks(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    """``body`` as an iterator: httpx sends it chunked, without a Content-Length."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def assert_too_large(response: httpx.Response, limit: int) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert f"limit of {limit} bytes" in error["message"]


@pytest.fixture
def capped(make_app: AppFactory) -> Iterator[TestClient]:
    with TestClient(make_app({"max_body_bytes": LIMIT})) as client:
        yield client


def test_declared_length_over_the_limit_is_413_and_queues_nothing(capped: TestClient) -> None:
    assert (
        capped.post("/v1/completions", content=completion_body(LIMIT), headers=JSON).status_code
        == 200
    )
    assert_too_large(
        capped.post("/v1/completions", content=completion_body(LIMIT + 1), headers=JSON), LIMIT
    )
    samples = parse_metrics(capped.get("/metrics").text)
    requests = "hybridspec_http_requests_total"
    assert metric(samples, requests, path="/v1/completions", status="413") == 1
    assert metric(samples, "hybridspec_requests_finished_total") == 1  # the one that fit
    assert metric(samples, "hybridspec_prompt_tokens_total") > 0


def test_chunked_body_is_counted_while_it_arrives(capped: TestClient) -> None:
    fits = capped.post("/v1/completions", content=chunks(completion_body(LIMIT), 100), headers=JSON)
    assert fits.status_code == 200, fits.text
    over = capped.post(
        "/v1/completions", content=chunks(completion_body(LIMIT + 1), 100), headers=JSON
    )
    assert_too_large(over, LIMIT)
    # A request without a body passes the check untouched.
    assert capped.get("/v1/models").status_code == 200


def test_default_limit_fits_a_full_context_of_token_ids() -> None:
    # 131072 token ids of six digits and a comma each, as JSON.
    assert 131072 * len("123456,") < ServerConfig().max_body_bytes == DEFAULT_MAX_BODY_BYTES


class SlowProposer(NoProposer):
    """Proposes nothing, slowly, so that a stream lasts long enough to overlap the uploads."""

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        time.sleep(0.01)
        return super().propose(requests)


def stream_chunk_times(url: str, started: threading.Event) -> list[float]:
    """Stream a long completion; the arrival time of each of its chunks."""
    body = {
        "prompt": "hello",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "proposer": "slow",
    }
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for _ in response.iter_raw():
            times.append(time.monotonic())
            started.set()
    return times


@pytest.mark.serial  # times a stream's gaps and a refusal (pyproject: markers)
@pytest.mark.usefixtures("frozen_heap")
def test_sixteen_megabytes_are_refused_at_once_while_streams_flow(
    tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    def factory(config: Any) -> Engine:
        engine = Engine(config, target=tiny_model)
        engine.register_proposer("slow", SlowProposer)
        return engine

    config = ServerConfig(
        engine=tiny_engine_config(tiny_model_dir), served_model_name=TINY_MODEL_NAME
    )
    huge = completion_body(SIXTEEN_MB)
    with serve_in_thread(create_app(config, engine_factory=factory)) as url:
        started = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream_chunk_times, url, event) for event in started]
            for event in started:
                assert event.wait(30), "a stream did not start"
            for content in (huge, chunks(huge)):
                start = time.monotonic()
                response = httpx.post(
                    f"{url}/v1/completions", content=content, headers=JSON, timeout=30
                )
                elapsed = time.monotonic() - start
                assert_too_large(response, DEFAULT_MAX_BODY_BYTES)
                assert elapsed < 1.0, f"the 413 took {elapsed:.2f} s"
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert not any(stream.done() for stream in streams), "the streams ended too soon"
            times = [stream.result() for stream in streams]
        samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text)
    for arrivals in times:
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert len(arrivals) > 10 and max(gaps) < 1.0, f"longest gap {max(gaps):.2f} s"
    assert metric(samples, "hybridspec_http_requests_total", status="413") == 2
    assert metric(samples, "hybridspec_requests_finished_total", finish_reason="length") == 2
