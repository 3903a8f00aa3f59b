"""Structured output and tools on the server: response_format, guided_regex/guided_grammar,
tools with each tool_choice, tool_calls (streamed too), and the 400s for what cannot be
served. The tiny model's chat template does not show tools, as SmolLM2's does not."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridspec.config import ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import load_model
from hybridspec.server import ServerConfig, create_app
from hybridspec.server.protocol import Tool
from hybridspec.server.structured import ToolPlan, cut_calls
from tests.conftest import save_tiny_llama
from tests.server.conftest import TINY_MODEL_NAME, tiny_engine_config

SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog", "eel"]}, "tame": {"type": "boolean"}},
    "required": ["kind", "tame"],
    "additionalProperties": False,
}
TOOLS = [  # small: the tiny model's context is 256 bytes, and they are described in it
    {
        "type": "function",
        "function": {
            "name": "lamp",
            "parameters": {
                "type": "object",
                "properties": {"room": {"enum": ["hall", "attic"]}},
                "required": ["room"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "beep",
            "parameters": {"properties": {"n": {"enum": [1, 2]}}, "required": ["n"]},
        },
    },
]
USER = [{"role": "user", "content": "Extract: a tame dog."}]


@pytest.fixture(scope="module")
def long_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """A server whose tiny model has a 1024-token context: room for tools' descriptions."""
    directory = save_tiny_llama(tmp_path_factory.mktemp("long"), max_position_embeddings=1024)
    model = load_model(ModelConfig(str(directory), dtype="float32"))
    config = ServerConfig(engine=tiny_engine_config(directory), served_model_name=TINY_MODEL_NAME)
    app = create_app(config, engine_factory=lambda cfg: Engine(cfg, target=model))
    with TestClient(app) as test_client:
        yield test_client


def chat(client: TestClient, status: int = 200, **body: Any) -> dict[str, Any]:
    request = {"model": TINY_MODEL_NAME, "messages": USER, "max_tokens": 60, "temperature": 0}
    response = client.post("/v1/chat/completions", json={**request, **body})
    assert response.status_code == status, response.text
    return response.json()


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def test_json_schema_output_parses_and_is_the_same_with_every_proposer(
    client: TestClient,
) -> None:
    contents = set()
    for proposer in ("none", "ngram", "grammar", "grammar+ngram"):
        body = chat(client, response_format=json_schema_format(SCHEMA), proposer=proposer)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop"
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"kind", "tame"} and value["kind"] in ("cat", "dog", "eel")
        contents.add(choice["message"]["content"])
    assert len(contents) == 1


def test_json_object_starts_an_object(client: TestClient) -> None:
    body = chat(client, response_format={"type": "json_object"}, max_tokens=8)
    assert body["choices"][0]["message"]["content"].startswith("{")


