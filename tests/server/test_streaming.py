"""The SSE response closes its generator however the response ends (no model needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Message

from hybridspec.server.streaming import EventStreamResponse


async def _leave_during_send() -> tuple[bool, list[Message]]:
    closed = asyncio.Event()
    first_body_sent = asyncio.Event()
    sent: list[Message] = []

    async def events() -> AsyncIterator[str]:
        try:
            for i in range(3):
                yield f"data: {i}\n\n"
        finally:
            closed.set()  # where the real generator aborts its engine request

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            first_body_sent.set()
            await asyncio.Event().wait()  # a stalled socket: this send never returns

    async def receive() -> Message:
        await first_body_sent.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    await asyncio.wait_for(EventStreamResponse(events())(scope, receive, send), timeout=5)
    return closed.is_set(), sent


def test_client_leaving_during_a_send_closes_the_generator() -> None:
    # Starlette cancels the sending task while the generator sits at ``yield``; without an
    # explicit close its ``finally`` would wait for garbage collection.
    closed, sent = asyncio.run(_leave_during_send())
    assert closed
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
