"""Structured output and tools: from a request's fields to the grammar its output must match,
and from the output back to OpenAI's ``tool_calls``.

One grammar per request, from (at most one of) ``response_format`` ``json_object`` /
``json_schema``, ``guided_regex``, ``guided_grammar`` (extensions) or ``tools`` with a
``tool_choice`` that asks for a call:

- ``required``: a JSON array of one or more calls (one when ``parallel_tool_calls`` is false),
  each ``{"name": <one of the tools>, "arguments": <that tool's parameters>}``;
- a named function: the output is that function's arguments, a JSON object of its parameters;
- ``auto`` (the default with tools), where the model's chat template shows the tools: free
  text, and a call is returned when the text is one (Hermes' ``<tool_call>`` blocks or the
  ``required`` format);
- ``auto`` where the template does not show tools (SmolLM2's): either text that does not start
  with ``[`` or whitespace, or the ``required`` array (``AUTO_TEXT``, joined to the array's
  grammar), so the model decides and every answer parses: an answer that starts with ``[`` is
  calls, any other is text;
- ``none``: free text, no call.

Where the template does not show tools, a constrained request's tools are described to the
model in a system message instead (``described_tools``): the grammar forces the call's form, the
description says what the functions are for (and, for ``auto``, how to call one, with two
example exchanges that call the first function).

A forced call cut short (by max_tokens or a stop string) is answered as OpenAI answers it: the
calls with the arguments written so far (``cut_calls``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from hybridspec.errors import GrammarError, IncompatibleFieldsError
from hybridspec.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionCall,
    Tool,
    ToolCall,
)
from hybridspec.types import GrammarSpec

ToolMode = Literal["none", "auto", "required", "named"]


def _require(condition: bool, param: str, message: str) -> None:
    """IncompatibleFieldsError (code ``incompatible_fields``) unless ``condition``: what tools,
    tool_choice and the output-format fields ask together, which no request schema states."""
    if not condition:
        raise IncompatibleFieldsError(f"{param}: {message}", param)


HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
# A call of the ``required`` array, cut short: its name so far, whether the name is complete,
# and its arguments so far (the grammar writes JSON with ``", "`` and ``": "``).
CUT_CALL = re.compile(
    r'\{"name": "(?P<name>[^"]*)(?P<closed>")?(?:, "arguments": (?P<args>.*))?', re.DOTALL
)
# ``auto`` without a template that shows tools: a text answer is empty or starts with anything
# but ``[`` (which starts the call array) or whitespace (which would hide it).
AUTO_TEXT = r'root ::= "" | [^\[ \t\r\n] [^]*'
# The example call's value of each parameter type (``example_call``).
PLACEHOLDERS: dict[str, Any] = {
    "string": "...",
    "integer": 0,
    "number": 0,
    "boolean": False,
    "array": [],
    "object": {},
    "null": None,
}
AUTO_INSTRUCTION = (
    'To call functions, answer with only a JSON array of calls: [{"name": <a function>, '
    '"arguments": <its arguments>}]. Otherwise answer in text.'
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a request's ``tools`` shape its output and its answer."""

    mode: ToolMode
    tools: tuple[Tool, ...]
    named: str | None = None  # the function of a named tool_choice
    shown: bool = False  # the chat template shows the tools to the model

    @property
    def constrains(self) -> bool:
        """True when a grammar shapes the output: ``required``, a named function, or ``auto``
        where the template does not show the tools (text or the call array)."""
        return self.mode in ("required", "named") or (self.mode == "auto" and not self.shown)

    @property
    def answers_array(self) -> bool:
        """True when a call answer is the ``required`` array of calls."""
        return self.mode == "required" or (self.mode == "auto" and not self.shown)

    def schemas(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's ``tools`` entries)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def tool_plan(body: ChatCompletionRequest, renders_tools: bool) -> ToolPlan | None:
    """The request's tool plan; None without tools. Raises for a choice it cannot serve."""
    choice = body.tool_choice
    if not body.tools:
        _require(choice in (None, "none"), "tool_choice", "a tool_choice needs tools")
        return None
    names = [tool.function.name for tool in body.tools]
    _require(len(set(names)) == len(names), "tools", f"function names repeat: {names}")
    if choice is None or isinstance(choice, str):
        return ToolPlan(choice or "auto", tuple(body.tools), shown=renders_tools)
    named = choice.function.name
    _require(
        named in names, "tool_choice", f"names {named!r}, which is not among the tools {names}"
    )
    return ToolPlan("named", tuple(body.tools), named, shown=renders_tools)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def grammar_source(
    body: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None
) -> tuple[str, GrammarSpec | None]:
    """The field the output's grammar comes from (what its errors name) and the grammar, or
    None for free text."""
    specs: dict[str, GrammarSpec] = {}
    if isinstance(body, ChatCompletionRequest) and body.response_format is not None:
        form = body.response_format
        schema = form.json_schema.schema_ if form.json_schema is not None else None
        _require(
            form.type == "json_schema" or form.json_schema is None,
            "response_format",
            f"json_schema is only allowed with type 'json_schema', not {form.type!r}",
        )
        _require(
            form.type != "json_schema" or form.json_schema is not None,
            "response_format",
            "type 'json_schema' needs a json_schema object",
        )
        if form.type == "json_object" or (form.type == "json_schema" and schema is None):
            specs["response_format"] = GrammarSpec("json_object")
        elif form.type == "json_schema":
            specs["response_format"] = GrammarSpec("json_schema", json.dumps(schema))
    if body.guided_regex is not None:
        specs["guided_regex"] = GrammarSpec("regex", body.guided_regex)
    if body.guided_grammar is not None:
        specs["guided_grammar"] = GrammarSpec("grammar", body.guided_grammar)
    if tools is not None and tools.constrains:
        parallel = isinstance(body, ChatCompletionRequest) and body.parallel_tool_calls is not False
        calls = json.dumps(_call_schema(tools, parallel))
        if tools.mode == "auto":
            specs["tool_choice"] = GrammarSpec("grammar", _text_or_calls(calls))
        else:
            specs["tool_choice"] = GrammarSpec("json_schema", calls)
    _require(
        len(specs) <= 1,
        sorted(specs)[-1] if specs else "response_format",
        f"at most one of {sorted(specs)} may constrain the output",
    )
    return next(iter(specs.items()), ("response_format", None))


def _call_schema(tools: ToolPlan, parallel: bool) -> dict[str, Any]:
    if tools.mode == "named":
        [tool] = [t for t in tools.tools if t.function.name == tools.named]
        return _parameters(tool)
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [tool.function.name]},
                "arguments": _parameters(tool),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools.tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _text_or_calls(schema: str) -> str:
    """The EBNF grammar of ``auto`` without a template that shows tools: ``AUTO_TEXT`` or the
    call array of ``schema``, in the compact JSON that ``verifier.grammar`` compiles."""
    import xgrammar as xgr  # on first use, as verifier.grammar does

    try:
        calls = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except Exception as exc:  # xgrammar's errors have no common base class
        raise GrammarError(
            f"tools: the functions' parameters do not compile: {exc}", "tools"
        ) from None
    return str(xgr.Grammar.union(calls, xgr.Grammar.from_ebnf(AUTO_TEXT)))


