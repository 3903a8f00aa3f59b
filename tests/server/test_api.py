"""In-process tests of the API's schema and streaming format, on a tiny random Llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridspec.config import DraftConfig, ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel
from hybridspec.server import create_app
from tests.server.conftest import TINY_MAX_SEQ_LEN, TINY_MODEL_NAME, tiny_engine_config
from tests.server.helpers import chunk_text, metric, parse_metrics, sse_chunks

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": TINY_MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"model": TINY_MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_create_app_loads_no_model() -> None:
    def refuse(config: object) -> Engine:
        raise AssertionError("the engine must be built by the lifespan, not by create_app")

    create_app(engine_factory=refuse)


def test_models_lists_target_with_proposers_and_defaults(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == TINY_MODEL_NAME and card["object"] == "model"
    assert card["max_model_len"] == TINY_MAX_SEQ_LEN
    proposers = {p["name"]: p for p in card["hybridspec"]["proposers"]}
    # No draft model configured; the grammar's proposers, since the model has a tokenizer.
    assert set(proposers) == {
        *("none", "ngram", "suffix", "grammar"),
        *("grammar+ngram", "grammar+none", "grammar+suffix"),
    }
    assert proposers["ngram"]["default"] and not proposers["none"]["default"]
    assert card["hybridspec"]["default_num_speculative_tokens"] == 4
    assert client.get(f"/v1/models/{TINY_MODEL_NAME}").json()["id"] == TINY_MODEL_NAME
    assert client.get("/v1/models/gpt-4").status_code == 404


def test_completion_schema_and_usage(client: TestClient) -> None:
    body = complete(client, prompt="hello world", max_tokens=6, temperature=0)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == TINY_MODEL_NAME and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stats = body["hybridspec"]
    assert stats["proposer"] == "ngram" and stats["num_speculative_tokens"] == 4
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["target_forwards"] >= 1 and stats["mean_accepted_length"] >= 1.0


@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_greedy_completion_equals_engine_generate(
    client: TestClient, tiny_model: LoadedModel, tiny_model_dir: Path, proposer: str
) -> None:
    engine = Engine(tiny_engine_config(tiny_model_dir), target=tiny_model)
    expected = engine.generate("the quick brown fox", max_new_tokens=12, proposer="none")
    body = complete(
        client, prompt="the quick brown fox", max_tokens=12, temperature=0, proposer=proposer
    )
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    assert body["hybridspec"]["proposer"] == proposer


def test_token_id_prompt_equals_text_prompt(client: TestClient, tiny_model: LoadedModel) -> None:
    assert tiny_model.tokenizer is not None
    ids = list(tiny_model.tokenizer.encode("hello world"))
    by_text = complete(client, prompt="hello world", max_tokens=5, temperature=0)
    by_ids = complete(client, prompt=ids, max_tokens=5, temperature=0)
    by_list = complete(client, prompt=[ids], max_tokens=5, temperature=0)
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    assert by_ids["choices"][0]["text"] == by_list["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_chat_completion_schema_and_template(
    client: TestClient, tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    body = chat(client, messages=CHAT, max_tokens=6, temperature=0, proposer="none")
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    engine = Engine(tiny_engine_config(tiny_model_dir), target=tiny_model)
    expected = engine.generate(messages=CHAT, max_new_tokens=6, proposer="none")
    assert choice["message"]["content"] == expected.text
    assert body["usage"]["prompt_tokens"] == len(engine.encode(messages=CHAT))
    assert body["hybridspec"]["proposer"] == "none"


def test_chat_accepts_text_content_parts(client: TestClient) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
        }
    ]
    plain = [{"role": "user", "content": "hello world"}]
    a = chat(client, messages=parts, max_tokens=5, temperature=0)
    b = chat(client, messages=plain, max_tokens=5, temperature=0)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_max_tokens_ends_with_length(client: TestClient) -> None:
    body = complete(client, prompt="hello", max_tokens=3, temperature=0, ignore_eos=True)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_stop_string_cuts_text_and_ends_with_stop(client: TestClient) -> None:
    full = complete(client, prompt="hello world", max_tokens=24, temperature=0, ignore_eos=True)
    text = full["choices"][0]["text"]
    assert len(text) >= 6, "the tiny model should produce some text"
    stop = text[3:5]
    body = complete(
        client, prompt="hello world", max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]
    )
    assert body["choices"][0]["text"] == text[: text.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(client: TestClient) -> None:
    runs = [
        complete(
            client,
            prompt="hello",
            max_tokens=8,
            temperature=1.0,
            top_p=0.9,
            top_k=50,
            seed=1234,
            ignore_eos=True,
        )["choices"][0]["text"]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_format_and_text_equal_non_stream(client: TestClient, endpoint: str) -> None:
    is_chat = endpoint == "chat"
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    body: dict[str, Any] = {"messages": CHAT} if is_chat else {"prompt": "hello world"}
    body.update(
        model=TINY_MODEL_NAME,
        max_tokens=10,
        temperature=0,
        proposer="ngram",
        num_speculative_tokens=3,
    )
    whole = client.post(path, json=body).json()
    response = client.post(path, json={**body, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(response.text)
    kind = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    assert all(c["object"] == kind and c["id"] == chunks[0]["id"] for c in chunks)
    if endpoint == "chat":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
        expected = whole["choices"][0]["message"]["content"]
    else:
        expected = whole["choices"][0]["text"]
    assert chunk_text(chunks) == expected
    *body_chunks, last = chunks
    assert all(c["choices"][0]["finish_reason"] is None for c in body_chunks)
    assert all("hybridspec" not in c for c in body_chunks)
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert last["hybridspec"]["proposer"] == "ngram"
    assert last["hybridspec"]["num_speculative_tokens"] == 3
    assert last["hybridspec"]["target_forwards"] == whole["hybridspec"]["target_forwards"]


def test_stream_include_usage_adds_a_usage_chunk(client: TestClient) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": CHAT,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
    )
    chunks = sse_chunks(response.text)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_metrics_count_requests_tokens_and_speculation(client: TestClient) -> None:
    for proposer in ("none", "ngram", "ngram"):
        complete(
            client,
            prompt="hello world hello world",
            max_tokens=5,
            temperature=0,
            ignore_eos=True,
            proposer=proposer,
        )
    client.post("/v1/completions", json={"prompt": "x", "proposer": "nope"})
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse_metrics(response.text)
    requests = "hybridspec_http_requests_total"
    assert metric(samples, requests, path="/v1/completions", status="200") == 3
    assert metric(samples, requests, path="/v1/completions", status="400") == 1
    finished = "hybridspec_requests_finished_total"
    assert metric(samples, finished, proposer="ngram", finish_reason="length") == 2
    assert metric(samples, finished, proposer="none", finish_reason="length") == 1
    assert metric(samples, "hybridspec_generated_tokens_total") == 15
    forwards = metric(samples, "hybridspec_target_forwards_total", proposer="none")
    assert forwards == 5  # no drafts: one forward per token
    assert metric(samples, "hybridspec_mean_accepted_length", proposer="none") == 1.0
    proposed = metric(samples, "hybridspec_draft_tokens_proposed_total", proposer="ngram")
    accepted = metric(samples, "hybridspec_draft_tokens_accepted_total", proposer="ngram")
    assert 0 <= accepted <= proposed
    assert metric(samples, "hybridspec_request_latency_seconds_count") == 3
    assert metric(samples, "hybridspec_time_to_first_token_seconds_count", proposer="ngram") == 2
    assert metric(samples, "hybridspec_num_running_requests") == 0
    assert metric(samples, "hybridspec_num_waiting_requests") == 0


def test_health(client: TestClient) -> None:
    response = client.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_draft_proposer_is_served_when_a_draft_model_is_given(
    make_app: Any, tiny_model_dir: Path
) -> None:
    # The draft is the target itself, so it costs a whole forward: priced as free to draft.
    model = ModelConfig(str(tiny_model_dir), dtype="float32", max_num_seqs=4)
    draft = DraftConfig(model=model, cost_per_token=0.0)
    with TestClient(make_app(draft=draft)) as client:
        (card,) = client.get("/v1/models").json()["data"]
        # hybrid drafts with the draft model where the target has no eagle head
        names = {p["name"] for p in card["hybridspec"]["proposers"]}
        assert {"none", "ngram", "draft", "hybrid", "grammar+draft"} <= names
        texts = {}
        for proposer in ("none", "draft"):
            body = complete(
                client,
                prompt="hello world",
                max_tokens=10,
                temperature=0,
                ignore_eos=True,
                proposer=proposer,
                num_speculative_tokens=3,
            )
            texts[proposer] = body["choices"][0]["text"]
            stats = body["hybridspec"]
        # The draft is the target itself: every draft token is accepted.
        assert texts["draft"] == texts["none"]
        assert stats["draft_tokens_proposed"] > 0
        assert stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(
    client: TestClient, route: str
) -> None:
    # The body guidellm sends by default (vLLM's stream_options extension included).
    body = {
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
        **({"messages": CHAT} if route.endswith("chat/completions") else {"prompt": "hello"}),
    }
    chunks = sse_chunks(client.post(route, json=body).text)
    usages = [chunk["usage"] for chunk in chunks]
    prompt = usages[0]["prompt_tokens"]
    assert prompt > 0 and all(u["prompt_tokens"] == prompt for u in usages)
    assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 6
    assert chunks[-1]["choices"] == []  # the usage chunk of include_usage still ends the stream


def test_continuous_usage_stats_needs_include_usage(client: TestClient) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    chunks = sse_chunks(client.post("/v1/chat/completions", json=body).text)
    assert all("usage" not in chunk for chunk in chunks)
