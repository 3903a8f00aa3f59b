"""The app's ASGI middleware, outermost first: HEAD, count, time out, authenticate, cap the body.

All five run before routing, so a request they refuse reaches no route and queues no work:

- ``HeadMiddleware`` answers ``HEAD`` as the route's ``GET`` without the body (FastAPI routes
  a GET route's HEAD to 405; HTTP says HEAD is GET without the body).
- ``RequestCountingMiddleware`` counts every HTTP response in the metrics, refusals included.
- ``TimeoutMiddleware`` answers 408 to a request whose body has not arrived within
  ``ServerConfig.request_read_timeout_s``, and cuts a response whose client has not read any of
  it for ``stream_write_timeout_s`` (a stream's engine request is then aborted, its slot freed).
- ``ApiKeyMiddleware`` (only with ``ServerConfig.api_key`` or ``tenant_keys``) answers 401 to
  every request without ``Authorization: Bearer <key>`` of a known key, except the liveness
  probe and the playground page (``OPEN_ROUTES``), and notes the key's tenant in the scope
  (``server.tenants``).
- ``BodySizeLimitMiddleware`` answers 413 to a body over ``ServerConfig.max_body_bytes``: at once
  from its ``Content-Length``, or, without one (chunked), as soon as the bytes received pass it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import fastapi.routing
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridspec.server.errors import error_response
from hybridspec.server.metrics import UNMATCHED_PATH, ServerMetrics
from hybridspec.server.tenants import TENANT_SCOPE_KEY, KeyRing

logger = logging.getLogger(__name__)

# (method, route template) pairs served without a key: the liveness probe.
# The playground page and its icon (``routes.playground``) are open too: a browser opening it
# sends no key; the page sends the key it is given with each API call.
OPEN_ROUTES = frozenset(
    (method, path)
    for method in ("GET", "HEAD")
    for path in ("/health", "/", "/playground", "/favicon.svg", "/favicon.ico")
)
MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
WRONG_KEY_MESSAGE = "Incorrect API key provided."


def app_routes(app: Starlette) -> list[Any]:
    """Every route of ``app``, with the routes of its included routers, in routing order.

    Recent FastAPI keeps an included router whole in ``app.routes`` and flattens it with
    ``fastapi.routing.iter_route_contexts``; older releases list its routes directly.
    """
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    return list(flatten(app.routes)) if flatten is not None else list(app.routes)


SENT_METHOD = "hybridspec.sent_method"  # a scope key: the method before HeadMiddleware


@dataclass(frozen=True, slots=True)
class _Route:
    template: str  # "/v1/models/{model:path}"
    regex: re.Pattern[str]  # what the router matches the path against
    methods: frozenset[str] | None  # None: any


class RouteTemplates:
    """The route template the router picks for a request, known before the router runs.

    The router's own rule: the first route that matches path and method, else the first that
    matches the path (it answers 405), else ``UNMATCHED_PATH``. Built from the app at its
    first request, when every route is registered.
    """

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self._routes: tuple[_Route, ...] | None = None

    def _table(self) -> tuple[_Route, ...]:
        if self._routes is None:
            self._routes = tuple(
                _Route(route.path, route.path_regex, frozenset(route.methods or ()) or None)
                for route in app_routes(self.app)
                if isinstance(getattr(route, "path", None), str) and hasattr(route, "path_regex")
            )
        return self._routes

    def __call__(self, scope: Scope) -> str:
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        partial = None
        for route in self._table():
            if route.regex.match(path):
                if route.methods is None or scope["method"] in route.methods:
                    return route.template
                partial = partial or route.template
        return partial or UNMATCHED_PATH


class RequestCountingMiddleware:
    """Counts every HTTP response by method, route template and status (stream-safe).

    Route templates, not raw paths, and the standard methods (others count as ``other``) keep
    the label set bounded. An exception that escapes the app counts as 500.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, templates: RouteTemplates) -> None:
        self.app = app
        self.metrics = metrics
        self.templates = templates

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, status = self.templates(scope), 500  # before the app: a mount rewrites the path

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            self.metrics.observe_http(scope.get(SENT_METHOD, scope["method"]), path, status)
            if TENANT_SCOPE_KEY in scope:  # set by ApiKeyMiddleware, on the same scope
                self.metrics.observe_tenant_http(scope[TENANT_SCOPE_KEY], status)


