"""From prepared requests to engine outputs and back: running, metrics, the response body.

Both endpoints share this path, and nothing here depends on the web framework (a deployment
other than the FastAPI app can hold a ``ServerState`` and call the same functions).
``server.preparation.prepare`` turns a body into one ``PreparedRequest`` per prompt;
``observe`` runs them through the engine loop, the ``n`` choices of each prompt sharing its
prefill (``engine.choices``), yielding each choice's outputs with its index (prompt ``i``,
choice ``j``: ``i * n + j``, as OpenAI numbers them) and recording metrics; closing it early
(client gone) aborts what still runs. ``response_body`` is the non-streamed response once
every choice has finished (``hybridspec.server.streaming`` writes the streamed one). ``usage``
counts each prompt's tokens once and the completion tokens of every choice, as OpenAI does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import cast

from hybridspec.engine import FinishReason, Logprobs, RequestOutput
from hybridspec.engine.choices import combined_stats
from hybridspec.engine.stats import GenerationStats
from hybridspec.errors import HybridSpecError
from hybridspec.server.errors import GenerationFailed
from hybridspec.server.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    token_ids_of,
)
from hybridspec.server.preparation import PreparedRequest
from hybridspec.server.protocol import (
    AssistantMessage,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionResponse,
    FinishReasonName,
    PromptTokensDetails,
    SpeculationStats,
    ToolCall,
    Usage,
)
from hybridspec.server.state import ServerState
from hybridspec.server.structured import cut_calls, tool_calls

Indexed = tuple[int, RequestOutput]  # a choice's index (prompt * n + choice) and an output


async def observe(
    state: ServerState, prepared: Sequence[PreparedRequest], final_only: bool = False
) -> AsyncGenerator[Indexed, None]:
    """Run every prompt's choices on the engine loop and yield their outputs with the
    choice's index, recording metrics (a prompt's tokens and first token once).

    ``final_only`` (a response that is not streamed): each choice's first and final outputs
    only (``EngineLoop.stream_choices``); the tokens of the outputs between are counted from
    the final one's result. Refusals (InvalidRequestError, CapacityError) raise on the first
    ``__anext__``. Closing or cancelling this generator before the last output aborts the
    choices still running.
    """
    metrics, proposer, n = state.metrics, prepared[0].proposer, prepared[0].n
    tenant = prepared[0].params.tenant
    arrival = time.perf_counter()
    started: set[int] = set()  # prompts that have a first token
    counted: dict[int, int] = {}  # tokens counted so far per choice
    finished, refused = 0, False
    try:
        # EngineLoop.stream_choices is an async generator (typed as an AsyncIterator).
        stream = cast(
            AsyncGenerator[Indexed, None],
            state.loop.stream_choices(
                [p.prompt_token_ids for p in prepared],
                [p.params for p in prepared],
                n,
                checked=True,  # by prepare, before tokenizing
                final_only=final_only,
            ),
        )
        async with contextlib.aclosing(stream) as outputs:
            async for index, output in outputs:
                if index // n not in started:
                    started.add(index // n)
                    ttft_s = time.perf_counter() - arrival
                    num_prompt = len(prepared[index // n].prompt_token_ids)
                    metrics.observe_first_token(proposer, ttft_s, num_prompt)
                num_tokens = len(output.new_token_ids)
                if final_only and output.finished and output.result is not None:  # and skipped
                    num_tokens = len(output.result.token_ids) - counted.get(index, 0)
                counted[index] = counted.get(index, 0) + num_tokens
                metrics.observe_tokens(proposer, num_tokens, tenant)
                if output.finished:
                    finished += 1
                    reason = output.finish_reason or FinishReason.ERROR
                    metrics.observe_finished(proposer, reason.value)
                    if output.result is not None and reason is not FinishReason.ERROR:
                        metrics.observe_result(
                            proposer, output.result.stats, time.perf_counter() - arrival
                        )
                yield index, output
    except HybridSpecError:
        refused = not started
        raise
    finally:
        if not refused:
            for _ in range(len(prepared) * n - finished):
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


async def final_outputs(outputs: AsyncIterator[Indexed], count: int) -> list[RequestOutput]:
    """Drain ``outputs`` and return the final output of each of the ``count`` choices."""
    finals: dict[int, RequestOutput] = {}
    async for index, output in outputs:
        if output.finished:
            finals[index] = output
    if len(finals) < count:
        raise HybridSpecError("the engine ended the request without a final output")
    return [finals[index] for index in range(count)]


async def next_output(outputs: AsyncIterator[Indexed]) -> Indexed:
    return await outputs.__anext__()


def answer_calls(prepared: PreparedRequest, output: RequestOutput) -> list[ToolCall] | None:
    """The tool calls a finished chat request answers with, or None for a text answer: the
    calls of its text, or, for a call cut short by max_tokens or a stop string, the calls
    with the arguments written so far (``structured.cut_calls``; [] when cut before a name)."""
    if not prepared.calls_tools:
        return None
    assert prepared.tools is not None and output.result is not None
    if output.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        return None
    text = output.result.text
    calls = tool_calls(prepared.tools, text) if output.finish_reason is FinishReason.STOP else None
    return calls if calls is not None else cut_calls(prepared.tools, text)


def finish_reason(output: RequestOutput, stopped: FinishReasonName = "stop") -> FinishReasonName:
    """``length`` when max_tokens cut the output, else ``stopped`` (``tool_calls`` for calls)."""
    return "length" if output.finish_reason is FinishReason.LENGTH else stopped


def usage(prepared: Sequence[PreparedRequest], outputs: Sequence[RequestOutput]) -> Usage:
    """Every prompt's tokens once, and every choice's completion tokens; the prompt tokens
    read from the prefix cache (only a prompt's first choice reads it: the others copy its
    prefill)."""
    completion = cached = 0
    for output in outputs:
        assert output.result is not None
        completion += len(output.result.token_ids)
        cached += output.result.stats.cached_tokens
    done = usage_so_far(prepared, completion)
    done.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
    return done


def usage_so_far(prepared: Sequence[PreparedRequest], completion: int) -> Usage:
    """Usage after ``completion`` generated tokens (over all choices)."""
    prompt = sum(len(p.prompt_token_ids) for p in prepared)
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
    prepared: Sequence[PreparedRequest],
    response_id: str,
    created: int,
    outputs: Sequence[RequestOutput],
) -> ChatCompletionResponse | CompletionResponse:
    """The non-streamed response once every choice (``outputs``, in index order) has
    finished; raises for a failed one (a 500). ``hybridspec``: the choices' statistics
    together."""
    for output in outputs:
        check_not_failed(output, response_id)
    n = prepared[0].n
    choices: list[dict[str, object]] = []
    stats = []
    for index, output in enumerate(outputs):
        one, result = prepared[index // n], output.result
        assert result is not None
        stats.append(result.stats)
        texts = await load_token_texts(state, one, result.logprobs, result.prompt_logprobs)
        logprobs = rendered_logprobs(one, texts, result.logprobs, result.prompt_logprobs)
        choice: dict[str, object] = {
            "index": index,
            "finish_reason": finish_reason(output),
            "logprobs": logprobs,
        }
        if one.chat:
            calls = answer_calls(one, output)
            if calls is not None:
                choice["finish_reason"] = finish_reason(output, "tool_calls")
            content = result.text if calls is None else None
            choice["message"] = AssistantMessage(content=content, tool_calls=calls or None)
        else:
            choice["text"] = (one.echo_text or "") + result.text
        choices.append(choice)
    num_prompt = sum(len(p.prompt_token_ids) for p in prepared)
    fields = {
        "id": response_id,
        "created": created,
        "model": prepared[0].model,
        "usage": usage(prepared, outputs),
        "hybridspec": speculation_stats(prepared[0], combined_stats(stats, num_prompt)),
        "choices": choices,
    }
    if prepared[0].chat:
        return ChatCompletionResponse.model_validate(fields)
    return CompletionResponse.model_validate(fields)
