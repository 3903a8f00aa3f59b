"""Checks of a request body that its JSON schema cannot state, made before any work.

- Text must be encodable as UTF-8: JSON may carry a lone surrogate (``"\\ud800"``), which no
  tokenizer or grammar compiler takes; it is a 400 naming the field where it was found.
- At most ``MAX_TOOLS`` tools (the OpenAPI document states it; each tool adds to the grammar
  of a constrained call and to the prompt).
- A ``tool`` message answers a call, so it names it (``tool_call_id``), as OpenAI requires.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from hybridspec.errors import InvalidRequestError, check
from hybridspec.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_TOOLS = 64


def check_body(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Raise InvalidRequestError naming the field for what ``check_body``'s module refuses."""
    check_text(body)
    if isinstance(body, ChatCompletionRequest):
        tools = body.tools or []
        check(len(tools) <= MAX_TOOLS, "tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
        for i, message in enumerate(body.messages):
            check(
                message.role != "tool" or message.tool_call_id is not None,
                f"messages[{i}].tool_call_id",
                "a tool message answers a call: it needs the call's tool_call_id",
            )


def check_text(body: BaseModel) -> None:
    """InvalidRequestError naming the first field of ``body`` (any route's) whose text holds
    a lone surrogate.

    pydantic's serializer (compiled) first tells whether any text does: it refuses to encode a
    lone surrogate as UTF-8. Only then, or where it gives up (nesting past its depth), does
    ``_surrogate_path`` walk the body in Python to name the field: a walk over every value of
    a huge schema holds the interpreter lock for a tenth of a second or more, pausing every
    stream, where serializing it takes about a millisecond."""
    try:
        body.model_dump_json()
        return
    except ValueError:  # PydanticSerializationError: a surrogate, or nesting too deep
        pass
    path = _surrogate_path(body, "")
    if path is not None:
        raise InvalidRequestError(
            f"{path}: the text holds a lone UTF-16 surrogate, which is not a character", path
        )


def _surrogate_path(value: Any, path: str) -> str | None:
    """The field path of the first string that does not encode as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    # Plain JSON before models: a model check goes through ABCMeta, slow where many models exist
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", item) for i, item in enumerate(value))
    elif isinstance(value, BaseModel):
        items = ((name, getattr(value, name)) for name in type(value).model_fields)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and not key.startswith("["):
            key_path = f"{path}.{key}" if path else key
            if _surrogate_path(key, key_path) is not None:
                return key_path
        else:
            key_path = f"{path}{key}"
        found = _surrogate_path(item, key_path)
        if found is not None:
            return found
    return None
