"""Bad input gets an OpenAI-style error body and the right status, and harms no one else."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridspec.config import EngineConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers import NoProposer
from hybridspec.server import ServerConfig, create_app
from hybridspec.types import Proposal, ProposeRequest
from tests.server.conftest import TINY_MODEL_NAME, tiny_engine_config
from tests.server.helpers import metric, parse_metrics

CHAT = [{"role": "user", "content": "hello"}]
LONG_PROMPT = "hello world " * 200  # far more than the tiny model's 256-token context


def assert_error(response: Any, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"proposer": "medusa"}, "proposer"),
        ({"proposer": "draft"}, "proposer"),  # no draft model configured
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"seed": 2**53}, "seed"),  # past what every JSON parser reads exactly
        ({"n": 0}, "n"),
        ({"n": 5}, "n"),  # more than the engine's 4 slots: its choices could never run at once
        ({"prompt": ["a"] * 69}, "prompt"),  # more prompts than the queue (64) and slots hold
        ({"prompt": ["a", ""]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": LONG_PROMPT}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 6}, "logprobs"),  # at most 5, as in the OpenAI API
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),  # 0 only with echo
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"007": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ],
)
def test_invalid_completion_values_are_400(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    request = {"model": TINY_MODEL_NAME, "prompt": "hello", "max_tokens": 4, **body}
    error = assert_error(client.post("/v1/completions", json=request), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": 5}, "prompt"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"max_tokens": 4.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"stop": [1, 2]}, "stop[0]"),
        ({"proposer": 3}, "proposer"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_wrong_types_are_400_not_422(client: TestClient, body: dict[str, Any], param: str) -> None:
    request = {"model": TINY_MODEL_NAME, "prompt": "hello", "max_tokens": 4, **body}
    assert_error(client.post("/v1/completions", json=request), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": None}, "messages"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"max_completion_tokens": 4, "max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
    ],
)
def test_invalid_chat_requests_are_400(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    request = {"model": TINY_MODEL_NAME, "messages": CHAT, "max_tokens": 4, **body}
    assert_error(client.post("/v1/chat/completions", json=request), 400, param)


def test_missing_required_field_is_400(client: TestClient) -> None:
    error = assert_error(
        client.post("/v1/chat/completions", json={"model": TINY_MODEL_NAME}), 400, "messages"
    )
    assert error["code"] == "missing_required_parameter"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"'])
def test_malformed_body_is_400(client: TestClient, raw: bytes) -> None:
    response = client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    error = assert_error(response, 400, response.json()["error"]["param"])
    assert not error["message"].startswith("None")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_empty_body_says_the_body_is_missing(client: TestClient, route: str) -> None:
    error = assert_error(client.post(route), 400, None)
    assert error["message"] == "the request body is missing: expected a JSON object"


def test_unknown_model_is_404(client: TestClient) -> None:
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ]
    for path, body in bodies:
        response = client.post(path, json={"model": "gpt-4o", **body})
        error = assert_error(response, 404, "model")
        assert error["code"] == "model_not_found"


def test_unknown_route_and_method_use_the_error_body(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, None)
    assert_error(client.get("/v1/completions"), 405, None)


def test_bad_stream_request_is_an_http_error_not_a_stream(client: TestClient) -> None:
    response = client.post(
        "/v1/chat/completions", json={"messages": CHAT, "stream": True, "proposer": "medusa"}
    )
    assert_error(response, 400, "proposer")
    assert response.headers["content-type"].startswith("application/json")


def test_errors_leave_the_server_serving(client: TestClient) -> None:
    before = client.post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0}
    ).json()["choices"][0]["text"]
    for bad in ({"prompt": LONG_PROMPT}, {"prompt": "x", "proposer": "draft"}, {"prompt": 1}):
        assert client.post("/v1/completions", json=bad).status_code == 400
    after = client.post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0}
    ).json()["choices"][0]["text"]
    assert before == after
    assert client.get("/health").status_code == 200


class BrokenProposer(NoProposer):
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        raise RuntimeError("broken on purpose")


def test_failing_proposer_is_a_500_for_its_request_only(
    tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    def factory(config: EngineConfig) -> Engine:
        engine = Engine(config, target=tiny_model)
        engine.register_proposer("broken", BrokenProposer)
        return engine

    app = create_app(
        ServerConfig(engine=tiny_engine_config(tiny_model_dir)), engine_factory=factory
    )
    with TestClient(app) as client:
        good = {"prompt": "hello", "max_tokens": 5, "temperature": 0}
        expected = client.post("/v1/completions", json=good).json()["choices"][0]["text"]
        for stream in (False, True):
            response = client.post(
                "/v1/completions", json={**good, "proposer": "broken", "stream": stream}
            )
            error = assert_error(response, 500, None)
            assert error["type"] == "server_error" and error["code"] == "internal_error"
            # The detail is logged, not sent; the request id is in the message and a header.
            assert "broken on purpose" not in error["message"]
            request_id = response.headers["x-request-id"]
            assert request_id.startswith("cmpl-") and request_id in error["message"]
        assert client.post("/v1/completions", json=good).json()["choices"][0]["text"] == expected
        samples = parse_metrics(client.get("/metrics").text)
        assert (
            metric(
                samples,
                "hybridspec_requests_finished_total",
                proposer="broken",
                finish_reason="error",
            )
            == 2
        )


def test_unexpected_error_is_a_500_naming_the_request_not_the_detail(
    tiny_model: LoadedModel, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def factory(config: EngineConfig) -> Engine:
        engine = Engine(config, target=tiny_model)

        def encode(*args: Any) -> list[int]:
            raise RuntimeError("secret detail")

        engine.encode = encode  # type: ignore[method-assign]
        return engine

    app = create_app(
        ServerConfig(engine=tiny_engine_config(tiny_model_dir)), engine_factory=factory
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        error = assert_error(response, 500, None)
        request_id = response.headers["x-request-id"]
        assert request_id.startswith("req-") and request_id in error["message"]
        assert "secret detail" not in response.text
        assert any(request_id in r.getMessage() for r in caplog.records)
        ids = {"prompt": [1, 2, 3], "max_tokens": 2}  # no tokenizing: served
        assert client.post("/v1/completions", json=ids).status_code == 200
