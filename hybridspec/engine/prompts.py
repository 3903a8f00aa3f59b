"""Prompt handling: text and chat messages to token ids, and the checks a prompt must pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hybridspec.engine.params import GenerationParams
from hybridspec.errors import ContextLengthError, InvalidRequestError, check

Messages = Sequence[dict[str, Any]]
# A tool that a chat template showing tools renders (``renders_tools``).
PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "parameters": {}}}
CHAT_ROLES = ("system", "user", "assistant", "tool")


def encode(
    tokenizer: Any,
    prompt: str | None = None,
    messages: Messages | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a plain prompt, or of chat messages with the chat template applied (and
    ``tools``, OpenAI's function definitions, for a template that shows them)."""
    if tokenizer is None:
        raise InvalidRequestError("prompt: this model has no tokenizer; pass token ids", "prompt")
    check(
        (prompt is None) != (messages is None),
        "prompt",
        "expected exactly one of a prompt or chat messages",
    )
    if prompt is not None:
        check(isinstance(prompt, str), "prompt", f"expected a string, got {type(prompt).__name__}")
        return list(tokenizer.encode(prompt))
    check_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            list(messages or ()), tools=tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # errors raised by the template itself, e.g. on roles
        raise InvalidRequestError(
            f"messages: the chat template rejected them: {exc}", "messages"
        ) from exc
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def prompt_and_params(
    encode_messages: Callable[[str | None, Messages | None], list[int]],
    prompt: str | None,
    messages: Messages | None,
    prompt_token_ids: Sequence[int] | None,
    params: GenerationParams | None,
    kwargs: dict[str, Any],
) -> tuple[Sequence[int], GenerationParams]:
    """The prompt's token ids and the parameters, from ``Engine.stream``'s arguments: one of a
    prompt, messages or token ids, and ``params`` or keyword options for
    ``GenerationParams.create``; ``encode_messages``: ``Engine.encode``."""
    if params is None:
        params = GenerationParams.create(**kwargs)
    else:
        check(not kwargs, "params", f"give either params or keyword options, not {sorted(kwargs)}")
    if prompt_token_ids is None:
        return encode_messages(prompt, messages), params
    check(
        prompt is None and messages is None,
        "prompt",
        "expected one of prompt, messages or prompt_token_ids",
    )
    return prompt_token_ids, params


def check_prompt(prompt_token_ids: Sequence[int], max_seq_len: int, vocab_size: int) -> None:
    """A prompt must be non-empty, leave room to generate and hold valid token ids."""
    n = len(prompt_token_ids)
    check(n >= 1, "prompt", "the prompt is empty")
    if n >= max_seq_len:
        raise ContextLengthError(
            f"prompt: the prompt has {n} tokens; the context holds {max_seq_len}, "
            f"so at most {max_seq_len - 1} fit with room to generate",
            "prompt",
        )
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    check(not bad, "prompt", f"token ids must be integers in [0, {vocab_size}), got {bad[:5]}")


def check_messages(messages: Messages | None) -> None:
    """Validate OpenAI-style chat messages: a non-empty list of {role, content} strings."""
    check(
        isinstance(messages, (list, tuple)) and len(messages) > 0,
        "messages",
        "expected a non-empty list of messages",
    )
    for i, message in enumerate(messages or ()):
        check(isinstance(message, dict), f"messages[{i}]", "expected an object")
        check(
            message.get("role") in CHAT_ROLES,
            f"messages[{i}].role",
            f"expected one of {CHAT_ROLES}, got {message.get('role')!r}",
        )
        check(
            isinstance(message.get("content"), str), f"messages[{i}].content", "expected a string"
        )


def renders_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template shows tools to the model: a conversation renders
    differently with a tool than without."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return False
    messages = [{"role": "user", "content": "x"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False)
        shown = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], tokenize=False)
    except Exception:  # a template that fails on tools does not show them
        return False
    return bool(plain != shown)
