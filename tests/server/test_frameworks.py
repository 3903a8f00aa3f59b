"""Agent frameworks' default tool loops against the server, on a real socket: the openai SDK
without ``tool_choice``, LangChain ``bind_tools`` + ``ToolMessage``, a pydantic-ai ``Agent``,
the OpenAI Agents SDK with a chat-completions model, and instructor's ``PARALLEL_TOOLS``.

Each sends tools without ``tool_choice`` (so ``auto``) to the tiny model, whose chat template
does not show tools (as SmolLM2's does not); the scripted model (``tests.server.scripted``)
calls the first tool, then answers the tool's result with ``ANSWER``. What is tested is the
loop's shape: the call arrives as ``tool_calls`` the framework runs, and the turn with the
result answers with text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from hybridspec.config import ModelConfig
from hybridspec.engine import Engine
from hybridspec.model.loader import load_model
from hybridspec.server import ServerConfig, create_app
from tests.conftest import save_tiny_llama
from tests.server.conftest import TINY_MODEL_NAME, serve_in_thread, tiny_engine_config
from tests.server.scripted import ANSWER, scripted

QUESTION = "What is the weather in Paris?"
KEY = "unused"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The scripted tiny model served on a loopback port; its context holds tools' texts."""
    directory = save_tiny_llama(tmp_path_factory.mktemp("agents"), max_position_embeddings=2048)
    model = scripted(load_model(ModelConfig(str(directory), dtype="float32")))
    config = ServerConfig(engine=tiny_engine_config(directory), served_model_name=TINY_MODEL_NAME)
    app = create_app(config, engine_factory=lambda cfg: Engine(cfg, target=model))
    with serve_in_thread(app) as url:
        yield f"{url}/v1"


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_openai_sdk_without_tool_choice(base_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=messages, tools=[WEATHER_TOOL]
    ).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    [call] = first.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert call.function.arguments == '{"city": "Paris"}'  # type: ignore[union-attr]
    messages.append(first.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather("Paris")})
    second = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=messages, tools=[WEATHER_TOOL]
    ).choices[0]
    assert (second.finish_reason, second.message.content) == ("stop", ANSWER)


def test_langchain_bind_tools_and_tool_message(base_url: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=TINY_MODEL_NAME, base_url=base_url, api_key=KEY, max_retries=0)
    bound = llm.bind_tools([get_weather])
    messages: list[Any] = [HumanMessage(QUESTION)]
    ai = bound.invoke(messages)
    [call] = ai.tool_calls  # type: ignore[attr-defined]
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    messages += [ai, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    assert bound.invoke(messages).content == ANSWER


def test_pydantic_ai_agent_with_a_tool(base_url: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        TINY_MODEL_NAME, provider=OpenAIProvider(base_url=base_url, api_key=KEY)
    )
    agent = Agent(model)
    cities: list[str] = []

    @agent.tool_plain
    def weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return get_weather(city)

    assert agent.run_sync(QUESTION).output == ANSWER
    assert cities == ["Paris"]


def test_openai_agents_sdk_with_a_chat_completions_model(base_url: str) -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return get_weather(city)

    client = AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    model = OpenAIChatCompletionsModel(model=TINY_MODEL_NAME, openai_client=client)
    agent = Agent(name="weather", instructions="Answer briefly.", tools=[weather], model=model)
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=3))
    assert result.final_output == ANSWER
    assert cities == ["Paris"]


class Weather(BaseModel):
    city: str


def test_instructor_parallel_tools(base_url: str) -> None:
    instructor = pytest.importorskip("instructor")  # installed without its pins (Makefile)
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(base_url=base_url, api_key=KEY, max_retries=0), mode=instructor.Mode.PARALLEL_TOOLS
    )
    found = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        response_model=Iterable[Weather],
        messages=[{"role": "user", "content": QUESTION}],
        max_retries=0,
    )
    assert list(found) == [Weather(city="Paris")]
