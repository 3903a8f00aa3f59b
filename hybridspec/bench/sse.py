"""One streamed request to an OpenAI-style server, read as its server-sent events' JSON chunks.

The bench's own HTTP clients (``serve_conversations``, ``served``) send with it: a ``POST`` of a
JSON body with ``stream: true``, then every ``data:`` line's JSON until ``data: [DONE]``. An
HTTP error, or an error event in the stream, raises ``ServedRequestError`` with the server's
message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from hybridspec.errors import HybridSpecError

REQUEST_TIMEOUT_S = 600.0
_DATA = "data:"
_DONE = "[DONE]"


class ServedRequestError(HybridSpecError, RuntimeError):
    """The server refused the request, or ended its stream with an error (the command line
    reports it as its other errors)."""


def stream_chunks(url: str, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST ``payload`` (``stream`` set true) to ``url``; yield each event's chunk in order.

    The request is sent on the first ``next``, so a caller's clock started before it counts
    the whole request.
    """
    request = urllib.request.Request(
        url,
        data=json.dumps({**payload, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        response = urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise ServedRequestError(f"{url}: HTTP {exc.code}: {detail}") from None
    with response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith(_DATA):
                continue
            data = line[len(_DATA) :].strip()
            if data == _DONE:
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServedRequestError(f"{url}: {chunk['error']}")
            yield chunk
