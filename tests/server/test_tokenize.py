"""``/tokenize`` and ``/detokenize`` (vLLM's shapes)."""

from __future__ import annotations

import random

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