def _bearer_token(scope: Scope) -> bytes | None:
    """The credentials of the first ``Authorization: Bearer ...`` header, or None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


class ApiKeyMiddleware:
    """401 for an HTTP request without a known bearer key; OpenAI's bodies and codes.

    A missing key is ``code: null``, a wrong one ``code: "invalid_api_key"``, as OpenAI
    answers; neither message repeats what the client sent. Keys are compared in constant
    time (``KeyRing``). A known key's tenant is set under ``TENANT_SCOPE_KEY`` in the scope.
    """

    def __init__(self, app: ASGIApp, keys: KeyRing, templates: RouteTemplates) -> None:
        self.app = app
        self.keys = keys
        self.templates = templates

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], self.templates(scope)) in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        known, tenant = self.keys.tenant_of(token) if token is not None else (False, None)
        if known:
            scope[TENANT_SCOPE_KEY] = tenant
            await self.app(scope, receive, send)
            return
        response = error_response(
            401,
            MISSING_KEY_MESSAGE if token is None else WRONG_KEY_MESSAGE,
            code=None if token is None else "invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses it before the app sees it
    return None


class BodySizeLimitMiddleware:
    """413 for a request body over ``max_body_bytes``, before any route reads it.

    With a ``Content-Length`` the check is immediate and the body is never read (the server
    holds the client to the length it declared). Without one (a chunked upload) the body is
    read here, at most ``max_body_bytes`` plus one message of it, and handed to the app whole
    once it is known to fit; later ``receive`` calls (disconnects) go to the server.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            if length > self.max_body_bytes:
                await self._refuse(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        first = await self._read_body(receive)
        if first is None:
            await self._refuse(scope, receive, send)
            return
        replayed = False

        async def receive_replayed() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return first

        await self.app(scope, receive_replayed, send)

    async def _read_body(self, receive: Receive) -> Message | None:
        """The whole body as one message (or the disconnect), or None once it passes the cap."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )
        await response(scope, receive, send)


class HeadMiddleware:
    """``HEAD`` runs as ``GET`` (the same status and headers, Content-Length included) and
    its body is dropped; a path without a GET answers as GET would (405, 404)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        # the metrics count it by the method the client sent
        head = {**scope, "method": "GET", SENT_METHOD: "HEAD"}
        await self.app(head, receive, send_headers_only)


class BodyReadTimeout(HTTPException):
    """The request body did not arrive in time: a 408 (FastAPI passes HTTPExceptions on)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s")


class _WriteTimeout(Exception):
    """The client read none of the response for the write timeout."""


class TimeoutMiddleware:
    """Deadlines on the two ends of an HTTP exchange that the client paces (module docstring).

    The body's deadline runs from the request's start; once the body is in, ``receive`` waits
    for the disconnect without one. The write timeout bounds each ``send``, which blocks only
    while the connection's buffers are full: a client that reads slowly but steadily is
    never cut.
    """

    def __init__(self, app: ASGIApp, read_timeout_s: float, write_timeout_s: float) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        body_done, started = False, False

        async def receive_timed() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise BodyReadTimeout(self.read_timeout_s) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def send_timed(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except asyncio.TimeoutError:
                raise _WriteTimeout() from None

        try:
            await self.app(scope, receive_timed, send_timed)
        except BodyReadTimeout as exc:  # raised outside FastAPI (the body cap reads it)
            if not started:
                response = error_response(408, str(exc.detail), code="request_timeout")
                await response(scope, receive, send)
        except _WriteTimeout:
            logger.warning(
                "%s %s: the client read nothing for %g s; response cut",
                scope["method"],
                scope["path"],
                self.write_timeout_s,
            )
