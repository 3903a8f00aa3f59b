"""The verify step: a batch of sequences' drafts checked against one target forward.

Greedy sequences (``temperature == 0``) take the target's argmax; sampled ones use lossless
rejection sampling (``acceptance.py``: p = target, q = draft, as in Leviathan et al. 2023 and
Chen et al. 2023). The verifier applies each request's sampling controls (``controls``: logit
bias, min_tokens, penalties; at row j counting the drafts d_1 .. d_j as generated, from the
sequence's ``TokenHistory``) and then its sampling transforms (``sampling``) to the target's
logits itself; greedy sequences take the argmax of the controlled logits. A sampling proposer's
``q`` must already be under the same controls and transforms (``controls.apply_controls``, then
``sampling.logits_to_probs``). A greedy sequence's draft probabilities are never read.

Randomness: a sampled sequence with deterministic drafts and ``KeyedUniforms`` (the engine
gives every request one) is decided by position-keyed uniforms (``uniforms``): its token at each
position is the inverse-CDF sample of p there, and its drafts are accepted while they equal
those tokens, so its text does not depend on what was drafted. Any other sampled sequence draws
``k_i + 1`` float64 uniforms from its own generator, in one call, whatever happens: ``u_1 ..
u_k`` decide its drafts and ``u_{k+1}`` samples its recovered or bonus token by inverse CDF.
Either way a sequence's result depends on its inputs and its own randomness only, never on the
other sequences of the batch (a ``None`` generator is torch's global one, which they share).
Greedy sequences draw nothing.

The batch's layout is ``VerifyInput.layout`` (``layout.DraftLayout``), built once per round;
sub-batches of one kind take theirs from it (``DraftLayout.select``).

Dimensions: ``num_seqs``, ``total_num_drafts`` (sum of k_i), ``vocab_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridspec.types import SamplingParams
from hybridspec.verifier.acceptance import (
    draw_uniforms,
    greedy_accept,
    one_hot_residual_probs,
    rejection_accept,
    residual_probs,
    sample_from_probs,
)
from hybridspec.verifier.batch import VerifyInput, VerifyKind, VerifyOutput
from hybridspec.verifier.checks import check_probs_values
from hybridspec.verifier.controls import apply_controls, is_controlled
from hybridspec.verifier.layout import DraftLayout
from hybridspec.verifier.sampling import (
    greedy_token_ids,
    logits_to_probs,
    logits_to_probs_by_row,
    transform_key,
)
from hybridspec.verifier.uniforms import KeyedUniforms


def verify(inp: VerifyInput) -> VerifyOutput:
    """Verify every sequence's drafts: greedy, keyed or rejection sampling (module docstring)."""
    if not any(map(is_controlled, inp.sampling, inp.histories)):
        return _verify(inp, inp.target_logits)
    drafts = inp.layout.split(inp.draft_token_ids.tolist())
    logits = apply_controls(inp.target_logits, inp.sampling, inp.histories, drafts, inp.layout)
    out = _verify(inp, logits)
    return VerifyOutput(out.num_accepted, out.output_token_ids, logits)


def _verify(inp: VerifyInput, target_logits: torch.Tensor) -> VerifyOutput:
    """``verify`` with p made from ``target_logits`` (the input's, or after the controls)."""
    kinds = [
        VerifyKind.of(params, keyed, probs)
        for params, keyed, probs in zip(inp.sampling, inp.keyed, inp.draft_probs, strict=True)
    ]
    if len(set(kinds)) == 1:
        seqs = _Seqs(
            inp.layout, inp.draft_probs, inp.sampling, inp.generators, inp.keyed, inp.checked
        )
        num_accepted, final = _STEPS[kinds[0]](target_logits, inp.draft_token_ids, seqs)
        return VerifyOutput(num_accepted, _output_token_ids(inp, num_accepted, final))
    num_accepted = torch.empty(inp.num_seqs, dtype=torch.long, device=target_logits.device)
    final = torch.empty_like(num_accepted)
    for kind in sorted(set(kinds)):
        members = [i for i, k in enumerate(kinds) if k == kind]
        logits, drafts, sub = _select(inp, target_logits, members)
        index = torch.tensor(members, device=num_accepted.device)
        sub_accepted, sub_final = _STEPS[kind](logits, drafts, sub)
        num_accepted.index_copy_(0, index, sub_accepted)
        final.index_copy_(0, index, sub_final)
    return VerifyOutput(num_accepted, _output_token_ids(inp, num_accepted, final))


