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
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import cast

from hybridspec.engine import FinishReason, GenerationParams, RequestOutput
from hybridspec.errors import HybridSpecError, check
from hybridspec.server.errors import GenerationFailed
from hybridspec.server.prompts import prompt_of
from hybridspec.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FinishReasonName,
    SpeculationStats,
    Usage,
)
from hybridspec.server.state import ServerState
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


def _reject_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse OpenAI options this server does not implement, rather than ignore them, and
    those that mean nothing here (as the OpenAI API does)."""
    check(
        body.stream or body.stream_options is None,
        "stream_options",
        "stream_options is only allowed when stream is true",
    )
    check(body.n is None or body.n == 1, "n", f"only n = 1 is supported, got {body.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        check(value is None or value == 0, name, f"only 0 is supported, got {value}")
    check(not body.logit_bias, "logit_bias", "logit_bias is not supported")
    penalty = body.repetition_penalty
    check(
        penalty is None or penalty == 1, "repetition_penalty", f"only 1 is supported, got {penalty}"
    )
    if isinstance(body, CompletionRequest):
        check(not body.echo, "echo", "echo is not supported")
        check(body.logprobs is None, "logprobs", "logprobs are not supported")
        check(body.best_of is None or body.best_of == 1, "best_of", "only best_of = 1 is supported")
    else:
        check(
            not body.logprobs and body.top_logprobs is None,
            "logprobs",
            "logprobs are not supported",
        )


def _params(body: CompletionRequest | ChatCompletionRequest) -> GenerationParams:
    """The body's generation options; ``max_new_tokens`` is set once the prompt is tokenized."""
    temperature = body.temperature
    return GenerationParams.create(
        max_new_tokens=1,
        temperature=temperature if temperature is not None else OPENAI_DEFAULT_TEMPERATURE,
        top_k=body.top_k,
        top_p=body.top_p if body.top_p is not None else 1.0,
        seed=body.seed,
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
    prompt = prompt_of(body)
    params = _params(body)
    proposer = state.model.resolve_proposer(params.proposer)
    k = params.num_speculative_tokens or state.model.default_num_speculative_tokens
    options = body.stream_options
    ids = await state.prompts.encode(prompt)
    max_tokens = _completion_budget(state.model.max_seq_len, len(ids), prompt.max_tokens)
    return PreparedRequest(
        model=model,
        prompt_token_ids=ids,
        params=dataclasses.replace(params, max_new_tokens=max_tokens),
        proposer=proposer,
        num_speculative_tokens=k,
        stream=body.stream,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None
        and options.include_usage
        and options.continuous_usage_stats,
        chat=isinstance(body, ChatCompletionRequest),
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


def response_body(
    prepared: PreparedRequest, response_id: str, created: int, output: RequestOutput
) -> ChatCompletionResponse | CompletionResponse:
    """The non-streamed response of a finished request; raises for a failed one (a 500)."""
    check_not_failed(output, response_id)
    assert output.result is not None
    text = output.result.text
    reason = finish_reason(output)
    fields = {
        "id": response_id,
        "created": created,
        "model": prepared.model,
        "usage": usage(prepared, output),
        "hybridspec": speculation_stats(prepared, output.result.stats),
    }
    if prepared.chat:
        message = AssistantMessage(content=text)
        return ChatCompletionResponse.model_validate(
            {**fields, "choices": [ChatChoice(message=message, finish_reason=reason)]}
        )
    return CompletionResponse.model_validate(
        {**fields, "choices": [CompletionChoice(text=text, finish_reason=reason)]}
    )
