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
from hybridspec.errors import InvalidRequestError, UnknownModelError
from hybridspec.server.cluster import Cluster
from hybridspec.server.config import ServerConfig
from hybridspec.server.logprobs import TokenTexts
from hybridspec.server.metrics import ServerMetrics
from hybridspec.server.prompts import PromptEncoder

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about the served engine, read once at startup before the engine loop runs."""

    names: tuple[str, ...]  # names[0] is listed; every one is accepted in requests
    max_seq_len: int
    vocab_size: int  # prompt token ids are below it
    proposers: tuple[str, ...]  # those that requests may pick
    unavailable_proposers: dict[str, str]  # registered but not built: name -> why
    default_proposer: str
    default_num_speculative_tokens: int
    max_choices: int  # n: the engine's slots, as a prompt's choices run at once
    max_queue_size: int  # prompts waiting for slots (``EngineConfig.max_queue_size``)
    created: int = field(default_factory=lambda: int(time.time()))

    @staticmethod
    def from_engine(engine: Engine, config: ServerConfig) -> ModelInfo:
        return ModelInfo(
            names=config.model_names(),
            max_seq_len=engine.max_seq_len,
            vocab_size=engine.vocab_size,
            proposers=tuple(engine.available_proposers()),
            unavailable_proposers=engine.unavailable_proposers(),
            default_proposer=engine.config.default_proposer,
            default_num_speculative_tokens=engine.config.default_num_speculative_tokens,
            max_choices=engine.max_num_seqs,
            max_queue_size=engine.config.max_queue_size,
        )

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

    def resolve_proposer(self, requested: str | None) -> str:
        """The proposer a request runs with; InvalidRequestError (400) naming the choices when
        it is unknown or unavailable, as ``Engine.add_request`` would say."""
        name = requested or self.default_proposer
        if name in self.unavailable_proposers:
            raise InvalidRequestError(
                f"proposer: {name!r} is not available: {self.unavailable_proposers[name]}",
                "proposer",
            )
        if name not in self.proposers:
            known = ", ".join(sorted({*self.proposers, *self.unavailable_proposers}))
            raise InvalidRequestError(
                f"proposer: unknown proposer {name!r}; registered: {known}", "proposer"
            )
        return name


@dataclass(slots=True)
class ServerState:
    """The running server: its engine loop (sole owner of the engine), the prompt encoder
    (worker threads), metrics and facts; ``cluster``, for a replica of many (else None)."""

    config: ServerConfig
    loop: EngineLoop
    model: ModelInfo
    metrics: ServerMetrics
    prompts: PromptEncoder
    token_texts: TokenTexts = field(default_factory=TokenTexts)  # for logprobs
    cluster: Cluster | None = None

    async def engine_call(self, fn: Callable[[Engine], T], timeout_s: float | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (snapshots for /health)."""
        result: T = await asyncio.wait_for(self.loop.call(fn), timeout_s)
        return result


def get_state(request: Request) -> ServerState:
    state = getattr(request.app.state, "server", None)
    assert isinstance(state, ServerState), "the app's lifespan has not run"
    return state


State = Annotated[ServerState, Depends(get_state)]