@pytest.mark.parametrize(
    ("field", "source", "pattern"),
    [
        ("guided_regex", "(yes|no)-[0-9]{2}!", r"(yes|no)-[0-9]{2}!"),
        ("guided_grammar", 'root ::= "<" ("ab" | "cd") ("ab" | "cd") ">"', r"<(ab|cd){2}>"),
    ],
)
def test_guided_fields_constrain_both_routes(
    client: TestClient, field: str, source: str, pattern: str
) -> None:
    completion = client.post(
        "/v1/completions",
        json={"prompt": "Answer:", "max_tokens": 30, "temperature": 0, field: source},
    )
    assert completion.status_code == 200, completion.text
    assert re.fullmatch(pattern, completion.json()["choices"][0]["text"])
    content = chat(client, **{field: source})["choices"][0]["message"]["content"]
    assert re.fullmatch(pattern, content)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
        ({"response_format": json_schema_format({"type": 5})}, "response_format"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_400(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    error = chat(client, 400, **body)["error"]
    assert error["code"] == "invalid_grammar" and error["param"] == param
    assert ".cc:" not in error["message"] and "/" not in error["message"]  # no library paths


def test_two_constraints_at_once_are_a_400(client: TestClient) -> None:
    error = chat(client, 400, guided_regex="a+", response_format={"type": "json_object"})["error"]
    assert "at most one" in error["message"] and error["code"] == "incompatible_fields"


def test_tool_choice_required_answers_calls(long_client: TestClient) -> None:
    body = chat(long_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    arguments = json.loads(call["function"]["arguments"])
    assert {"lamp": "room", "beep": "n"}[call["function"]["name"]] in arguments
    assert arguments in ({"room": "hall"}, {"room": "attic"}, {"n": 1}, {"n": 2})
    # Parallel calls: an array the random model goes on with until max_tokens cuts it. The
    # answer is the calls it made, as OpenAI answers a cut call: the last one with the
    # arguments written so far (finish_reason length); no call when it was cut before a name.
    cut = chat(long_client, tools=TOOLS, tool_choice="required", max_tokens=120)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    *complete, last = cut["message"]["tool_calls"]
    assert len(complete) == 2 and all(json.loads(c["function"]["arguments"]) for c in complete)
    assert last["function"]["name"] == "lamp" and last["function"]["arguments"] == ""
    early = chat(long_client, tools=TOOLS, tool_choice="required", max_tokens=8)["choices"][0]
    assert early["finish_reason"] == "length"
    assert early["message"] == {"role": "assistant", "content": None, "tool_calls": None}


def test_a_named_function_streams_its_call_as_deltas(long_client: TestClient) -> None:
    choice = {"type": "function", "function": {"name": "lamp"}}
    plain = chat(long_client, tools=TOOLS, tool_choice=choice)["choices"][0]["message"][
        "tool_calls"
    ]
    assert [c["function"]["name"] for c in plain] == ["lamp"]
    request = {
        "model": TINY_MODEL_NAME,
        "messages": USER,
        "max_tokens": 60,
        "temperature": 0,
        "tools": TOOLS,
        "tool_choice": choice,
        "stream": True,
    }
    with long_client.stream("POST", "/v1/chat/completions", json=request) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == plain[0]["function"]
    assert not any(delta.get("content") for delta in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    ],
)
def test_tool_choices_that_name_nothing_are_400s(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    assert chat(client, 400, **body)["error"]["param"] == param


def test_a_history_with_calls_and_results_is_accepted(long_client: TestClient) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "lamp", "arguments": '{"room": "hall"}'},
    }
    messages = [
        {"role": "user", "content": "Light the hall."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    body = chat(long_client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert body["usage"]["prompt_tokens"] > 80  # the call's JSON is in the prompt


def test_every_choice_of_every_prompt_matches_its_own_grammar(client: TestClient) -> None:
    """n sampled choices of a list of prompts: each choice is its own request, with its own
    matcher, so each text matches the pattern whatever the others drew."""
    response = client.post(
        "/v1/completions",
        json={
            "prompt": ["Answer:", "Reply:"],
            "n": 3,
            "max_tokens": 30,
            "temperature": 1.0,
            "seed": 7,
            "guided_regex": "(yes|no)-[0-9]{2}!",
        },
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        assert re.fullmatch(r"(yes|no)-[0-9]{2}!", choice["text"])
    body = chat(client, n=2, temperature=1.0, seed=3, response_format=json_schema_format(SCHEMA))
    for choice in body["choices"]:
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"kind", "tame"} and value["kind"] in ("cat", "dog", "eel")


def test_each_choice_answers_and_streams_its_own_calls(long_client: TestClient) -> None:
    function = {"type": "function", "function": {"name": "lamp"}}
    options = {"tools": TOOLS, "tool_choice": function, "n": 2, "temperature": 1.0, "seed": 5}
    plain = chat(long_client, **options)["choices"]
    assert [c["index"] for c in plain] == [0, 1]
    for choice in plain:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "lamp"
        assert json.loads(call["function"]["arguments"]) in ({"room": "hall"}, {"room": "attic"})
    request = {"model": TINY_MODEL_NAME, "messages": USER, "max_tokens": 60, "stream": True}
    with long_client.stream(
        "POST", "/v1/chat/completions", json={**request, **options}
    ) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        calls = [call for c in mine for call in c["delta"].get("tool_calls", [])]
        assert len(calls) == 1 and calls[0]["index"] == 0
        # Same seed, same choice: the streamed call is the non-streamed one.
        assert calls[0]["function"] == plain[index]["message"]["tool_calls"][0]["function"]
        assert not any(c["delta"].get("content") for c in mine)
        assert mine[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[{"name": "lamp", "arguments": {"room": "hall"}}, {"name": "lamp", "argu',
            [("lamp", '{"room": "hall"}'), ("lamp", "")],
        ),
        (
            '[ {"name": "lamp", "arguments": {"room": "hall"}} ,\n {"name": "lamp", '
            '"arguments": {"room": "attic"}}, {',
            [("lamp", '{"room": "hall"}'), ("lamp", '{"room": "attic"}')],
        ),
        ('[{"name": "lamp", "arguments": {"room": "ha', [("lamp", '{"room": "ha')]),
        ('[{"name": "be', [("beep", "")]),
        ('[{"name": "', []),
        ("[", []),
    ],
)
def test_a_cut_required_array_answers_its_calls_as_written(
    text: str, expected: list[tuple[str, str]]
) -> None:
    plan = ToolPlan("required", tuple(Tool.model_validate(t) for t in TOOLS))
    calls = cut_calls(plan, text)
    assert [(c.function.name, c.function.arguments) for c in calls or []] == expected
    # The same text under auto (no template shows the tools) is the same cut array.
    auto = cut_calls(ToolPlan("auto", plan.tools), text)
    assert [(c.function.name, c.function.arguments) for c in auto or []] == expected
    # A named function's output is its arguments: a cut one is its call, arguments so far.
    [named] = cut_calls(ToolPlan("named", plan.tools, "beep"), text) or []
    assert (named.function.name, named.function.arguments) == ("beep", text)


def test_a_cut_auto_text_is_text() -> None:
    plan = ToolPlan("auto", tuple(Tool.model_validate(t) for t in TOOLS))
    assert cut_calls(plan, "The lamp is") is None
    assert cut_calls(ToolPlan("required", plan.tools), "") == []
