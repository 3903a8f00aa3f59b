"""What the app keeps on ``app.state`` while it runs, and the dependencies that read it.

Routes receive the state through ``Depends(get_state)``; tests may override that dependency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from hybridspec.engine import Engine, EngineLoop
from hybridspec.engine.resolution import ProposerCatalog
from hybridspec.errors import UnknownModelError
from hybridspec.model import num_threads
from hybridspec.server.cluster import Cluster
from hybridspec.server.config import ServerConfig
from hybridspec.server.grammars import GrammarPool
from hybridspec.server.logprobs import TokenTexts
from hybridspec.server.metrics import ServerMetrics
from hybridspec.server.prompts import PromptEncoder
from hybridspec.server.shutdown import Shutdown

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about the served engine, read once at startup on the engine thread (``from_engine``
    is given to ``EngineLoop.call``) before any request runs."""

    names: tuple[str, ...]  # names[0] is listed; every one is accepted in requests
    max_seq_len: int
    vocab_size: int  # prompt token ids are below it
    # the engine's proposers and defaults, which requests resolve against before tokenizing
    catalog: ProposerCatalog
    max_choices: int  # n: the engine's slots, as a prompt's choices run at once
    max_queue_size: int  # prompts waiting for slots (``EngineConfig.max_queue_size``)
    num_threads: int  # the forward's CPU threads, read on the engine thread (``model.threads``)
    created: int = field(default_factory=lambda: int(time.time()))

    @staticmethod
    def from_engine(engine: Engine, config: ServerConfig) -> ModelInfo:
        return ModelInfo(
            names=config.model_names(),
            max_seq_len=engine.max_seq_len,
            vocab_size=engine.vocab_size,
            catalog=engine.catalog,
            max_choices=engine.max_num_seqs,
            max_queue_size=engine.config.max_queue_size,
            num_threads=num_threads(),
        )

    @property
    def proposers(self) -> tuple[str, ...]:
        """The proposers requests may pick."""
        return self.catalog.names()

    @property
    def unavailable_proposers(self) -> dict[str, str]:
        """Registered proposers that could not be built: name -> why."""
        return dict(self.catalog.unavailable)

    @property
    def default_proposer(self) -> str:
        return self.catalog.default_proposer

    @property
    def default_num_speculative_tokens(self) -> int:
        return self.catalog.default_num_speculative_tokens

    @property
    def max_prompts(self) -> int:
        """Prompts in one request: as many as the queue and the slots hold."""
        return self.max_queue_size + self.max_choices

    @property
    def name(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The served name for a request's ``model``; raises UnknownModelError (404)."""
        if requested is None or requested in self.names:
            return self.name
        raise UnknownModelError(
            f"model: the model {requested!r} does not exist; this server serves {self.name!r}",
            param="model",
        )


@dataclass(slots=True)
class ServerState:
    """The running server: its engine loop (sole owner of the engine), the prompt encoder
    (worker threads), metrics and facts; ``cluster``, for a replica of many (else None)."""

    config: ServerConfig
    loop: EngineLoop
    model: ModelInfo
    metrics: ServerMetrics
    prompts: PromptEncoder
    grammars: GrammarPool  # compiles requests' grammars on worker threads
    token_texts: TokenTexts = field(default_factory=TokenTexts)  # for logprobs
    cluster: Cluster | None = None
    shutdown: Shutdown = field(default_factory=Shutdown)  # server.shutdown

    async def engine_call(self, fn: Callable[[Engine], T], timeout_s: float | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (snapshots for /health)."""
        result: T = await asyncio.wait_for(self.loop.call(fn), timeout_s)
        return result


def get_state(request: Request) -> ServerState:
    state = getattr(request.app.state, "server", None)
    assert isinstance(state, ServerState), "the app's lifespan has not run"
    return state


State = Annotated[ServerState, Depends(get_state)]