@dataclass(frozen=True, slots=True)
class _Seqs:
    """The per-sequence fields of a (sub-)batch, in order."""

    layout: DraftLayout
    draft_probs: Sequence[torch.Tensor | None]
    sampling: Sequence[SamplingParams]
    generators: Sequence[torch.Generator | None]
    keyed: Sequence[KeyedUniforms | None]
    checked: bool  # q was validated where it entered


def _select(
    inp: VerifyInput, target_logits: torch.Tensor, members: list[int]
) -> tuple[torch.Tensor, torch.Tensor, _Seqs]:
    """The target rows, drafts and per-sequence fields of the sequences ``members``."""
    layout, draft_index, row_index = inp.layout.select(members)
    device = target_logits.device
    logits = target_logits[torch.tensor(row_index, device=device)]
    drafts = inp.draft_token_ids[torch.tensor(draft_index, dtype=torch.long, device=device)]
    sub = _Seqs(
        layout,
        [inp.draft_probs[i] for i in members],
        [inp.sampling[i] for i in members],
        [inp.generators[i] for i in members],
        [inp.keyed[i] for i in members],
        inp.checked,
    )
    return logits, drafts, sub


def _verify_greedy(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, seqs: _Seqs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted [num_seqs], final_token_ids [num_seqs]) by argmax; one argmax in all."""
    return greedy_accept(greedy_token_ids(target_logits), draft_token_ids, seqs.layout)


def _verify_keyed(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, seqs: _Seqs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted, final_token_ids) of sampled sequences with deterministic drafts and
    ``KeyedUniforms``: the token at each position is the inverse-CDF sample of p at that
    position's uniform; drafts are accepted while they equal it (``uniforms``).

    Rows are sampled in waves, row j of every sequence still matching its drafts at once, so
    only the rows that decide a token are transformed and sampled.
    """
    layout = seqs.layout
    nums, draft_starts, row_starts = layout.num_drafts, layout.offsets, layout.row_offsets
    drafts = draft_token_ids.tolist()
    num_accepted, final = [0] * len(nums), [0] * len(nums)
    active, j = list(range(len(nums))), 0
    while active:
        rows = torch.tensor([row_starts[i] + j for i in active], device=target_logits.device)
        probs = _probs_of_rows(target_logits[rows], [seqs.sampling[i] for i in active])
        uniforms = [seqs.keyed[i].uniform(j) for i in active]  # type: ignore[union-attr]
        tokens = sample_from_probs(
            probs, torch.tensor(uniforms, dtype=torch.float64, device=probs.device)
        ).tolist()
        still = []
        for i, token in zip(active, tokens, strict=True):
            if j < nums[i] and token == drafts[draft_starts[i] + j]:
                still.append(i)
            else:
                num_accepted[i], final[i] = j, token
        active, j = still, j + 1
    device = target_logits.device
    return (
        torch.tensor(num_accepted, dtype=torch.long, device=device),
        torch.tensor(final, dtype=torch.long, device=device),
    )


def _probs_of_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """p of ``logits`` row r under ``params[r]``."""
    if len({transform_key(p) for p in params}) == 1:
        return logits_to_probs(logits, params[0])
    return logits_to_probs_by_row(logits, list(params))


def _verify_sampled(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, seqs: _Seqs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted [num_seqs], final_token_ids [num_seqs]) by rejection sampling."""
    device = target_logits.device
    layout = seqs.layout
    nums = layout.num_drafts
    target_probs = _target_probs(target_logits, seqs)  # [num_rows, vocab_size]
    uniforms = torch.cat(
        [draw_uniforms(k + 1, gen) for k, gen in zip(nums, seqs.generators, strict=True)]
    ).to(device)  # [num_rows]: each sequence's k_i acceptance draws, then its final-token draw
    p_at_draft = target_probs[layout.draft_rows, draft_token_ids]  # [total_num_drafts]
    draft_q = _gather_draft_q(draft_token_ids, seqs)
    q_at_draft = None if draft_q is None else draft_q.at_draft
    num_accepted = rejection_accept(p_at_draft, q_at_draft, uniforms[layout.draft_rows], layout)
    final_probs = _final_probs(target_probs, draft_token_ids, draft_q, num_accepted, layout, seqs)
    return num_accepted, sample_from_probs(final_probs, uniforms[layout.bonus_rows])


def _target_probs(target_logits: torch.Tensor, seqs: _Seqs) -> torch.Tensor:
    """p at every target row, each under its own sequence's sampling transforms."""
    row_params = [
        params
        for params, k in zip(seqs.sampling, seqs.layout.num_drafts, strict=True)
        for _ in range(k + 1)
    ]
    return _probs_of_rows(target_logits, row_params)


