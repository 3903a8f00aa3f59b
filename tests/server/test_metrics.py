"""The metrics: their names, buckets and exposition on hand-built values, and their label values
bounded however clients call the server."""

from __future__ import annotations

import logging
import math
import random
import re
import string
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hybridspec.engine.stats import GenerationStats
from hybridspec.server.metrics import (
    HTTP_METHODS,
    LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    UNMATCHED_PATH,
    ServerMetrics,
    method_label,
)
from hybridspec.server.middleware import app_routes
from tests.server.conftest import AppFactory
from tests.server.helpers import metric, parse_metrics

README = Path(__file__).resolve().parents[2] / "docs" / "server.md"
METRICS = {  # name: type, as documented in docs/server.md
    "hybridspec_http_requests_total": "counter",
    "hybridspec_requests_finished_total": "counter",
    "hybridspec_prompt_tokens_total": "counter",
    "hybridspec_generated_tokens_total": "counter",
    "hybridspec_draft_tokens_proposed_total": "counter",
    "hybridspec_draft_tokens_accepted_total": "counter",
    "hybridspec_target_forwards_total": "counter",
    "hybridspec_mean_accepted_length": "gauge",
    "hybridspec_request_latency_seconds": "histogram",
    "hybridspec_time_to_first_token_seconds": "histogram",
    "hybridspec_num_running_requests": "gauge",
    "hybridspec_num_waiting_requests": "gauge",
    "hybridspec_prefix_cache_hit_tokens_total": "counter",
    "hybridspec_prefix_cache_evicted_tokens_total": "counter",
    "hybridspec_prefix_cache_tokens": "gauge",
    "hybridspec_tenant_http_requests_total": "counter",
    "hybridspec_tenant_generated_tokens_total": "counter",
    "hybridspec_engine_step_seconds_total": "counter",
}


