"""``tool_choice: "auto"`` on a template that does not show tools (the tiny model's, as
SmolLM2's), nulls for every optional field, and the newer OpenAI fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from hybridspec.config import ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import load_model
from hybridspec.server import ServerConfig, create_app
from hybridspec.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionDefinition,
    StreamOptions,
    Tool,
)
from hybridspec.server.structured import AUTO_INSTRUCTION, example_call, tool_messages, tool_plan
from tests.conftest import TINY_EOS, TINY_IM_END, save_tiny_llama
from tests.server.conftest import TINY_MODEL_NAME, tiny_engine_config
from tests.server.helpers import sse_chunks
from tests.server.test_structured import TOOLS, USER

OPEN_BRACKET = ord("[")  # the tiny vocabulary's byte tokens: id b is byte b


@pytest.fixture(scope="module")
def long_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The tiny model with a 1024-token context: room for the tools' description."""
    directory = save_tiny_llama(tmp_path_factory.mktemp("tools"), max_position_embeddings=1024)
    model = load_model(ModelConfig(str(directory), dtype="float32"))
    config = ServerConfig(engine=tiny_engine_config(directory), served_model_name=TINY_MODEL_NAME)
    app = create_app(config, engine_factory=lambda cfg: Engine(cfg, target=model))
    with TestClient(app) as test_client:
        yield test_client


def post(client: TestClient, route: str = "chat/completions", **body: Any) -> dict[str, Any]:
    response = client.post(f"/v1/{route}", json={"model": TINY_MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def auto(client: TestClient, **body: Any) -> dict[str, Any]:
    """A greedy request with tools and no tool_choice; its one choice."""
    options = {"messages": USER, "tools": TOOLS, "max_tokens": 40, "temperature": 0}
    return post(client, **{**options, **body})["choices"][0]


def answer_of(choice: dict[str, Any]) -> tuple[str | None, list[tuple[str, str]] | None]:
    message = choice["message"]
    calls = message["tool_calls"]
    pairs = (
        None
        if calls is None
        else [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    )
    return message["content"], pairs


@pytest.mark.parametrize("bias", [None, {str(OPEN_BRACKET): 100}])
def test_greedy_auto_is_the_same_with_every_proposer(
    long_client: TestClient, bias: dict[str, int] | None
) -> None:
    """Text, or (with ``[`` pushed first) calls: the grammar of auto is one more grammar, and
    speculation under it is exact."""
    answers = set()
    for proposer in ("none", "ngram", "grammar", "grammar+ngram"):
        choice = auto(long_client, proposer=proposer, logit_bias=bias)
        content, calls = answer_of(choice)
        if bias is None:
            assert calls is None and content and not content.startswith(("[", " ", "\n"))
        else:
            assert content is None and calls
            assert choice["finish_reason"] in ("tool_calls", "length")
        answers.add((content, json.dumps(calls)))
    assert len(answers) == 1


@pytest.mark.parametrize("bias", [None, {str(OPEN_BRACKET): 100}])
def test_a_streamed_auto_answer_is_all_text_or_all_calls(
    long_client: TestClient, bias: dict[str, int] | None
) -> None:
    plain = auto(long_client, logit_bias=bias)
    request = {"model": TINY_MODEL_NAME, "messages": USER, "tools": TOOLS, "max_tokens": 40}
    request.update(temperature=0, logit_bias=bias, stream=True)
    response = long_client.post("/v1/chat/completions", json=request)
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(response.text) if c["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    content, expected = answer_of(plain)
    if content is not None:
        assert text == content and not calls
        assert sum(bool(d.get("content")) for d in deltas) > 1  # text streams, not held back
    else:
        assert not text
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected


@pytest.mark.parametrize("temperature", [0, 1])
@pytest.mark.parametrize("stop_token", [TINY_EOS, TINY_IM_END])
def test_an_auto_text_answer_ends_where_the_model_ends_it(
    long_client: TestClient, stop_token: int, temperature: float
) -> None:
    """The text branch of auto's grammar allows every stop token (EOS and the template's end
    of turn) after any text: a model that ends its answer ends it, and the answer does not
    run to max_tokens. Text forced by ``[`` pushed down; the stop token pushed up once
    ``min_tokens`` lets it through."""
    bias = {str(OPEN_BRACKET): -100, str(stop_token): 100}
    choice = auto(long_client, logit_bias=bias, min_tokens=3, temperature=temperature, seed=7)
    content, calls = answer_of(choice)
    assert calls is None and content and not content.startswith("[")
    assert choice["finish_reason"] == "stop"
    assert len(content.encode()) == 3  # the tiny vocabulary's byte tokens: 3 tokens, 3 bytes


def test_the_tools_are_described_with_how_to_call_them(long_client: TestClient) -> None:
    """none: the model sees no tools; auto: their description and how to call one."""
    options = {"messages": USER, "tools": TOOLS, "max_tokens": 1}
    hidden = post(long_client, tool_choice="none", **options)["usage"]["prompt_tokens"]
    described = post(long_client, **options)["usage"]["prompt_tokens"]
    assert described - hidden > len(json.dumps([t["function"] for t in TOOLS]))


@pytest.mark.parametrize("description", [None, "Light a room."])
def test_auto_shows_the_functions_then_two_calls_of_the_first(
    long_client: TestClient, description: str | None
) -> None:
    """What a model whose template does not show tools is shown for auto: the functions and
    how to call one, then two exchanges that call the first function (named, then asked for by
    its description), then the conversation; the chat route's prompt is exactly that through
    the tiny model's chat template."""
    lamp = {"name": "lamp", "description": description, **TOOLS[0]["function"]}
    tools = [{"type": "function", "function": lamp}, TOOLS[1]]
    functions = [{k: v for k, v in t["function"].items() if v is not None} for t in tools]
    listed = json.dumps(functions, separators=(",", ":"))
    call = json.dumps([{"name": "lamp", "arguments": {"room": "hall"}}])  # enum: its first
    shown = [
        {"role": "system", "content": f"You can call these functions: {listed} {AUTO_INSTRUCTION}"},
        {"role": "user", "content": "Call lamp."},
        {"role": "assistant", "content": call},
        {"role": "user", "content": description or "Use lamp."},
        {"role": "assistant", "content": call},
        *USER,
    ]
    body = ChatCompletionRequest.model_validate({"messages": USER, "tools": tools})
    assert tool_messages(body.messages, tool_plan(body, False), False) == shown
    engine = long_client.app.state.server.loop.engine  # type: ignore[attr-defined]
    usage = post(long_client, messages=USER, tools=tools, max_tokens=1)["usage"]
    assert usage["prompt_tokens"] == len(engine.encode(messages=shown))


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        ({"type": "string"}, "..."),
        ({"type": "integer"}, 0),
        ({"type": "number"}, 0),
        ({"type": "boolean"}, False),
        ({"type": "array", "items": {"type": "string"}}, []),
        ({"type": "object"}, {}),
        ({"type": ["string", "null"]}, "..."),
        ({"enum": ["hall", "attic"]}, "hall"),
        ({"const": 3}, 3),
        ({}, "..."),
    ],
)
def test_the_example_call_fills_each_required_parameter_by_its_type(
    schema: dict[str, Any], value: Any
) -> None:
    parameters = {"type": "object", "properties": {"a": schema, "b": schema}, "required": ["a"]}
    tool = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": parameters}}
    )
    assert example_call(tool) == {"name": "f", "arguments": {"a": value}}


def optional_fields(model: type[BaseModel]) -> list[str]:
    return [name for name, field in model.model_fields.items() if not field.is_required()]


def nulls(schema: type[BaseModel], /, **given: Any) -> dict[str, Any]:
    """Every optional field of ``schema`` as null (by its JSON name), but those ``given``."""
    names = [schema.model_fields[n].alias or n for n in optional_fields(schema)]
    return {**dict.fromkeys(names), **given}


def test_every_optional_field_takes_null(long_client: TestClient) -> None:
    tool = {"type": "function", "function": nulls(FunctionDefinition, name="lamp")}
    message = nulls(ChatMessage, role="user", content="Hi.")
    body = nulls(ChatCompletionRequest, model=TINY_MODEL_NAME, messages=[message], max_tokens=2)
    assert post(long_client, **{**body, "tools": [tool]})["choices"][0]["message"]
    body = nulls(CompletionRequest, model=TINY_MODEL_NAME, prompt="Hi", max_tokens=2)
    assert post(long_client, "completions", **body)["choices"][0]["text"] is not None
    options = nulls(StreamOptions)
    response = long_client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": options},
    )
    assert response.status_code == 200 and sse_chunks(response.text)


