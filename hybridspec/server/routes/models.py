"""Routes ``GET /v1/models`` and ``GET /v1/models/{model}``: the target and its proposers."""

from __future__ import annotations

from fastapi import APIRouter

from hybridspec.config import MAX_SPECULATIVE_TOKENS, MIN_SPECULATIVE_TOKENS
from hybridspec.server.openapi import error_responses
from hybridspec.server.protocol import ModelCard, ModelList
from hybridspec.server.state import ModelInfo, State

router = APIRouter(tags=["models"])


def model_card(model: ModelInfo) -> ModelCard:
    return ModelCard(
        id=model.name,
        created=model.created,
        max_model_len=model.max_seq_len,
        hybridspec={
            "aliases": list(model.names[1:]),
            "proposers": [
                {
                    "name": name,
                    "default": name == model.default_proposer,
                    "default_num_speculative_tokens": model.default_num_speculative_tokens,
                }
                for name in model.proposers
            ],
            "default_proposer": model.default_proposer,
            "default_num_speculative_tokens": model.default_num_speculative_tokens,
            "num_speculative_tokens_range": [MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS],
            "num_threads": model.num_threads,
        },
    )


@router.get("/v1/models")
async def list_models(state: State) -> ModelList:
    return ModelList(data=[model_card(state.model)])


@router.get("/v1/models/{model:path}", responses=error_responses(404))
async def retrieve_model(model: str, state: State) -> ModelCard:
    state.model.resolve(model)
    return model_card(state.model)
