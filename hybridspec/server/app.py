"""The app factory. Importing or creating the app loads no model: ``lifespan`` does.

On startup the lifespan builds the Engine (``engine_factory``, by default ``Engine``), warms it up
(``hybridspec.engine.warmup``: every kernel compiled or loaded from its disk cache before the first
request; then the grammar compiler, ``GrammarPool.warm``), freezes the heap where the config says
(``freeze_heap``), hands it to an EngineLoop (the one thread that steps it), keeps a ServerState
on ``app.state.server`` and logs one ``ready:`` line. Until then the server accepts no
connection, so ``/health`` answers 200 only once the engine is warm. On shutdown it aborts
whatever the engine still holds, stops the loop and closes the engine. With ``bench_twin``, the
loop also builds the engine's twin (``twin_engine``), which runs the requests for ``none``, and
the twin is warmed up, aborted and closed with it, and the app has the bench's ``/bench/hold``
(``routes.ops``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from hybridspec.config import DraftConfig, EngineConfig
from hybridspec.engine import Engine, EngineLoop, freeze_heap, warm_up
from hybridspec.server.cluster import Cluster
from hybridspec.server.config import ServerConfig
from hybridspec.server.errors import install_error_handlers
from hybridspec.server.grammars import GrammarPool
from hybridspec.server.metrics import ServerMetrics
from hybridspec.server.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    HeadMiddleware,
    RequestCountingMiddleware,
    RouteTemplates,
    TimeoutMiddleware,
)
from hybridspec.server.openapi import install_openapi
from hybridspec.server.prompts import PromptEncoder, longest_token_chars
from hybridspec.server.routes import ROUTERS
from hybridspec.server.routes.ops import bench_router, metrics_snapshot
from hybridspec.server.state import ModelInfo, ServerState
from hybridspec.server.tenants import KeyRing

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], Engine]
SHUTDOWN_ABORT_TIMEOUT_S = 10.0


def twin_engine(engine: Engine) -> Engine:
    """A second engine over ``engine``'s weights and on its options, its caches its own and no
    draft model (it runs ``none`` alone: ``engine.loop``)."""
    config = dataclasses.replace(engine.config, draft=DraftConfig(None))
    return Engine(config, target=engine.target)


def ready_line(engine: Engine, model: ModelInfo, steps: dict[str, float]) -> str:
    """``ready: NAME (SOURCE -> DTYPE), N threads, proposers A,B; STEP S s, ...``."""
    kind, _, where = engine.target.source.partition(":")
    dtype = str(engine.target.dtype).removeprefix("torch.")
    timings = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in steps.items())
    return (
        f"ready: {model.name} ({kind} {Path(where).name} -> {dtype}), "
        f"{model.num_threads} threads, proposers {','.join(model.proposers)}; {timings}"
    )


def create_app(
    config: ServerConfig | EngineConfig | None = None,
    *,
    engine_factory: EngineFactory | None = None,
    import_s: float | None = None,
    cluster: Cluster | None = None,
) -> FastAPI:
    """Build the OpenAI-compatible app.

    ``config`` is a ServerConfig, or an EngineConfig (served with default server options).
    ``engine_factory`` builds the engine from ``config.engine`` at startup; tests pass one that
    returns an engine over a prebuilt model. The app closes the engine when it shuts down.
    ``import_s``: the seconds the caller spent importing the server, for the ``ready:`` line.
    ``cluster``: the replicas beside this one, when the app is one replica of many
    (``hybridspec.deploy``); started once the engine is warm, stopped at shutdown.
    """
    if config is None or isinstance(config, EngineConfig):
        server_config = ServerConfig(engine=config if config is not None else EngineConfig())
    else:
        server_config = config
    factory: EngineFactory = engine_factory if engine_factory is not None else Engine
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        steps = {} if import_s is None else {"import": import_s}
        start = time.perf_counter()
        # Built, warmed up and stepped on the engine thread alone: one team of OpenMP workers
        # (engine.loop). ModelInfo is read there too, before any request runs.
        twin = twin_engine if server_config.bench_twin else None
        loop = await EngineLoop.start(lambda: factory(server_config.engine_config()), twin=twin)
        steps["load"] = time.perf_counter() - start
        engine = loop.engine
        prompts: PromptEncoder | None = None
        grammars: GrammarPool | None = None
        started = False
        try:
            steps["warm-up"] = await loop.call(lambda _: sum(map(warm_up, loop.engines)))
            model = await loop.call(lambda e: ModelInfo.from_engine(e, server_config))
            prompts = prompt_encoder(engine, server_config)
            grammars = GrammarPool(engine.grammars, server_config.grammar_timeout_s)
            await grammars.warm()  # not on the first structured request's path (server.grammars)
            if server_config.freeze_heap:
                steps["gc"] = freeze_heap()
            state = ServerState(
                server_config, loop, model, metrics, prompts, grammars, cluster=cluster
            )
            app.state.server = state
            if cluster is not None:
                await cluster.start(lambda: metrics_snapshot(state))
                started = True
            logger.info("%s", ready_line(engine, model, steps))
            yield
        finally:
            if started and cluster is not None:
                await cluster.stop()
            if prompts is not None:
                prompts.close()
            if grammars is not None:
                grammars.close()
            await _stop(loop)
            for each in loop.engines:
                each.close()

    app = FastAPI(title="hybridspec", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app, server_config.retry_after_s)
    # Added innermost first: HEAD, counting, timeouts, the key, the body cap run before routing.
    templates = RouteTemplates(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=server_config.max_body_bytes)
    keys: list[tuple[str | None, str]] = list(server_config.tenant_keys)
    if server_config.api_key is not None:
        keys.append((None, server_config.api_key))
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=KeyRing(keys), templates=templates)
    app.add_middleware(
        TimeoutMiddleware,
        read_timeout_s=server_config.request_read_timeout_s,
        write_timeout_s=server_config.stream_write_timeout_s,
    )
    app.add_middleware(RequestCountingMiddleware, metrics=metrics, templates=templates)
    app.add_middleware(HeadMiddleware)
    for router in ROUTERS:
        app.include_router(router)
    if server_config.bench_twin:
        app.include_router(bench_router)
    install_openapi(app, api_key_required=bool(keys))
    return app


def prompt_encoder(engine: Engine, config: ServerConfig) -> PromptEncoder:
    """Tokenizes on worker threads; prompts hold at most ``config.max_prompt_tokens`` tokens
    (None: the context but one, the least room to generate)."""
    limit = engine.max_seq_len - 1
    if config.max_prompt_tokens is not None:
        limit = min(limit, config.max_prompt_tokens)
    chars = longest_token_chars(engine.tokenizer, engine.vocab_size)
    return PromptEncoder(engine.encode, engine.check_prompt, limit, chars, engine.tokenizer)


async def _stop(loop: EngineLoop) -> None:
    """Abort what the engine still holds, then stop its thread."""

    def abort_all(_: Engine) -> int:
        return sum(len(engine.abort_all()) for engine in loop.engines)

    try:
        aborted = await asyncio.wait_for(loop.call(abort_all), SHUTDOWN_ABORT_TIMEOUT_S)
        if aborted:
            logger.info("aborted %d unfinished requests at shutdown", aborted)
    except asyncio.TimeoutError:
        logger.warning("the engine loop did not answer at shutdown")
    loop.close()