def test_the_document_says_every_optional_field_takes_null(long_client: TestClient) -> None:
    schemas = long_client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "StreamOptions"):
        required = set(schemas[name].get("required", []))
        for field, schema in schemas[name]["properties"].items():
            if field in required:
                continue
            kinds = [s.get("type") for s in schema.get("anyOf", [schema])]
            assert "null" in kinds, f"{name}.{field}: {schema}"


def test_newer_fields_are_accepted_and_change_nothing(long_client: TestClient) -> None:
    plain = {"messages": USER, "max_tokens": 8, "temperature": 0}
    newer = {
        "prompt_cache_key": "conversation-1",
        "safety_identifier": "user-hash",
        "user": "someone",
        "reasoning_effort": "low",
        "verbosity": "low",
        "modalities": ["text"],
    }
    same = [post(long_client, **plain)["choices"][0]["message"]["content"]]
    same.append(post(long_client, **plain, **newer)["choices"][0]["message"]["content"])
    assert same[0] == same[1]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat/completions", {"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
        ("completions", {"prompt": "Hi", "suffix": "end"}, "suffix"),
    ],
)
def test_what_cannot_be_served_is_an_invalid_value(
    long_client: TestClient, route: str, body: dict[str, Any], param: str
) -> None:
    response = long_client.post(f"/v1/{route}", json={"max_tokens": 2, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_value",
        param,
    )
