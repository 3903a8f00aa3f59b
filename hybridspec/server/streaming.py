"""Server-sent events: the framing of a streamed completion and the generator that writes it.

A streamed response is a sequence of server-sent events, ``data: <chunk JSON>``, ending with
``data: [DONE]``. Each chunk carries one choice, named by its ``index`` (prompt ``i``, choice
``j``: ``i * n + j``), as OpenAI streams ``n`` choices; their chunks interleave as the engine
commits their tokens. A chat stream first carries the role of each choice; a choice's last
chunk carries its finish reason and its ``hybridspec`` statistics; after every choice's, when
``stream_options.include_usage`` is set, one chunk with empty choices and the usage of all. With
``continuous_usage_stats`` too (vLLM's extension), every chunk also carries the usage so far.
A request that asks for logprobs gets those of each chunk's tokens on that chunk (a chunk may
carry tokens whose text is held back, with empty text); an echoed prompt, with its logprobs,
comes first, on the first text chunk. A chat request with tools holds each choice's text
back: at that choice's end it sends its calls (one chunk per call, OpenAI's ``tool_calls``
delta with the call's id, name and whole arguments; finish reason ``tool_calls``) or, when it
made none, its text. With ``auto`` on a template that does not show tools, the first character
decides (``structured``): text streams on from there, a ``[`` is held back as calls, so a
choice's deltas are all text or all ``tool_calls``.

``stream_events`` is independent of the web framework: it turns a request's engine outputs
into the event strings; ``EventStreamResponse`` is the Starlette response that sends them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hybridspec.engine import RequestOutput
from hybridspec.server.errors import exception_response
from hybridspec.server.generation import (
    Indexed,
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
    CompletionChunk,
    CompletionLogprobs,
    Delta,
    DeltaFunctionCall,
    DeltaToolCall,
    DraftToken,
    FinishReasonName,
    SpeculationStats,
    ToolCall,
    Usage,
)
from hybridspec.server.shutdown import ServerShuttingDown
from hybridspec.server.state import ServerState

DONE = "data: [DONE]\n\n"
# Tokens decoded before a chunk's to find their texts (``prompts.text_pieces``): enough for a
# character split over tokens, and for the space a tokenizer drops at the start of a text.
DRAFT_TEXT_CONTEXT = 4


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
        schema = ChatCompletionChunk if self.chat else CompletionChunk
        fields = {"id": self.id, "created": self.created, "model": self.model, **extra}
        chunk = schema.model_validate({**fields, "choices": choices})
        # As OpenAI does: a delta holds only what it carries; usage and the statistics appear
        # only on the chunks that carry them.
        data = chunk.model_dump(mode="json")
        for key in ("usage", "hybridspec"):
            if data[key] is None:
                del data[key]
        for choice in data["choices"]:
            if choice.get("tokens", ()) is None:  # only on the streams that asked for them
                del choice["tokens"]
            if "delta" in choice:
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

    def head(self, usage: Usage | None = None, index: int = 0) -> str | None:
        if not self.chat:
            return None
        delta = Delta(role="assistant", content="")
        return self._event([{"index": index, "delta": delta}], usage=usage)

    def text(
        self,
        text: str,
        usage: Usage | None = None,
        logprobs: ChatLogprobs | CompletionLogprobs | None = None,
        index: int = 0,
        tokens: list[DraftToken] | None = None,
    ) -> str:
        choice: dict[str, object] = {"index": index, "logprobs": logprobs, "tokens": tokens}
        if self.chat:
            choice["delta"] = Delta(content=text)
        else:
            choice.update(text=text, finish_reason=None)
        return self._event([choice], usage=usage)

    def tool_calls(self, calls: list[ToolCall], index: int = 0) -> list[str]:
        """One chunk per call of choice ``index``: the call's index, id, name and arguments."""
        events = []
        for i, call in enumerate(calls):
            function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
            delta = DeltaToolCall(index=i, id=call.id, type="function", function=function)
            events.append(self._event([{"index": index, "delta": Delta(tool_calls=[delta])}]))
        return events

    def final(
        self,
        reason: FinishReasonName,
        stats: SpeculationStats,
        usage: Usage | None = None,
        index: int = 0,
    ) -> str:
        choice: dict[str, object] = {"index": index, "finish_reason": reason}
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
    index: int = 0  # the choice's
    offset: int = 0  # completions: the text offset of the next token
    held: str = ""  # a choice that may call tools: its text so far, until it is known as text
    texting: bool = False  # that choice's answer is known to be text: it streams on
    # include_drafts: the last tokens whose text was sent, and those after them whose text waits
    draft_context: list[int] = field(default_factory=list)
    draft_held: list[int] = field(default_factory=list)

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
        tokens = None
        if self.prepared.include_drafts and not self.prepared.calls_tools and output.new_token_ids:
            tokens = await self._tokens(output)
        if not text and logprobs is None and tokens is None:
            return None
        return self.render.text(text, usage, logprobs, self.index, tokens)

    async def _tokens(self, output: RequestOutput) -> list[DraftToken]:
        """``output``'s tokens, their texts and their origin (``include_drafts``). Tokens whose
        text is not complete yet (part of a character) are decoded again with the next ones,
        and the first of those carries their text."""
        ids, pending = output.new_token_ids, len(self.draft_held)
        seq = [*self.draft_held, *ids]
        pieces = await self.state.prompts.decode_pieces(self.draft_context, seq)
        written = max((i + 1 for i, piece in enumerate(pieces) if piece), default=0)
        self.draft_context = [*self.draft_context, *seq[:written]][-DRAFT_TEXT_CONTEXT:]
        self.draft_held = seq[written:]
        texts = ["".join(pieces[: pending + 1]), *pieces[pending + 1 :]]
        return [
            DraftToken(
                id=i, text=t, drafted_by=output.drafted_by if j < output.num_drafted else None
            )
            for j, (i, t) in enumerate(zip(ids, texts, strict=True))
        ]

    async def events(self, output: RequestOutput, usage: Usage | None) -> list[str]:
        """The events of one output of this choice: its text chunk and, once it finished, its
        final chunk. A choice that may call tools holds its text back until the end, then sends
        its calls (finish reason ``tool_calls``) or, when it made none, its text."""
        prepared, render, index = self.prepared, self.render, self.index
        holding = prepared.calls_tools and not self.texting
        if holding and not output.finished:
            return self._decide(output, usage)
        events = []
        reason = finish_reason(output)
        calls = answer_calls(prepared, output) if output.finished else None
        if calls is not None:
            events += render.tool_calls(calls, index)
            reason = finish_reason(output, "tool_calls")
        elif holding:
            assert output.result is not None
            events.append(render.text(output.result.text, usage, index=index))
        else:
            chunk = await self.chunk(output, usage)
            if chunk is not None:
                events.append(chunk)
        if output.finished:
            assert output.result is not None
            stats = speculation_stats(prepared, output.result.stats)
            events.append(render.final(reason, stats, usage, index))
        return events

    def _decide(self, output: RequestOutput, usage: Usage | None) -> list[str]:
        """Hold a tool-calling choice's text until it is known to be text (``auto`` on a
        template that does not show tools: a first character other than ``[``); then send
        what was held, and stream on."""
        self.held += output.new_text
        tools = self.prepared.tools
        assert tools is not None
        if tools.mode != "auto" or not tools.answers_array or self.held[:1] in ("", "["):
            return []
        self.texting = True
        return [self.render.text(self.held, usage, index=self.index)]


