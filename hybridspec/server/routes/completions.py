"""Routes ``POST /v1/completions`` and ``POST /v1/chat/completions``.

The HTTP side only: the request's path through the engine is ``server.generation`` and the
event stream ``server.streaming``. What is HTTP's own is here: a client that hangs up before
its response begins cancels its request (``until_disconnected``), and a streamed request's
refusal is an HTTP error, not an event (its first output is awaited before the stream begins).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hybridspec.server.errors import ClientDisconnected
from hybridspec.server.generation import (
    PreparedRequest,
    check_not_failed,
    final_outputs,
    next_output,
    observe,
    response_body,
)
from hybridspec.server.openapi import GENERATION_ERRORS
from hybridspec.server.preparation import prepare
from hybridspec.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from hybridspec.server.shutdown import guard
from hybridspec.server.state import ServerState, State
from hybridspec.server.streaming import ChunkRenderer, EventStreamResponse, stream_events
from hybridspec.server.tenants import tenant_of

T = TypeVar("T")

router = APIRouter(tags=["completions"])


async def _respond(
    request: Request, state: ServerState, prepared: list[PreparedRequest]
) -> Response:
    """Run every prompt's choices; answer once all have finished, or stream them."""
    chat, stream = prepared[0].chat, prepared[0].stream
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    # 503 once shutdown aborts it; a response that is not streamed needs only each choice's end
    outputs = guard(state.shutdown, observe(state, prepared, final_only=not stream))
    if stream:
        try:
            # Wait for the first output before answering, so that a refusal is an HTTP error.
            first = await until_disconnected(request, next_output(outputs))
            check_not_failed(first[1], response_id)  # failed before its first token: HTTP error
        except BaseException:
            await outputs.aclose()
            raise
        render = ChunkRenderer(response_id, created, prepared[0].model, chat)
        return EventStreamResponse(
            stream_events(state, prepared, render, first, outputs),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async with contextlib.aclosing(outputs):
        count = len(prepared) * prepared[0].n
        finals = await until_disconnected(request, final_outputs(outputs, count))
    body = await response_body(state, prepared, response_id, created, finals)
    return Response(body.model_dump_json(), media_type="application/json")


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        # Once the body is read, servers answer receive() only at disconnect; never spin.
        await asyncio.sleep(0.05)


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client hangs up first, cancel it and raise ClientDisconnected.

    Cancelling it cancels the generator it drives, whose ``finally`` aborts the engine request.
    """
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses=GENERATION_ERRORS,
)
async def create_completion(body: CompletionRequest, request: Request, state: State) -> Response:
    return await _respond(request, state, await prepare(state, body, tenant_of(request)))


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=GENERATION_ERRORS,
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: State
) -> Response:
    return await _respond(request, state, await prepare(state, body, tenant_of(request)))
