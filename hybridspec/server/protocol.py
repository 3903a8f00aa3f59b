"""Pydantic models mirroring the OpenAI schema, plus hybridspec's extension fields.

Request bodies are strict (no string-to-number coercion) and refuse unknown fields, as the
OpenAI API does; value ranges are checked by the engine's own parameter classes, so that every
bound lives in one place (``hybridspec.config``, ``hybridspec.types``). Extension fields in a
request: ``proposer``, ``num_speculative_tokens``, ``top_k``, ``ignore_eos``. In a response:
``hybridspec`` (the request's speculation statistics; in a stream, on the final chunk).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReasonName = Literal["stop", "length"]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension, which load generators (guidellm) send: with include_usage, every chunk
    # carries the usage so far, not only the last one.
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields shared by completion and chat completion requests."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0, as in the OpenAI API
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # hybridspec extensions
    proposer: str | None = None
    num_speculative_tokens: int | None = None
    ignore_eos: bool = False


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``; ``prompt`` may be text or token ids (one prompt only)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """An input message; extra keys that clients echo back (``refusal``...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


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


class TopLogprob(BaseModel):
    """A token and its log-probability (chat format). ``bytes``: the token's text in UTF-8."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """A returned token and the most likely tokens at its position (``top_logprobs`` many)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's (or chunk's) ``logprobs``: one entry per token of its content."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's ``logprobs`` (the legacy format): per token, its text, its
    log-probability (None for an echoed prompt's first token), a map of the most likely tokens
    and the token itself to their log-probabilities, and its offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
