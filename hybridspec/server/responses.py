"""``POST /v1/responses``: OpenAI's Responses API, the subset its SDK and agents SDK use, as a
chat completion.

A Responses request becomes a ``ChatCompletionRequest`` (``to_chat``): ``instructions`` a
system message; ``input`` text a user message, or items: messages (text content parts),
``function_call`` items (an assistant message's tool calls) and ``function_call_output`` items
(tool messages); function ``tools`` and ``tool_choice`` as chat's, so that the chat route's tool
machinery (``server.structured``) constrains and parses the calls; ``text.format`` as
``response_format``; ``max_output_tokens`` as ``max_completion_tokens``. Anything else (stored
responses, reasoning, other tools or content) is refused with a 400 naming the field, never
ignored. The answer (``response_object``) holds a ``message`` item with the text, or one
``function_call`` item per call; ``hybridspec``: the request's speculation statistics.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridspec.config import MAX_SPECULATIVE_TOKENS, MIN_SPECULATIVE_TOKENS
from hybridspec.errors import GrammarError, check
from hybridspec.server.protocol import (
    MAX_JSON_SEED,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    JsonInt,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    SpeculationStats,
    Tool,
    ToolCall,
    _Body,
    documented,
)

# A function's or a format's name, matched as JSON Schema validators match the document's
# ``pattern`` (``re.search``), so that the server takes exactly what the document states.
NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"


def check_name(name: str | None, field: str) -> None:
    check(
        name is None or re.search(NAME_PATTERN, name) is not None,
        field,
        f"expected 1 to 64 letters, digits, '_' or '-', got {name!r}",
    )


class _Item(BaseModel):
    """An input item; keys that clients echo back from earlier output (``id``, ``status``,
    ``annotations``...) are ignored, as in chat messages."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Item):
    """A call the model made earlier: an assistant message's tool call."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    """A call's result: a tool message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(json_schema_extra={"pattern": NAME_PATTERN})
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, json_schema_extra={"pattern": NAME_PATTERN})
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: None = None  # not supported


class ResponsesRequest(_Body):
    """``POST /v1/responses`` (module docstring). ``store``, ``metadata``, ``user``,
    ``service_tier``, ``prompt_cache_key``, ``prompt_cache_retention`` and
    ``safety_identifier`` change nothing here and are accepted; ``parallel_tool_calls`` false
    allows one call, as on the chat route; fields typed null are
    OpenAI's that this server does not serve (stored responses, reasoning...)."""

    model: str | None = None
    input: str | list[InputItem] = Field(json_schema_extra={"minItems": 1})
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, json_schema_extra={"maxItems": 64})
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    temperature: float | None = documented(minimum=0, description="0: greedy. Default 1.")
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    max_output_tokens: JsonInt | None = documented(minimum=1)
    stream: bool = False
    text: TextConfig | None = None
    include: list[str] | None = Field(default=None, max_length=0)
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    previous_response_id: None = None
    conversation: None = None
    prompt: None = None
    background: None = None
    reasoning: None = None
    context_management: None = None
    top_logprobs: None = None
    stream_options: None = None
    # hybridspec extensions, as in the chat route.
    seed: JsonInt | None = documented(minimum=0, maximum=MAX_JSON_SEED)
    proposer: str | None = None
    num_speculative_tokens: JsonInt | None = documented(
        minimum=MIN_SPECULATIVE_TOKENS, maximum=MAX_SPECULATIVE_TOKENS
    )


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that answers ``body``."""
    for index, tool in enumerate(body.tools or ()):
        check_name(tool.name, f"tools[{index}].name")
    if body.text is not None and body.text.format is not None:
        check_name(body.text.format.name, "text.format.name")
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
    else:
        for item in body.input:
            _add_item(messages, item)
    tools = None
    if body.tools:
        tools = [
            Tool(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"})))
            for t in body.tools
        ]
    choice: Any = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        temperature=body.temperature,
        top_p=body.top_p,
        max_completion_tokens=body.max_output_tokens,
        stream=body.stream,
        seed=body.seed,
        proposer=body.proposer,
        num_speculative_tokens=body.num_speculative_tokens,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
    )


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _add_item(messages: list[ChatMessage], item: InputItem) -> None:
    """Append one input item as chat messages; consecutive function calls join one assistant
    message, as chat writes a turn's parallel calls."""
    if isinstance(item, MessageItem):
        messages.append(ChatMessage(role=item.role, content=_text(item.content)))
    elif isinstance(item, FunctionCallItem):
        call = ToolCall(
            id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
        )
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
            last.tool_calls.append(call)
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    else:
        content = _text(item.output)
        messages.append(ChatMessage(role="tool", content=content, tool_call_id=item.call_id))


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    """``text.format`` as chat's ``response_format``; a name or schema only with
    ``json_schema`` (GrammarError, as chat's ``response_format`` refuses them)."""
    form = text.format if text is not None else None
    if form is None:
        return None
    if form.type != "json_schema":
        extra = [k for k in ("name", "description", "schema_", "strict") if getattr(form, k)]
        if extra:
            raise GrammarError(
                f"text.format: {extra[0].rstrip('_')} is only allowed with type 'json_schema'",
                "text.format",
            )
        return ResponseFormat(type=form.type)
    schema = JsonSchemaFormat.model_validate(
        {
            "name": form.name or "response",
            "description": form.description,
            "schema": form.schema_,
            "strict": form.strict,
        }
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments if status == "completed" else "",
        "status": status,
    }


def response_object(
    body: ResponsesRequest,
    response_id: str,
    model: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: tuple[int, int] | None = None,
    stats: SpeculationStats | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """The Response object: the request's settings echoed, ``output`` items, ``usage``
    (``(input_tokens, output_tokens)``) and the ``hybridspec`` statistics when known."""
    choice: Any = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(choice, FunctionToolChoice):
        choice = choice.model_dump()
    fields: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "tool_choice": choice,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "text": {"format": {"type": "text"}}
        if body.text is None or body.text.format is None
        else {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "store": False,
        "previous_response_id": None,
        "reasoning": None,
        "user": body.user,
        "usage": None,
    }
    if usage is not None:
        fields["usage"] = {
            "input_tokens": usage[0],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage[1],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": sum(usage),
        }
    if stats is not None:
        fields["hybridspec"] = stats.model_dump(mode="json")
    return fields


def sse(event: dict[str, Any]) -> str:
    """One server-sent event of a Responses stream: named by its ``type``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def now() -> int:
    return int(time.time())
