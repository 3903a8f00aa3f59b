"""From an OpenAI request body to engine outputs and back: validation, tokenizing, running,
metrics, the response body.

Both endpoints share this path, and nothing here depends on the web framework (a deployment
other than the FastAPI app can hold a ``ServerState`` and call the same functions). ``prepare``
turns a body into a ``PreparedRequest`` (prompt token ids, GenerationParams) or raises
InvalidRequestError / UnknownModelError naming the field. ``observe`` runs it through the engine
loop, yielding its outputs and recording metrics; closing it early (client gone) aborts the
request in the engine. ``response_body`` is a finished request's non-streamed response
(``hybridspec.server.streaming`` writes the streamed one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import cast

from hybridspec.engine import FinishReason, GenerationParams, Logprobs, RequestOutput
from hybridspec.errors import HybridSpecError, check
from hybridspec.server.errors import GenerationFailed
from hybridspec.server.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    logprobs_options,
    token_ids_of,
)
from hybridspec.server.prompts import prompt_of
from hybridspec.server.protocol import (
    MAX_JSON_SEED,
    TOKEN_ID_PATTERN,
    AssistantMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FinishReasonName,
    SpeculationStats,
    ToolCall,
    Usage,
)
from hybridspec.server.state import ServerState
from hybridspec.server.structured import ToolPlan, grammar_of, tool_calls, tool_plan
from hybridspec.types import GenerationStats

OPENAI_DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request, ready for the engine loop."""

    model: str  # the served name, echoed in responses
    prompt_token_ids: list[int]
    params: GenerationParams
    proposer: str  # resolved: the request's or the engine's default
    num_speculative_tokens: int  # resolved likewise
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage so far on every chunk (needs include_usage, as in vLLM)
    chat: bool  # a chat completion (else a text completion)
    # A completion's echoed prompt (``echo``); its logprobs come when ``params.logprobs`` is set.
    echo_text: str | None = None
    tools: ToolPlan | None = None  # a chat request's tools (``server.structured``)

    @property
    def calls_tools(self) -> bool:
        """True when the answer may be ``tool_calls`` rather than text."""
        return self.tools is not None and self.tools.mode != "none"

    @property
    def echo_logprobs(self) -> bool:
        return self.echo_text is not None and self.params.logprobs is not None


def _reject_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse OpenAI options this server does not implement, rather than ignore them, and
    those that mean nothing here (as the OpenAI API does)."""
    check(
        body.stream or body.stream_options is None,
        "stream_options",
        "stream_options is only allowed when stream is true",
    )
    check(body.n is None or body.n == 1, "n", f"only n = 1 is supported, got {body.n}")
    if isinstance(body, CompletionRequest):
        check(body.best_of is None or body.best_of == 1, "best_of", "only best_of = 1 is supported")


def _logit_bias(
    body: CompletionRequest | ChatCompletionRequest, vocab_size: int
) -> dict[int, float]:
    """``logit_bias`` with integer keys: token ids of the vocabulary, written as in the schema.

    Keys are matched as JSON Schema validators match the document's ``pattern`` (``re.search``,
    whose ``$`` also matches before a final newline), so the server takes exactly what the
    document states.
    """
    bias = body.logit_bias or {}
    bad = [key for key in bias if not re.search(TOKEN_ID_PATTERN, key)]
    check(not bad, "logit_bias", f"keys must be token ids (decimal integers), got {bad[:5]}")
    ids = {key: key.removesuffix("\n") for key in bias}
    # The length test first: int() refuses strings of over 4300 digits.
    outside = [k for k, d in ids.items() if len(d) > len(str(vocab_size)) or int(d) >= vocab_size]
    check(
        not outside,
        "logit_bias",
        f"token ids must be below the vocabulary size {vocab_size}, got {outside[:5]}",
    )
    return {int(ids[key]): value for key, value in bias.items()}


def _params(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> GenerationParams:
    """The body's generation options; ``max_new_tokens`` is set once the prompt is tokenized."""
    temperature = body.temperature
    check(
        body.seed is None or 0 <= body.seed <= MAX_JSON_SEED,
        "seed",
        f"expected an integer in [0, 2**53), got {body.seed}",
    )
    logit_bias = _logit_bias(body, vocab_size)
    logprobs, prompt_logprobs = logprobs_options(body)
    return GenerationParams.create(
        max_new_tokens=1,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        temperature=temperature if temperature is not None else OPENAI_DEFAULT_TEMPERATURE,
        top_k=body.top_k,
        top_p=body.top_p if body.top_p is not None else 1.0,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
        logit_bias=logit_bias,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0,
        proposer=body.proposer,
        num_speculative_tokens=body.num_speculative_tokens,
        stop=body.stop,
        ignore_eos=body.ignore_eos,
    )


