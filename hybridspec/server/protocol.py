"""Pydantic models mirroring the OpenAI schema, plus hybridspec's extension fields.

Request bodies are strict (no string-to-number coercion) and refuse unknown fields, as the
OpenAI API does; value ranges are checked by the engine's own parameter classes, so that every
bound lives in one place (``hybridspec.config``, ``hybridspec.types``). Extension fields in a
request: ``proposer``, ``num_speculative_tokens``, ``top_k``, ``ignore_eos`` and vLLM's
``repetition_penalty`` (only 1). In a response: ``hybridspec`` (the request's speculation
statistics; in a stream, on the final chunk).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridspec.config import MAX_SPECULATIVE_TOKENS, MIN_SPECULATIVE_TOKENS
from hybridspec.engine.request import MAX_STOP_STRINGS
from hybridspec.types import MAX_SEED

FinishReasonName = Literal["stop", "length"]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def documented(**bounds: Any) -> Any:
    """A field whose bounds the schema states and the engine's parameter classes enforce (with
    messages naming the field): ``documented(minimum=1)``. Field(ge=...) would enforce them a
    second time, with pydantic's wording."""
    return Field(default=None, json_schema_extra=bounds)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension, which load generators (guidellm) send: with include_usage, every chunk
    # carries the usage so far, not only the last one.
    continuous_usage_stats: bool = False


# ``stream_options`` only with ``stream: true``, as in the OpenAI API.
STREAM_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


class _SamplingFields(_Body):
    """Fields shared by completion and chat completion requests."""

    model_config = ConfigDict(json_schema_extra=STREAM_OPTIONS_NEED_STREAM)

    model: str | None = None  # None: the served model
    max_tokens: int | None = documented(
        minimum=1,
        description="At most this many tokens; generation also ends when the context is full "
        "(finish_reason 'length').",
    )
    temperature: float | None = documented(minimum=0, description="0: greedy. Default 1.")
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = documented(minimum=1)
    stop: str | list[str] | None = documented(
        anyOf=[
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "maxItems": MAX_STOP_STRINGS,
            },
            {"type": "null"},
        ]
    )
    seed: int | None = documented(minimum=0, maximum=MAX_SEED - 1)
    n: int | None = documented(minimum=1, maximum=1, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = documented(
        minimum=0, maximum=0, description="Only 0 is supported."
    )
    frequency_penalty: float | None = documented(
        minimum=0, maximum=0, description="Only 0 is supported."
    )
    logit_bias: dict[str, float] | None = documented(
        maxProperties=0, description="Not supported: only an empty object."
    )
    user: str | None = None
    # hybridspec extensions
    proposer: str | None = Field(
        default=None, description="The proposer (hybridspec extension); default: the server's."
    )
    num_speculative_tokens: int | None = documented(
        minimum=MIN_SPECULATIVE_TOKENS,
        maximum=MAX_SPECULATIVE_TOKENS,
        description="K, the most drafts per round (hybridspec extension).",
    )
    ignore_eos: bool = Field(default=False, description="Generate past EOS (extension).")
    # vLLM's extension; its serving benchmark sends 1.0 on every completions request.
    repetition_penalty: float | None = documented(
        minimum=1, maximum=1, description="Only 1 (no penalty) is supported (extension)."
    )


TokenIds = list[int]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``; ``prompt`` may be text or token ids (one prompt only)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra={
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": 1,
                },
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0},
                        "minItems": 1,
                    },
                    "minItems": 1,
                    "maxItems": 1,
                },
            ]
        }
    )
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = documented(minimum=1, maximum=1, description="Only 1 is supported.")


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    """An input message; extra keys that clients echo back (``refusal``...) are ignored. A
    ``developer`` message is a ``system`` one."""

    model_config = ConfigDict(extra="ignore")

    role: ChatRole
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = documented(minimum=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


# ---------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationStats(BaseModel):
    """The ``hybridspec`` extension field: how speculation went for this one request."""

    proposer: str
    num_speculative_tokens: int
    acceptance_rate: float
    mean_accepted_length: float  # committed tokens per target forward
    target_forwards: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    acceptance_per_position: list[float]
    time_to_first_token_s: float | None
    elapsed_s: float
    tokens_per_second: float


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReasonName | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    hybridspec: SpeculationStats | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReasonName


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    hybridspec: SpeculationStats


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    hybridspec: SpeculationStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybridspec"
    max_model_len: int
    hybridspec: dict[str, Any] = Field(default_factory=dict)  # proposers and their defaults


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"
