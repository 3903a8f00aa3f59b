"""A request's prompt, from its body to checked token ids, off the engine thread.

Tokenizing and chat templating run on a small pool of worker threads (``PromptEncoder``), not
on the engine thread that steps every running request, nor on the event loop that streams
their tokens: a long prompt delays only its own request. Before any of that work, a prompt that
cannot fit is refused at once by its size alone (``PromptEncoder.check_size``):

- token ids: more than ``max_prompt_tokens`` of them;
- text (or the messages' contents together): more characters than ``max_prompt_tokens`` tokens
  can hold, ``max_prompt_tokens * max_token_chars``, where ``max_token_chars`` is the longest
  text that one token of the vocabulary decodes to. Tokenizing only ever covers the text with
  tokens, so a text that long needs more tokens than fit. (A tokenizer whose normalizer shrinks
  text, e.g. collapsing runs of spaces, could be refused here for a prompt that would have fit
  once normalized; the byte-level BPE of Llama-family targets has no such normalizer.)

Worked example (SmolLM2-135M: 8192-token context, longest token 81 characters): a prompt may
use 8191 tokens, so a text over 8191 * 81 = 663,471 characters is refused without tokenizing;
an 8 MB text is refused in microseconds instead of taking 11 s of tokenizing.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridspec.engine.prompts import renders_tools
from hybridspec.errors import ContextLengthError, check
from hybridspec.server.protocol import ChatCompletionRequest, CompletionRequest
from hybridspec.server.structured import ToolPlan, tool_messages

COMPLETION_MAX_TOKENS = 16  # as in the OpenAI legacy completions API
TOKENIZER_THREADS = 2
REPLACEMENT = "\ufffd"  # what a tokenizer decodes part of a character to
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Prompt:
    """What to tokenize (exactly one of the three) and the requested completion budget;
    ``tools``: the tools the chat template shows the model (None: none)."""

    text: str | None
    messages: list[dict[str, Any]] | None
    token_ids: list[int] | None
    max_tokens: int | None  # None: the rest of the context
    tools: list[dict[str, Any]] | None = None

    @property
    def num_chars(self) -> int:
        if self.text is not None:
            return len(self.text)
        return sum(len(m["content"]) for m in self.messages or ())


def prompts_of(
    body: CompletionRequest | ChatCompletionRequest,
    tools: ToolPlan | None = None,
    renders_tools: bool = False,
) -> list[Prompt]:
    """The body's prompts: one chat (with its tools: ``structured.tool_messages``), or a
    completion's text or token ids, one or a list."""
    if isinstance(body, ChatCompletionRequest):
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(body, name)
            check(value is None or value >= 1, name, f"expected an integer >= 1, got {value}")
        chosen = body.max_completion_tokens
        max_tokens = chosen if chosen is not None else body.max_tokens
        messages = tool_messages(body.messages, tools, renders_tools)
        shown = tools.schemas() if tools is not None and renders_tools else None
        return [Prompt(None, messages, None, max_tokens, shown)]
    raw = body.prompt
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS
    check(
        max_tokens >= (0 if body.echo else 1),
        "max_tokens",
        f"expected an integer >= 1 (or 0 with echo, to score the prompt), got {max_tokens}",
    )
    several = isinstance(raw, list) and bool(raw) and isinstance(raw[0], (str, list))
    return [
        Prompt(one, None, None, max_tokens)
        if isinstance(one, str)
        else Prompt(None, None, list(one), max_tokens)  # type: ignore[arg-type]
        for one in (raw if several else [raw])
    ]


Encode = Callable[[str | None, list[dict[str, Any]] | None, list[dict[str, Any]] | None], list[int]]
CheckPrompt = Callable[[Sequence[int]], None]


