"""The proxy's middleware: the ``user`` field as the session header; a replica's death as an
OpenAI error (a whole 502, or a cut stream's last event). Driven over a stand-in for Ray's
proxy app, which answers as Ray's does."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from hybridspec.deploy.proxy import SESSION_HEADER, ReplicaProxyMiddleware

Seen = dict[str, object]


def _proxy(behaviour: str, seen: Seen) -> ReplicaProxyMiddleware:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen["headers"] = {k.decode(): v.decode() for k, v in scope["headers"]}
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        seen["body"] = body
        if behaviour == "ok":
            start = {"status": 200, "headers": [(b"content-type", b"application/json")]}
            await send({"type": "http.response.start", **start})
            await send({"type": "http.response.body", "body": b'{"ok": true}'})
        elif behaviour == "replica-error":  # the app's own 500: JSON, passed on as it is
            start = {"status": 500, "headers": [(b"content-type", b"application/json")]}
            await send({"type": "http.response.start", **start})
            await send({"type": "http.response.body", "body": b'{"error": {"code": "x"}}'})
        elif behaviour == "died":  # Ray's answer when the replica's actor died
            headers = [(b"content-type", b"text/plain"), (b"x-request-id", b"r-1")]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": b"Internal Server Error"})
        elif behaviour == "raised":  # nothing sent: the server would answer a bare 500
            raise RuntimeError("actor died")
        elif behaviour == "cut-stream":
            start = {"status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            await send({"type": "http.response.start", **start})
            message: Message = {"type": "http.response.body", "body": b"data: {}\n\n"}
            await send({**message, "more_body": True})

    return ReplicaProxyMiddleware(app, max_body_bytes=64)


def _post(
    behaviour: str, body: object, headers: dict[str, str] | None = None
) -> tuple[httpx.Response, Seen]:
    seen: Seen = {}
    transport = httpx.ASGITransport(app=_proxy(behaviour, seen))

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.post("/v1/chat/completions", json=body, headers=headers)

    import asyncio

    return asyncio.run(send()), seen


def test_the_user_field_becomes_the_session_header_and_the_body_arrives_whole() -> None:
    body = {"messages": [], "user": "alice"}
    response, seen = _post("ok", body)
    assert response.status_code == 200
    assert seen["headers"][SESSION_HEADER] == "alice"  # type: ignore[index]
    assert json.loads(seen["body"]) == body  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "headers", "session"),
    [
        ({"user": "alice"}, {SESSION_HEADER: "explicit"}, "explicit"),  # the header wins
        ({"user": 7}, None, None),
        ({"user": ""}, None, None),
        ({"prompt": "x"}, None, None),
        ({"user": "alice", "prompt": "x" * 100}, None, None),  # over the cap: not read
    ],
)
def test_session_header_only_from_a_usable_user(
    body: dict[str, object], headers: dict[str, str] | None, session: str | None
) -> None:
    response, seen = _post("ok", body, headers)
    assert response.status_code == 200
    assert seen["headers"].get(SESSION_HEADER) == session  # type: ignore[attr-defined]
    assert json.loads(seen["body"]) == body  # type: ignore[arg-type]


@pytest.mark.parametrize("behaviour", ["died", "raised"])
def test_a_dead_replica_is_a_502_naming_the_cause(behaviour: str) -> None:
    response, _ = _post(behaviour, {"prompt": "x"})
    assert response.status_code == 502
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "replica_failed")
    assert "stopped before it answered" in error["message"]
    if behaviour == "died":
        assert response.headers["x-request-id"] == "r-1"


def test_a_replica_error_passes_unchanged() -> None:
    response, _ = _post("replica-error", {"prompt": "x"})
    assert response.status_code == 500 and response.json() == {"error": {"code": "x"}}


def test_a_cut_stream_ends_with_the_error_event() -> None:
    response, _ = _post("cut-stream", {"prompt": "x", "stream": True})
    events = [line for line in response.text.split("\n\n") if line]
    assert events[0] == "data: {}"
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "replica_failed"
