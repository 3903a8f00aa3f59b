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
from typing import Any

from hybridspec.errors import InvalidRequestError, check
from hybridspec.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

COMPLETION_MAX_TOKENS = 16  # as in the OpenAI legacy completions API
TOKENIZER_THREADS = 2


@dataclass(frozen=True, slots=True)
class Prompt:
    """What to tokenize (exactly one of the three) and the requested completion budget."""

    text: str | None
    messages: list[dict[str, str]] | None
    token_ids: list[int] | None
    max_tokens: int | None  # None: the rest of the context

    @property
    def num_chars(self) -> int:
        if self.text is not None:
            return len(self.text)
        return sum(len(m["content"]) for m in self.messages or ())


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """OpenAI messages as the {role, content} strings that the chat template takes; a
    ``developer`` message (OpenAI's newer name for instructions) becomes a ``system`` one."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": content or ""})
    return out


def prompt_of(body: CompletionRequest | ChatCompletionRequest) -> Prompt:
    """One text prompt, token ids or chat; several prompts are refused like n > 1."""
    if isinstance(body, ChatCompletionRequest):
        chosen = body.max_completion_tokens
        max_tokens = chosen if chosen is not None else body.max_tokens
        prompt = Prompt(None, chat_messages(body.messages), None, max_tokens)
    else:
        raw = body.prompt
        if isinstance(raw, list) and raw and isinstance(raw[0], (str, list)):
            check(
                len(raw) == 1, "prompt", f"only one prompt per request is supported, got {len(raw)}"
            )
            raw = raw[0]
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS
        if isinstance(raw, str):
            prompt = Prompt(raw, None, None, max_tokens)
        else:
            prompt = Prompt(None, None, list(raw), max_tokens)  # type: ignore[arg-type]
    check(
        prompt.max_tokens is None or prompt.max_tokens >= 1,
        "max_tokens",
        f"expected an integer >= 1, got {prompt.max_tokens}",
    )
    return prompt


Encode = Callable[[str | None, list[dict[str, str]] | None], list[int]]
CheckPrompt = Callable[[Sequence[int]], None]


class PromptEncoder:
    """Tokenizes prompts on worker threads and checks them against the context.

    ``encode`` and ``check_prompt`` are the engine's (``Engine.encode``,
    ``Engine.check_prompt``): they read only the tokenizer and the model's fixed sizes, never
    state that the engine thread changes, so they are safe on any thread. Hugging Face fast
    tokenizers release the GIL while they encode, so the event loop keeps streaming meanwhile.
    """

    def __init__(
        self,
        encode: Encode,
        check_prompt: CheckPrompt,
        max_prompt_tokens: int,
        max_token_chars: int | None,
    ) -> None:
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
            n = len(prompt.token_ids)
            check(
                n <= self.max_prompt_tokens,
                "prompt",
                f"the prompt has {n} tokens; at most {self.max_prompt_tokens} are allowed",
            )
        elif self.max_prompt_chars is not None and prompt.num_chars > self.max_prompt_chars:
            field = "prompt" if prompt.text is not None else "messages"
            raise InvalidRequestError(
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
            ids = self._encode(prompt.text, prompt.messages)
        check(
            len(ids) <= self.max_prompt_tokens,
            "prompt" if prompt.messages is None else "messages",
            f"the prompt has {len(ids)} tokens; at most {self.max_prompt_tokens} are allowed",
        )
        self._check_prompt(ids)
        return ids

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
