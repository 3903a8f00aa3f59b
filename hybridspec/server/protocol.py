"""Pydantic models mirroring the OpenAI schema, plus hybridspec's extension fields.

Request bodies are strict (no string-to-number coercion) and refuse unknown fields, as the
OpenAI API does; value ranges are checked by the engine's own parameter classes, so that every
bound lives in one place (``hybridspec.config``, ``hybridspec.types``). Extension fields in a
request: ``proposer``, ``num_speculative_tokens``, ``top_k``, ``ignore_eos``, ``cache_prompt``,
``cache_salt``, ``repetition_penalty``, ``min_p``, ``min_tokens``, ``stop_token_ids``,
``guided_regex``, ``guided_grammar``. In a response: ``hybridspec`` (the request's speculation
statistics, its choices' together; in a stream, each choice's on its final chunk).

One module over 400 lines, on purpose: the request and response models share their message
classes (a ``ToolCall`` is part of an assistant message in a request and in a response), and the
OpenAPI document (``server.openapi``) is built from the whole set.

Every optional field takes null and then means its default, as OpenAI's schema allows (clients
that send every field send nulls); a field whose default is not null says it in its
description.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hybridspec.config import MAX_SPECULATIVE_TOKENS, MIN_SPECULATIVE_TOKENS
from hybridspec.types import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
)

FinishReasonName = Literal["stop", "length", "tool_calls"]
MAX_COMPLETION_LOGPROBS = 5  # as in the OpenAI legacy completions API
# A token id as a ``logit_bias`` key: a decimal integer without leading zeros. The served
# document narrows it to the model's vocabulary (``openapi``).
TOKEN_ID_PATTERN = "^(0|[1-9][0-9]*)$"
# Seeds the API takes: integers that every JSON parser (JavaScript's, schemathesis' float
# arithmetic) reads exactly. The library takes seeds up to 2**63 - 1.
MAX_JSON_SEED = 2**53 - 1


def _integral(value: Any) -> Any:
    """1.0 and 1e3 are integers in JSON Schema (numbers without a fractional part): take them
    as ints. Anything else goes on to strict validation (a string or 1.5 stays an error)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def documented(**bounds: Any) -> Any:
    """A field whose bounds the schema states and the engine's parameter classes enforce (with
    messages naming the field): ``documented(minimum=1)``. Field(ge=...) would enforce them a
    second time, with pydantic's wording."""
    return Field(default=None, json_schema_extra=bounds)


class StreamOptions(_Body):
    include_usage: bool | None = Field(default=None, description="Default false.")
    # vLLM's extension, which load generators (guidellm) send: with include_usage, every chunk
    # carries the usage so far, not only the last one.
    continuous_usage_stats: bool | None = Field(default=None, description="Default false.")
    include_drafts: bool | None = Field(
        default=None,
        description="Each text chunk also carries its tokens and their origin: 'tokens' on "
        "the chunk's choice (hybridspec extension; not with tools). Default false.",
    )


# A source the engine compiles (``guided_*``): empty is refused (``types.GrammarSpec``).
NON_EMPTY_STRING_OR_NULL: list[dict[str, Any]] = [
    {"type": "string", "minLength": 1},
    {"type": "null"},
]

# ``stream_options`` only with ``stream: true``, as in the OpenAI API.
STREAM_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def present(field: str) -> dict[str, Any]:
    """JSON Schema: ``field`` is given and not null."""
    return {"required": [field], "properties": {field: {"not": {"type": "null"}}}}


