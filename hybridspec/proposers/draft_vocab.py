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

import torch

from hybridspec.errors import ModelLoadError
from hybridspec.model import LoadedModel
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
