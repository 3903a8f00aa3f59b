"""``logprobs`` on both routes, streamed and not, and ``echo`` scoring on completions.

The reference is the library: an Engine over the same tiny model, asked directly. The tiny
tokenizer is byte-level, so every token is one byte and "hello" is five tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridspec import Engine, GenerationParams, GenerationResult
from hybridspec.model.loader import LoadedModel
from tests.server.conftest import AppFactory, tiny_engine_config
from tests.server.helpers import sse_chunks

CHAT = [{"role": "user", "content": "Tell me about cats."}]
PROMPT = "The cat sat on the mat. The cat sat on the"
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 11}


@pytest.fixture(scope="module")
def library(tiny_model: LoadedModel, tiny_model_dir: Path) -> Iterator[Engine]:
    engine = Engine(tiny_engine_config(tiny_model_dir), target=tiny_model)
    yield engine
    engine.close()


@pytest.fixture
def client(make_app: AppFactory) -> Iterator[TestClient]:
    with TestClient(make_app(default_proposer="none")) as test_client:
        yield test_client


def post(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def stream(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = client.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    return sse_chunks(response.text)


def assert_close(served: list[float | None], expected: list[float]) -> None:
    assert len(served) == len(expected)
    for a, b in zip(served, expected, strict=True):
        assert a is not None and math.isclose(a, max(b, -9999.0), abs_tol=1e-5), (a, b)


@pytest.mark.parametrize("options", [{"temperature": 0}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_chat_logprobs_are_the_librarys(
    client: TestClient, library: Engine, proposer: str, options: dict[str, Any]
) -> None:
    body = {"messages": CHAT, "max_tokens": 24, "logprobs": True, "top_logprobs": 3, **options}
    served = post(client, "/v1/chat/completions", {**body, "proposer": proposer})
    content = served["choices"][0]["logprobs"]["content"]
    params = GenerationParams.create(max_new_tokens=24, logprobs=3, proposer="none", **options)
    expected = library.generate(messages=CHAT, params=params)
    assert expected.logprobs is not None
    assert len(content) == served["usage"]["completion_tokens"] + eos_scored(expected)
    assert_close([e["logprob"] for e in content], expected.logprobs.logprobs.tolist())
    for entry, top_ids in zip(content, expected.logprobs.top_token_ids.tolist(), strict=True):
        assert entry["bytes"] == list(entry["token"].encode())
        assert [t["token"] for t in entry["top_logprobs"]] == [
            library.tokenizer.decode([i]) for i in top_ids
        ]
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6


def eos_scored(result: GenerationResult) -> int:
    """1 when the request stopped at EOS, which is scored but not returned."""
    assert result.logprobs is not None
    return len(result.logprobs) - len(result.token_ids)


def test_streamed_chat_logprobs_join_to_the_whole(client: TestClient) -> None:
    body = {"messages": CHAT, "max_tokens": 30, "logprobs": True, "top_logprobs": 2, **SAMPLED}
    whole = post(client, "/v1/chat/completions", {**body, "proposer": "ngram"})
    chunks = stream(client, "/v1/chat/completions", {**body, "proposer": "ngram"})
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    joined = [entry for piece in pieces if piece is not None for entry in piece["content"]]
    assert joined == whole["choices"][0]["logprobs"]["content"]
    assert sum(piece is not None for piece in pieces) > 1  # spread over several chunks


def test_completion_echo_with_max_tokens_zero_scores_the_prompt(
    client: TestClient, library: Engine
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    served = post(client, "/v1/completions", body)
    choice = served["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert served["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == PROMPT
    assert logprobs["text_offset"] == list(range(len(PROMPT)))
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    ids = library.encode(PROMPT)
    expected = library.generate(prompt_token_ids=ids, max_new_tokens=0, prompt_logprobs=2)
    assert expected.prompt_logprobs is not None
    assert_close(logprobs["token_logprobs"][1:], expected.prompt_logprobs.logprobs.tolist())
    for top, token, logprob in zip(
        logprobs["top_logprobs"][1:],
        logprobs["tokens"][1:],
        logprobs["token_logprobs"][1:],
        strict=True,
    ):
        assert len(top) in (2, 3) and top[token] == logprob  # the top 2 and the token itself
    plain = post(client, "/v1/completions", {**body, "logprobs": None})["choices"][0]
    assert plain["text"] == PROMPT and plain["logprobs"] is None


def test_loglikelihood_request_as_lm_eval_sends_it(client: TestClient, library: Engine) -> None:
    """lm-evaluation-harness's ``local-completions`` scores a continuation with token ids,
    ``echo``, ``max_tokens: 1`` and ``logprobs: 1``, then sums ``token_logprobs[ctxlen:-1]``."""
    context, continuation = library.encode("The cat sat on"), library.encode(" the mat")
    body = {
        "model": "tiny-llama",
        "prompt": [context + continuation],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    logprobs = post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(context) + len(continuation) + 1
    served = sum(logprobs["token_logprobs"][len(context) : -1])
    expected = library.generate(
        prompt_token_ids=context + continuation, max_new_tokens=0, prompt_logprobs=0
    )
    assert expected.prompt_logprobs is not None
    direct = expected.prompt_logprobs.logprobs[len(context) - 1 :].sum().item()
    assert math.isclose(served, direct, abs_tol=1e-5)


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_join_to_the_whole(client: TestClient, echo: bool) -> None:
    body = {"prompt": PROMPT, "max_tokens": 20, "logprobs": 3, "echo": echo, **SAMPLED}
    whole = post(client, "/v1/completions", {**body, "proposer": "ngram"})["choices"][0]
    chunks = stream(client, "/v1/completions", {**body, "proposer": "ngram"})
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in pieces) == whole["text"]
    assert whole["text"].startswith(PROMPT) == echo
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [x for p in pieces if p["logprobs"] is not None for x in p["logprobs"][field]]
        assert joined == whole["logprobs"][field], field
    assert whole["logprobs"]["text_offset"][0] == 0


def test_stop_string_keeps_tokens_and_logprobs_aligned(client: TestClient) -> None:
    free = post(
        client,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1},
    )["choices"][0]
    stop = free["text"][6:8]
    assert stop and stop not in free["text"][:7]
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1, "stop": stop}
    for proposer in ("none", "ngram"):
        served = post(client, "/v1/completions", {**body, "proposer": proposer})
        choice = served["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == free["text"][:6]
        logprobs = choice["logprobs"]
        # Every returned token is scored, the one holding the stop string included.
        assert len(logprobs["tokens"]) == served["usage"]["completion_tokens"]
        expected = free["logprobs"]["token_logprobs"][: len(logprobs["tokens"])]
        assert_close(logprobs["token_logprobs"], expected)
        assert "".join(logprobs["tokens"]).startswith(choice["text"] + stop)


def test_no_logprobs_asked_gives_none(client: TestClient) -> None:
    chat = post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
    assert chat["choices"][0]["logprobs"] is None
    completion = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert completion["choices"][0]["logprobs"] is None
    chunks = stream(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
    assert all(c["choices"][0].get("logprobs") is None for c in chunks if c["choices"])


def test_alternatives_filtered_by_top_k_report_minus_9999(client: TestClient) -> None:
    """JSON has no -inf: outside the request's top-k a token's log-probability is -9999.0."""
    body = {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 4}
    served = post(client, "/v1/chat/completions", {**body, **SAMPLED, "top_k": 2})
    for entry in served["choices"][0]["logprobs"]["content"]:
        values = [top["logprob"] for top in entry["top_logprobs"]]
        assert values[2:] == [-9999.0, -9999.0] and all(v > -9999.0 for v in values[:2])
        assert entry["logprob"] in values[:2]
