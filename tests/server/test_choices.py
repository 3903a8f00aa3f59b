"""``n`` choices and lists of prompts over HTTP: OpenAI's indexing, usage and stream format,
each choice the request made alone, and the 400s of what the engine can never hold."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from hybridspec.engine import Engine
from hybridspec.model.loader import LoadedModel
from tests.server.conftest import (
    TINY_MODEL_NAME,
    AppFactory,
    serve_in_thread,
    tiny_engine_config,
)
from tests.server.helpers import sse_chunks

CHAT = [{"role": "user", "content": "count with me"}]


def completion(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def texts(body: dict[str, Any]) -> list[str]:
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_greedy_choices_equal_the_single_request(client: TestClient, proposer: str) -> None:
    options = {"temperature": 0, "proposer": proposer}
    three = chat(client, n=3, **options)
    one = chat(client, **options)
    assert texts(three) == texts(one) * 3
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # counted once
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert three["hybridspec"]["target_forwards"] == 3 * one["hybridspec"]["target_forwards"]


def test_seeded_choice_i_is_the_single_request_with_seed_plus_i(client: TestClient) -> None:
    options = {"temperature": 1.0, "max_tokens": 12, "proposer": "ngram"}
    three = texts(chat(client, n=3, seed=40, **options))
    assert texts(chat(client, n=3, seed=40, **options)) == three  # reproducible
    singles = [texts(chat(client, seed=40 + i, **options))[0] for i in range(3)]
    assert three == singles
    assert len(set(three)) > 1


def test_a_list_of_prompts_is_indexed_prompt_times_n_plus_choice(client: TestClient) -> None:
    prompts = ["hello there", "one two three", "abc"]
    options = {"temperature": 0.7, "seed": 3, "echo": True, "max_tokens": 6}
    body = completion(client, prompt=prompts, n=2, **options)
    got = texts(body)
    assert len(got) == 6
    completion_tokens = 0
    for i, prompt in enumerate(prompts):
        for j in range(2):
            alone = completion(client, prompt=prompt, **{**options, "seed": 3 + j})
            assert got[i * 2 + j] == texts(alone)[0]
            assert got[i * 2 + j].startswith(prompt)  # echoed
            completion_tokens += alone["usage"]["completion_tokens"]
    prompt_tokens = sum(completion(client, prompt=p)["usage"]["prompt_tokens"] for p in prompts)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == completion_tokens


def test_token_id_prompts_and_logprobs_per_choice(client: TestClient) -> None:
    options = {"logprobs": 2, "temperature": 0}
    body = completion(client, prompt=[[5, 6, 7], [8, 9]], n=2, **options)
    for i, prompt in enumerate([[5, 6, 7], [8, 9]]):
        (alone,) = completion(client, prompt=prompt, **options)["choices"]
        for choice in body["choices"][2 * i : 2 * i + 2]:
            assert choice["text"] == alone["text"]
            assert choice["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
            got, want = choice["logprobs"]["token_logprobs"], alone["logprobs"]["token_logprobs"]
            assert got == pytest.approx(want, abs=1e-5)


def collect_stream(chunks: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, str]]:
    """Each choice's streamed text and finish reason, checking that a chat choice gets its
    role first and its finish reason last, once."""
    text: dict[int, str] = defaultdict(str)
    reasons: dict[int, str] = {}
    for chunk in chunks:
        if not chunk["choices"]:
            continue
        (choice,) = chunk["choices"]  # one choice per chunk, as OpenAI streams n choices
        index = choice["index"]
        assert index not in reasons  # nothing after its finish reason
        delta = choice.get("delta")
        if delta is not None and "role" in delta:
            assert index not in text
            text[index] = ""
        else:
            text[index] += delta.get("content", "") if delta is not None else choice["text"]
        if choice["finish_reason"] is not None:
            reasons[index] = choice["finish_reason"]
            assert "hybridspec" in chunk  # each choice's own statistics
    return dict(text), reasons


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_streamed_choices_carry_their_index_and_equal_the_response(
    client: TestClient, endpoint: str
) -> None:
    body: dict[str, Any] = {"n": 3, "temperature": 1.0, "seed": 9, "max_tokens": 10}
    if endpoint.endswith("chat/completions"):
        body["messages"] = CHAT
    else:
        body["prompt"] = ["a b c", "d e f"]
    plain = client.post(endpoint, json=body)
    assert plain.status_code == 200, plain.text
    options = {"stream": True, "stream_options": {"include_usage": True}}
    streamed = client.post(endpoint, json={**body, **options})
    assert streamed.status_code == 200, streamed.text
    chunks = sse_chunks(streamed.text)
    text, reasons = collect_stream(chunks)
    expected = plain.json()
    assert [text[i] for i in range(len(text))] == texts(expected)
    assert [reasons[i] for i in range(len(reasons))] == [
        c["finish_reason"] for c in expected["choices"]
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected["usage"]


def test_chat_logprobs_per_choice(client: TestClient) -> None:
    body = chat(client, n=2, temperature=1.0, seed=1, logprobs=True, top_logprobs=2)
    for choice in body["choices"]:
        tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
        assert "".join(tokens) == choice["message"]["content"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"n": 5}, "n: expected an integer in [1, 4]"),
        ({"n": 0}, "n: expected an integer in [1, 4]"),
        ({"n": 2, "prompt": ["x"] * 69}, "prompt: expected 1 to 68 prompts"),
    ],
)
def test_what_the_engine_can_never_hold_is_a_400(
    client: TestClient, body: dict[str, Any], message: str
) -> None:
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_the_document_bounds_n_and_the_prompts(client: TestClient) -> None:
    components = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        n = components[name]["properties"]["n"]
        assert {"type": "integer", "maximum": 4} in n["anyOf"] and n["minimum"] == 1
    prompt = components["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    lists = [c for c in prompt if c["type"] == "array" and c["items"]["type"] != "integer"]
    assert len(lists) == 2 and all(c["maxItems"] == 68 for c in lists)


def test_the_openai_sdk_gets_n_choices_streamed_or_not(make_app: AppFactory) -> None:
    with serve_in_thread(make_app()) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        options: dict[str, Any] = {
            "model": TINY_MODEL_NAME,
            "messages": CHAT,
            "max_tokens": 8,
            "n": 3,
            "seed": 2,
            "temperature": 0.9,
        }
        reply = client.chat.completions.create(**options)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        single = client.chat.completions.create(**{**options, "n": 1})
        assert reply.usage is not None and single.usage is not None
        assert reply.usage.prompt_tokens == single.usage.prompt_tokens
        assert reply.choices[0].message.content == single.choices[0].message.content
        streamed: dict[int, str] = defaultdict(str)
        for chunk in client.chat.completions.create(**options, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
        assert [streamed[i] for i in range(3)] == [c.message.content for c in reply.choices]
        listed = client.completions.create(
            model=TINY_MODEL_NAME, prompt=["a", "b"], n=2, max_tokens=4, temperature=0
        )
        assert [c.index for c in listed.choices] == [0, 1, 2, 3]
        assert listed.choices[0].text == listed.choices[1].text


def test_stop_token_ids_end_the_text(
    client: TestClient, tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    engine = Engine(tiny_engine_config(tiny_model_dir), target=tiny_model)
    expected = engine.generate(
        prompt_token_ids=[5, 6, 7], max_new_tokens=12, proposer="none", ignore_eos=True
    )
    stop = expected.token_ids[5]
    cut = engine.generate(
        prompt_token_ids=[5, 6, 7],
        max_new_tokens=12,
        proposer="none",
        ignore_eos=True,
        stop_token_ids=[stop],
    )
    options = {"prompt": [5, 6, 7], "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    body = completion(client, stop_token_ids=[stop], **options)
    assert body["choices"][0]["text"] == cut.text
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == expected.token_ids.index(stop) < 12
    bad = client.post("/v1/completions", json={**options, "stop_token_ids": [260]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


def test_n_and_the_prompts_are_checked_once_where_the_request_enters(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hybridspec.engine.admission as admission
    import hybridspec.server.preparation as preparation

    calls: list[str] = []
    for module in (admission, preparation):
        checker = module.check_choices

        def counting(*args: Any, _name: str = module.__name__, _check: Any = checker) -> None:
            calls.append(_name)
            _check(*args)

        monkeypatch.setattr(module, "check_choices", counting)
    assert len(texts(completion(client, prompt=["a", "b"], n=2))) == 4
    assert calls == ["hybridspec.server.preparation"]  # the server's, before tokenizing
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 5})
    assert response.status_code == 400 and calls == ["hybridspec.server.preparation"] * 2


def test_the_most_prompts_are_served_beside_a_running_stream(make_app: AppFactory) -> None:
    """A request of as many prompts as queue and slots hold (4 + 4), while a stream holds a
    slot: queued as one request, all answered, never a 503."""
    import httpx

    with serve_in_thread(make_app(max_queue_size=4)) as url, httpx.Client(base_url=url) as http:
        stream = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=stream, timeout=60) as running:
            assert running.status_code == 200
            next(running.iter_lines())  # its first event: it holds a slot
            body = {"prompt": [f"p{i}" for i in range(8)], "max_tokens": 2}
            response = http.post("/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert len(texts(response.json())) == 8
