"""Routes ``POST /tokenize`` and ``POST /detokenize``: the served tokenizer, in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (text; ``add_special_tokens``, default true, as the
tokenizer's own ``encode``) or chat ``messages`` (and ``tools``), which go through the chat
template exactly as ``/v1/chat/completions`` tokenizes them, generation prompt included
(``add_generation_prompt`` is true or absent). It
answers ``count``, ``max_model_len``, ``tokens`` and, with ``return_token_strs``, each token's
string in the vocabulary (``token_strs``). ``/detokenize`` takes ``tokens`` and answers their
text as ``prompt``, special tokens included, so that ``/tokenize`` then ``/detokenize`` gives
back the text. Tokenizing runs on the prompt encoder's worker threads, off the event loop.

Both take what the generation routes take, under the same bounds: text with a lone surrogate
is a 400 naming its field; a prompt too long for the context by its size alone is refused
before tokenizing, and one of more than the prompt's most tokens after (``server.prompts``);
``/detokenize`` takes at most the context length's token ids.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Discriminator, Field, Tag

from hybridspec.errors import check
from hybridspec.server.inputs import check_text
from hybridspec.server.openapi import error_responses
from hybridspec.server.prompts import Prompt, prompts_of
from hybridspec.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonInt,
    Tool,
    _Body,
)
from hybridspec.server.responses import check_name
from hybridspec.server.state import State
from hybridspec.server.structured import tool_plan

router = APIRouter(tags=["tokenizer"])


class TokenizePromptRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(
        default=True, description="The tokenizer's BOS and the like, as its encode adds them."
    )
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """Messages (and tools) tokenized as ``/v1/chat/completions`` tokenizes them."""

    model: str | None = None
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    tools: list[Tool] | None = Field(default=None, json_schema_extra={"maxItems": 64})
    add_generation_prompt: Literal[True] = Field(
        default=True, description="Only true: the chat route's prompt ends with it."
    )
    return_token_strs: bool = False


def _shape(body: Any) -> str:
    """Which request ``body`` is: the messages' when it has them and no prompt."""
    is_chat = isinstance(body, dict) and "messages" in body and "prompt" not in body
    return "messages" if is_chat or isinstance(body, TokenizeChatRequest) else "prompt"


TokenizeRequest = Annotated[
    Annotated[TokenizePromptRequest, Tag("prompt")]
    | Annotated[TokenizeChatRequest, Tag("messages")],
    Discriminator(_shape),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[JsonInt] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class DetokenizeResponse(BaseModel):
    prompt: str


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _token_strs(tokenizer: Any, token_ids: list[int]) -> list[str]:
    return [str(token) for token in tokenizer.convert_ids_to_tokens(token_ids)]


def _decode(tokenizer: Any, token_ids: list[int]) -> str:
    return str(tokenizer.decode(token_ids))


async def _chat_token_ids(body: TokenizeChatRequest, state: State) -> list[int]:
    """The messages' token ids as the chat route tokenizes them (its checks included)."""
    for index, tool in enumerate(body.tools or ()):
        check_name(tool.function.name, f"tools[{index}].function.name")  # the document's pattern
    chat = ChatCompletionRequest(messages=body.messages, tools=body.tools)
    renders = state.prompts.renders_tools
    (prompt,) = prompts_of(chat, tool_plan(chat, renders), renders)
    return await state.prompts.encode(prompt)


@router.post("/tokenize", responses=error_responses(400, 404, 408, 413))
async def tokenize(body: TokenizeRequest, state: State) -> TokenizeResponse:
    check_text(body)
    state.model.resolve(body.model)
    if isinstance(body, TokenizePromptRequest):
        field = "prompt"
        state.prompts.check_size(Prompt(body.prompt, None, None, None))
        ids = await state.prompts.with_tokenizer(
            field, _encode, body.prompt, body.add_special_tokens
        )
        state.prompts.check_count(len(ids), field)
    else:
        field = "messages"
        ids = await _chat_token_ids(body, state)
    strs = None
    if body.return_token_strs:
        strs = await state.prompts.with_tokenizer(field, _token_strs, ids)
    return TokenizeResponse(
        count=len(ids), max_model_len=state.model.max_seq_len, tokens=ids, token_strs=strs
    )


@router.post("/detokenize", responses=error_responses(400, 404, 408, 413))
async def detokenize(body: DetokenizeRequest, state: State) -> DetokenizeResponse:
    check_text(body)
    state.model.resolve(body.model)
    most = state.model.max_seq_len
    check(
        len(body.tokens) <= most,
        "tokens",
        f"at most {most} token ids (the model's context), got {len(body.tokens)}",
    )
    vocab_size = state.model.vocab_size
    outside = [t for t in body.tokens if not 0 <= t < vocab_size]
    check(not outside, "tokens", f"token ids must be in [0, {vocab_size}), got {outside[:5]}")
    return DetokenizeResponse(
        prompt=await state.prompts.with_tokenizer("tokens", _decode, body.tokens)
    )