class PromptEncoder:
    """Tokenizes prompts on worker threads and checks them against the context.

    ``encode`` and ``check_prompt`` are the engine's (``Engine.encode``,
    ``Engine.check_prompt``): they read only the tokenizer and the model's fixed sizes, never
    state that the engine thread changes, so they are safe on any thread, as is decoding (an
    echoed prompt, the token texts of logprobs) with the same tokenizer. Hugging Face fast
    tokenizers release the GIL while they encode, so the event loop keeps streaming meanwhile.
    """

    def __init__(
        self,
        encode: Encode,
        check_prompt: CheckPrompt,
        max_prompt_tokens: int,
        max_token_chars: int | None,
        tokenizer: Any = None,
    ) -> None:
        self._tokenizer = tokenizer  # for decoding (echo, logprobs' token texts); None: none
        # Whether the chat template shows tools to the model (``structured``).
        self.renders_tools = renders_tools(tokenizer)
        self._encode = encode
        self._check_prompt = check_prompt
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_chars = (
            None if max_token_chars is None else max_prompt_tokens * max(1, max_token_chars)
        )
        self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, "hybridspec-tokenize")

    def check_size(self, prompt: Prompt) -> None:
        """Refuse at once a prompt too long for the context by its size alone (module doc)."""
        if prompt.token_ids is not None:
            self.check_count(len(prompt.token_ids), "prompt")
        elif self.max_prompt_chars is not None and prompt.num_chars > self.max_prompt_chars:
            field = "prompt" if prompt.text is not None else "messages"
            raise ContextLengthError(
                f"{field}: the prompt has {prompt.num_chars} characters, more than "
                f"{self.max_prompt_tokens} tokens can hold (at most {self.max_prompt_chars})",
                field,
            )

    async def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, tokenized on a worker thread and checked there."""
        self.check_size(prompt)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(self._run, prompt))

    def _run(self, prompt: Prompt) -> list[int]:
        ids = prompt.token_ids
        if ids is None:
            ids = self._encode(prompt.text, prompt.messages, prompt.tools)
        self.check_count(len(ids), "prompt" if prompt.messages is None else "messages")
        self._check_prompt(ids)
        return ids

    def check_count(self, num_tokens: int, field: str) -> None:
        """ContextLengthError naming ``field`` for more than ``max_prompt_tokens`` tokens."""
        if num_tokens > self.max_prompt_tokens:
            raise ContextLengthError(
                f"{field}: the prompt has {num_tokens} tokens; at most "
                f"{self.max_prompt_tokens} are allowed",
                field,
            )

    async def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (an echoed prompt), decoded on a worker thread."""
        check(self._tokenizer is not None, "echo", "echo needs a tokenizer; this model has none")
        text = await self._run_on_worker(self._tokenizer.decode, token_ids)
        assert isinstance(text, str)  # one sequence decodes to one string
        return text

    async def decode_each(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (``token_id:N`` without a tokenizer), on a worker thread."""
        if self._tokenizer is None:
            return [f"token_id:{i}" for i in token_ids]
        texts = await self._run_on_worker(self._tokenizer.batch_decode, [[i] for i in token_ids])
        return [str(text) for text in texts]

    async def decode_pieces(self, context: list[int], token_ids: list[int]) -> list[str]:
        """Each of ``token_ids``' text as it reads after ``context`` and the tokens before it
        (``server.drafts``), on a worker thread; ``token_id:N`` without a tokenizer."""
        if self._tokenizer is None:
            return [f"token_id:{i}" for i in token_ids]
        pieces = await self._run_on_worker(text_pieces, self._tokenizer, context, token_ids)
        return list(pieces)

    async def with_tokenizer(self, field: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(tokenizer, *args)`` on a worker thread (``/tokenize``, ``/detokenize``);
        InvalidRequestError naming ``field`` when the model has no tokenizer."""
        check(self._tokenizer is not None, field, "this model has no tokenizer")
        result: T = await self._run_on_worker(fn, self._tokenizer, *args)
        return result

    async def _run_on_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def longest_token_chars(tokenizer: Any, vocab_size: int) -> int | None:
    """The most characters that one token decodes to (None: no tokenizer). Special tokens
    count: their text in a prompt becomes one token."""
    if tokenizer is None:
        return None
    size = min(vocab_size, len(tokenizer))  # ids past the tokenizer's never come from text
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    return max((len(t) for t in texts), default=1)


def text_pieces(tokenizer: Any, context: list[int], token_ids: list[int]) -> list[str]:
    """The text each of ``token_ids`` adds after ``context``: decoding ``context + token_ids[:i
    + 1]`` and taking what it adds, so that spaces a tokenizer drops at the start of a text and
    characters split over tokens come out right. A token whose text ends inside a character
    (U+FFFD) adds nothing: a later token adds its text once the character is complete or shown
    broken (at the end of a text, a character left incomplete is dropped, as the engine's
    detokenizer drops it)."""
    done = tokenizer.decode(context)
    pieces = []
    for end in range(1, len(token_ids) + 1):
        text = tokenizer.decode([*context, *token_ids[:end]])
        if text.endswith(REPLACEMENT) or not text.startswith(done):
            pieces.append("")
            continue
        pieces.append(text[len(done) :])
        done = text
    return pieces
