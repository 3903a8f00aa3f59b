"""Five agent frameworks' default tool loops against ``hybridspec serve`` on the embedded model:
how often the model calls the tool, answers in text, or the loop fails.

Run from the repository root with the environment's interpreter, e.g.::

    .venv/bin/python benchmarks/experiments/grammar/agent_loops.py
    .venv/bin/python benchmarks/experiments/grammar/agent_loops.py --tries 3 \
        --frameworks instructor openai

One run starts ``python -m hybridspec.cli serve`` with its defaults (the embedded
SmolLM2-135M-Instruct; a child process on a free loopback port), or uses ``--url``'s server,
and runs each framework's loop as a new user would write it, with one tool (the weather in a
city) and no ``tool_choice`` (so ``auto``), once per prompt of ``PROMPTS`` (each plainly asks
for the tool), cycled to ``--tries``:

- ``openai``: the openai SDK, ``chat.completions.create(tools=...)``, then the tool's result
  when the answer finished with ``tool_calls`` (one cut by max_tokens holds partial arguments);
- ``langchain``: ``ChatOpenAI.bind_tools``, ``invoke``, then a ``ToolMessage``;
- ``pydantic-ai``: an ``Agent`` with the tool (``tool_plain``), ``run_sync``;
- ``agents``: the OpenAI Agents SDK, an ``Agent`` on ``OpenAIChatCompletionsModel``;
- ``instructor``: ``Mode.PARALLEL_TOOLS`` with ``response_model=Iterable[Weather]`` (its loop
  is the one request: the call is the answer, there is no next turn).

Every request goes through an httpx event hook that records its answer: a try's first request
is a ``call`` (``finish_reason`` ``tool_calls``), ``text``, or an HTTP error; a request that
carries a tool result is a next turn, whose status is reported. A framework that raises is a
failure, counted with its exception. The agent loops are capped at ``MAX_TURNS`` requests (a
model that calls the tool on every turn would otherwise run to each framework's own limit).
``--plain`` then asks questions that need no tool, with the tool attached (openai SDK), to
check that they still get text. Sampling is the server's default (temperature 1), so figures
are rates over tries, not a greedy pin. ``--max-tokens`` bounds every request (a text answer
cut short is still a text answer; a call is far shorter), so that a run ends in minutes.

``--first-tokens N`` measures the model's choice alone, cheaply: each framework's first
request for each prompt (its body captured from the framework without a server), sent with
``max_tokens`` 1 and ``logprobs``, once greedy and with ``n`` = N at the request's own
settings; a first token that starts with ``[`` begins a call. ``plain`` is the openai SDK's
request for the questions that need no tool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from hybridspec.bench import ServerSpec, running

KEY = "unused"
MAX_TURNS = 3
# Each request's max_tokens (--max-tokens; None: not set, the server's default): bounds a
# rambling text answer.
MAX_TOKENS: list[int | None] = [256]
# Each client's timeout in seconds (--timeout).
TIMEOUT = [600.0]
PROMPTS = (
    "What is the weather in Paris?",
    "Use the weather tool to look up the weather in Tokyo.",
    "Check the current weather in London for me.",
    "Is it raining in Berlin right now? Look it up.",
    "Call the weather function for New York.",
    "I need today's weather in Madrid.",
)
PLAIN = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
)
FRAMEWORKS = ("openai", "langchain", "pydantic-ai", "agents", "instructor")


def weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny, 21 C in {city}"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class Weather(BaseModel):
    """The current weather in a city."""

    city: str = Field(description="the city")


@dataclass(frozen=True, slots=True)
class Answer:
    """One chat request's answer: ``call``, ``text``, ``length`` (cut by max_tokens or the
    context) or ``HTTP <status>``; its completion tokens and seconds."""

    kind: str
    completion_tokens: int
    seconds: float

    def __str__(self) -> str:
        return f"{self.kind}:{self.completion_tokens}t/{self.seconds:.0f}s"


@dataclass
class Recorder:
    """What each chat request of the current try answered (the httpx hooks fill it)."""

    first: list[str] = field(default_factory=list)  # "call", "text" or "HTTP <status>"
    next_statuses: list[int] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)  # every request's, in order

    def record(self, request: httpx.Request, response: httpx.Response) -> None:
        if not request.url.path.endswith("/chat/completions"):
            return
        self.answers.append(answer_of(response))
        body = json.loads(request.content or b"{}")
        if any(m.get("role") == "tool" for m in body.get("messages", [])):
            self.next_statuses.append(response.status_code)
            return
        if self.first:  # a retry (instructor) or a later turn without a tool result
            return
        if response.status_code != 200:
            self.first.append(f"HTTP {response.status_code}")
            return
        choice = response.json()["choices"][0]
        self.first.append("call" if choice["message"].get("tool_calls") else "text")

    def client(self) -> httpx.Client:
        def hook(response: httpx.Response) -> None:
            response.read()
            self.record(response.request, response)

        return httpx.Client(event_hooks={"response": [hook]}, timeout=TIMEOUT[0])

    def async_client(self) -> httpx.AsyncClient:
        async def hook(response: httpx.Response) -> None:
            await response.aread()
            self.record(response.request, response)

        return httpx.AsyncClient(event_hooks={"response": [hook]}, timeout=TIMEOUT[0])


def answer_of(response: httpx.Response) -> Answer:
    seconds = response.elapsed.total_seconds()
    if response.status_code != 200:
        return Answer(f"HTTP {response.status_code}", 0, seconds)
    body = response.json()
    choice = body["choices"][0]
    kind = "call" if choice["message"].get("tool_calls") else "text"
    kind = "length" if choice["finish_reason"] == "length" else kind
    return Answer(kind, int(body["usage"]["completion_tokens"]), seconds)


def bound() -> dict[str, int]:
    """``max_tokens`` as a keyword, only when set: a framework's default sends none."""
    return {} if MAX_TOKENS[0] is None else {"max_tokens": MAX_TOKENS[0]}


