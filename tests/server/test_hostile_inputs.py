"""Hostile request bodies get a 400 naming their field, quickly, never a 500 (issue 39).

Each case is one that an attacker's probe found answered with a 500 or a stall: lone
surrogates, ``$ref`` cycles, grammars that allow nothing or compile for minutes, more tools than
documented, huge echoed inputs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridspec.engine import Engine
from hybridspec.errors import InvalidRequestError
from hybridspec.model.loader import LoadedModel
from hybridspec.server import ServerConfig, create_app, inputs
from hybridspec.server.protocol import ChatCompletionRequest
from hybridspec.verifier.grammar_bounds import MAX_OPTIONAL, MAX_PROPERTIES
from tests.server.conftest import TINY_MODEL_NAME, tiny_engine_config

USER = [{"role": "user", "content": "Hi"}]
JSON = {"content-type": "application/json"}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def properties(count: int, required: bool = False) -> dict[str, Any]:
    names = [f"p{i}" for i in range(count)]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {n: {"type": "string"} for n in names},
    }
    if required:
        schema["required"] = names
    return schema


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


REF_CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
# An object that requires an object of its own type: no finite JSON satisfies it.
REQUIRED_CYCLE = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client(tiny_model: LoadedModel, tiny_model_dir: Path) -> Iterator[TestClient]:
    """One app for the module: every case is refused before it reaches the engine."""
    config = ServerConfig(
        engine=tiny_engine_config(tiny_model_dir), served_model_name=TINY_MODEL_NAME
    )
    app = create_app(config, engine_factory=lambda cfg: Engine(cfg, target=tiny_model))
    with TestClient(app) as test_client:
        yield test_client


def post(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert len(response.content) < 2000 and ".cc:" not in error["message"]
    return error


def chat_with(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, **fields}


ALTERNATIVES = "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))
NOTHING = "root ::= [^\\x00-\\U0010FFFF]"
MANY_TOOLS = [{**TOOL, "function": {"name": f"f{i}"}} for i in range(65)]
TOOL_ANSWER = {"role": "tool", "content": "4"}
FIELDS = ("response_format", "guided_regex", "guided_grammar", "tools")

CHAT_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "surrogate in a message",
        {"messages": [{"role": "user", "content": "\ud800 x"}]},
        "messages[0].content",
        "invalid_value",
    ),
    ("lone surrogate in a regex", chat_with(guided_regex="\udc62x"), FIELDS[1], "invalid_value"),
    (
        "$ref cycle",
        chat_with(response_format=schema_format(REF_CYCLE)),
        FIELDS[0],
        "invalid_grammar",
    ),
    (
        "a required $ref cycle",
        chat_with(response_format=schema_format(REQUIRED_CYCLE)),
        FIELDS[0],
        "invalid_grammar",
    ),
    ("a grammar of nothing", chat_with(guided_grammar=NOTHING), FIELDS[2], "invalid_grammar"),
    (
        "10,000 optional properties",
        chat_with(response_format=schema_format(properties(10_000))),
        FIELDS[0],
        "invalid_grammar",
    ),
    (
        "too many optional properties",
        chat_with(response_format=schema_format(properties(MAX_OPTIONAL + 1))),
        FIELDS[0],
        "invalid_grammar",
    ),
    (
        "too many properties",
        chat_with(response_format=schema_format(properties(MAX_PROPERTIES + 1, True))),
        FIELDS[0],
        "invalid_grammar",
    ),
    (
        "900 levels of arrays",
        chat_with(response_format=schema_format(nested(900))),
        FIELDS[0],
        "invalid_grammar",
    ),
    ("20,000 alternatives", chat_with(guided_grammar=ALTERNATIVES), FIELDS[2], "invalid_grammar"),
    (
        "a huge maxLength",
        chat_with(response_format=schema_format({"type": "string", "maxLength": 100_000})),
        FIELDS[0],
        "invalid_grammar",
    ),
    ("a huge regex count", chat_with(guided_regex="a{5,100000}"), FIELDS[1], "invalid_grammar"),
    (
        "65 tools",
        chat_with(tools=MANY_TOOLS, tool_choice="required"),
        FIELDS[3],
        "invalid_value",
    ),
    (
        "a tool message without its call's id",
        {"messages": [*USER, TOOL_ANSWER]},
        "messages[1].tool_call_id",
        "invalid_value",
    ),
]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [case[1:] for case in CHAT_CASES],
    ids=[case[0] for case in CHAT_CASES],
)
def test_hostile_chat_bodies_are_quick_400s_naming_the_field(
    client: TestClient, body: dict[str, Any], param: str, code: str
) -> None:
    start = time.perf_counter()
    error = post(client, "/v1/chat/completions", {**body, "max_tokens": 4})
    assert time.perf_counter() - start < 2.0
    assert (error["param"], error["code"]) == (param, code), error


def test_a_surrogate_in_a_prompt_is_a_400(client: TestClient) -> None:
    error = post(client, "/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2})
    assert error["param"] == "prompt[1]"


def test_the_text_check_walks_only_a_body_that_holds_a_surrogate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clean body, however large (10,000 properties), is cleared by pydantic's serializer
    without the Python walk that would hold the interpreter lock; a surrogate deep in a schema
    (as a value or as a key) is still named by its path, and so is one past the
    serializer's depth."""
    walked: list[str] = []
    walk = inputs._surrogate_path
    monkeypatch.setattr(
        inputs, "_surrogate_path", lambda value, path: walked.append(path) or walk(value, path)
    )
    clean = schema_format(properties(10_000))
    inputs.check_text(ChatCompletionRequest.model_validate(chat_with(response_format=clean)))
    assert walked == []
    in_value = properties(3)
    in_value["properties"]["p1"] = {"type": "string", "enum": ["a", "\udc00"]}
    in_key = properties(3)
    in_key["properties"]["\ud800"] = {"type": "string"}
    too_deep = nested(900)
    leaf = too_deep
    while "items" in leaf:
        leaf = leaf["items"]
    leaf["type"] = "\udc01"
    for schema in (in_value, in_key, too_deep):
        if schema is too_deep:
            monkeypatch.undo()  # the spy doubles the walk's frames: too deep for it
        body = json.loads(json.dumps(chat_with(response_format=schema_format(schema))))
        with pytest.raises(InvalidRequestError) as error:
            inputs.check_text(ChatCompletionRequest.model_validate(body))
        assert str(error.value.param).startswith("response_format.json_schema.schema")
    assert walked


def test_a_huge_input_is_not_echoed_back_whole(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "model": "m" * 100_000})
    assert response.status_code == 404 and len(response.content) < 2000
    assert "cut" in response.json()["error"]["message"]


def test_invalid_utf8_is_a_400_with_a_code(client: TestClient) -> None:
    response = client.post(
        "/v1/completions",
        content=b'{"prompt": "\xff\xfe", "max_tokens": 2}',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] is not None, response.text


def test_a_grammar_after_refusals_still_serves(client: TestClient) -> None:
    post(
        client,
        "/v1/chat/completions",
        {"messages": USER, "response_format": schema_format(REF_CYCLE)},
    )
    response = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 8, "guided_regex": "(yes|no)"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_schemathesis_found_regex_is_not_a_500(client: TestClient) -> None:
    """The surrogate pair schemathesis sent as ``guided_regex`` (issue 39): one character."""
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
    body += b'"guided_regex": "\\uda21\\udc62"}'
    response = client.post("/v1/chat/completions", content=body, headers=JSON)
    assert response.status_code in (200, 400), response.text