def tool_messages(
    messages: list[ChatMessage], tools: ToolPlan | None, renders_tools: bool
) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: ``tool_calls`` with their arguments as
    objects, ``tool_call_id`` on tool results; a ``developer`` message is a ``system`` one.
    Where the template does not show tools (or calls), a constrained request's tools are
    described in a system message and earlier calls are written as their JSON."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": content or "",
        }
        if message.tool_calls:
            calls = [_call_dict(call) for call in message.tool_calls]
            entry["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            if not renders_tools and not content:
                entry["content"] = json.dumps(calls)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    if tools is not None and tools.constrains and not renders_tools:
        out[0:0] = described_tools(tools)
    return out


def described_tools(tools: ToolPlan) -> list[dict[str, Any]]:
    """The messages that show a constrained request's tools to a model whose template does not:
    a system message with the functions (and, for ``auto``, how to call one), then, for
    ``auto``, two example exchanges: a user naming the first function, then one saying what
    it does (its description), each answered by a call of it (``example_call``). A model never
    trained on calls (SmolLM2-135M) almost never starts an answer with ``[`` from the
    instruction alone; calls in the conversation are what make it call when a request asks
    for a function (docs/tools.md: how often, on each agent framework's loop)."""
    functions = [tool.function.model_dump(exclude_none=True) for tool in tools.tools]
    described = f"You can call these functions: {json.dumps(functions, separators=(',', ':'))}"
    if tools.mode != "auto":
        return [{"role": "system", "content": described}]
    first = tools.tools[0].function
    call = json.dumps([example_call(tools.tools[0])])
    return [
        {"role": "system", "content": f"{described} {AUTO_INSTRUCTION}"},
        {"role": "user", "content": f"Call {first.name}."},
        {"role": "assistant", "content": call},
        {"role": "user", "content": first.description or f"Use {first.name}."},
        {"role": "assistant", "content": call},
    ]


def example_call(tool: Tool) -> dict[str, Any]:
    """A call of ``tool`` in the ``required`` format, each required parameter a placeholder of
    its type: ``{"name": "get_weather", "arguments": {"city": "..."}}``."""
    parameters = _parameters(tool)
    properties = parameters.get("properties") or {}
    required = parameters.get("required", list(properties))
    arguments = {
        name: _placeholder(schema)
        for name, schema in properties.items()
        if name in required and isinstance(schema, dict)
    }
    return {"name": tool.function.name, "arguments": arguments}


def _placeholder(schema: dict[str, Any]) -> Any:
    """A value of ``schema``'s type that stands for "fill this in"."""
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    return PLACEHOLDERS.get(kind, "...") if isinstance(kind, str) else "..."


def _call_dict(call: ToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return {"name": call.function.name, "arguments": arguments}


def tool_calls(tools: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls that ``text`` makes, or None when it makes none (free text, or a call cut
    short: ``cut_calls``)."""
    try:
        if tools.mode == "named":
            assert tools.named is not None
            return [_tool_call(tools.named, json.loads(text))]
        if tools.answers_array and (tools.mode == "required" or text.startswith("[")):
            return [_tool_call(call["name"], call["arguments"]) for call in json.loads(text)]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if tools.mode == "auto" and tools.shown:
        return _free_calls(tools, text)
    return None


def cut_calls(tools: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls of a forced call cut short (by max_tokens or a stop string), as OpenAI
    answers one: the complete calls, then the cut one with its arguments written so far (a
    prefix of JSON). [] when it was cut before its function's name was known; None when the
    output is not a call (an ``auto`` text answer)."""
    if tools.mode == "named":
        assert tools.named is not None
        return [_raw_call(tools.named, text)]
    if not tools.answers_array or not text.startswith("["):
        return None if tools.mode != "required" else []
    decoder, calls = json.JSONDecoder(), []
    position = 1
    while True:
        try:
            call, end = decoder.raw_decode(text, _skip_space(text, position))
            calls.append(_tool_call(call["name"], call["arguments"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            break
        position = _skip_space(text, end)
        if not text.startswith(",", position):
            return calls
        position += 1
    cut = CUT_CALL.match(text, _skip_space(text, position))
    if cut is not None:
        names = [t.function.name for t in tools.tools if t.function.name.startswith(cut["name"])]
        if cut["closed"] or len(names) == 1:
            # The grammar allows only the tools' names: a prefix of one of them is that one.
            name = cut["name"] if cut["closed"] else names[0]
            calls.append(_raw_call(name, cut["args"] or ""))
    return calls


def _skip_space(text: str, position: int) -> int:
    return len(text) - len(text[position:].lstrip())


def _free_calls(tools: ToolPlan, text: str) -> list[ToolCall] | None:
    """Calls in free text: Hermes' ``<tool_call>{...}</tool_call>`` blocks, or the whole text
    in the ``required`` format; each must name one of the tools."""
    names = {tool.function.name for tool in tools.tools}
    found = [m.group(1) for m in HERMES_CALL.finditer(text)] or [text]
    calls = []
    for piece in found:
        try:
            value = json.loads(piece)
        except json.JSONDecodeError:
            return None
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or call.get("name") not in names:
                return None
            calls.append(_tool_call(call["name"], call.get("arguments", {})))
    return calls or None


def _tool_call(name: str, arguments: Any) -> ToolCall:
    return _raw_call(name, json.dumps(arguments))


def _raw_call(name: str, arguments: str) -> ToolCall:
    """A call whose ``arguments`` are JSON text as written (a cut call's: a prefix of it)."""
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments)
    )
