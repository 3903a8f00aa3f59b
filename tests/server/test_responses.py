"""``POST /v1/responses`` through the openai SDK (plain, streamed, a function tool) and its
agents SDK with one tool, against a served tiny model on a loopback socket."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.server.conftest import TINY_MODEL_NAME, AppFactory, serve_in_thread

openai = pytest.importorskip("openai")

# Short: the tiny model's context (256 byte-level tokens) holds the tool's description.
WEATHER = {
    "type": "function",
    "name": "w",
    "parameters": {
        "type": "object",
        "properties": {"c": {"enum": ["Paris", "Rome"]}},  # a random model's strings run on
        "required": ["c"],
    },
}


@pytest.fixture(scope="module")
def served(make_app_module: AppFactory) -> Iterator[str]:
    with serve_in_thread(make_app_module()) as url:
        yield url


@pytest.fixture(scope="module")
def make_app_module(tiny_model: Any, tiny_model_dir: Any) -> AppFactory:
    from hybridspec.engine import Engine
    from hybridspec.server import ServerConfig, create_app
    from tests.server.conftest import tiny_engine_config

    def make() -> Any:
        config = ServerConfig(
            engine=tiny_engine_config(tiny_model_dir), served_model_name=TINY_MODEL_NAME
        )
        return create_app(config, engine_factory=lambda cfg: Engine(cfg, target=tiny_model))

    return make


def sdk(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_plain_response_matches_the_chat_completion(served: str) -> None:
    client = sdk(served)
    options: dict[str, Any] = {"model": TINY_MODEL_NAME, "temperature": 0, "max_output_tokens": 12}
    response = client.responses.create(input="Say hi", instructions="Be brief", **options)
    chat = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        temperature=0,
        max_tokens=12,
        messages=[{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say hi"}],
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected


def test_streamed_response_deltas_make_the_text(served: str) -> None:
    client = sdk(served)
    options: dict[str, Any] = {"model": TINY_MODEL_NAME, "temperature": 0, "max_output_tokens": 16}
    plain = client.responses.create(input="Count to ten", **options)
    events = list(client.responses.create(input="Count to ten", stream=True, **options))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_call_and_its_result(served: str, stream: bool) -> None:
    client = sdk(served)
    options: dict[str, Any] = {
        "model": TINY_MODEL_NAME,
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 80,  # a call, or the context full
    }
    question = {"role": "user", "content": "Weather in Paris?"}
    if stream:
        events = list(client.responses.create(input=[question], stream=True, **options))
        done = [e.item for e in events if e.type == "response.output_item.done"]
        response = events[-1].response
        assert [item.id for item in done] == [item.id for item in response.output]
    else:
        response = client.responses.create(input=[question], **options)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "w"
    assert json.loads(calls[0].arguments)["c"] in ("Paris", "Rome")
    follow_up = client.responses.create(
        input=[
            question,
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
        **{**options, "tool_choice": "none"},
    )
    assert follow_up.output[0].type == "message"


def test_parallel_tool_calls_false_allows_one_call(served: str) -> None:
    options: dict[str, Any] = {
        "model": TINY_MODEL_NAME,
        "input": "Weather in Paris and in Rome?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 80,
    }
    calls = {
        parallel: [
            item
            for item in sdk(served).responses.create(parallel_tool_calls=parallel, **options).output
            if item.type == "function_call"
        ]
        for parallel in (True, False)
    }
    assert len(calls[False]) == 1, calls[False]
    assert calls[False][0].arguments == calls[True][0].arguments  # the same first call


def test_agents_sdk_runs_one_tool(served: str) -> None:
    agents = pytest.importorskip("agents")
    called: list[str] = []

    async def weather(context: Any, arguments: str) -> str:
        city = json.loads(arguments)["c"]
        called.append(city)
        return f"sunny in {city}"

    tool = agents.FunctionTool(
        name="w",
        description="",
        params_json_schema=WEATHER["parameters"],
        on_invoke_tool=weather,
        strict_json_schema=False,
    )
    client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)
    model = agents.OpenAIResponsesModel(model=TINY_MODEL_NAME, openai_client=client)
    agent = agents.Agent(
        name="weather",
        tools=[tool],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    config = agents.RunConfig(tracing_disabled=True)
    result = asyncio.run(agents.Runner.run(agent, "Paris?", run_config=config))
    assert len(called) == 1 and result.final_output == f"sunny in {called[0]}"


def test_unsupported_fields_are_400s_naming_them(client: TestClient) -> None:
    cases = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"text": {"format": {"type": "text", "name": "x"}}}, "text.format"),
    ]
    for fields, param in cases:
        response = client.post("/v1/responses", json={"input": "hi", **fields})
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["param"].startswith(param), (fields, response.text)