Loop = Callable[[str, str, str, Recorder], None]  # base URL, model, prompt, recorder


def run_openai(base: str, model: str, prompt: str, rec: Recorder) -> None:
    from openai import OpenAI

    client = OpenAI(
        base_url=base, api_key=KEY, max_retries=0, timeout=TIMEOUT[0], http_client=rec.client()
    )
    messages: list[Any] = [{"role": "user", "content": prompt}]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], **bound()
    )
    choice = answer.choices[0]
    message = choice.message
    if choice.finish_reason != "tool_calls" or not message.tool_calls:
        return  # text, or a call that max_tokens cut mid-arguments: nothing to run
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        city = json.loads(call.function.arguments).get("city", "")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": weather(city)})
    client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], **bound())


def run_langchain(base: str, model: str, prompt: str, rec: Recorder) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=model,
        base_url=base,
        api_key=KEY,
        max_retries=0,
        timeout=TIMEOUT[0],
        http_client=rec.client(),
        max_tokens=MAX_TOKENS[0],
    )
    bound = llm.bind_tools([weather])
    messages: list[Any] = [HumanMessage(prompt)]
    ai = bound.invoke(messages)
    if not ai.tool_calls:
        return
    messages.append(ai)
    for call in ai.tool_calls:
        messages.append(ToolMessage(weather(**call["args"]), tool_call_id=call["id"]))
    bound.invoke(messages)


def run_pydantic_ai(base: str, model: str, prompt: str, rec: Recorder) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, UsageLimits
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(
        base_url=base, api_key=KEY, timeout=TIMEOUT[0], http_client=rec.async_client()
    )
    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client)))
    agent.tool_plain(weather)
    agent.run_sync(
        prompt,
        usage_limits=UsageLimits(request_limit=MAX_TURNS),
        model_settings={"max_tokens": MAX_TOKENS[0]},
    )


