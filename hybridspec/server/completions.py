"""Routes ``POST /v1/completions`` and ``POST /v1/chat/completions``.

A streamed response is a sequence of server-sent events, ``data: <chunk JSON>``, ending with
``data: [DONE]``. A chat stream's first chunk carries the role; the last chunk before
``[DONE]`` carries the finish reason and the ``hybridspec`` statistics (then, when
``stream_options.include_usage`` is set, one chunk with empty choices and the usage).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from hybridspec.engine import FinishReason, RequestOutput
from hybridspec.server.errors import exception_response
from hybridspec.server.generation import (
    PreparedRequest,
    check_not_failed,
    final_output,
    next_output,
    observe,
    prepare,
    speculation_stats,
    until_disconnected,
)
from hybridspec.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    FinishReasonName,
    SpeculationStats,
    Usage,
)
from hybridspec.server.state import ServerState, State

router = APIRouter(tags=["completions"])

DONE = "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """A stream of server-sent events that closes its generator however the response ends.

    Starlette cancels the sending task when the client disconnects, but leaves a generator
    that was suspended at ``yield`` unclosed until garbage collection; closing it here makes
    its ``finally`` (which aborts the engine request) run at once.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _finish_reason(output: RequestOutput) -> FinishReasonName:
    return "length" if output.finish_reason is FinishReason.LENGTH else "stop"


def _usage(prepared: PreparedRequest, output: RequestOutput) -> Usage:
    assert output.result is not None
    completion = len(output.result.token_ids)
    prompt = len(prepared.prompt_token_ids)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


@dataclass(frozen=True, slots=True)
class ChunkRenderer:
    """Renders one stream's events, as chat chunks or as text completion chunks."""

    id: str
    created: int
    model: str
    chat: bool

    def _event(self, choices: list[dict[str, object]], **extra: object) -> str:
        schema = ChatCompletionChunk if self.chat else CompletionResponse
        fields = {"id": self.id, "created": self.created, "model": self.model, **extra}
        chunk = schema.model_validate({**fields, "choices": choices})
        # As OpenAI does: a delta holds only what it carries; usage and the statistics appear
        # only on the chunks that carry them.
        data = chunk.model_dump(mode="json")
        for key in ("usage", "hybridspec"):
            if data[key] is None:
                del data[key]
        for choice in data["choices"]:
            if "delta" in choice:
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

    def head(self) -> str | None:
        if not self.chat:
            return None
        return self._event([{"delta": Delta(role="assistant", content="")}])

    def text(self, text: str) -> str:
        if self.chat:
            return self._event([{"delta": Delta(content=text)}])
        return self._event([{"text": text, "finish_reason": None}])

    def final(self, reason: FinishReasonName, stats: SpeculationStats) -> str:
        choice: dict[str, object] = {"finish_reason": reason}
        choice.update({"delta": Delta()} if self.chat else {"text": ""})
        return self._event([choice], hybridspec=stats)

    def usage(self, usage: Usage) -> str:
        return self._event([], usage=usage)


def _error_event(exc: Exception) -> str:
    return f"data: {bytes(exception_response(exc).body).decode()}\n\n"


async def _events(
    prepared: PreparedRequest,
    render: ChunkRenderer,
    first: RequestOutput,
    outputs: AsyncGenerator[RequestOutput, None],
) -> AsyncIterator[str]:
    """The SSE body: ``first`` was awaited already (refusals became an HTTP error before)."""
    async with contextlib.aclosing(outputs):
        head = render.head()
        if head is not None:
            yield head
        output = first
        while not output.finished:
            if output.new_text:
                yield render.text(output.new_text)
            output = await next_output(outputs)
        try:
            check_not_failed(output)
        except Exception as exc:
            yield _error_event(exc)
            yield DONE
            return
        assert output.result is not None
        if output.new_text:
            yield render.text(output.new_text)
        yield render.final(_finish_reason(output), speculation_stats(prepared, output.result.stats))
        if prepared.include_usage:
            yield render.usage(_usage(prepared, output))
        yield DONE


async def _respond(
    request: Request, state: ServerState, prepared: PreparedRequest, chat: bool
) -> Response:
    kind = "chatcmpl" if chat else "cmpl"
    render = ChunkRenderer(f"{kind}-{uuid.uuid4().hex}", int(time.time()), prepared.model, chat)
    outputs = observe(state, prepared)
    if prepared.stream:
        try:
            # Wait for the first output before answering, so that a refusal is an HTTP error.
            first = await until_disconnected(request, next_output(outputs))
            check_not_failed(first)  # failed before its first token: still an HTTP error
        except BaseException:
            await outputs.aclose()
            raise
        return EventStreamResponse(
            _events(prepared, render, first, outputs),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async with contextlib.aclosing(outputs):
        output = await until_disconnected(request, final_output(outputs))
    return _whole_response(prepared, render, output)


def _whole_response(
    prepared: PreparedRequest, render: ChunkRenderer, output: RequestOutput
) -> Response:
    """The non-streamed response of a finished request."""
    check_not_failed(output)
    assert output.result is not None
    text = output.result.text
    reason = _finish_reason(output)
    fields = {
        "id": render.id,
        "created": render.created,
        "model": render.model,
        "usage": _usage(prepared, output),
        "hybridspec": speculation_stats(prepared, output.result.stats),
    }
    body: ChatCompletionResponse | CompletionResponse
    if render.chat:
        message = AssistantMessage(content=text)
        body = ChatCompletionResponse.model_validate(
            {**fields, "choices": [ChatChoice(message=message, finish_reason=reason)]}
        )
    else:
        body = CompletionResponse.model_validate(
            {**fields, "choices": [CompletionChoice(text=text, finish_reason=reason)]}
        )
    return Response(body.model_dump_json(), media_type="application/json")


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request, state: State) -> Response:
    return await _respond(request, state, await prepare(state, body), chat=False)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: State
) -> Response:
    return await _respond(request, state, await prepare(state, body), chat=True)
