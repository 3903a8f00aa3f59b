"""The prefix cache through the server: ``cached_tokens`` in usage, ``cache_prompt``, metrics."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.server.conftest import AppFactory
from tests.server.helpers import metric, parse_metrics

PROMPT = [5, 9, 14, 2, 27, 5, 11, 40, 8, 19, 33, 6, 21, 12, 30, 7]


def complete(client: TestClient, prompt: list[int], **options: object) -> dict:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = client.post("/v1/completions", json={**body, **options})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_repeated_prefix_is_reported_as_cached_tokens(make_app: AppFactory) -> None:
    with TestClient(make_app(prefix_cache_mb=8)) as client:
        first = complete(client, PROMPT)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        again = complete(client, [*PROMPT, 3, 4])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
        cold = complete(client, [*PROMPT, 3, 4], cache_prompt=False)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cold["choices"][0]["text"] == again["choices"][0]["text"]
        samples = parse_metrics(client.get("/metrics").text)
        assert metric(samples, "hybridspec_prefix_cache_hit_tokens_total") == len(PROMPT)
        assert metric(samples, "hybridspec_prefix_cache_tokens") > 0


def test_cache_prompt_must_be_a_bool(make_app: AppFactory) -> None:
    with TestClient(make_app(prefix_cache_mb=8)) as client:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2, "cache_prompt": 3}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400 or response.status_code == 422, response.text
        assert "cache_prompt" in response.text