def run_agents(base: str, model: str, prompt: str, rec: Recorder) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(
        base_url=base,
        api_key=KEY,
        max_retries=0,
        timeout=TIMEOUT[0],
        http_client=rec.async_client(),
    )
    chat_model = OpenAIChatCompletionsModel(model=model, openai_client=client)
    settings = ModelSettings(max_tokens=MAX_TOKENS[0])
    agent = Agent(
        name="assistant", tools=[function_tool(weather)], model=chat_model, model_settings=settings
    )
    asyncio.run(Runner.run(agent, prompt, max_turns=MAX_TURNS))


def run_instructor(base: str, model: str, prompt: str, rec: Recorder) -> None:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(
            base_url=base, api_key=KEY, max_retries=0, timeout=TIMEOUT[0], http_client=rec.client()
        ),
        mode=instructor.Mode.PARALLEL_TOOLS,
    )
    found = client.chat.completions.create(
        model=model,
        response_model=Iterable[Weather],
        messages=[{"role": "user", "content": prompt}],
        **bound(),
    )
    list(found)


LOOPS: dict[str, Loop] = {
    "openai": run_openai,
    "langchain": run_langchain,
    "pydantic-ai": run_pydantic_ai,
    "agents": run_agents,
    "instructor": run_instructor,
}


@dataclass
class Tally:
    """One framework's tries."""

    first: Counter[str] = field(default_factory=Counter)
    next_statuses: Counter[int] = field(default_factory=Counter)
    raised: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def row(self, name: str, tries: int) -> str:
        calls, texts = self.first["call"], self.first["text"]
        errors = sum(n for k, n in self.first.items() if k.startswith("HTTP"))
        statuses = ", ".join(f"{s}x{n}" for s, n in sorted(self.next_statuses.items())) or "-"
        raised = "; ".join(f"{k} x{n}" for k, n in self.raised.most_common()) or "-"
        return (
            f"| {name} | {calls}/{tries} | {texts}/{tries} | {errors} | "
            f"{sum(self.raised.values())} | {statuses} | {raised} | {self.seconds:.0f} |"
        )


def short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:140]}"


