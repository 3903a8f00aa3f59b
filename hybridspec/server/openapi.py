"""The OpenAPI document, made to describe exactly what the server does.

FastAPI derives most of it from the routes and the pydantic models of ``server.protocol``;
this module adds what derivation misses and takes out what is not true here:

- every status code each route answers, with the OpenAI error body (``error_responses``), and
  both content types of a completion: JSON, or server-sent events when ``stream`` is true
  (each event's data a chunk, an error body or ``[DONE]``);
- FastAPI's 422 is removed from every operation: validation errors are 400s here
  (``server.errors``);
- facts of the served model, once it is loaded: the proposers a request may name (an enum),
  the largest token id a prompt may hold, the most choices per prompt (``n``: the engine's
  slots) and prompts per request (its queue and slots);
- with an API key configured, the bearer security scheme and a 401 on every operation.

The schema is built on first use after start-up and then kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from hybridspec.server.protocol import ChatCompletionChunk, CompletionChunk, ErrorResponse
from hybridspec.server.state import ModelInfo

REF = "#/components/schemas/"

STATUS_DESCRIPTIONS = {
    400: "Invalid request: a field's value, type or an unknown field (OpenAI error body)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    408: "The request body did not arrive within the server's read timeout",
    413: "Request body over the server's limit",
    429: "The tenant has as many requests waiting as the server lets one tenant (Retry-After)",
    500: "The request failed inside the server; the message carries a request id",
    503: (
        "Overloaded: the request queue is full or too many grammars are compiling "
        "(Retry-After); the server is shutting down; or the engine does not answer"
    ),
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of a route for these error status codes."""
    return {
        code: {"model": ErrorResponse, "description": STATUS_DESCRIPTIONS[code]} for code in codes
    }


GENERATION_ERRORS = error_responses(400, 404, 408, 413, 429, 500, 503)
# The chunk model of each streamed route's events (a text completion streams CompletionResponse
# chunks, as OpenAI's legacy API does).
STREAM_CHUNKS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionChunk,
    "/v1/chat/completions": ChatCompletionChunk,
}


def install_openapi(app: FastAPI, api_key_required: bool) -> None:
    """Make ``app.openapi()`` build the exact document (module docstring)."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, routes=app.routes, description=app.description
        )
        _drop_validation_errors(schema)
        _add_event_streams(schema)
        if api_key_required:
            _require_bearer(schema)
        state = getattr(app.state, "server", None)
        if state is None:
            return schema  # before start-up: the model's facts are not known yet; not kept
        _add_model_facts(schema, state.model)
        app.openapi_schema = schema
        return schema

    app.openapi = build  # type: ignore[method-assign]


def _operations(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for methods in schema.get("paths", {}).values():
        yield from methods.values()


def _drop_validation_errors(schema: dict[str, Any]) -> None:
    for operation in _operations(schema):
        operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _add_event_streams(schema: dict[str, Any]) -> None:
    """Document a streamed completion: each server-sent event's ``data`` is a chunk (JSON), an
    error body (a failure after the stream began) or ``[DONE]``, the last event."""
    models: list[type[BaseModel]] = [*STREAM_CHUNKS.values(), ErrorResponse]
    _, definitions = models_json_schema(
        [(model, "serialization") for model in models], ref_template=REF + "{model}"
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in definitions.get("$defs", {}).items():
        components.setdefault(name, definition)
    for path, chunk in STREAM_CHUNKS.items():
        operation = schema["paths"][path]["post"]
        payload = {"anyOf": [{"$ref": REF + chunk.__name__}, {"$ref": REF + "ErrorResponse"}]}
        event = {
            "type": "object",
            "properties": {
                "event": {"type": "string"},
                "data": {
                    "anyOf": [
                        {"const": "[DONE]"},
                        {
                            "type": "string",
                            "contentMediaType": "application/json",
                            "contentSchema": payload,
                        },
                    ]
                },
            },
            "required": ["data"],
            "description": "One server-sent event of a streamed completion (stream: true)",
        }
        content = operation["responses"]["200"].setdefault("content", {})
        content["text/event-stream"] = {"schema": event}


def _require_bearer(schema: dict[str, Any]) -> None:
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})["bearer"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "The server's API key (hybridspec serve --api-key)",
    }
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, methods in schema.get("paths", {}).items():
        if path == "/health":
            continue  # the liveness probe stays open
        for operation in methods.values():
            operation["security"] = [{"bearer": []}]
            operation.setdefault("responses", {})["401"] = {
                "description": STATUS_DESCRIPTIONS[401],
                "content": {"application/json": {"schema": error}},
            }


def _add_model_facts(schema: dict[str, Any], model: ModelInfo) -> None:
    components = schema.get("components", {}).get("schemas", {})
    vocab_size = model.vocab_size
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        properties = components.get(name, {}).get("properties", {})
        if "proposer" in properties:
            properties["proposer"]["anyOf"] = [
                {"type": "string", "enum": sorted(model.proposers)},
                {"type": "null"},
            ]
        if "stop_token_ids" in properties:
            properties["stop_token_ids"]["items"]["maximum"] = vocab_size - 1
        for choice in properties.get("n", {}).get("anyOf", []):
            if choice.get("type") == "integer":
                choice["maximum"] = model.max_choices
    detokenize = components.get("DetokenizeRequest", {}).get("properties", {})
    if "tokens" in detokenize:
        detokenize["tokens"]["items"]["maximum"] = vocab_size - 1
        detokenize["tokens"]["maxItems"] = model.max_seq_len  # routes.tokenize
    prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    for choice in prompt.get("anyOf", []):
        items = choice.get("items", {})
        if items.get("type") != "integer" and choice.get("type") == "array":
            choice["maxItems"] = model.max_prompts  # a list of prompts
        if items.get("type") == "array":
            items = items.get("items", {})
        if items.get("type") == "integer":
            items["maximum"] = vocab_size - 1
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        bias = components.get(name, {}).get("properties", {}).get("logit_bias")
        if bias is not None:
            bias["propertyNames"] = {"pattern": decimal_below(vocab_size)}


def decimal_below(limit: int) -> str:
    """A regular expression of the decimal integers 0 .. limit - 1, without leading zeros.

    Worked example, limit 260 (largest 259): ``0``, then the shorter numbers ``[1-9][0-9]{0,1}``
    (1..99), then the 3-digit ones digit by digit below 259: ``1[0-9]{2}`` (100..199),
    ``2[0-4][0-9]{1}`` (200..249), ``25[0-8]`` (250..258) and ``259`` itself.
    """
    top = str(limit - 1)
    choices = ["0"]
    if len(top) > 1:
        choices.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            choices.append(
                f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else "")
            )
    if top != "0":
        choices.append(top)
    return "^(" + "|".join(choices) + ")$"