def _completion_budget(max_seq_len: int, num_prompt_tokens: int, max_tokens: int | None) -> int:
    """``max_tokens``, at most the rest of the context (None: all of it). A larger
    ``max_tokens`` is a bound, not an error: generation ends when the context is full, with
    finish_reason ``length`` (as llama.cpp's server does; clients often send a large default)."""
    room = max_seq_len - num_prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


async def prepare(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest
) -> PreparedRequest:
    """Validate ``body`` and tokenize its prompt on a worker thread (``server.prompts``)."""
    model = state.model.resolve(body.model)
    _reject_unsupported(body)
    renders = state.prompts.renders_tools
    tools = tool_plan(body, renders) if isinstance(body, ChatCompletionRequest) else None
    prompt = prompt_of(body, tools, renders)
    params = _params(body, state.model.vocab_size)
    grammar = grammar_of(body, tools)
    proposer = state.model.resolve_proposer(params.proposer)
    k = params.num_speculative_tokens or state.model.default_num_speculative_tokens
    options = body.stream_options
    ids = await state.prompts.encode(prompt)
    echo_text = None
    if isinstance(body, CompletionRequest) and body.echo:
        echo_text = prompt.text if prompt.text is not None else await state.prompts.decode(ids)
    max_tokens = _completion_budget(state.model.max_seq_len, len(ids), prompt.max_tokens)
    return PreparedRequest(
        model=model,
        prompt_token_ids=ids,
        params=dataclasses.replace(params, max_new_tokens=max_tokens, grammar=grammar),
        proposer=proposer,
        num_speculative_tokens=k,
        stream=body.stream,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None
        and options.include_usage
        and options.continuous_usage_stats,
        chat=isinstance(body, ChatCompletionRequest),
        echo_text=echo_text,
        tools=tools,
    )


async def observe(
    state: ServerState, prepared: PreparedRequest
) -> AsyncGenerator[RequestOutput, None]:
    """Run ``prepared`` on the engine loop and yield its outputs, recording metrics.

    Refusals (InvalidRequestError, CapacityError) raise on the first ``__anext__``. Closing or
    cancelling this generator before the last output aborts the request in the engine.
    """
    metrics, proposer = state.metrics, prepared.proposer
    arrival = time.perf_counter()
    finished, refused, first = False, False, True
    try:
        # EngineLoop.stream is an async generator (typed as an AsyncIterator): closable.
        stream = cast(
            AsyncGenerator[RequestOutput, None],
            state.loop.stream(prepared.prompt_token_ids, prepared.params),
        )
        async with contextlib.aclosing(stream) as outputs:
            async for output in outputs:
                if first:
                    first = False
                    ttft_s = time.perf_counter() - arrival
                    metrics.observe_first_token(proposer, ttft_s, len(prepared.prompt_token_ids))
                metrics.observe_tokens(proposer, len(output.new_token_ids))
                if output.finished:
                    finished = True
                    reason = output.finish_reason or FinishReason.ERROR
                    metrics.observe_finished(proposer, reason.value)
                    if output.result is not None and reason is not FinishReason.ERROR:
                        metrics.observe_result(
                            proposer, output.result.stats, time.perf_counter() - arrival
                        )
                yield output
    except HybridSpecError:
        refused = first
        raise
    finally:
        if not finished and not refused:
            metrics.observe_finished(proposer, FinishReason.ABORT.value)


def speculation_stats(prepared: PreparedRequest, stats: GenerationStats) -> SpeculationStats:
    measured = stats.to_dict()
    return SpeculationStats.model_validate(
        {
            "proposer": prepared.proposer,
            "num_speculative_tokens": prepared.num_speculative_tokens,
            **{name: measured[name] for name in SpeculationStats.model_fields if name in measured},
        }
    )


