"""Routes ``GET /health``, ``GET /metrics`` and, under ``serve --bench-twin`` only, ``POST
/bench/hold``: the bench's pairs hold the engine's steps until both loops' requests are in
(``EngineLoop.hold``), ``{"requests": N, "timeout_s": S}`` (default 30 s, at most 600)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from hybridspec.engine import Engine
from hybridspec.engine.prefix_cache import PrefixCacheStats
from hybridspec.errors import check
from hybridspec.server.errors import error_response
from hybridspec.server.metrics import CONTENT_TYPE
from hybridspec.server.openapi import error_responses
from hybridspec.server.protocol import Health, JsonInt, _Body
from hybridspec.server.state import ServerState, State

logger = logging.getLogger(__name__)

router = APIRouter(tags=["operations"])

METRICS_SNAPSHOT_TIMEOUT_S = 1.0
HOLD_TIMEOUT_S = 30.0  # the default of ``/bench/hold``'s timeout_s
MAX_HOLD_TIMEOUT_S = 600.0


class BenchHold(_Body):
    requests: JsonInt
    timeout_s: float = HOLD_TIMEOUT_S


def _engine_state(engine: Engine) -> tuple[int, int, PrefixCacheStats]:
    return engine.num_running, engine.num_waiting, engine.prefix_cache.stats()


@router.get("/health", response_model=Health, responses=error_responses(503))
async def health(state: State) -> JSONResponse:
    """200 while the engine thread answers between steps; 503 when it does not in time."""
    try:
        await state.engine_call(_engine_state, state.config.health_timeout_s)
    except asyncio.TimeoutError:
        return error_response(
            503,
            "the engine loop is not responding",
            type_="server_error",
            code="engine_unresponsive",
        )
    if state.cluster is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "ok", "replicas": await state.cluster.replicas_up()})


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(state: State) -> Response:
    """This server's metrics; a replica of many answers every live replica's, each series
    labelled with its replica."""
    own = await metrics_snapshot(state)
    body = own if state.cluster is None else await state.cluster.metrics(own)
    return Response(body, media_type=CONTENT_TYPE)


async def metrics_snapshot(state: ServerState) -> bytes:
    """The exposition, with the batch and queue sizes read from the engine between steps, and
    each engine's seconds of steps (``EngineLoop.step_seconds``)."""
    try:
        running, waiting, cache = await state.engine_call(_engine_state, METRICS_SNAPSHOT_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.info("engine busy; /metrics reports the previous batch and queue sizes")
    else:
        state.metrics.set_engine_state(running, waiting)
        state.metrics.set_prefix_cache(cache)
    state.metrics.set_step_seconds(state.loop.step_seconds)
    return state.metrics.render()


# Included by the app under ``--bench-twin`` only: a server without a twin has no such route.
bench_router = APIRouter(tags=["operations"], include_in_schema=False)


@bench_router.post("/bench/hold")
async def bench_hold(body: BenchHold, state: State) -> JSONResponse:
    """Hold the engines' steps until they hold ``requests`` requests (module docstring)."""
    check(body.requests >= 1, "requests", f"expected an integer >= 1, got {body.requests}")
    check(
        0 < body.timeout_s <= MAX_HOLD_TIMEOUT_S,
        "timeout_s",
        f"expected seconds in (0, {MAX_HOLD_TIMEOUT_S:g}], got {body.timeout_s}",
    )
    state.loop.hold(body.requests, body.timeout_s)
    return JSONResponse({"requests": body.requests, "timeout_s": body.timeout_s})
