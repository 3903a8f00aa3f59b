"""Graceful shutdown: stop accepting, let running requests finish, end the rest cleanly.

On SIGTERM (or SIGINT) ``DrainingServer`` starts ``drain`` before uvicorn's own shutdown:

1. uvicorn stops accepting connections and closes idle ones; a request that arrives on an open
   one, or that was still being prepared, gets a JSON 503 (``ServerShuttingDown``, code
   ``overloaded``, with Retry-After);
2. requests still waiting for a slot are aborted and answered with that JSON 503;
3. running requests get ``ServerConfig.shutdown_timeout_s`` to finish;
4. then the rest are aborted: a stream ends with an error event (the same 503 body) and
   ``data: [DONE]``, a non-streamed request gets the JSON 503.

uvicorn's own graceful timeout is one second longer, a backstop that cancels what is left; the
process exits within the timeout plus about a second.

The same server bounds each connection's kernel send buffer (``SEND_BUFFER_BYTES``), so that a
client that stops reading blocks the server's writes after a bounded amount of its stream, and
``middleware.TimeoutMiddleware``'s write timeout then aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from hybridspec.engine import Engine, EngineLoop, FinishReason, RequestOutput
from hybridspec.errors import CapacityError

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI


logger = logging.getLogger(__name__)

Indexed = tuple[int, RequestOutput]
T = TypeVar("T")
POLL_S = 0.05
# A connection's kernel send buffer (Linux doubles it): without a bound the kernel grows it to
# megabytes, which an unread stream fills for minutes before the write timeout can see it.
SEND_BUFFER_BYTES = 64 * 1024


class ServerShuttingDown(CapacityError):
    """The server is shutting down: a 503, as any refusal for want of capacity."""


@dataclass(slots=True)
class Shutdown:
    """Where the server is in its shutdown; read by ``guard`` on the event loop."""

    started: bool = False
    deadline_passed: bool = False

    def error(self) -> ServerShuttingDown:
        when = "its shutdown timeout passed" if self.deadline_passed else "it is shutting down"
        return ServerShuttingDown(f"the server ended the request: {when}; retry elsewhere")


async def guard(
    shutdown: Shutdown, outputs: AsyncGenerator[Indexed, None]
) -> AsyncGenerator[Indexed, None]:
    """``outputs`` until shutdown aborts the request, then ServerShuttingDown; one that arrives
    once shutdown has started is refused at once."""
    async with contextlib.aclosing(outputs):
        if shutdown.started:
            raise shutdown.error()
        async for index, output in outputs:
            if shutdown.started and output.finish_reason is FinishReason.ABORT:
                raise shutdown.error()
            yield index, output


def _waiting(engines: tuple[Engine, ...]) -> list[str]:
    return [r.request_id for engine in engines for r in engine.scheduler.waiting]


def _running(engines: tuple[Engine, ...]) -> list[str]:
    return [r.request_id for engine in engines for r in engine.scheduler.running]


def _num_unfinished(engines: tuple[Engine, ...]) -> int:
    return sum(engine.num_running + engine.num_waiting for engine in engines)


async def drain(shutdown: Shutdown, loop: EngineLoop, timeout_s: float) -> None:
    """Steps 2-4 of the module docstring, over the loop's engines (its twin too)."""
    shutdown.started = True
    deadline = time.monotonic() + timeout_s

    async def read(fn: Callable[[tuple[Engine, ...]], T]) -> T:
        result: T = await loop.call(lambda _: fn(loop.engines))
        return result

    for request_id in await read(_waiting):
        loop.abort(request_id)
    while time.monotonic() < deadline:
        if await read(_num_unfinished) == 0:
            return
        await asyncio.sleep(POLL_S)
    shutdown.deadline_passed = True
    running = await read(_running)
    logger.warning("shutdown timeout passed: ending %d running requests", len(running))
    for request_id in running:
        loop.abort(request_id)


def begin_shutdown(app: FastAPI) -> asyncio.Task[None] | None:
    """Start ``drain`` on the running loop (None when the app never started)."""
    state = getattr(app.state, "server", None)
    if state is None or state.shutdown.started:
        return None
    return asyncio.ensure_future(drain(state.shutdown, state.loop, state.config.shutdown_timeout_s))


def draining_server(
    config: uvicorn.Config, app: FastAPI, send_buffer_bytes: int = SEND_BUFFER_BYTES
) -> uvicorn.Server:
    """A uvicorn server that drains ``app`` (``drain``) before its own shutdown, and whose
    connections have a send buffer of ``send_buffer_bytes`` (module docstring)."""
    import socket

    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            if sockets is None and self.config.uds is None and self.config.fd is None:
                listener = self.config.bind_socket()  # accepted connections inherit the size
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
                sockets = [listener]
            await super().startup(sockets)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            begin_shutdown(app)
            await super().shutdown(sockets)

    return DrainingServer(config)