def check_not_failed(output: RequestOutput, response_id: str) -> None:
    """Raise GenerationFailed for a request that the engine failed (a proposer's or its
    round's error): a 500 naming ``response_id``, the engine's detail logged."""
    if output.finish_reason is FinishReason.ERROR:
        error = output.result.error if output.result is not None else None
        raise GenerationFailed(error or "unknown error", response_id)


async def final_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Drain ``outputs`` and return the final one."""
    async for output in outputs:
        if output.finished:
            return output
    raise HybridSpecError("the engine ended the request without a final output")


async def next_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await outputs.__anext__()


def answer_calls(prepared: PreparedRequest, output: RequestOutput) -> list[ToolCall] | None:
    """The tool calls a finished chat request answers with, or None for a text answer."""
    if not prepared.calls_tools or output.finish_reason is not FinishReason.STOP:
        return None
    assert prepared.tools is not None and output.result is not None
    return tool_calls(prepared.tools, output.result.text)


def finish_reason(output: RequestOutput) -> FinishReasonName:
    return "length" if output.finish_reason is FinishReason.LENGTH else "stop"


def usage(prepared: PreparedRequest, output: RequestOutput) -> Usage:
    assert output.result is not None
    return usage_so_far(prepared, len(output.result.token_ids))


def usage_so_far(prepared: PreparedRequest, completion: int) -> Usage:
    """Usage after ``completion`` generated tokens."""
    prompt = len(prepared.prompt_token_ids)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def load_token_texts(
    state: ServerState, prepared: PreparedRequest, *scored: Logprobs | None
) -> TokenTexts:
    """The server's token texts, knowing every token that rendering ``scored`` names (and an
    echoed prompt's first token)."""
    ids = token_ids_of(*scored)
    if prepared.echo_logprobs:
        ids.add(prepared.prompt_token_ids[0])
    await state.token_texts.load(state.prompts.decode_each, ids)
    return state.token_texts


def rendered_logprobs(
    prepared: PreparedRequest,
    texts: TokenTexts,
    logprobs: Logprobs | None,
    prompt_logprobs: Logprobs | None = None,
    offset: int = 0,
) -> ChatLogprobs | CompletionLogprobs | None:
    """A choice's (or chunk's) ``logprobs``: of the prompt (when ``prompt_logprobs`` is given and
    echoed) then of ``logprobs``; None when the request asked for none. ``offset``: the text
    offset of the first token (completions)."""
    if prepared.params.logprobs is None:
        return None
    num_top = prepared.params.logprobs
    scored = logprobs if logprobs is not None else Logprobs.empty(num_top)
    if prepared.chat:
        return chat_logprobs(scored, texts)
    if prompt_logprobs is None or not prepared.echo_logprobs:
        return completion_logprobs([scored], texts, offset=offset)
    first = prepared.prompt_token_ids[0]
    return completion_logprobs([prompt_logprobs, scored], texts, first_token_id=first)


async def response_body(
    state: ServerState,
    prepared: PreparedRequest,
    response_id: str,
    created: int,
    output: RequestOutput,
) -> ChatCompletionResponse | CompletionResponse:
    """The non-streamed response of a finished request; raises for a failed one (a 500)."""
    check_not_failed(output, response_id)
    assert output.result is not None
    texts = await load_token_texts(
        state, prepared, output.result.logprobs, output.result.prompt_logprobs
    )
    text = output.result.text
    reason = finish_reason(output)
    logprobs = rendered_logprobs(
        prepared, texts, output.result.logprobs, output.result.prompt_logprobs
    )
    fields = {
        "id": response_id,
        "created": created,
        "model": prepared.model,
        "usage": usage(prepared, output),
        "hybridspec": speculation_stats(prepared, output.result.stats),
    }
    choice: dict[str, object] = {"finish_reason": reason, "logprobs": logprobs}
    if prepared.chat:
        calls = answer_calls(prepared, output)
        if calls is not None:
            choice["finish_reason"] = "tool_calls"
        message = AssistantMessage(content=None, tool_calls=calls) if calls else None
        choice["message"] = message or AssistantMessage(content=text)
        return ChatCompletionResponse.model_validate({**fields, "choices": [choice]})
    choice["text"] = (prepared.echo_text or "") + text
    return CompletionResponse.model_validate({**fields, "choices": [choice]})