def run_framework(
    name: str, base: str, model: str, tries: int, verbose: bool, first: int = 0
) -> Tally:
    tally = Tally()
    start = time.perf_counter()
    for i in range(first, first + tries):
        prompt = PROMPTS[i % len(PROMPTS)]
        began = time.perf_counter()
        rec = Recorder()
        try:
            LOOPS[name](base, model, prompt, rec)
        except Exception as exc:  # the failure is the finding: count it, go on
            tally.raised[short(exc)] += 1
            if verbose:
                traceback.print_exc()
        tally.first.update(rec.first or ["none"])
        tally.next_statuses.update(rec.next_statuses)
        answers = " ".join(str(a) for a in rec.answers)
        print(
            f"  {name} {i}: {rec.first} next {rec.next_statuses}; requests [{answers}]; "
            f"{time.perf_counter() - began:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    tally.seconds = time.perf_counter() - start
    return tally


class Capture(Recorder):
    """A recorder whose clients never reach a server: each chat request's body is kept and
    answered with the text ``ok`` (so every loop ends after its first request)."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []

    def _answer(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content or b"{}"))
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m"}
        return httpx.Response(200, json={**body, "choices": [choice], "usage": usage})

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self._answer))

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self._answer))


def first_request(name: str, model: str, prompt: str) -> dict[str, Any]:
    """The body of the first chat request that framework ``name``'s loop sends for ``prompt``."""
    capture = Capture()
    with contextlib.suppress(Exception):  # instructor raises on the text answer
        LOOPS[name]("http://127.0.0.1:1/v1", model, prompt, capture)
    return capture.bodies[0]


def probe(name: str, base: str, model: str, samples: int) -> tuple[int, int, int, int]:
    """The first token of each prompt's first request, greedy and ``samples`` times sampled
    (the request's own settings, ``max_tokens`` 1): greedy calls, sampled calls (a first token
    that starts with ``[``), and the counts of each."""
    greedy = sampled = total = 0
    prompts = PLAIN if name == "plain" else PROMPTS
    with httpx.Client(timeout=TIMEOUT[0]) as client:
        for prompt in prompts:
            body = first_request("openai" if name == "plain" else name, model, prompt)
            for n, extra in ((1, {"temperature": 0}), (samples, {})):
                request = {**body, **extra, "n": n, "max_tokens": 1, "logprobs": True}
                request.pop("max_completion_tokens", None)  # LangChain's name for max_tokens
                answer = client.post(f"{base}/chat/completions", json=request)
                answer.raise_for_status()
                tokens = [c["logprobs"]["content"][0]["token"] for c in answer.json()["choices"]]
                calls = sum(token.startswith("[") for token in tokens)
                if n == 1:
                    greedy += calls
                else:
                    sampled, total = sampled + calls, total + len(tokens)
    return greedy, len(prompts), sampled, total


def run_plain(base: str, model: str) -> Counter[str]:
    """The answers (``call`` or ``text``) to questions that need no tool, the tool attached."""
    found: Counter[str] = Counter()
    for question in PLAIN:
        rec = Recorder()
        with contextlib.suppress(Exception):
            run_openai(base, model, question, rec)
        found.update(rec.first or ["none"])
    return found


@contextlib.contextmanager
def server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    command = [sys.executable, "-m", "hybridspec.cli", "serve", "--host", "127.0.0.1"]
    spec = ServerSpec("hybridspec", lambda port: [*command, "--port", str(port)], ours=True)
    with tempfile.TemporaryDirectory() as tmp, running(spec, Path(tmp) / "serve.log") as base:
        yield base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=6, help="loops per framework")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--plain", action="store_true", help="also ask questions needing no tool")
    parser.add_argument(
        "--first-tokens",
        type=int,
        default=0,
        metavar="N",
        help="instead of the loops: each framework's first request's first token, greedy and "
        "N times sampled (the model's choice between a call and text)",
    )
    parser.add_argument("--url", default=None, help="a running server instead of a new one")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS[0],
        help="each request's bound; 0: none (instructor raises on a text answer cut short)",
    )
    parser.add_argument(
        "--timeout", type=float, default=TIMEOUT[0], help="each client's timeout in seconds"
    )
    parser.add_argument("--start", type=int, default=0, help="the first prompt's index")
    parser.add_argument("--verbose", action="store_true", help="print each failure's traceback")
    args = parser.parse_args()
    MAX_TOKENS[0] = args.max_tokens or None
    TIMEOUT[0] = args.timeout
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on a kill too

    with server(args.url) as url:
        base = f"{url}/v1"
        model = httpx.get(f"{base}/models").json()["data"][0]["id"]
        if args.first_tokens:
            print("| framework | greedy first token a call | sampled first tokens calls |")
            print("| --- | --- | --- |")
            for name in [*args.frameworks, "plain"]:
                greedy, prompts, sampled, total = probe(name, base, model, args.first_tokens)
                print(f"| {name} | {greedy}/{prompts} | {sampled}/{total} |", flush=True)
            return
        tallies = {
            n: run_framework(n, base, model, args.tries, args.verbose, args.start)
            for n in args.frameworks
        }
        plain = run_plain(base, model) if args.plain else None
    load = os.getloadavg()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; model {model}; "
        f"load average {load[0]:.2f} {load[1]:.2f}"
    )
    print(
        "| framework | calls | text answers | HTTP errors | raised | next turn | what raised | s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, tally in tallies.items():
        print(tally.row(name, args.tries))
    if plain is not None:
        print(f"questions needing no tool ({len(PLAIN)}): {dict(plain)}")


if __name__ == "__main__":
    main()
