"""ASGI middleware in Ray Serve's HTTP proxy, in front of every replica.

Two things only the proxy can do, because only it sees a request before a replica is chosen
and after its replica is gone:

- **The OpenAI ``user`` field as a session hint.** Ray's router sees headers, never bodies
  (``routing``). For a JSON POST without the session header, the proxy reads the body (at most
  ``max_body_bytes``; a larger one is passed on unread, for the replica to refuse), and a
  string ``user`` becomes the session header, so the request sticks to that user's replica.
  An explicit header wins.
- **A clear error when a replica dies under a request.** Ray's proxy answers a request whose
  replica died with a bare ``500 Internal Server Error`` (text/plain), or, once a stream has
  begun, cuts it. A replica's own errors are always JSON, so a non-JSON 5xx here is the
  replica's failure: it becomes a 502 with an OpenAI error body (``code: "replica_failed"``),
  and a cut stream ends with that error as its last event. Clients that retry 5xx (the
  ``openai`` client does) go to a live replica.

``hybridspec serve --replicas`` installs it through Serve's ``http_options``; on a cluster,
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=hybridspec.deploy.proxy:middlewares`` in the
nodes' environment before ``ray start`` does.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridspec.server.config import DEFAULT_MAX_BODY_BYTES
from hybridspec.server.errors import error_response

logger = logging.getLogger(__name__)

# Ray's session header: the name Ray's proxy reads (its default, or the operator's override).
SESSION_HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id").lower()
REPLICA_FAILED = 502
REPLICA_FAILED_MESSAGE = (
    "the replica serving this request stopped before it answered (its process died or its "
    "node was lost); Ray Serve starts another: retry the request"
)


def middlewares() -> list[Middleware]:
    """The proxy's middleware, for ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``."""
    return [Middleware(ReplicaProxyMiddleware)]


def replica_failed_body() -> bytes:
    response = error_response(
        REPLICA_FAILED, REPLICA_FAILED_MESSAGE, type_="server_error", code="replica_failed"
    )
    return bytes(response.body)


class ReplicaProxyMiddleware:
    """The ``user`` field as a session hint; a replica's death as an OpenAI error."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _wants_session_from_body(scope):
            scope, receive = await self._session_from_user(scope, receive)
        guard = _FailureGuard(send)
        try:
            await self.app(scope, receive, guard.send)
        except Exception:  # answered below, as when the proxy answers a failure itself
            logger.warning("the proxy failed a request", exc_info=True)
        await guard.finish()

    async def _session_from_user(self, scope: Scope, receive: Receive) -> tuple[Scope, Receive]:
        """Read the body (up to the cap); with a string ``user``, add the session header."""
        read: list[Message] = []
        size, complete = 0, False
        while not complete and size <= self.max_body_bytes:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            complete = not message.get("more_body", False)
        user = _user_field(b"".join(m.get("body", b"") for m in read)) if complete else None
        if user:
            headers = [*scope["headers"], (SESSION_HEADER.encode(), user.encode())]
            scope = {**scope, "headers": headers}

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        return scope, replay


def _wants_session_from_body(scope: Scope) -> bool:
    if scope["method"] != "POST":
        return False
    names = {name for name, _ in scope["headers"]}
    content_type = dict(scope["headers"]).get(b"content-type", b"")
    return SESSION_HEADER.encode() not in names and content_type.startswith(b"application/json")


def _user_field(body: bytes) -> str | None:
    try:
        payload: Any = json.loads(body)
    except ValueError:
        return None  # the replica answers the 400
    user = payload.get("user") if isinstance(payload, dict) else None
    return user if isinstance(user, str) and user.isprintable() and 0 < len(user) <= 256 else None


class _FailureGuard:
    """Passes the response through, but turns the proxy's own failure answers into errors."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._started = False  # a response start went out
        self._held_start: Message | None = None  # a non-JSON 5xx start, replaced at its end
        self._streaming = False  # a server-sent-event stream has begun
        self._done = False  # the last body message went out

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if message["status"] >= 500 and not content_type.startswith(b"application/json"):
                self._held_start = message
                return
            self._started = True
            self._streaming = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            if self._held_start is not None:
                if not message.get("more_body", False):
                    await self._replace()
                return
            self._done = not message.get("more_body", False)
        await self._send(message)

    async def _replace(self) -> None:
        body = replica_failed_body()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        held = self._held_start.get("headers", []) if self._held_start is not None else []
        headers += [(name, value) for name, value in held if name == b"x-request-id"]
        self._held_start, self._started, self._done = None, True, True
        await self._send(
            {"type": "http.response.start", "status": REPLICA_FAILED, "headers": headers}
        )
        await self._send({"type": "http.response.body", "body": body})

    async def finish(self) -> None:
        """After the proxy's app: a failure it did not answer, or a stream it cut, gets the
        error (a whole 502, or the stream's last event)."""
        try:
            if self._held_start is not None or not self._started:
                await self._replace()
            elif self._streaming and not self._done:
                self._done = True
                event = b"data: " + replica_failed_body() + b"\n\n"
                await self._send({"type": "http.response.body", "body": event})
        except OSError:  # the client went away too
            return
