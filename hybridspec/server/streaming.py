"""Server-sent events: the framing of a streamed completion and the generator that writes it.

A streamed response is a sequence of server-sent events, ``data: <chunk JSON>``, ending with
``data: [DONE]``. A chat stream's first chunk carries the role; the last chunk before
``[DONE]`` carries the finish reason and the ``hybridspec`` statistics (then, when
``stream_options.include_usage`` is set, one chunk with empty choices and the usage). With
``continuous_usage_stats`` too (vLLM's extension), every chunk also carries the usage so far.
A request that asks for logprobs gets those of each chunk's tokens on that chunk (a chunk may
carry tokens whose text is held back, with empty text); an echoed prompt, with its logprobs,
comes first, on the first text chunk. A chat request with tools holds its text back: at the
end it sends its calls (one chunk per call, OpenAI's ``tool_calls`` delta with the call's id,
name and whole arguments; finish reason ``tool_calls``) or, when it made none, its text.

``stream_events`` is independent of the web framework: it turns a request's engine outputs
into the event strings; ``EventStreamResponse`` is the Starlette response that sends them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hybridspec.engine import RequestOutput
from hybridspec.server.errors import exception_response
from hybridspec.server.generation import (
    PreparedRequest,
    answer_calls,
    check_not_failed,
    finish_reason,
    load_token_texts,
    next_output,
    rendered_logprobs,
    speculation_stats,
    usage,
    usage_so_far,
)
from hybridspec.server.protocol import (
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    DeltaFunctionCall,
    DeltaToolCall,
    FinishReasonName,
    SpeculationStats,
    ToolCall,
    Usage,
)
from hybridspec.server.state import ServerState

DONE = "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """A stream of server-sent events that closes its generator however the response ends.

    Starlette cancels the sending task when the client disconnects, but leaves a generator
    that was suspended at ``yield`` unclosed until garbage collection; closing it here makes
    its ``finally`` (which aborts the engine request) run at once.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


@dataclass(frozen=True, slots=True)
class ChunkRenderer:
    """Renders one stream's events, as chat chunks or as text completion chunks."""

    id: str
    created: int
    model: str
    chat: bool

    def _event(self, choices: list[dict[str, object]], **extra: object) -> str:
        schema = ChatCompletionChunk if self.chat else CompletionResponse
        fields = {"id": self.id, "created": self.created, "model": self.model, **extra}
        chunk = schema.model_validate({**fields, "choices": choices})
        # As OpenAI does: a delta holds only what it carries; usage and the statistics appear
        # only on the chunks that carry them.
        data = chunk.model_dump(mode="json")
        for key in ("usage", "hybridspec"):
            if data[key] is None:
                del data[key]
        for choice in data["choices"]:
            if "delta" in choice:
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

    def head(self, usage: Usage | None = None) -> str | None:
        if not self.chat:
            return None
        return self._event([{"delta": Delta(role="assistant", content="")}], usage=usage)

    def text(
        self,
        text: str,
        usage: Usage | None = None,
        logprobs: ChatLogprobs | CompletionLogprobs | None = None,
    ) -> str:
        if self.chat:
            return self._event([{"delta": Delta(content=text), "logprobs": logprobs}], usage=usage)
        return self._event(
            [{"text": text, "finish_reason": None, "logprobs": logprobs}], usage=usage
        )

    def tool_calls(self, calls: list[ToolCall]) -> list[str]:
        """One chunk per call: its index, id, name and arguments."""
        return [
            self._event(
                [
                    {
                        "delta": Delta(
                            tool_calls=[
                                DeltaToolCall(
                                    index=i,
                                    id=call.id,
                                    type="function",
                                    function=DeltaFunctionCall(
                                        name=call.function.name, arguments=call.function.arguments
                                    ),
                                )
                            ]
                        )
                    }
                ]
            )
            for i, call in enumerate(calls)
        ]

    def final(
        self, reason: FinishReasonName, stats: SpeculationStats, usage: Usage | None = None
    ) -> str:
        choice: dict[str, object] = {"finish_reason": reason}
        choice.update({"delta": Delta()} if self.chat else {"text": ""})
        return self._event([choice], hybridspec=stats, usage=usage)

    def usage(self, usage: Usage) -> str:
        return self._event([], usage=usage)


def error_event(exc: Exception) -> str:
    """An error body (as the HTTP error would carry it) framed as one event."""
    return f"data: {bytes(exception_response(exc).body).decode()}\n\n"


@dataclass(slots=True)
class _Pieces:
    """Turns one stream's outputs into its text chunks: the echoed prompt first, then each
    output's text and logprobs (``text_offset`` counted on across chunks)."""

    state: ServerState
    prepared: PreparedRequest
    render: ChunkRenderer
    echo: str | None  # the prompt's text until it is sent
    offset: int = 0  # completions: the text offset of the next token

    async def chunk(self, output: RequestOutput, usage: Usage | None) -> str | None:
        """The text chunk of ``output``; None when it carries neither text nor logprobs."""
        text, prompt = output.new_text, output.prompt_logprobs
        if self.echo is not None:
            text, self.echo = self.echo + text, None
        logprobs = None
        if output.logprobs or (prompt is not None and self.prepared.echo_logprobs):
            texts = await load_token_texts(self.state, self.prepared, output.logprobs, prompt)
            logprobs = rendered_logprobs(self.prepared, texts, output.logprobs, prompt, self.offset)
            if isinstance(logprobs, CompletionLogprobs) and logprobs.tokens:
                self.offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if not text and logprobs is None:
            return None
        return self.render.text(text, usage, logprobs)


async def stream_events(
    state: ServerState,
    prepared: PreparedRequest,
    render: ChunkRenderer,
    first: RequestOutput,
    outputs: AsyncGenerator[RequestOutput, None],
) -> AsyncIterator[str]:
    """The event stream of one request whose ``first`` output was awaited already (so that a
    refusal became an HTTP error before the stream began). Closes ``outputs`` when it ends."""
    generated = 0
    pieces = _Pieces(state, prepared, render, prepared.echo_text)

    def so_far() -> Usage | None:
        return usage_so_far(prepared, generated) if prepared.continuous_usage else None

    async with contextlib.aclosing(outputs):
        head = render.head(so_far())
        if head is not None:
            yield head
        output = first
        while not output.finished:
            generated += len(output.new_token_ids)
            chunk = None if prepared.calls_tools else await pieces.chunk(output, so_far())
            if chunk is not None:
                yield chunk
            output = await next_output(outputs)
        try:
            check_not_failed(output, render.id)
        except Exception as exc:
            yield error_event(exc)
            yield DONE
            return
        assert output.result is not None
        generated = len(output.result.token_ids)
        reason = finish_reason(output)
        calls = answer_calls(prepared, output)
        if calls is not None:
            for event in render.tool_calls(calls):
                yield event
            reason = "tool_calls"
        elif prepared.calls_tools:
            yield render.text(output.result.text, so_far())
        else:
            chunk = await pieces.chunk(output, so_far())
            if chunk is not None:
                yield chunk
        stats = speculation_stats(prepared, output.result.stats)
        yield render.final(reason, stats, so_far())
        if prepared.include_usage:
            yield render.usage(usage(prepared, output))
        yield DONE
