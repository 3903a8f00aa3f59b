"""The app factory. Importing or creating the app loads no model: ``lifespan`` does.

On startup the lifespan builds the Engine (``engine_factory``, by default ``Engine``), hands it
to an EngineLoop (the one thread that steps it) and keeps a ServerState on ``app.state.server``.
On shutdown it aborts whatever the engine still holds, stops the loop and closes the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from hybridspec.config import EngineConfig
from hybridspec.engine import Engine, EngineLoop
from hybridspec.server import completions, models, ops
from hybridspec.server.config import ServerConfig
from hybridspec.server.errors import install_error_handlers
from hybridspec.server.metrics import ServerMetrics
from hybridspec.server.ops import RequestCountingMiddleware
from hybridspec.server.state import ModelInfo, ServerState

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], Engine]
SHUTDOWN_ABORT_TIMEOUT_S = 10.0


def _abort_all(engine: Engine) -> int:
    return len(engine.abort_all())


def create_app(
    config: ServerConfig | EngineConfig | None = None,
    *,
    engine_factory: EngineFactory | None = None,
) -> FastAPI:
    """Build the OpenAI-compatible app.

    ``config`` is a ServerConfig, or an EngineConfig (served with default server options).
    ``engine_factory`` builds the engine from ``config.engine`` at startup; tests pass one that
    returns an engine over a prebuilt model. The app closes the engine when it shuts down.
    """
    if config is None or isinstance(config, EngineConfig):
        server_config = ServerConfig(engine=config if config is not None else EngineConfig())
    else:
        server_config = config
    factory: EngineFactory = engine_factory if engine_factory is not None else Engine
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = factory(server_config.engine)
        loop = EngineLoop(engine)
        try:
            model = await loop.call(lambda e: ModelInfo.from_engine(e, server_config))
            app.state.server = ServerState(server_config, loop, model, metrics)
            logger.info("serving %s with proposers %s", model.name, ", ".join(model.proposers))
            yield
        finally:
            try:
                aborted = await asyncio.wait_for(loop.call(_abort_all), SHUTDOWN_ABORT_TIMEOUT_S)
                if aborted:
                    logger.info("aborted %d unfinished requests at shutdown", aborted)
            except asyncio.TimeoutError:
                logger.warning("the engine loop did not answer at shutdown")
            loop.close()
            engine.close()

    app = FastAPI(title="hybridspec", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app, server_config.retry_after_s)
    app.add_middleware(RequestCountingMiddleware, metrics=metrics)
    app.include_router(completions.router)
    app.include_router(models.router)
    app.include_router(ops.router)
    return app
