"""The request bodies that load generators send by default are served, streamed to the end.

Recorded bodies (prompts shortened, the model renamed to the tiny one):

- guidellm 0.8.1, ``guidellm run --backend kind=openai_http,request_format=...`` with synthetic
  text: recorded by a logging proxy in front of ``hybridspec serve``. It streams with vLLM's
  ``stream_options.continuous_usage_stats``, fixes the output length with ``ignore_eos``, sends
  chat content as parts and ``max_completion_tokens`` on the chat route.
- vLLM's serving benchmark (``vllm bench serve``, ``benchmarks/lib/endpoint_request_func.py``):
  ``repetition_penalty: 1.0`` and ``logprobs: null`` on every completions request, greedy by
  default (``temperature: 0.0``), ``ignore_eos`` with ``--ignore-eos``.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.server.conftest import TINY_MODEL_NAME
from tests.server.helpers import sse_chunks

MAX_TOKENS = 8
PROMPT = "Finish medical want almost away until. Its culture song reveal return finally affect."

GUIDELLM_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}

GUIDELLM_CHAT: dict[str, Any] = {
    "model": TINY_MODEL_NAME,
    "stream": True,
    "stream_options": GUIDELLM_STREAM_OPTIONS,
    "max_completion_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
}
GUIDELLM_COMPLETIONS: dict[str, Any] = {
    "model": TINY_MODEL_NAME,
    "stream": True,
    "stream_options": GUIDELLM_STREAM_OPTIONS,
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "prompt": PROMPT,
}
VLLM_CHAT: dict[str, Any] = {
    "model": TINY_MODEL_NAME,
    "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    "max_completion_tokens": MAX_TOKENS,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
    "temperature": 0.0,
}
VLLM_COMPLETIONS: dict[str, Any] = {
    "model": TINY_MODEL_NAME,
    "prompt": PROMPT,
    "repetition_penalty": 1.0,
    "max_tokens": MAX_TOKENS,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
    "temperature": 0.0,
}

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("chat", GUIDELLM_CHAT),
        ("completions", GUIDELLM_COMPLETIONS),
        ("chat", VLLM_CHAT),
        ("completions", VLLM_COMPLETIONS),
    ],
    ids=["guidellm-chat", "guidellm-completions", "vllm-chat", "vllm-completions"],
)
def test_load_generator_body_streams_to_the_end(
    client: TestClient, route: str, body: dict[str, Any]
) -> None:
    response = client.post(ROUTES[route], json=body)
    assert response.status_code == 200, response.text
    chunks = sse_chunks(response.text)
    *token_chunks, last = chunks
    # ignore_eos: exactly max_tokens tokens, then the usage chunk with empty choices.
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == MAX_TOKENS
    finals = [c for c in token_chunks if c["choices"][0]["finish_reason"] is not None]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    assert token_chunks[-1] is finals[0]
    expected_object = "chat.completion.chunk" if route == "chat" else "text_completion"
    assert {c["object"] for c in chunks} == {expected_object}
    assert {c["model"] for c in chunks} == {TINY_MODEL_NAME}


@pytest.mark.parametrize(
    ("route", "body"), [("chat", GUIDELLM_CHAT), ("completions", GUIDELLM_COMPLETIONS)]
)
def test_continuous_usage_is_on_every_chunk_and_grows(
    client: TestClient, route: str, body: dict[str, Any]
) -> None:
    """guidellm counts output tokens from the usage it finds on the chunks it reads."""
    chunks = sse_chunks(client.post(ROUTES[route], json=body).text)
    usages = [c["usage"] for c in chunks]
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert len({u["prompt_tokens"] for u in usages}) == 1
    completed = [u["completion_tokens"] for u in usages]
    assert completed == sorted(completed)
    assert completed[-1] == MAX_TOKENS


def test_vllm_benchmark_body_with_a_real_repetition_penalty_is_served(
    client: TestClient,
) -> None:
    """vLLM's benchmark sends 1.0 (no penalty); other values are a sampling control too."""
    body = {**VLLM_COMPLETIONS, "stream": False, "repetition_penalty": 1.1}
    del body["stream_options"]
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
