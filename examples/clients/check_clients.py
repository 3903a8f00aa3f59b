"""Send what the openai SDK and LangChain send, to a running ``hybridspec serve``, and check
every answer.

Start a server first (``make serve``, or ``.venv/bin/hybridspec serve --port 8000``), then, from
an environment with ``openai`` and ``langchain-openai`` installed (the latter is optional: its
checks are skipped where it is missing)::

    python examples/clients/check_clients.py [--base-url http://127.0.0.1:8000/v1]

Checked, each through the client's own API: ``n=3`` (three indexed choices, the first seeded
one equal to the single request); presence, frequency and repetition penalties, ``logit_bias``,
``min_p``, ``min_tokens``; ``response_format`` json_schema strict (the answer parses and
validates); ``tools`` with ``tool_choice`` "required" and a named function (``tool_calls``,
their arguments valid for the function's schema, streamed too); a ``developer`` message and
``store=False``; a list of prompts on the completions route; greedy texts equal across the
served proposers; LangChain's ``with_structured_output(..., method="json_schema")`` returning a
parsed object, and ``bind_tools`` with a required call. Prints one line a check and exits 1 if
any failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import jsonschema
from openai import OpenAI

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "teacher", "doctor"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
TEXT = "Maria Lopez is a 41-year-old teacher from Seville."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Write one sentence about the sea."}]


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, name: str, check: Callable[[], str]) -> None:
        start = time.monotonic()
        try:
            detail = check()
        except Exception as error:  # a failed check is reported, the others still run
            self.failed.append(name)
            print(f"FAIL {name}: {type(error).__name__}: {error}")
            return
        print(f"ok   {name} ({time.monotonic() - start:.1f} s): {detail}")


def openai_checks(client: OpenAI, model: str, proposers: list[str], checks: Checks) -> None:
    def chat(**body: Any) -> Any:
        return client.chat.completions.create(model=model, **{"messages": ASK, **body})

    def n_choices() -> str:
        reply = chat(n=3, max_tokens=24, temperature=0.8, seed=7)
        single = chat(max_tokens=24, temperature=0.8, seed=7)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert reply.choices[0].message.content == single.choices[0].message.content
        assert reply.usage is not None and reply.usage.prompt_tokens == single.usage.prompt_tokens
        return f"{len({c.message.content for c in reply.choices})} distinct texts"

    def controls() -> str:
        base = chat(max_tokens=24, temperature=0)
        steered = chat(
            max_tokens=24,
            temperature=0,
            presence_penalty=1.5,
            frequency_penalty=1.0,
            logit_bias={"198": -100},
            extra_body={"min_p": 0.05, "min_tokens": 4, "repetition_penalty": 1.2},
        )
        assert steered.choices[0].message.content, "empty text"
        changed = base.choices[0].message.content != steered.choices[0].message.content
        return f"served, text {'changed' if changed else 'unchanged'} by the controls"

    def json_schema() -> str:
        reply = chat(
            messages=[{"role": "user", "content": f"Extract the person: {TEXT}"}],
            max_tokens=80,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        value = json.loads(reply.choices[0].message.content or "")
        jsonschema.validate(value, PERSON)
        return json.dumps(value)

    def tools(tool_choice: Any, stream: bool) -> Callable[[], str]:
        def check() -> str:
            body: dict[str, Any] = {
                "messages": [{"role": "user", "content": "What's the weather in Oslo?"}],
                "tools": [WEATHER],
                "tool_choice": tool_choice,
                "max_tokens": 60,
                "temperature": 0,
            }
            if not stream:
                message = chat(**body).choices[0].message
                calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            else:
                parts: dict[int, list[str]] = {}
                names: dict[int, str] = {}
                for chunk in chat(**body, stream=True):
                    for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                        if delta.function and delta.function.name:
                            names[delta.index] = delta.function.name
                        if delta.function and delta.function.arguments:
                            parts.setdefault(delta.index, []).append(delta.function.arguments)
                calls = [(names[i], "".join(parts.get(i, []))) for i in sorted(names)]
            assert calls, "no tool call"
            for name, arguments in calls:
                assert name == "get_weather", name
                jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
            return "; ".join(f"{n}({a})" for n, a in calls)

        return check

    def roles_and_fields() -> str:
        messages = [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
        ]
        reply = chat(messages=messages, max_tokens=8, store=False, user="someone", metadata={})
        return repr(reply.choices[0].message.content)

    def prompt_list() -> str:
        reply = client.completions.create(
            model=model, prompt=["The sky is", "Water is"], max_tokens=6, temperature=0, n=2
        )
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert reply.choices[0].text == reply.choices[1].text  # greedy choices agree
        return " | ".join(repr(c.text) for c in reply.choices[::2])

    def same_text_across_proposers() -> str:
        texts = {
            p: chat(max_tokens=32, temperature=0, extra_body={"proposer": p})
            .choices[0]
            .message.content
            for p in proposers
        }
        assert len(set(texts.values())) == 1, texts
        return f"{len(texts)} proposers: {', '.join(texts)}"

    checks.run("openai: n=3", n_choices)
    checks.run("openai: penalties, logit_bias, min_p, min_tokens", controls)
    checks.run("openai: response_format json_schema strict", json_schema)
    checks.run("openai: tools, tool_choice required", tools("required", stream=False))
    checks.run("openai: tools, tool_choice required, streamed", tools("required", stream=True))
    named = {"type": "function", "function": {"name": "get_weather"}}
    checks.run("openai: tools, a named function", tools(named, stream=False))
    checks.run("openai: developer role, store=False, user, metadata", roles_and_fields)
    checks.run("openai: a list of prompts with n=2", prompt_list)
    checks.run("openai: greedy text equal across proposers", same_text_across_proposers)


def langchain_checks(base_url: str, api_key: str, model: str, checks: Checks) -> None:
    try:
        from langchain_openai import ChatOpenAI
        from pydantic import BaseModel
    except ImportError:
        print("skip langchain: langchain-openai is not installed")
        return

    class Person(BaseModel):
        name: str
        age: int

    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, temperature=0, max_tokens=80)

    def structured() -> str:
        runnable = llm.with_structured_output(Person, method="json_schema")
        person = runnable.invoke(f"Extract the person: {TEXT}")
        assert isinstance(person, Person), type(person)
        return repr(person)

    def bound_tools() -> str:
        reply = llm.bind_tools([WEATHER], tool_choice="required").invoke("Weather in Oslo?")
        calls = reply.tool_calls  # type: ignore[attr-defined]
        assert calls and calls[0]["name"] == "get_weather", calls
        return repr(calls[0]["args"])

    def plain() -> str:
        return repr(llm.invoke("Say hello.").content)

    checks.run("langchain: invoke", plain)
    checks.run("langchain: with_structured_output(method='json_schema')", structured)
    checks.run("langchain: bind_tools(tool_choice='required')", bound_tools)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=300, max_retries=0)
    card = client.models.list().data[0]
    model = card.id
    served = {p["name"] for p in card.model_dump()["hybridspec"]["proposers"]}
    proposers = [p for p in ("none", "ngram", "eagle", "hybrid", "draft") if p in served]
    checks = Checks()
    openai_checks(client, model, proposers, checks)
    langchain_checks(args.base_url, args.api_key, model, checks)
    print(
        f"{len(checks.failed)} failed" + (f": {', '.join(checks.failed)}" if checks.failed else "")
    )
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
