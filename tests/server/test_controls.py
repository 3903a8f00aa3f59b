"""The sampling controls on both routes: served with the engine's semantics, validated with a
400 naming the field, and stated exactly in the OpenAPI document."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridspec.server.openapi import decimal_below
from tests.conftest import TINY_EOS
from tests.server.conftest import TINY_MODEL_NAME

PROMPT = [65, 66, 67, 65, 66]


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    request = {"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = client.post("/v1/completions", json={**request, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_logit_bias_steers_greedy_text_with_every_proposer(client: TestClient) -> None:
    texts = {
        proposer: complete(client, proposer=proposer, logit_bias={"90": 100})["choices"][0]["text"]
        for proposer in ("none", "ngram")
    }
    assert texts == {"none": "Z" * 8, "ngram": "Z" * 8}  # token 90 is the byte "Z"


def test_min_tokens_holds_back_eos(client: TestClient) -> None:
    body = {"logit_bias": {str(TINY_EOS): 100}, "ignore_eos": False}
    assert complete(client, **body)["usage"]["completion_tokens"] == 0
    held = complete(client, min_tokens=3, **body)
    assert held["usage"]["completion_tokens"] == 3
    assert held["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_every_control_is_served_on_both_routes(client: TestClient, proposer: str) -> None:
    controls = {
        "presence_penalty": 1.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {"70": 3, "71": -2.5},
        "min_p": 0.1,
        "min_tokens": 2,
        "temperature": 0.8,
        "seed": 5,
        "proposer": proposer,
    }
    first = complete(client, **controls)["choices"][0]["text"]
    assert complete(client, **controls)["choices"][0]["text"] == first  # seeded
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **controls}
    response = client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.001}, "repetition_penalty"),
        ({"min_p": -0.5}, "min_p"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"260": 1}}, "logit_bias"),  # the tiny vocabulary has 260 tokens
        ({"logit_bias": {"1" + "0" * 5000: 1}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_bad_controls_are_400_naming_the_field(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    for route, base in (
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = client.post(route, json={**base, "max_tokens": 2, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_the_document_states_the_controls_bounds(client: TestClient) -> None:
    components = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = components[name]["properties"]
        bias = properties["logit_bias"]
        assert bias["propertyNames"] == {"pattern": decimal_below(260)}
        assert bias["maxProperties"] == 300
        assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
        assert (
            properties["presence_penalty"]["minimum"],
            properties["presence_penalty"]["maximum"],
        ) == (-2, 2)
        assert properties["min_p"]["maximum"] == 1 and properties["min_tokens"]["minimum"] == 0


@pytest.mark.parametrize("limit", [1, 2, 9, 10, 11, 99, 100, 101, 260, 1000, 4097])
def test_decimal_below_matches_exactly_the_ids_below_the_limit(limit: int) -> None:
    pattern = re.compile(decimal_below(limit))
    for n in range(3 * limit + 20):
        assert bool(pattern.search(str(n))) == (n < limit), n
    for text in ("", "00", "01", "-1", "1a", " 1", "1.0"):
        assert not pattern.search(text), text
