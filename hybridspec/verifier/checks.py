"""Validation of what enters verification: a proposal where it enters the engine, and the
fields of a ``VerifyInput`` built by hand.

Each check tests first and formats its message only on failure: batches can hold thousands of
sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridspec.errors import check
from hybridspec.types import Proposal

PROBS_SUM_TOLERANCE = 1e-3  # |sum(q row) - 1| allowed; float32 softmax rows miss 1 by ~1e-6


def check_proposal(proposal: Proposal, max_num_drafts: int, vocab_size: int) -> None:
    """Raise InvalidRequestError (param ``proposer``) unless ``proposal`` is verifiable.

    The one validation of a proposal, where it enters the engine: at most ``max_num_drafts``
    integer token ids in ``[0, vocab_size)``; ``probs``, when given, a float
    ``[num_drafts, vocab_size]`` tensor whose rows are distributions that give their own draft
    a positive mass.
    """
    if not isinstance(proposal, Proposal):
        check(False, "proposer", f"expected a Proposal, got {type(proposal).__name__}")
    num_drafts = proposal.num_drafts
    if num_drafts > max_num_drafts:
        check(
            False,
            "proposer",
            f"proposed {num_drafts} drafts where at most {max_num_drafts} were asked",
        )
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in proposal.token_ids):
        check(False, "proposer", f"proposed token ids outside [0, {vocab_size})")
    probs = proposal.probs
    if probs is None:
        return
    check(
        isinstance(probs, torch.Tensor)
        and probs.is_floating_point()
        and tuple(probs.shape) == (num_drafts, vocab_size),
        "proposer",
        f"expected probs of shape [{num_drafts}, {vocab_size}], got "
        f"{getattr(probs, 'dtype', type(probs).__name__)} {list(getattr(probs, 'shape', ()))}",
    )
    if num_drafts:
        index = torch.tensor(list(proposal.token_ids), device=probs.device).unsqueeze(1)
        found = probs_problem(probs, probs.gather(1, index).squeeze(1))
        if found is not None:
            check(False, "proposer", f"draft {found[0]}: {found[1]}")


def check_drafts(
    draft_token_ids: torch.Tensor,
    total: int,
    num_seqs: int,
    target_logits: torch.Tensor,
    checked: bool,
) -> None:
    if not (target_logits.dim() == 2 and target_logits.is_floating_point()):
        check(
            False,
            "target_logits",
            f"expected a float tensor [num_rows, vocab_size], got {target_logits.dtype} "
            f"{tuple(target_logits.shape)}",
        )
    if not (draft_token_ids.dim() == 1 and draft_token_ids.dtype == torch.long):
        check(
            False,
            "draft_token_ids",
            f"expected int64 [total_num_drafts], got {draft_token_ids.dtype} "
            f"{tuple(draft_token_ids.shape)}",
        )
    if draft_token_ids.numel() != total:
        check(
            False,
            "draft_token_ids",
            f"expected cu_num_drafts[-1] = {total} tokens, got {draft_token_ids.numel()}",
        )
    if draft_token_ids.device != target_logits.device:
        check(
            False,
            "draft_token_ids",
            f"expected device {target_logits.device}, got {draft_token_ids.device}",
        )
    if target_logits.shape[0] != total + num_seqs:
        check(
            False,
            "target_logits",
            f"expected total_num_drafts + num_seqs = {total} + {num_seqs} rows, "
            f"got {target_logits.shape[0]}",
        )
    vocab_size = target_logits.shape[1]
    if total and not checked:
        low, high = torch.aminmax(draft_token_ids)
        check(
            int(low) >= 0 and int(high) < vocab_size,
            "draft_token_ids",
            f"expected token ids in [0, {vocab_size}), got values in [{int(low)}, {int(high)}]",
        )


def check_probs_shape(
    probs: torch.Tensor, seq: int, shape: tuple[int, int], device: torch.device
) -> None:
    check(
        probs.is_floating_point() and probs.shape == shape,
        "draft_probs",
        f"sequence {seq}: expected a float tensor {list(shape)}, got {probs.dtype} "
        f"{list(probs.shape)}",
    )
    check(
        probs.device == device,
        "draft_probs",
        f"sequence {seq}: expected device {device}, got {probs.device}",
    )


def probs_problem(q: torch.Tensor, q_at_tokens: torch.Tensor) -> tuple[int, str] | None:
    """The first row of q [n, vocab_size] that is not a distribution giving its own draft a
    positive mass (``q_at_tokens`` [n]), with what is wrong; None when every row is fine."""
    if q.numel() == 0:
        return None
    error = (q.sum(dim=1) - 1).abs()
    if not bool(error.max() <= PROBS_SUM_TOLERANCE):  # also True for NaN
        row = int(torch.nan_to_num(error, nan=float("inf")).argmax())
        problem = f"expected a row summing to 1 within {PROBS_SUM_TOLERANCE}"
        return row, problem + f", got {float(q[row].sum()):.6g}"
    if not bool(q.min() >= 0):
        return int(q.min(dim=1).values.argmin()), "expected probabilities >= 0"
    if not bool(q_at_tokens.min() > 0):
        return int(q_at_tokens.argmin()), "the draft token has probability 0 under its own q"
    return None


def check_probs_values(
    q: torch.Tensor, q_at_tokens: torch.Tensor, with_probs: list[int], nums: Sequence[int]
) -> None:
    """Rows of q [n, vocab_size] are distributions that give their own draft a positive mass.

    Row r of q is a draft of the sequences ``with_probs``, in order (``nums`` drafts each).
    """
    found = probs_problem(q, q_at_tokens)
    if found is None:
        return
    row, problem = found
    seq, pos = [(i, j) for i in with_probs for j in range(nums[i])][row]
    check(False, "draft_probs", f"sequence {seq} position {pos}: {problem}")