# ``max_tokens: 0`` only with ``echo: true`` (scoring the prompt).
ZERO_TOKENS_NEED_ECHO: dict[str, Any] = {
    "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
    "then": {"required": ["echo"], "properties": {"echo": {"const": True}}},
}
# ``top_logprobs`` only with ``logprobs: true``, as in the OpenAI API.
TOP_LOGPROBS_NEED_LOGPROBS: dict[str, Any] = {
    "if": present("top_logprobs"),
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


class _SamplingFields(_Body):
    """Fields shared by completion and chat completion requests."""

    model_config = ConfigDict(json_schema_extra=STREAM_OPTIONS_NEED_STREAM)

    model: str | None = None  # None: the served model
    max_tokens: JsonInt | None = documented(
        minimum=1,
        description="At most this many tokens; generation also ends when the context is full "
        "(finish_reason 'length').",
    )
    temperature: float | None = documented(minimum=0, description="0: greedy. Default 1.")
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: JsonInt | None = documented(minimum=1)
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
    seed: JsonInt | None = documented(
        minimum=0,
        maximum=MAX_JSON_SEED,
        description="Reproducible sampling; below 2**53, where every JSON number is exact.",
    )
    n: JsonInt | None = documented(
        minimum=1,
        description="Choices per prompt, sharing its prefill; at most the server's batch slots "
        "(the document states them). Choice i samples with seed + i.",
    )
    stream: bool | None = Field(default=None, description="Default false.")
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = documented(
        minimum=-MAX_PENALTY,
        maximum=MAX_PENALTY,
        description="Subtracted from the logit of every token already generated. Default 0.",
    )
    frequency_penalty: float | None = documented(
        minimum=-MAX_PENALTY,
        maximum=MAX_PENALTY,
        description="Times the number of times a token was generated, subtracted from its "
        "logit. Default 0.",
    )
    logit_bias: dict[str, float] | None = documented(
        maxProperties=MAX_LOGIT_BIAS_ENTRIES,
        propertyNames={"pattern": TOKEN_ID_PATTERN},
        additionalProperties={
            "type": "number",
            "minimum": -MAX_LOGIT_BIAS,
            "maximum": MAX_LOGIT_BIAS,
        },
        description="Token id (a decimal string) -> a bias added to its logit.",
    )
    repetition_penalty: float | None = documented(
        minimum=MIN_REPETITION_PENALTY,
        maximum=MAX_REPETITION_PENALTY,
        description="A logit of a token in the prompt or the generated text is divided by it "
        "when positive, else multiplied (extension). Default 1.",
    )
    min_p: float | None = documented(
        minimum=0,
        maximum=1,
        description="Tokens less likely than min_p times the most likely are dropped "
        "(extension). Default 0.",
    )
    min_tokens: JsonInt | None = documented(
        minimum=0, description="EOS is not generated before this many tokens (extension)."
    )
    user: str | None = Field(
        default=None, description="Accepted; sticks a session to a replica (hybridspec.deploy)."
    )
    # hybridspec extensions
    proposer: str | None = Field(
        default=None, description="The proposer (hybridspec extension); default: the server's."
    )
    num_speculative_tokens: JsonInt | None = documented(
        minimum=MIN_SPECULATIVE_TOKENS,
        maximum=MAX_SPECULATIVE_TOKENS,
        description="K, the most drafts per round (hybridspec extension).",
    )
    ignore_eos: bool | None = Field(
        default=None, description="Generate past EOS (extension). Default false."
    )
    cache_prompt: bool | None = Field(
        default=None,
        description="Reuse and keep this request's tokens in the prefix cache (extension, "
        "llama.cpp's name). Default true.",
    )
    cache_salt: str | None = documented(
        anyOf=NON_EMPTY_STRING_OR_NULL,
        description="Cached text (prefix cache, suffix pools) is reused only between requests "
        "of the same salt, within the tenant under per-tenant isolation (as vLLM's).",
    )
    stop_token_ids: list[JsonInt] | None = documented(
        maxItems=MAX_STOP_TOKEN_IDS,
        items={"type": "integer", "minimum": 0},
        description="Token ids that end the text as EOS does, left out of it (extension).",
    )
    guided_regex: str | None = documented(
        anyOf=NON_EMPTY_STRING_OR_NULL,
        description="The output matches this regular expression (extension, as vLLM's).",
    )
    guided_grammar: str | None = documented(
        anyOf=NON_EMPTY_STRING_OR_NULL,
        description="The output matches this EBNF grammar, start rule 'root' (extension, as "
        "vLLM's; xgrammar's syntax, that of llama.cpp's GBNF).",
    )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``; ``prompt`` may be text or token ids, one prompt or a list
    (run batched; the document bounds the list by the server's queue and slots)."""

    prompt: str | list[str] | list[JsonInt] | list[list[JsonInt]] = Field(
        json_schema_extra={
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0},
                        "minItems": 1,
                    },
                    "minItems": 1,
                },
            ]
        }
    )
    model_config = ConfigDict(
        json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM, ZERO_TOKENS_NEED_ECHO]}
    )

    max_tokens: JsonInt | None = documented(
        minimum=0,
        description="At most this many tokens (default 16); 0 only with echo, to score the "
        "prompt. Generation also ends when the context is full (finish_reason 'length').",
    )
    echo: bool | None = Field(default=None, description="Default false.")
    suffix: str | None = documented(
        anyOf=[{"type": "string", "maxLength": 0}, {"type": "null"}],
        description="Text after the completion: only null or empty is supported.",
    )
    logprobs: JsonInt | None = documented(
        minimum=0,
        maximum=MAX_COMPLETION_LOGPROBS,
        description="The chosen token's logprob and this many others.",
    )
    best_of: JsonInt | None = documented(minimum=1, maximum=1, description="Only 1 is supported.")


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(BaseModel):
    """A function call: its name and its arguments as JSON text (OpenAI's format)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """An input message; extra keys that clients echo back (``refusal``...) are ignored. A
    ``developer`` message is a ``system`` one; an assistant message may carry the
    ``tool_calls`` it made, and a ``tool`` message answers one (``tool_call_id``)."""

    model_config = ConfigDict(extra="ignore")

    role: ChatRole
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(_Body):
    name: str = Field(json_schema_extra={"pattern": "^[a-zA-Z0-9_-]{1,64}$"})
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (JSON matching
    ``json_schema.schema``; without a schema, any JSON object). Output is constrained by the
    grammar in every case, ``strict`` or not."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Body):
    name: str = Field(json_schema_extra={"pattern": "^[a-zA-Z0-9_-]{1,64}$"})
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``store``, ``metadata``, ``service_tier``,
    ``prompt_cache_key``, ``safety_identifier``, ``reasoning_effort`` and ``verbosity`` are
    documented OpenAI fields that do not change the output here: they are accepted (clients
    send them) and change nothing (the model does not reason; the prefix cache needs no key).
    ``modalities`` may only ask for text."""

    model_config = ConfigDict(
        json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM, TOP_LOGPROBS_NEED_LOGPROBS]}
    )

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: JsonInt | None = documented(minimum=1)
    logprobs: bool | None = None
    top_logprobs: JsonInt | None = documented(minimum=0, maximum=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, json_schema_extra={"maxItems": 64})
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="'required' or a named function: the output is a call, constrained to the "
        "functions' parameters. 'auto' (the default with tools): text or calls, as the model "
        "decides; where the chat template does not show tools, they are described to the "
        "model and a grammar allows either text or the array of calls.",
    )
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    parallel_tool_calls: bool | None = Field(default=None, description="Default true.")
    prompt_cache_key: str | None = Field(default=None, description="Accepted and ignored.")
    safety_identifier: str | None = Field(default=None, description="Accepted and ignored.")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        default=None, description="Accepted; no effect (the model does not reason)."
    )
    verbosity: Literal["low", "medium", "high"] | None = Field(
        default=None, description="Accepted; no effect."
    )
    modalities: list[str] | None = Field(
        default=None,
        json_schema_extra={"items": {"const": "text"}},
        description="Only ['text'] (or null) is supported.",
    )


# ---------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache, as OpenAI reports them


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


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


class DraftToken(BaseModel):
    """A streamed token and its origin (``stream_options.include_drafts``). ``text``: the
    token's text decoded after the tokens before it (empty while it holds part of a character,
    which the next token's text completes)."""

    id: int
    text: str
    drafted_by: str | None = Field(
        description="The proposer whose draft the target accepted; null: the target's own "
        "token (a round's bonus or recovered token, or plain decoding)."
    )


class CompletionChunkChoice(CompletionChoice):
    tokens: list[DraftToken] | None = None  # only with stream_options.include_drafts


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    hybridspec: SpeculationStats | None = None


class CompletionChunk(CompletionResponse):
    """A streamed text completion's event (OpenAI streams the response's own shape)."""

    choices: list[CompletionChunkChoice]  # type: ignore[assignment]  # a narrower choice


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


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


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: the first of each call carries its id and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    tokens: list[DraftToken] | None = None  # only with stream_options.include_drafts


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
    replicas: int | None = Field(
        default=None, ge=1, description="replicas up, when served by several (hybridspec.deploy)"
    )
