"""Route ``POST /v1/responses`` (``server.responses``: the request as a chat completion).

Not streamed, the answer is the Response object once generation ends. Streamed, the events
are OpenAI's: ``response.created`` and ``response.in_progress``; for a text answer the
message's ``output_item.added``, ``content_part.added``, one ``output_text.delta`` per engine
output, ``output_text.done``, ``content_part.done``, ``output_item.done``; for calls (tools
hold the text back until the end, as the chat stream does) per call ``output_item.added``,
``function_call_arguments.delta`` (the whole arguments) and ``.done``, ``output_item.done``;
last ``response.completed`` (``response.incomplete`` when max_output_tokens cut the text), or
``response.failed`` when the engine failed the request after the stream began. Each event is
named (``event:``) by its ``type`` and numbered (``sequence_number``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from hybridspec.engine import FinishReason, RequestOutput
from hybridspec.server.errors import exception_response
from hybridspec.server.generation import (
    Indexed,
    PreparedRequest,
    answer_calls,
    check_not_failed,
    final_outputs,
    next_output,
    observe,
    speculation_stats,
)
from hybridspec.server.openapi import GENERATION_ERRORS
from hybridspec.server.preparation import prepare
from hybridspec.server.responses import (
    ResponsesRequest,
    call_item,
    message_item,
    new_id,
    now,
    response_object,
    sse,
    to_chat,
)
from hybridspec.server.routes.completions import until_disconnected
from hybridspec.server.state import State
from hybridspec.server.streaming import EventStreamResponse
from hybridspec.server.tenants import tenant_of

router = APIRouter(tags=["responses"])

EVENT_STREAM = {
    "schema": {
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "contentMediaType": "application/json"},
        },
        "required": ["data"],
        "description": "One server-sent event of a streamed response (stream: true), named by "
        "its type",
    }
}
RESPONSE_OBJECT = {
    "schema": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "status": {"enum": ["completed", "incomplete"]},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object"},
        },
        "required": ["id", "object", "status", "output", "usage"],
    }
}


class _Answer:
    """A request's settings and ids, and the Response object at each point of its life."""

    def __init__(self, body: ResponsesRequest, prepared: PreparedRequest) -> None:
        self.body, self.prepared = body, prepared
        self.id, self.created, self.message_id = new_id("resp"), now(), new_id("msg")

    def object(
        self, status: str, output: list[dict[str, Any]], final: RequestOutput | None = None
    ) -> dict[str, Any]:
        if final is None or final.result is None:
            return response_object(
                self.body, self.id, self.prepared.model, self.created, status, output
            )
        result = final.result
        usage = (len(self.prepared.prompt_token_ids), len(result.token_ids))
        stats = speculation_stats(self.prepared, result.stats)
        cut = final.finish_reason is FinishReason.LENGTH and status == "incomplete"
        return response_object(
            self.body,
            self.id,
            self.prepared.model,
            self.created,
            status,
            output,
            usage,
            stats,
            "max_output_tokens" if cut else None,
        )

    def items(self, final: RequestOutput) -> tuple[str, list[dict[str, Any]]]:
        """The status and output items of a finished request: its calls, or its text."""
        assert final.result is not None
        calls = answer_calls(self.prepared, final)
        if calls:
            return "completed", [call_item(call) for call in calls]
        cut = final.finish_reason is FinishReason.LENGTH
        status = "incomplete" if cut else "completed"
        return status, [message_item(final.result.text, self.message_id)]


@router.post(
    "/v1/responses",
    response_class=Response,
    responses={
        **GENERATION_ERRORS,
        200: {
            "description": "The Response object, or its events when stream is true",
            "content": {"application/json": RESPONSE_OBJECT, "text/event-stream": EVENT_STREAM},
        },
    },
)
async def create_response(body: ResponsesRequest, request: Request, state: State) -> Response:
    (prepared,) = await prepare(state, to_chat(body), tenant_of(request))
    answer = _Answer(body, prepared)
    outputs = observe(state, [prepared], final_only=not body.stream)
    if body.stream:
        try:
            first = await until_disconnected(request, next_output(outputs))
            check_not_failed(first[1], answer.id)  # failed before its first token: HTTP error
        except BaseException:
            await outputs.aclose()
            raise
        return EventStreamResponse(
            _events(answer, first[1], outputs),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async with contextlib.aclosing(outputs):
        (final,) = await until_disconnected(request, final_outputs(outputs, 1))
    check_not_failed(final, answer.id)
    status, items = answer.items(final)
    return JSONResponse(answer.object(status, items, final))


async def _events(
    answer: _Answer, first: RequestOutput, outputs: AsyncGenerator[Indexed, None]
) -> AsyncIterator[str]:
    """The event stream of a request whose first output was awaited already (module doc)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(numbers), **fields})

    where = {"item_id": answer.message_id, "output_index": 0, "content_index": 0}
    started = answer.object("in_progress", [])
    async with contextlib.aclosing(outputs):
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        output, opened = first, False
        while True:
            if output.finished:
                try:
                    check_not_failed(output, answer.id)
                except Exception as exc:
                    failed = answer.object("failed", [])
                    failed["error"] = json.loads(bytes(exception_response(exc).body))["error"]
                    yield event("response.failed", response=failed)
                    return
            text = output.new_text
            if text and not answer.prepared.calls_tools:
                if not opened:
                    for opening in _open_message(answer, event):
                        yield opening
                    opened = True
                yield event("response.output_text.delta", **where, delta=text, logprobs=[])
            if output.finished:
                break
            _, output = await next_output(outputs)
        status, items = answer.items(output)
        for index, item in enumerate(items):
            if item["type"] == "function_call":
                for call_event in _call_events(item, index, event):
                    yield call_event
                continue
            if not opened:
                for opening in _open_message(answer, event):
                    yield opening
                if item["content"][0]["text"]:  # a tools request's text, held back until now
                    yield event(
                        "response.output_text.delta",
                        **where,
                        delta=item["content"][0]["text"],
                        logprobs=[],
                    )
            part = item["content"][0]
            yield event("response.output_text.done", **where, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, part=part)
            yield event("response.output_item.done", output_index=0, item=item)
        final = answer.object(status, items, output)
        yield event(f"response.{status}", response=final)


def _open_message(answer: _Answer, event: Any) -> list[str]:
    item = message_item("", answer.message_id, "in_progress")
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        event("response.output_item.added", output_index=0, item=item),
        event(
            "response.content_part.added",
            item_id=answer.message_id,
            output_index=0,
            content_index=0,
            part=part,
        ),
    ]


def _call_events(item: dict[str, Any], index: int, event: Any) -> list[str]:
    started = {**item, "arguments": "", "status": "in_progress"}
    where = {"item_id": item["id"], "output_index": index}
    return [
        event("response.output_item.added", output_index=index, item=started),
        event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
        event(
            "response.function_call_arguments.done",
            **where,
            name=item["name"],
            arguments=item["arguments"],
        ),
        event("response.output_item.done", output_index=index, item=item),
    ]
