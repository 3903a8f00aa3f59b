"""``ServerConfig.api_key``: every route the app registers wants ``Authorization: Bearer <key>``,
except the liveness probe and the playground page; refusals are OpenAI's 401s and count in the
metrics."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hybridspec.errors import InvalidRequestError
from hybridspec.server import ServerConfig
from hybridspec.server.middleware import app_routes
from tests.server.conftest import TINY_MODEL_NAME, AppFactory
from tests.server.helpers import metric, parse_metrics

openai = pytest.importorskip("openai")

KEY = "sk-hybridspec-test-5f1c0e"
AUTH = {"Authorization": f"Bearer {KEY}"}
WRONG = {"Authorization": f"Bearer {KEY}x"}
OPEN = {
    ("GET", "/health"),
    ("HEAD", "/health"),
    ("GET", "/"),
    ("GET", "/playground"),
    ("GET", "/favicon.ico"),
    ("GET", "/favicon.svg"),
}
# Routes this app must register; the enumeration below must find at least these.
KNOWN = {
    ("GET", "/docs"),
    ("GET", "/redoc"),
    ("GET", "/openapi.json"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/metrics"),
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model:path}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1]},
}


def registered(app: FastAPI) -> set[tuple[str, str]]:
    """Every (method, route template) the app registers."""
    return {(method, route.path) for route in app_routes(app) for method in route.methods}


def concrete(template: str) -> str:
    return re.sub(r"\{[^}]*\}", TINY_MODEL_NAME, template)


@pytest.fixture
def keyed(make_app: AppFactory) -> Iterator[TestClient]:
    with TestClient(make_app({"api_key": KEY})) as client:
        yield client


def assert_unauthorized(response: httpx.Response, code: str | None) -> None:
    assert response.status_code == 401, (response.request.url, response.text)
    assert response.headers["www-authenticate"] == "Bearer"
    if response.request.method == "HEAD":
        return  # no body
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (None, code)
    assert KEY not in response.text


def test_every_registered_route_wants_the_key(keyed: TestClient) -> None:
    routes = registered(keyed.app)  # type: ignore[arg-type]
    assert routes >= KNOWN, KNOWN - routes
    for method, template in sorted(routes - OPEN):
        url, body = concrete(template), BODIES.get(template)
        missing = keyed.request(method, url, json=body)
        assert_unauthorized(missing, None)
        assert method == "HEAD" or "You didn't provide" in missing.json()["error"]["message"]
        assert_unauthorized(keyed.request(method, url, json=body, headers=WRONG), "invalid_api_key")
        allowed = keyed.request(method, url, json=body, headers=AUTH)
        assert allowed.status_code == 200, (method, url, allowed.text)


def test_the_liveness_probe_is_open(keyed: TestClient) -> None:
    assert keyed.get("/health").status_code == 200
    assert keyed.head("/health").status_code == 200  # HEAD answers as GET, open as it is
    # Only the probe itself: neighbours of it and unknown routes are refused before routing.
    assert_unauthorized(keyed.get("/health/"), None)
    assert_unauthorized(keyed.post("/health"), None)
    assert_unauthorized(keyed.get("/no/such/route"), None)


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        (f"bearer {KEY}", None),  # the scheme is case-insensitive: accepted
        (f"Bearer  {KEY} ", None),
        (f"Basic {KEY}", "missing"),
        ("Bearer", "missing"),
        ("Bearer ", "missing"),
        (KEY, "missing"),
        (f"Bearer {KEY[:-1]}", "invalid_api_key"),
        (f"Bearer {KEY.upper()}", "invalid_api_key"),
    ],
)
def test_authorization_header_forms(keyed: TestClient, authorization: str, code: str) -> None:
    response = keyed.get("/v1/models", headers={"Authorization": authorization})
    if code is None:
        assert response.status_code == 200
    else:
        assert_unauthorized(response, None if code == "missing" else code)


def test_refusals_count_in_the_metrics_with_bounded_labels(keyed: TestClient) -> None:
    keyed.post("/v1/completions", json=BODIES["/v1/completions"])
    keyed.get("/v1/models/anything", headers=WRONG)
    keyed.request("PROPFIND", "/secret/path")
    samples = parse_metrics(keyed.get("/metrics", headers=AUTH).text)
    requests = "hybridspec_http_requests_total"
    assert metric(samples, requests, status="401") == 3
    assert metric(samples, requests, method="POST", path="/v1/completions", status="401") == 1
    path = "/v1/models/{model:path}"
    assert metric(samples, requests, method="GET", path=path, status="401") == 1
    assert metric(samples, requests, method="other", path="unmatched", status="401") == 1
    assert metric(samples, "hybridspec_prompt_tokens_total") == 0  # nothing reached the engine


def test_the_official_client_with_and_without_the_key(keyed: TestClient) -> None:
    def client(api_key: str) -> Any:
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key=api_key, http_client=keyed, max_retries=0
        )

    (model,) = client(KEY).models.list().data
    assert model.id == TINY_MODEL_NAME
    completion = client(KEY).completions.create(model=model.id, prompt="hi", max_tokens=1)
    assert completion.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError) as wrong:
        client("sk-wrong").models.list()
    assert wrong.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as missing:
        client("unused").completions.create(
            model=model.id,
            prompt="hi",
            max_tokens=1,
            extra_headers={"Authorization": openai.omit},  # sends no Authorization header
        )
    assert missing.value.code is None
    assert "didn't provide an API key" in missing.value.message


def test_no_key_configured_no_authentication(client: TestClient) -> None:
    assert client.get("/v1/models").status_code == 200
    assert client.get("/openapi.json", headers=WRONG).status_code == 200


def test_the_key_is_never_shown(make_app: AppFactory, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG), TestClient(make_app({"api_key": KEY})) as client:
        client.get("/v1/models", headers=WRONG)
    assert KEY not in caplog.text
    assert KEY not in repr(ServerConfig(api_key=KEY))
    for bad in ("", f"{KEY} ", "a\nb"):
        with pytest.raises(InvalidRequestError, match="api_key") as refused:
            ServerConfig(api_key=bad)
        assert not bad or bad.strip() not in str(refused.value)
