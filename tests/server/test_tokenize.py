"""``/tokenize`` and ``/detokenize`` (vLLM's shapes)."""

from __future__ import annotations

import json
import random
from typing import Any

from fastapi.testclient import TestClient

from tests.server.conftest import TINY_MAX_SEQ_LEN

MESSAGES = [{"role": "user", "content": "Hello there"}]
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABC0123456789 .,;:!?'\"\n\t-éüß漢字🙂"


def test_hundred_random_texts_round_trip(client: TestClient) -> None:
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))
        tokens = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert tokens.status_code == 200, tokens.text
        body = tokens.json()
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == TINY_MAX_SEQ_LEN
        back = client.post("/detokenize", json={"tokens": body["tokens"]})
        assert back.status_code == 200, back.text
        assert back.json() == {"prompt": text}


def test_special_tokens_and_token_strings(client: TestClient) -> None:
    plain = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
    full = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert full["tokens"][-len(plain["tokens"]) :] == plain["tokens"]
    assert len(full["token_strs"]) == full["count"] and plain["token_strs"] is None


def test_messages_tokenize_as_the_chat_route_does(client: TestClient) -> None:
    tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"]
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "Hello there" in text and "<|im_start|>" in text


def test_bad_requests_name_the_field(client: TestClient) -> None:
    cases = [
        ({"prompt": "a", "messages": MESSAGES}, "/tokenize", "messages"),
        ({}, "/tokenize", "prompt"),
        (
            {"messages": MESSAGES, "add_generation_prompt": False},
            "/tokenize",
            "add_generation_prompt",
        ),
        ({"tokens": [10**9]}, "/detokenize", "tokens"),
        ({"tokens": [-1]}, "/detokenize", "tokens"),
    ]
    for body, path, field in cases:
        response = client.post(path, json=body)
        assert response.status_code == 400, (body, response.text)
        # The body is a prompt's or the messages' (the schema's anyOf): pydantic names the
        # field, after the shape it was checked against.
        assert field in response.text, (body, response.text)
    assert client.post("/tokenize", json={"prompt": "a", "model": "nope"}).status_code == 404


def post_json(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    """``body`` as escaped JSON, so that lone surrogates travel as ``\\ud800``."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_lone_surrogates_are_400s_naming_the_field(client: TestClient) -> None:
    cases = [
        ("/tokenize", {"prompt": "a \ud800 b"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages[0].content"),
        ("/tokenize", {"prompt": "a", "model": "\ud800"}, "model"),
        ("/detokenize", {"tokens": [1], "model": "\udfff"}, "model"),
    ]
    for path, body, field in cases:
        response = post_json(client, path, body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == field and error["code"] == "invalid_value", error


def test_inputs_over_the_generation_bounds_are_400s_naming_the_bound(client: TestClient) -> None:
    """A text more tokens than a prompt may hold (before tokenizing when its characters alone
    tell), and more token ids than the context, as the generation routes refuse them."""
    most = TINY_MAX_SEQ_LEN - 1
    many_tokens = " ".join(["a"] * (4 * TINY_MAX_SEQ_LEN))  # few characters per token
    huge = "x" * 1_000_000  # more characters than any prompt's tokens can hold
    for text in (many_tokens, huge):
        response = post_json(client, "/tokenize", {"prompt": text})
        assert response.status_code == 400, response.text[:200]
        error = response.json()["error"]
        assert error["param"] == "prompt" and str(most) in error["message"], error
    response = post_json(client, "/detokenize", {"tokens": [1] * (TINY_MAX_SEQ_LEN + 1)})
    assert response.status_code == 400, response.text[:200]
    error = response.json()["error"]
    assert error["param"] == "tokens" and str(TINY_MAX_SEQ_LEN) in error["message"], error
    assert post_json(client, "/detokenize", {"tokens": [1] * TINY_MAX_SEQ_LEN}).status_code == 200
