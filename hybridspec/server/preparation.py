"""From an OpenAI request body to what the engine loop takes: validation, the request's
proposer and K resolved, its grammar compiled and its prompts tokenized on worker threads.

``prepare`` turns a body into one ``PreparedRequest`` per prompt (prompt token ids,
GenerationParams, ``n``) or raises InvalidRequestError / UnknownModelError naming the field;
``server.generation`` runs them. Nothing here depends on the web framework.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from dataclasses import dataclass

from hybridspec.engine import GenerationParams
from hybridspec.engine.choices import check_choices
from hybridspec.errors import check
from hybridspec.server.inputs import check_body
from hybridspec.server.logprobs import (
    logprobs_options,
)
from hybridspec.server.prompts import prompts_of
from hybridspec.server.protocol import (
    MAX_JSON_SEED,
    TOKEN_ID_PATTERN,
    ChatCompletionRequest,
    CompletionRequest,
)
from hybridspec.server.state import ServerState
from hybridspec.server.structured import ToolPlan, grammar_source, tool_plan
from hybridspec.server.tenants import scoped

OPENAI_DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated prompt of a request, ready for the engine loop; a request holds one per
    prompt, each with the request's options."""

    model: str  # the served name, echoed in responses
    prompt_token_ids: list[int]
    params: GenerationParams
    proposer: str  # resolved (``params.resolved``): the request's or the engine's default
    num_speculative_tokens: int  # resolved likewise
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage so far on every chunk (needs include_usage, as in vLLM)
    chat: bool  # a chat completion (else a text completion)
    # A completion's echoed prompt (``echo``); its logprobs come when ``params.logprobs`` is set.
    echo_text: str | None = None
    n: int = 1  # choices of this prompt
    tools: ToolPlan | None = None  # a chat request's tools (``server.structured``)
    include_drafts: bool = False  # stream each chunk's tokens and their origin

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
    if isinstance(body, CompletionRequest):
        check(body.best_of is None or body.best_of == 1, "best_of", "only best_of = 1 is supported")
        check(not body.suffix, "suffix", "a suffix is not supported (only null or empty)")
    else:
        modalities = body.modalities or []
        check(
            all(m == "text" for m in modalities),
            "modalities",
            f"only 'text' output is supported, got {modalities}",
        )


# Digits of a ``logit_bias`` key at most: far beyond any vocabulary, and short enough for int()
# (which refuses strings of over 4300 digits). The vocabulary's bound is the engine's check
# (``verifier.check_logit_bias``, when the request is added).
MAX_TOKEN_ID_DIGITS = 18


def _logit_bias(body: CompletionRequest | ChatCompletionRequest) -> dict[int, float]:
    """``logit_bias`` with integer keys, written as in the schema.

    Keys are matched as JSON Schema validators match the document's ``pattern`` (``re.search``,
    whose ``$`` also matches before a final newline), so the server takes exactly what the
    document states.
    """
    bias = body.logit_bias or {}
    bad = [
        key
        for key in bias
        if not re.search(TOKEN_ID_PATTERN, key) or len(key.strip()) > MAX_TOKEN_ID_DIGITS
    ]
    check(not bad, "logit_bias", f"keys must be token ids (decimal integers), got {bad[:5]}")
    return {int(key.removesuffix("\n")): value for key, value in bias.items()}


# The body's options that mean the same as ``GenerationParams.create``'s arguments, and take
# its defaults where the body leaves them out.
_GIVEN_OR_DEFAULT = (
    "top_k",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
)


def _params(body: CompletionRequest | ChatCompletionRequest) -> GenerationParams:
    """The body's generation options; ``max_new_tokens`` is set once the prompt is tokenized.
    Options the body leaves out take ``GenerationParams.create``'s defaults, but temperature,
    whose default is OpenAI's."""
    check(
        body.seed is None or 0 <= body.seed <= MAX_JSON_SEED,
        "seed",
        f"expected an integer in [0, 2**53), got {body.seed}",
    )
    logprobs, prompt_logprobs = logprobs_options(body)
    given = {
        name: getattr(body, name) for name in _GIVEN_OR_DEFAULT if getattr(body, name) is not None
    }
    return GenerationParams.create(
        max_new_tokens=1,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        temperature=body.temperature
        if body.temperature is not None
        else OPENAI_DEFAULT_TEMPERATURE,
        logit_bias=_logit_bias(body),
        proposer=body.proposer,
        num_speculative_tokens=body.num_speculative_tokens,
        stop=body.stop,
        ignore_eos=bool(body.ignore_eos),
        cache_prompt=body.cache_prompt is not False,
        session=body.user,
        stop_token_ids=body.stop_token_ids or (),
        **given,
    )


def _completion_budget(max_seq_len: int, num_prompt_tokens: int, max_tokens: int | None) -> int:
    """``max_tokens``, at most the rest of the context (None: all of it). A larger
    ``max_tokens`` is a bound, not an error: generation ends when the context is full, with
    finish_reason ``length`` (as llama.cpp's server does; clients often send a large default)."""
    room = max_seq_len - num_prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


async def prepare(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    tenant: str | None = None,
) -> list[PreparedRequest]:
    """Validate ``body`` and tokenize its prompts on worker threads (``server.prompts``); one
    ``PreparedRequest`` per prompt. ``n`` and the number of prompts are checked before any
    tokenizing, with the engine's own bounds (``engine.choices.check_choices``; the engine
    is told, and does not check them again). ``tenant``: whose key the request came with
    (``server.tenants``), which with ``cache_salt`` sets its turn and cache scope."""
    model = state.model.resolve(body.model)
    check_body(body)
    _reject_unsupported(body)
    renders = state.prompts.renders_tools
    tools = tool_plan(body, renders) if isinstance(body, ChatCompletionRequest) else None
    prompts = prompts_of(body, tools, renders)
    n = body.n if body.n is not None else 1
    check_choices(n, len(prompts), state.model.max_choices, state.model.max_queue_size)
    check(body.cache_salt is None or bool(body.cache_salt), "cache_salt", "expected a salt")
    params = scoped(_params(body), state.config.isolation, tenant, body.cache_salt)
    resolved = state.model.catalog.resolve(params.proposer, params.num_speculative_tokens)
    param, spec = grammar_source(body, tools)
    grammar = await state.grammars.compile(spec, param)  # on worker threads, with a deadline
    options = body.stream_options
    all_ids = await asyncio.gather(*(state.prompts.encode(prompt) for prompt in prompts))
    prepared = []
    for prompt, ids in zip(prompts, all_ids, strict=True):
        echo_text = None
        if isinstance(body, CompletionRequest) and body.echo:
            echo_text = prompt.text if prompt.text is not None else await state.prompts.decode(ids)
        max_tokens = _completion_budget(state.model.max_seq_len, len(ids), prompt.max_tokens)
        prepared.append(
            PreparedRequest(
                model=model,
                prompt_token_ids=ids,
                params=dataclasses.replace(
                    params, max_new_tokens=max_tokens, grammar=grammar, resolved=resolved
                ),
                proposer=resolved.name,
                num_speculative_tokens=resolved.num_speculative_tokens,
                stream=bool(body.stream),
                include_usage=options is not None and bool(options.include_usage),
                continuous_usage=options is not None
                and bool(options.include_usage and options.continuous_usage_stats),
                chat=isinstance(body, ChatCompletionRequest),
                echo_text=echo_text,
                n=n,
                tools=tools,
                include_drafts=options is not None and bool(options.include_drafts),
            )
        )
    return prepared