async def stream_events(
    state: ServerState,
    prepared: Sequence[PreparedRequest],
    render: ChunkRenderer,
    first: Indexed,
    outputs: AsyncGenerator[Indexed, None],
) -> AsyncIterator[str]:
    """The event stream of every choice of a request whose ``first`` output was awaited
    already (so that a refusal became an HTTP error before the stream began). Closes
    ``outputs`` when it ends: a failed choice ends the stream with an error event, and the
    choices still running are aborted."""
    n = prepared[0].n
    count = len(prepared) * n
    generated = [0] * count  # per choice
    pieces = [
        _Pieces(state, prepared[i // n], render, prepared[i // n].echo_text, i)
        for i in range(count)
    ]

    def so_far() -> Usage | None:
        return usage_so_far(prepared, sum(generated)) if prepared[0].continuous_usage else None

    async with contextlib.aclosing(outputs):
        for index in range(count):
            head = render.head(so_far(), index)
            if head is not None:
                yield head
        index, output = first
        finals: list[RequestOutput] = []
        while True:
            if output.finished:
                try:
                    check_not_failed(output, render.id)
                except Exception as exc:
                    yield error_event(exc)
                    yield DONE
                    return
                assert output.result is not None
                generated[index] = len(output.result.token_ids)
            else:
                generated[index] += len(output.new_token_ids)
            for event in await pieces[index].events(output, so_far()):
                yield event
            if output.finished:
                finals.append(output)
                if len(finals) == count:
                    break
            try:
                index, output = await next_output(outputs)
            except ServerShuttingDown as exc:  # its shutdown timeout passed
                yield error_event(exc)
                yield DONE
                return
        if prepared[0].include_usage:
            yield render.usage(usage(prepared, finals))
        yield DONE