def exposed_types(text: str) -> dict[str, str]:
    """``# TYPE`` lines of an exposition: {name: type}."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def test_metric_names_and_types_are_kept_and_documented() -> None:
    text = ServerMetrics().render().decode()
    assert exposed_types(text) == METRICS
    readme = README.read_text()
    for name in METRICS:
        assert f"`{name}`" in readme, f"{name} is not documented in docs/server.md"


def test_mean_accepted_length_pools_tokens_over_forwards() -> None:
    metrics = ServerMetrics()
    # 10 tokens in 4 forwards, then 2 tokens in 2 forwards: (10 + 2) / (4 + 2) = 2.
    metrics.observe_result(
        "ngram",
        GenerationStats(
            generated_tokens=10,
            target_forwards=4,
            draft_tokens_proposed=12,
            draft_tokens_accepted=6,
        ),
        0.3,
    )
    metrics.observe_result("ngram", GenerationStats(generated_tokens=2, target_forwards=2), 0.2)
    samples = parse_metrics(metrics.render())
    assert metric(samples, "hybridspec_mean_accepted_length", proposer="ngram") == 2.0
    assert metric(samples, "hybridspec_draft_tokens_proposed_total", proposer="ngram") == 12
    assert metric(samples, "hybridspec_draft_tokens_accepted_total", proposer="ngram") == 6
    assert metric(samples, "hybridspec_request_latency_seconds_count", proposer="ngram") == 2
    assert metric(samples, "hybridspec_request_latency_seconds_sum", proposer="ngram") == 0.5
    assert metric(samples, "hybridspec_num_running_requests") == 0


@pytest.mark.parametrize(
    ("name", "bounds"),
    [
        ("hybridspec_request_latency_seconds", LATENCY_BUCKETS_S),
        ("hybridspec_time_to_first_token_seconds", TTFT_BUCKETS_S),
    ],
)
def test_histogram_buckets_are_cumulative_with_inclusive_bounds(
    name: str, bounds: tuple[float, ...]
) -> None:
    metrics = ServerMetrics()
    for value in (bounds[0], bounds[1] / 2 + bounds[0] / 2, 1e6):
        metrics.observe_first_token("none", value, 1)
        metrics.observe_result("none", GenerationStats(), value)
    samples = parse_metrics(metrics.render())
    buckets = {
        float(dict(labels)["le"]): value
        for (sample, labels), value in samples.items()
        if sample == f"{name}_bucket"
    }
    assert list(buckets) == [*bounds, math.inf]
    assert buckets[bounds[0]] == 1  # a value on a bound counts in it
    assert buckets[bounds[1]] == 2
    assert buckets[bounds[-1]] == 2 and buckets[math.inf] == 3
    assert metric(samples, f"{name}_count") == 3


def test_exposition_has_no_created_series_and_apps_count_apart() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.observe_http("GET", "/health", 200)
    first.observe_finished("none", "stop")
    first.observe_result("none", GenerationStats(generated_tokens=1, target_forwards=1), 0.1)
    text = first.render().decode()
    assert "_created" not in text
    samples = parse_metrics(text)
    assert metric(samples, "hybridspec_http_requests_total", path="/health", status="200") == 1
    assert metric(parse_metrics(second.render()), "hybridspec_http_requests_total") == 0


def test_label_values_are_escaped() -> None:
    metrics = ServerMetrics()
    metrics.observe_finished('a"b\\c\nd', "stop")
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    (sample,) = families["hybridspec_requests_finished"].samples
    assert sample.labels == {"proposer": 'a"b\\c\nd', "finish_reason": "stop"}


def test_methods_outside_the_standard_set_count_as_other() -> None:
    assert {method_label(m) for m in HTTP_METHODS} == HTTP_METHODS
    for method in ("FOO", "PROPFIND", "get", "CONNECT", "TRACE", ""):
        assert method_label(method) == "other"


def random_path(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + "-._~%!$&'()*+,;=:@é"
    parts = ["".join(rng.choices(alphabet, k=rng.randint(1, 12))) for _ in range(rng.randint(1, 4))]
    return "/" + "/".join(parts)


def route_templates(app: FastAPI) -> set[str]:
    return {route.path for route in app_routes(app)}


def test_label_values_stay_bounded_after_a_thousand_random_requests(make_app: AppFactory) -> None:
    rng = random.Random(19)
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    methods += ["FOO", "PROPFIND", "MKCOL", "TRACE", "get", "Post"]
    known = ["/health", "/metrics", "/v1/models", "/v1/models/x", "/v1/completions", "/docs"]
    app = make_app()
    templates = route_templates(app)
    expected_methods: set[str] = set()
    expected_paths: set[str] = set()
    with TestClient(app) as client:
        for i in range(1000):
            method = rng.choice(methods) if i % 3 else "".join(rng.choices("ABCXYZ", k=5))
            path = rng.choice(known) if i % 4 == 0 else random_path(rng)
            response = client.request(method, path, content=b"{}")
            assert response.status_code < 500, (method, path, response.text)
            expected_methods.add(method if method in HTTP_METHODS else "other")
            if path in known:
                expected_paths.add("/v1/models/{model:path}" if path == "/v1/models/x" else path)
            else:
                expected_paths.add(UNMATCHED_PATH)
        samples = parse_metrics(client.get("/metrics").text)
    requests = {
        labels: value
        for (name, labels), value in samples.items()
        if name == "hybridspec_http_requests_total"
    }
    values: dict[str, set[str]] = {"method": set(), "path": set(), "status": set()}
    for labels in requests:
        for key, value in labels:
            values[key].add(value)
    assert sum(requests.values()) == 1000
    # The exact sets: standard methods as sent, everything else one "other"; routes by their
    # template, everything else one "unmatched"; statuses among the few the app sends.
    assert values["method"] == expected_methods and len(values["method"]) == 8
    assert values["path"] == expected_paths and values["path"] <= templates | {UNMATCHED_PATH}
    assert values["status"] <= {"200", "400", "404", "405", "422"}
    assert len(requests) <= 8 * len(values["path"]) * len(values["status"])


def test_proposer_labels_hold_only_names_the_engine_resolved(client: TestClient) -> None:
    rng = random.Random(7)
    for _ in range(20):
        name = "".join(rng.choices(string.ascii_lowercase, k=8))
        body = {"prompt": "hi", "max_tokens": 2, "proposer": name}
        assert client.post("/v1/completions", json=body).status_code == 400
    for proposer in ("none", "ngram"):
        body = {"prompt": "hi", "max_tokens": 2, "proposer": proposer}
        assert client.post("/v1/completions", json=body).status_code == 200
    samples = parse_metrics(client.get("/metrics").text)
    proposers = {value for _, labels in samples for key, value in labels if key == "proposer"}
    assert proposers == {"none", "ngram"}


def test_step_seconds_count_each_engine_and_a_twin_runs_none(make_app: AppFactory) -> None:
    """Under ``bench_twin``, ``none``'s request runs on the twin: both engines' step seconds
    grow, and only the twin's with ``none``'s."""
    with TestClient(make_app({"bench_twin": True})) as client:

        def step_seconds() -> dict[str, float]:
            samples = parse_metrics(client.get("/metrics").text)
            name = "hybridspec_engine_step_seconds_total"
            return {e: metric(samples, name, engine=e) for e in ("main", "twin")}

        before = step_seconds()
        body = {"prompt": "hi", "max_tokens": 4, "proposer": "none"}
        assert client.post("/v1/completions", json=body).status_code == 200
        after_none = step_seconds()
        assert after_none["twin"] > before["twin"] and after_none["main"] == before["main"]
        body["proposer"] = "ngram"
        assert client.post("/v1/completions", json=body).status_code == 200
        after_ngram = step_seconds()
        assert after_ngram["main"] > after_none["main"]
        assert after_ngram["twin"] == after_none["twin"]


def test_a_bench_hold_is_a_twin_servers_route_and_ends_when_its_requests_are_in(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """``/bench/hold`` (``serve --bench-twin`` only) checks its body like any route, and a hold
    for one request ends when that request is in, not at its deadline (which would warn)."""
    with TestClient(make_app()) as client:
        response = client.post("/bench/hold", json={"requests": 1})
        assert response.status_code == 404 and response.json()["error"]["message"]
    with TestClient(make_app({"bench_twin": True})) as client:
        for body, param in [
            ({"requests": 0}, "requests"),
            ({"requests": "2"}, None),
            ({"requests": 2, "timeout_s": 0}, "timeout_s"),
            ({"requests": 2, "timeout_s": 601}, "timeout_s"),
            ({"requests": 2, "extra": 1}, None),
        ]:
            response = client.post("/bench/hold", json=body)
            assert response.status_code == 400, body
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            if param is not None:
                assert error["param"] == param
        with caplog.at_level(logging.WARNING, logger="hybridspec.engine.loop"):
            hold = {"requests": 1, "timeout_s": 5}
            assert client.post("/bench/hold", json=hold).json() == hold
            body = {"prompt": "hi", "max_tokens": 4, "proposer": "ngram"}
            assert client.post("/v1/completions", json=body).status_code == 200
        assert "held the steps" not in caplog.text
