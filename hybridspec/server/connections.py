"""A deadline on a request's headers, which uvicorn does not have.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a connection
that sends nothing, or sends its headers a byte at a time, stays open for as long as the client
likes, each holding a socket and a task. ``header_deadline_protocol`` gives uvicorn an HTTP
protocol (its httptools one) that closes a connection whose request line and headers have not
all arrived within ``timeout_s`` of the connection's start, or of the next request's first
byte. The body's own deadline is ``middleware.TimeoutMiddleware``'s.
"""

from __future__ import annotations

import asyncio
from typing import Any


def header_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol with the header deadline; ``"auto"`` (uvicorn's choice,
    no deadline) where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol
