"""A deadline and size bounds on a request's headers, which uvicorn's httptools protocol lacks.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a connection
that sends nothing, or sends its headers a byte at a time, stays open for as long as the client
likes, each holding a socket and a task. ``header_deadline_protocol`` gives uvicorn an HTTP
protocol (its httptools one) that closes a connection whose request line and headers have not
all arrived within ``timeout_s`` of the connection's start, or of the next request's first
byte. The body's own deadline is ``middleware.TimeoutMiddleware``'s.

The same protocol bounds the headers' size: more than ``MAX_HEADER_BYTES`` of request line
and headers, or more than ``MAX_HEADERS`` header fields, get a ``431 Request Header Fields
Too Large`` (RFC 6585) with an OpenAI-style error body, and the connection is closed, as
soon as the bytes received pass the bound (httptools itself reads headers of any size).
Node's and h11's bound is 16 KiB; nginx's default buffers take 32 KiB; gunicorn and Apache
take 100 fields.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

MAX_HEADER_BYTES = 32 * 1024  # request line and headers
MAX_HEADERS = 100


class _HeadersTooLarge(Exception):
    """Raised in a parser callback to stop parsing; the protocol answers 431."""


def too_large_response(message: str) -> bytes:
    """A whole HTTP/1.1 431 response, closing the connection, with an OpenAI-style body."""
    error = {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": "request_header_fields_too_large",
    }
    body = json.dumps({"error": error}).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def header_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol with the header deadline and bounds; ``"auto"``
    (uvicorn's choice: h11 where httptools is not installed, which answers headers over its
    16 KiB with a 400, and has no deadline)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _in_headers = True  # the current request's headers are not complete yet
        _received = 0  # bytes received while they were not
        _header_bytes = 0  # the current request's line and headers, as parsed
        _num_headers = 0
        _refused = False

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_headers:
                self._received += len(data)
            super().data_received(data)
            if self._in_headers and self._received > MAX_HEADER_BYTES:
                self._refuse(f"the request's headers pass {MAX_HEADER_BYTES} bytes")

        def send_400_response(self, msg: str) -> None:
            if self._refused:  # a callback below stopped the parser
                return
            super().send_400_response(msg)

        def _refuse(self, message: str) -> None:
            self._refused = True
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(too_large_response(message))
                self.transport.close()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._num_headers += 1
            self._count(len(name) + len(value) + 4)
            if self._num_headers > MAX_HEADERS:
                self._refuse(f"the request has more than {MAX_HEADERS} header fields")
                raise _HeadersTooLarge
            super().on_header(name, value)

        def _count(self, num_bytes: int) -> None:
            self._header_bytes += num_bytes
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse(f"the request's headers pass {MAX_HEADER_BYTES} bytes")
                raise _HeadersTooLarge

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_headers, self._received = True, 0

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
            self._header_bytes = self._num_headers = 0
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._in_headers = False
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol
