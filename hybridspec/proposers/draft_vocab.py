"""A draft model's vocabulary against the target's: the same tokens, up to padding.

Checkpoints of one family often differ only in unused rows past the tokenizer's last token
(Qwen2.5-0.5B has 151,936 embedding rows, Qwen2.5-7B 152,064; the tokenizer has 151,665
tokens). Such a draft is accepted: its logits are cut to the tokenizer's tokens and padded with
``-inf`` to the target's rows (``fit_draft_logits``), so that a draft is never an unused id and
``q`` is a distribution over the target's rows; verification is unchanged (lossless). A draft
whose tokens differ is refused, naming the first id whose token differs.

Dimensions: ``n`` rows of logits, ``Vd`` the draft's rows, ``V`` the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridspec.errors import ModelLoadError
from hybridspec.model import GGUFFile, LoadedModel
from hybridspec.proposers.base import ProposerContext


def draftable_ids(target: ProposerContext, draft: LoadedModel) -> int:
    """How many ids (from 0) the draft may propose: both models' rows when they are as many,
    else the tokenizer's tokens, which both must list alike and both models must have rows
    for. Raises ModelLoadError naming what differs."""
    if draft.vocab_size == target.vocab_size:
        return target.vocab_size
    if target.tokenizer is None or draft.tokenizer is None:
        raise ModelLoadError(
            f"draft model: vocabulary size {draft.vocab_size} differs from the target's "
            f"{target.vocab_size}, and without both tokenizers the extra rows cannot be told "
            "unused; a draft must share the target's tokenizer"
        )
    target_tokens = _tokens(target.tokenizer)
    draft_tokens = _tokens(draft.tokenizer)
    for i in range(max(len(target_tokens), len(draft_tokens))):
        ours = target_tokens[i] if i < len(target_tokens) else None
        theirs = draft_tokens[i] if i < len(draft_tokens) else None
        if ours != theirs:
            raise ModelLoadError(
                f"draft model: its vocabulary differs from the target's at token id {i}: "
                f"{theirs!r} in the draft, {ours!r} in the target"
            )
    used = len(target_tokens)
    smaller = min(draft.vocab_size, target.vocab_size)
    if used > smaller:
        raise ModelLoadError(
            f"draft model: vocabulary size {draft.vocab_size} differs from the target's "
            f"{target.vocab_size}, and the tokenizer's {used} tokens do not fit in {smaller} rows"
        )
    return used


def _tokens(tokenizer: object) -> list[str | None]:
    """Every token of ``tokenizer`` by id (added tokens included), None for an id it skips."""
    vocab: dict[str, int] = tokenizer.get_vocab()  # type: ignore[attr-defined]
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


def fit_draft_logits(logits: torch.Tensor, draftable: int, vocab_size: int) -> torch.Tensor:
    """``logits [n, Vd]`` as ``[n, V]``: the first ``draftable`` columns kept, the rest
    ``-inf`` (unused ids are never drafted). Unchanged when nothing is cut or padded."""
    if draftable == logits.shape[1] == vocab_size:
        return logits
    fitted = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    fitted[:, :draftable] = logits[:, :draftable]
    return fitted


UNUSED_TOKEN_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: a padding entry


def gguf_vocabulary_problem(target: str | None, draft: str | None) -> str | None:
    """Why the draft file's vocabulary is not the target file's, or None (also where either is
    not a GGUF file: ``draftable_ids`` checks those once loaded). Reads the token lists from
    the files' metadata (``GGUFFile``: memory-mapped, only these two arrays decoded), so that a
    mismatch is told before any weight is read: the lists must agree on every id both have,
    and the longer one's extra entries must be unused padding."""
    if not (target and draft and _is_gguf(target) and _is_gguf(draft)):
        return None
    target_tokens, target_types = _gguf_tokens(target)
    draft_tokens, draft_types = _gguf_tokens(draft)
    for i, (ours, theirs) in enumerate(zip(target_tokens, draft_tokens, strict=False)):
        if ours != theirs:
            return (
                f"draft model {draft}: its vocabulary differs from the target {target}'s at "
                f"token id {i}: {theirs!r} in the draft, {ours!r} in the target"
            )
    n = min(len(target_tokens), len(draft_tokens))
    extra = (target_types if len(target_types) > n else draft_types)[n:]
    if any(t != UNUSED_TOKEN_TYPE for t in extra):
        return (
            f"draft model {draft}: {len(draft_tokens)} tokens against the target {target}'s "
            f"{len(target_tokens)}, and the longer vocabulary's extra tokens are in use"
        )
    return None


def _is_gguf(name: str) -> bool:
    return name.endswith(".gguf") and Path(name).is_file()


def _gguf_tokens(path: str) -> tuple[list[str], list[int]]:
    file = GGUFFile(path)
    tokens = file.get("tokenizer.ggml.tokens")
    types = file.get("tokenizer.ggml.token_type")
    if tokens is None:
        raise ModelLoadError(f"GGUF file {path}: no tokenizer.ggml.tokens in its metadata")
    listed = [str(t) for t in tokens]
    kinds = [int(t) for t in types] if types is not None else [1] * len(listed)
    return listed, kinds