@dataclass(frozen=True, slots=True)
class _DraftQ:
    """The draft distributions of the sequences that sent them, gathered once."""

    probs: torch.Tensor  # [num_q_rows, vocab_size]: their q rows, concatenated in sequence order
    first_row: dict[int, int]  # sequence -> the row of probs holding its first draft's q
    at_draft: torch.Tensor  # [total_num_drafts] q(d) of every draft; 1 for deterministic ones


def _gather_draft_q(draft_token_ids: torch.Tensor, seqs: _Seqs) -> _DraftQ | None:
    """q of the probabilistic drafts, checked; None when every draft is deterministic."""
    with_probs = [i for i, q in enumerate(seqs.draft_probs) if q is not None]
    if not with_probs:
        return None
    nums, offsets = seqs.layout.num_drafts, seqs.layout.offsets
    rows = [seqs.draft_probs[i] for i in with_probs]
    q = torch.cat(rows) if len(rows) > 1 else rows[0]  # type: ignore[arg-type]
    assert q is not None
    first_row, start = {}, 0
    for i in with_probs:
        first_row[i] = start
        start += nums[i]
    if len(with_probs) == len(nums):
        q_at_tokens = q.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
        at_draft = q_at_tokens
    else:
        index = [t for i in with_probs for t in range(offsets[i], offsets[i + 1])]
        index_t = torch.tensor(index, dtype=torch.long, device=draft_token_ids.device)
        q_at_tokens = q.gather(1, draft_token_ids[index_t].unsqueeze(1)).squeeze(1)
        at_draft = torch.ones(len(draft_token_ids), dtype=q.dtype, device=q.device)
        at_draft.index_copy_(0, index_t, q_at_tokens)
    if not seqs.checked:
        check_probs_values(q, q_at_tokens, with_probs, nums)
    return _DraftQ(q, first_row, at_draft)


def _final_probs(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_q: _DraftQ | None,
    num_accepted: torch.Tensor,
    layout: DraftLayout,
    seqs: _Seqs,
) -> torch.Tensor:
    """[num_seqs, vocab_size]: the residual at the first rejection, else p after the last draft."""
    final = target_probs[layout.first_rows + num_accepted]
    accepted = num_accepted.tolist()
    rejected = [
        i for i, (n, k) in enumerate(zip(accepted, seqs.layout.num_drafts, strict=True)) if n < k
    ]
    probabilistic = [i for i in rejected if seqs.draft_probs[i] is not None]
    deterministic = [i for i in rejected if seqs.draft_probs[i] is None]
    device = final.device
    if probabilistic:
        assert draft_q is not None
        index = torch.tensor(probabilistic, device=device)
        rows = torch.tensor(
            [draft_q.first_row[i] + accepted[i] for i in probabilistic], device=device
        )
        final[index] = residual_probs(final[index], draft_q.probs[rows].to(final.dtype))
    if deterministic:
        index = torch.tensor(deterministic, device=device)
        offsets = seqs.layout.offsets
        at = torch.tensor([offsets[i] + accepted[i] for i in deterministic], device=device)
        final[index] = one_hot_residual_probs(final[index], draft_token_ids[at])
    return final


def _output_token_ids(
    inp: VerifyInput, num_accepted: torch.Tensor, final: torch.Tensor
) -> list[list[int]]:
    """Per sequence: its first num_accepted drafts, then its final token (3 host copies)."""
    drafts, accepted, finals = inp.draft_token_ids.tolist(), num_accepted.tolist(), final.tolist()
    starts = inp.layout.offsets[:-1]
    return [
        [*drafts[start : start + n], token]
        for start, n, token in zip(starts, accepted, finals, strict=True)
    ]


_STEPS = {
    VerifyKind.GREEDY: _verify_greedy,
    VerifyKind.KEYED: _verify_keyed,
    VerifyKind.SAMPLED: _verify_sampled,
}
