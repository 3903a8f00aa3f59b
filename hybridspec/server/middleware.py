"""The middleware that counts every HTTP response in the server's metrics."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridspec.server.metrics import ServerMetrics


class RequestCountingMiddleware:
    """Counts every HTTP response by method, route template and status (ASGI, stream-safe).

    Route templates (``/v1/models/{model:path}``), not raw paths, keep the label set bounded;
    requests matching no route count under ``unmatched``. An exception that escapes the app
    counts as 500.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.http_requests.inc(scope["method"], path, str(status))
