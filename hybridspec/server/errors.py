"""Maps every failure to an OpenAI-style error body and status code.

``{"error": {"message", "type", "param", "code"}}`` with:

==================================  ======  =======================  =====================
exception                           status  type                     code
==================================  ======  =======================  =====================
UnknownModelError                   404     invalid_request_error    model_not_found
ContextLengthError                  400     invalid_request_error    context_length_exceeded
GrammarError                        400     invalid_request_error    invalid_grammar
IncompatibleFieldsError             400     invalid_request_error    incompatible_fields
InvalidRequestError                 400     invalid_request_error    invalid_value
RequestValidationError (pydantic)   400     invalid_request_error    invalid_type / ...
TenantLimitError                    429     rate_limit_error         rate_limit_exceeded
                                                                     (Retry-After)
CapacityError                       503     server_error             overloaded (Retry-After)
ClientDisconnected                  499     invalid_request_error    client_disconnected
HTTPException (404 route, 405...)   as is   invalid_request_error    None (400: invalid_json,
                                                                     408: request_timeout)
GenerationFailed, any other         500     server_error             internal_error
==================================  ======  =======================  =====================

Two refusals come from ``server.middleware``, before any route runs: 401 (missing or wrong API
key: ``invalid_request_error``, code None or ``invalid_api_key``) and 413 (a body over
``max_body_bytes``: ``request_too_large``).

A 500 says what failed in general terms and carries a request id (in the message and the
``x-request-id`` header); the detail (the exception, the engine's error) goes to the log under
that id, never to the client.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from hybridspec.errors import (
    CapacityError,
    ContextLengthError,
    GrammarError,
    HybridSpecError,
    IncompatibleFieldsError,
    InvalidRequestError,
    TenantLimitError,
    UnknownModelError,
)
from hybridspec.server.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

# Engine parameter names that the OpenAI schema spells differently.
PARAM_NAMES = {"max_new_tokens": "max_tokens"}
CLIENT_CLOSED_REQUEST = 499
MAX_MESSAGE_CHARS = 1000
HTTP_CODES = {400: "invalid_json", 408: "request_timeout"}


class ClientDisconnected(Exception):
    """The client went away before its response began; its request was cancelled."""


class GenerationFailed(HybridSpecError):
    """The engine ended a request with an error (a proposer's, or its round's).

    ``str(exc)`` is the engine's detail, for the log; ``request_id`` names the request in the
    500 body and in the log line.
    """

    def __init__(self, detail: str, request_id: str) -> None:
        super().__init__(detail)
        self.request_id = request_id


def error_response(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    if len(message) > MAX_MESSAGE_CHARS:  # never echo a huge input back whole
        message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters, cut)"
    body = ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _pydantic_location(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    parts = [p for p in loc if p != "body"]
    # A union's member name ("str", "list[int]") appears after the field; it is not a field.
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif "[" in str(part) or str(part) in {"str", "int", "float", "bool", "function-after"}:
            continue
        else:
            text += f".{part}" if text else str(part)
    return text or None


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # The most specific error first: for a value matching no member of a union (a content part
    # of the wrong type), the member it came closest to has the longest location.
    errors = sorted(errors, key=lambda e: -len(e.get("loc", ())))
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "invalid"}
    kind = str(first.get("type", "invalid"))
    if kind == "json_invalid":
        return error_response(
            400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json"
        )
    param = _pydantic_location(tuple(first.get("loc", ())))
    if kind == "extra_forbidden":
        return error_response(
            400,
            f"unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    if kind == "missing" and param is None:
        return error_response(
            400,
            "the request body is missing: expected a JSON object",
            code="missing_required_parameter",
        )
    if kind == "missing":
        return error_response(
            400,
            f"{param}: a required field is missing",
            param=param,
            code="missing_required_parameter",
        )
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return error_response(400, message, param=param, code="invalid_type")


def exception_response(exc: Exception, retry_after_s: int = 1) -> JSONResponse:
    """The response for an exception raised while handling a request."""
    if isinstance(exc, ClientDisconnected):
        # Nobody reads it; the status marks the request in the metrics (nginx's convention).
        return error_response(
            CLIENT_CLOSED_REQUEST, str(exc) or "client disconnected", code="client_disconnected"
        )
    if isinstance(exc, UnknownModelError):
        return error_response(404, str(exc), param=exc.param or "model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        param = PARAM_NAMES.get(exc.param, exc.param) if exc.param else None
        code = (
            "context_length_exceeded"
            if isinstance(exc, ContextLengthError)
            else "invalid_grammar"
            if isinstance(exc, GrammarError)
            else "incompatible_fields"
            if isinstance(exc, IncompatibleFieldsError)
            else "invalid_value"
        )
        return error_response(400, str(exc), param=param, code=code)
    if isinstance(exc, CapacityError):
        status, type_, code = (
            (429, "rate_limit_error", "rate_limit_exceeded")
            if isinstance(exc, TenantLimitError)
            else (503, "server_error", "overloaded")
        )
        if status == 429:
            logger.info("429: %s", exc)  # the message names the tenant, never its key
        return error_response(
            status, str(exc), type_=type_, code=code, headers={"Retry-After": str(retry_after_s)}
        )
    if isinstance(exc, RequestValidationError):
        return validation_error_response(exc)
    if isinstance(exc, HTTPException):
        # FastAPI's only 400 is a body it cannot parse (not UTF-8, say): as pydantic's JSON error;
        # a 408 is a body that did not arrive in time (server.middleware.TimeoutMiddleware).
        http_code = HTTP_CODES.get(exc.status_code)
        headers = dict(exc.headers or {})
        return error_response(exc.status_code, str(exc.detail), code=http_code, headers=headers)
    return internal_error_response(exc)


def internal_error_response(exc: Exception) -> JSONResponse:
    """A 500 naming the request, with the detail logged under its id (module docstring)."""
    if isinstance(exc, GenerationFailed):
        request_id, what = exc.request_id, "generation failed inside the engine"
        logger.warning("request %s failed: %s", request_id, exc)
    else:
        request_id, what = f"req-{uuid.uuid4().hex}", "the server failed while handling it"
        logger.error("request %s: unhandled error", request_id, exc_info=exc)
    return error_response(
        500,
        f"{what} (request id {request_id}; the server's log has the details)",
        type_="server_error",
        code="internal_error",
        headers={"x-request-id": request_id},
    )


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return exception_response(exc, retry_after_s)

    # HybridSpecError is handled inside the app; only unexpected errors reach ``Exception``,
    # which Starlette answers in its outermost middleware and then re-raises (logged).
    for cls in (
        HybridSpecError,
        ClientDisconnected,
        RequestValidationError,
        HTTPException,
        Exception,
    ):
        app.add_exception_handler(cls, handle)
