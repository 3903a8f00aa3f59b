"""Log-probabilities in the OpenAI API: the requests' options (``logprobs_options``) and the
answers' formats, chat's ``logprobs.content`` and the legacy completions' ``tokens``,
``token_logprobs``, ``top_logprobs`` and ``text_offset``.

The engine scores tokens (``engine.logprobs``: the target's distribution under the request's
sampling transforms; for greedy requests the plain softmax); this module names them. A token's
text is what the tokenizer decodes from that token alone, and its ``bytes`` that text in UTF-8
(a token that holds part of a character decodes to U+FFFD). JSON has no ``-inf``: a token that
the request's top-k or top-p leaves out reports ``-9999.0``, as vLLM does.

Completions' ``top_logprobs`` maps the most likely tokens and the token itself to their
log-probabilities (so up to ``logprobs + 1`` entries, as in the OpenAI API); chat's lists the
most likely ``top_logprobs`` tokens only. ``text_offset`` is each token's offset in the
choice's text, echoed prompt included, counted over the tokens' texts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

from hybridspec.engine import Logprobs
from hybridspec.errors import check
from hybridspec.server.protocol import (
    MAX_COMPLETION_LOGPROBS,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
)
from hybridspec.types import MAX_LOGPROBS

MIN_LOGPROB = -9999.0

DecodeEach = Callable[[list[int]], Awaitable[list[str]]]  # token ids -> each one's text


class TokenTexts:
    """Each token's text, decoded (on a tokenizer worker thread) the first time a response
    needs it, then kept: at most one string per token of the vocabulary."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}

    async def load(self, decode_each: DecodeEach, token_ids: Iterable[int]) -> None:
        """Decode the tokens of ``token_ids`` not known yet, in one call."""
        missing = sorted(set(token_ids) - self._texts.keys())
        if missing:
            texts = await decode_each(missing)
            self._texts.update(zip(missing, texts, strict=True))

    def __getitem__(self, token_id: int) -> str:
        return self._texts[token_id]


def logprobs_options(
    body: CompletionRequest | ChatCompletionRequest,
) -> tuple[int | None, int | None]:
    """The engine's ``logprobs`` and ``prompt_logprobs`` for a body's options, checked: chat's
    ``top_logprobs`` (0..20, only with ``logprobs: true``), completions' ``logprobs`` (0..5;
    with ``echo``, for the prompt too)."""
    if isinstance(body, ChatCompletionRequest):
        top = body.top_logprobs
        check(
            top is None or 0 <= top <= MAX_LOGPROBS,
            "top_logprobs",
            f"expected an integer in [0, {MAX_LOGPROBS}], got {top}",
        )
        check(
            top is None or body.logprobs is True,
            "top_logprobs",
            "top_logprobs needs logprobs set to true",
        )
        return ((top or 0) if body.logprobs else None), None
    n = body.logprobs
    check(
        n is None or 0 <= n <= MAX_COMPLETION_LOGPROBS,
        "logprobs",
        f"expected an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {n}",
    )
    if body.echo and body.max_tokens == 0 and n is None:
        return None, 0  # echo only: the engine scores the prompt, which nobody asked to see
    return n, n if body.echo else None


def token_ids_of(*scored: Logprobs | None) -> set[int]:
    """Every token id that rendering ``scored`` names: the tokens and their alternatives."""
    ids: set[int] = set()
    for part in scored:
        if part is not None:
            ids.update(part.token_ids.tolist())
            ids.update(part.top_token_ids.flatten().tolist())
    return ids


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(texts: TokenTexts, token_id: int, logprob: float) -> TopLogprob:
    text = texts[token_id]
    return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))


def chat_logprobs(scored: Logprobs, texts: TokenTexts) -> ChatLogprobs:
    """The chat format of ``scored``: one entry per token, with its alternatives."""
    content = []
    for token_id, logprob, top_ids, top_logprobs in scored.rows():
        entry = _top(texts, token_id, logprob)
        alternatives = [_top(texts, i, lp) for i, lp in zip(top_ids, top_logprobs, strict=True)]
        content.append(ChatTokenLogprob(**entry.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def completion_logprobs(
    scored: Sequence[Logprobs],
    texts: TokenTexts,
    *,
    first_token_id: int | None = None,
    offset: int = 0,
) -> CompletionLogprobs:
    """The legacy format of ``scored``, one part after another. ``first_token_id``: an echoed
    prompt's first token, which has no log-probability; ``offset``: the text offset of the
    first token (the length of the text sent before, in a stream)."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    if first_token_id is not None:
        _append(out, texts[first_token_id], None, None, offset)
        offset += len(texts[first_token_id])
    for part in scored:
        for token_id, logprob, top_ids, top_logprobs in part.rows():
            top = {texts[i]: _finite(lp) for i, lp in zip(top_ids, top_logprobs, strict=True)}
            top.setdefault(texts[token_id], _finite(logprob))
            _append(out, texts[token_id], _finite(logprob), top, offset)
            offset += len(texts[token_id])
    return out


def _append(
    out: CompletionLogprobs,
    token: str,
    logprob: float | None,
    top: dict[str, float] | None,
    offset: int,
) -> None:
    out.tokens.append(token)
    out.token_logprobs.append(logprob)
    out.top_logprobs.append(top)
    out.text_offset.append(offset)
