"""The verify step: a batch of sequences' drafts checked against one target forward.

Greedy sequences (``temperature == 0``) take the target's argmax; sampled ones use lossless
rejection sampling (``acceptance.py``: p = target, q = draft, as in Leviathan et al. 2023 and
Chen et al. 2023). The verifier applies the request's sampling transforms to the target's logits
itself; a sampling proposer's ``q`` must already be under the same transforms (it gets them from
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

Layout of ``target_logits`` (as in vLLM): sequence i with k_i drafts owns the k_i + 1 rows
``cu[i] + i .. cu[i + 1] + i``; row j of them holds the target's logits after the last committed
token and d_1 .. d_j. Example: k = [2, 0, 3] gives cu = [0, 2, 2, 5] and 8 rows: seq 0 rows 0..2,
seq 1 row 3, seq 2 rows 4..7 (see ``acceptance.DraftLayout``).

Dimensions: ``num_seqs``, ``total_draft_tokens`` (sum of k_i), ``vocab_size``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridspec.errors import check
from hybridspec.types import Proposal, SamplingParams
from hybridspec.verifier.acceptance import (
    DraftLayout,
    greedy_accept,
    one_hot_residual_probs,
    rejection_accept,
    residual_probs,
    sample_from_probs,
)
from hybridspec.verifier.sampling import (
    greedy_token_ids,
    logits_to_probs,
    logits_to_probs_by_row,
    transform_key,
)
from hybridspec.verifier.uniforms import KeyedUniforms

GREEDY = SamplingParams()  # frozen, so safe to share as a default
PROBS_SUM_TOLERANCE = 1e-3  # |sum(q row) - 1| allowed; float32 softmax rows miss 1 by ~1e-6


@dataclass(frozen=True, slots=True)
class VerifyInput:
    """One batch to verify: flat ragged drafts and the target's logits at every position."""

    draft_token_ids: torch.Tensor  # [total_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor  # [num_seqs + 1] int64, cumulative, cu[0] = 0
    draft_probs: Sequence[torch.Tensor | None]  # per seq: q [k_i, vocab_size], None = deterministic
    target_logits: torch.Tensor  # [total_draft_tokens + num_seqs, vocab_size] float
    sampling: Sequence[SamplingParams]  # per seq
    generators: Sequence[torch.Generator | None]  # per seq, on target_logits' device
    # per seq: position-keyed randomness, used when its drafts are deterministic; () = all None
    keyed: Sequence[KeyedUniforms | None] = ()
    num_draft_tokens: tuple[int, ...] = field(init=False)  # per seq k_i, read from cu once

    def __post_init__(self) -> None:
        cu = self.cu_num_draft_tokens
        check(
            cu.dim() == 1 and cu.numel() >= 2 and cu.dtype == torch.long,
            "cu_num_draft_tokens",
            f"expected int64 [num_seqs + 1] with num_seqs >= 1, got {cu.dtype} {tuple(cu.shape)}",
        )
        offsets = cu.tolist()
        counts = tuple(b - a for a, b in itertools.pairwise(offsets))
        check(
            offsets[0] == 0 and min(counts) >= 0,
            "cu_num_draft_tokens",
            f"expected non-decreasing offsets starting at 0, got {offsets}",
        )
        object.__setattr__(self, "num_draft_tokens", counts)
        num_seqs = len(counts)
        if not self.keyed:
            object.__setattr__(self, "keyed", (None,) * num_seqs)
        _check_drafts(self.draft_token_ids, offsets[-1], num_seqs, self.target_logits)
        for name, values in (
            ("draft_probs", self.draft_probs),
            ("sampling", self.sampling),
            ("generators", self.generators),
            ("keyed", self.keyed),
        ):
            check(
                len(values) == num_seqs,
                name,
                f"expected one entry per sequence ({num_seqs}), got {len(values)}",
            )
        # Per-sequence checks test first and format a message only on failure: batches can
        # hold thousands of sequences.
        shape = (0, self.target_logits.shape[1])
        device = self.target_logits.device
        per_seq = zip(self.sampling, self.generators, self.draft_probs, strict=True)
        for i, (params, gen, probs) in enumerate(per_seq):
            if not isinstance(params, SamplingParams):
                check(False, "sampling", f"sequence {i}: expected SamplingParams, got {params!r}")
            if gen is not None and not isinstance(gen, torch.Generator):
                check(False, "generators", f"sequence {i}: expected a Generator, got {gen!r}")
            if self.keyed[i] is not None and not isinstance(self.keyed[i], KeyedUniforms):
                check(
                    False, "keyed", f"sequence {i}: expected KeyedUniforms, got {self.keyed[i]!r}"
                )
            if probs is None:
                continue
            shape = (counts[i], shape[1])
            if not (probs.shape == shape and probs.is_floating_point() and probs.device == device):
                _check_probs_shape(probs, i, shape, device)

    @property
    def num_seqs(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[1]

    @staticmethod
    def from_proposals(
        proposals: Sequence[Proposal],
        target_logits: torch.Tensor,
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        keyed: Sequence[KeyedUniforms | None] = (),
    ) -> VerifyInput:
        """Flatten one ``Proposal`` per sequence; ``generators`` None means all None."""
        device = target_logits.device
        flat = [int(t) for proposal in proposals for t in proposal.token_ids]
        cu = list(itertools.accumulate((p.num_tokens for p in proposals), initial=0))
        return VerifyInput(
            draft_token_ids=torch.tensor(flat, dtype=torch.long, device=device),
            cu_num_draft_tokens=torch.tensor(cu, dtype=torch.long),
            draft_probs=[p.probs for p in proposals],
            target_logits=target_logits,
            sampling=list(sampling),
            generators=[None] * len(proposals) if generators is None else list(generators),
            keyed=list(keyed),
        )

    @staticmethod
    def dummy(
        num_draft_tokens: Sequence[int] = (3,),
        vocab_size: int = 32,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        probabilistic: bool | Sequence[bool] = False,
        seed: int = 0,
    ) -> VerifyInput:
        """A random valid batch for tests; sequence i's generator is seeded ``seed + i``.

        The draft's logits are the target's plus noise, so that drafts are often accepted:
        a deterministic draft is their argmax, a probabilistic one a sample of q, their softmax
        under the sequence's transforms (temperature 1 for a greedy sequence).
        """
        num_seqs = len(num_draft_tokens)
        params = [sampling] * num_seqs if isinstance(sampling, SamplingParams) else list(sampling)
        kinds = [probabilistic] * num_seqs if isinstance(probabilistic, bool) else probabilistic
        rng = torch.Generator().manual_seed(seed)
        logits = torch.randn(sum(num_draft_tokens) + num_seqs, vocab_size, generator=rng) * 2
        proposals, row = [], 0
        for k, sp, kind in zip(num_draft_tokens, params, kinds, strict=True):
            draft_logits = logits[row : row + k] + torch.randn(k, vocab_size, generator=rng)
            row += k + 1
            if not kind:
                proposals.append(Proposal(draft_logits.argmax(dim=-1).tolist()))
                continue
            q = logits_to_probs(
                draft_logits, SamplingParams(temperature=1.0) if sp.is_greedy else sp
            )
            tokens = torch.multinomial(q, 1, generator=rng).squeeze(1).tolist() if k else []
            proposals.append(Proposal(tokens, q))
        gens = [torch.Generator().manual_seed(seed + i) for i in range(num_seqs)]
        return VerifyInput.from_proposals(proposals, logits, params, gens)


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    """What each sequence commits: its accepted drafts, then one recovered or bonus token."""

    num_accepted: torch.Tensor  # [num_seqs] int64, accepted drafts per sequence, 0..k_i
    output_token_ids: list[list[int]]  # per seq: num_accepted[i] + 1 token ids

    @property
    def num_seqs(self) -> int:
        return len(self.output_token_ids)


def verify(inp: VerifyInput) -> VerifyOutput:
    """Verify every sequence's drafts: greedy, keyed or rejection sampling (module docstring)."""
    steps = (_verify_greedy, _verify_keyed, _verify_sampled)
    kinds = [
        0 if params.is_greedy else 1 if keyed is not None and probs is None else 2
        for params, keyed, probs in zip(inp.sampling, inp.keyed, inp.draft_probs, strict=True)
    ]
    if len(set(kinds)) == 1:
        seqs = _Seqs(inp.num_draft_tokens, inp.draft_probs, inp.sampling, inp.generators, inp.keyed)
        num_accepted, final = steps[kinds[0]](inp.target_logits, inp.draft_token_ids, seqs)
        return VerifyOutput(num_accepted, _output_token_ids(inp, num_accepted, final))
    num_accepted = torch.empty(inp.num_seqs, dtype=torch.long, device=inp.target_logits.device)
    final = torch.empty_like(num_accepted)
    for kind in sorted(set(kinds)):
        members = [i for i, k in enumerate(kinds) if k == kind]
        logits, drafts, sub = _select(inp, members)
        index = torch.tensor(members, device=num_accepted.device)
        sub_accepted, sub_final = steps[kind](logits, drafts, sub)
        num_accepted.index_copy_(0, index, sub_accepted)
        final.index_copy_(0, index, sub_final)
    return VerifyOutput(num_accepted, _output_token_ids(inp, num_accepted, final))


@dataclass(frozen=True, slots=True)
class _Seqs:
    """The per-sequence fields of a (sub-)batch, in order."""

    num_draft_tokens: Sequence[int]
    draft_probs: Sequence[torch.Tensor | None]
    sampling: Sequence[SamplingParams]
    generators: Sequence[torch.Generator | None]
    keyed: Sequence[KeyedUniforms | None]


def _select(inp: VerifyInput, members: list[int]) -> tuple[torch.Tensor, torch.Tensor, _Seqs]:
    """The target rows, drafts and per-sequence fields of the sequences ``members``."""
    offsets = list(itertools.accumulate(inp.num_draft_tokens, initial=0))
    draft_index = [t for i in members for t in range(offsets[i], offsets[i + 1])]
    row_index = [r for i in members for r in range(offsets[i] + i, offsets[i + 1] + i + 1)]
    device = inp.target_logits.device
    logits = inp.target_logits[torch.tensor(row_index, device=device)]
    drafts = inp.draft_token_ids[torch.tensor(draft_index, dtype=torch.long, device=device)]
    sub = _Seqs(
        [inp.num_draft_tokens[i] for i in members],
        [inp.draft_probs[i] for i in members],
        [inp.sampling[i] for i in members],
        [inp.generators[i] for i in members],
        [inp.keyed[i] for i in members],
    )
    return logits, drafts, sub


def _verify_greedy(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, seqs: _Seqs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted [num_seqs], final_token_ids [num_seqs]) by argmax; one argmax in all."""
    layout = DraftLayout.from_counts(seqs.num_draft_tokens, target_logits.device)
    return greedy_accept(greedy_token_ids(target_logits), draft_token_ids, layout)


def _verify_keyed(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, seqs: _Seqs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted, final_token_ids) of sampled sequences with deterministic drafts and
    ``KeyedUniforms``: the token at each position is the inverse-CDF sample of p at that
    position's uniform; drafts are accepted while they equal it (``uniforms``).

    Rows are sampled in waves, row j of every sequence still matching its drafts at once, so
    only the rows that decide a token are transformed and sampled.
    """
    nums = seqs.num_draft_tokens
    draft_starts = list(itertools.accumulate(nums[:-1], initial=0))  # seq i's row j: start + i + j
    drafts = draft_token_ids.tolist()
    num_accepted, final = [0] * len(nums), [0] * len(nums)
    active, j = list(range(len(nums))), 0
    while active:
        rows = torch.tensor([draft_starts[i] + i + j for i in active], device=target_logits.device)
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
    nums = seqs.num_draft_tokens
    layout = DraftLayout.from_counts(nums, device)
    target_probs = _target_probs(target_logits, seqs)  # [num_rows, vocab_size]
    uniforms = torch.cat(
        [
            torch.rand(k + 1, generator=gen, dtype=torch.float64, device=device)
            for k, gen in zip(nums, seqs.generators, strict=True)
        ]
    )  # [num_rows]: each sequence's k_i acceptance draws, then its final-token draw
    p_at_draft = target_probs[layout.draft_rows, draft_token_ids]  # [total_draft_tokens]
    draft_q = _gather_draft_q(draft_token_ids, seqs)
    q_at_draft = None if draft_q is None else draft_q.at_draft
    num_accepted = rejection_accept(p_at_draft, q_at_draft, uniforms[layout.draft_rows], layout)
    final_probs = _final_probs(target_probs, draft_token_ids, draft_q, num_accepted, layout, seqs)
    return num_accepted, sample_from_probs(final_probs, uniforms[layout.bonus_rows])


def _target_probs(target_logits: torch.Tensor, seqs: _Seqs) -> torch.Tensor:
    """p at every target row, each under its own sequence's sampling transforms."""
    row_params = [
        params
        for params, k in zip(seqs.sampling, seqs.num_draft_tokens, strict=True)
        for _ in range(k + 1)
    ]
    return _probs_of_rows(target_logits, row_params)


@dataclass(frozen=True, slots=True)
class _DraftQ:
    """The draft distributions of the sequences that sent them, gathered once."""

    probs: torch.Tensor  # [num_q_rows, vocab_size]: their q rows, concatenated in sequence order
    first_row: dict[int, int]  # sequence -> the row of probs holding its first draft's q
    at_draft: torch.Tensor  # [total_draft_tokens] q(d) of every draft; 1 for deterministic ones


def _gather_draft_q(draft_token_ids: torch.Tensor, seqs: _Seqs) -> _DraftQ | None:
    """q of the probabilistic drafts, checked; None when every draft is deterministic."""
    with_probs = [i for i, q in enumerate(seqs.draft_probs) if q is not None]
    if not with_probs:
        return None
    nums = seqs.num_draft_tokens
    rows = [seqs.draft_probs[i] for i in with_probs]
    q = torch.cat(rows) if len(rows) > 1 else rows[0]  # type: ignore[arg-type]
    assert q is not None
    starts = itertools.accumulate((nums[i] for i in with_probs[:-1]), initial=0)
    first_row = dict(zip(with_probs, starts, strict=True))
    if len(with_probs) == len(nums):
        q_at_tokens = q.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
        at_draft = q_at_tokens
    else:
        offsets = list(itertools.accumulate(nums, initial=0))
        index = [t for i in with_probs for t in range(offsets[i], offsets[i + 1])]
        index_t = torch.tensor(index, dtype=torch.long, device=draft_token_ids.device)
        q_at_tokens = q.gather(1, draft_token_ids[index_t].unsqueeze(1)).squeeze(1)
        at_draft = torch.ones(len(draft_token_ids), dtype=q.dtype, device=q.device)
        at_draft.index_copy_(0, index_t, q_at_tokens)
    _check_probs_values(q, q_at_tokens, with_probs, nums)
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
        i for i, (n, k) in enumerate(zip(accepted, seqs.num_draft_tokens, strict=True)) if n < k
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
        offsets = list(itertools.accumulate(seqs.num_draft_tokens, initial=0))
        at = torch.tensor([offsets[i] + accepted[i] for i in deterministic], device=device)
        final[index] = one_hot_residual_probs(final[index], draft_token_ids[at])
    return final


def _output_token_ids(
    inp: VerifyInput, num_accepted: torch.Tensor, final: torch.Tensor
) -> list[list[int]]:
    """Per sequence: its first num_accepted drafts, then its final token (3 host copies)."""
    drafts, accepted, finals = inp.draft_token_ids.tolist(), num_accepted.tolist(), final.tolist()
    out, start = [], 0
    for k, n, token in zip(inp.num_draft_tokens, accepted, finals, strict=True):
        out.append([*drafts[start : start + n], token])
        start += k
    return out


def _check_drafts(
    draft_token_ids: torch.Tensor, total: int, num_seqs: int, target_logits: torch.Tensor
) -> None:
    check(
        target_logits.dim() == 2 and target_logits.is_floating_point(),
        "target_logits",
        f"expected a float tensor [num_rows, vocab_size], got {target_logits.dtype} "
        f"{tuple(target_logits.shape)}",
    )
    check(
        draft_token_ids.dim() == 1 and draft_token_ids.dtype == torch.long,
        "draft_token_ids",
        f"expected int64 [total_draft_tokens], got {draft_token_ids.dtype} "
        f"{tuple(draft_token_ids.shape)}",
    )
    check(
        draft_token_ids.numel() == total,
        "draft_token_ids",
        f"expected cu_num_draft_tokens[-1] = {total} tokens, got {draft_token_ids.numel()}",
    )
    check(
        draft_token_ids.device == target_logits.device,
        "draft_token_ids",
        f"expected device {target_logits.device}, got {draft_token_ids.device}",
    )
    check(
        target_logits.shape[0] == total + num_seqs,
        "target_logits",
        f"expected total_draft_tokens + num_seqs = {total} + {num_seqs} rows, "
        f"got {target_logits.shape[0]}",
    )
    vocab_size = target_logits.shape[1]
    if total:
        low, high = torch.aminmax(draft_token_ids)
        check(
            int(low) >= 0 and int(high) < vocab_size,
            "draft_token_ids",
            f"expected token ids in [0, {vocab_size}), got values in [{int(low)}, {int(high)}]",
        )


def _check_probs_shape(
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


def _check_probs_values(
    q: torch.Tensor, q_at_tokens: torch.Tensor, with_probs: list[int], nums: Sequence[int]
) -> None:
    """Rows of q [n, vocab_size] are distributions that give their own draft a positive mass.

    Row r of q is a draft of the sequences ``with_probs``, in order (``nums`` drafts each).
    """
    if q.numel() == 0:
        return
    error = (q.sum(dim=1) - 1).abs()
    if not bool(error.max() <= PROBS_SUM_TOLERANCE):  # also True for NaN
        row = int(torch.nan_to_num(error, nan=float("inf")).argmax())
        problem = f"expected a row summing to 1 within {PROBS_SUM_TOLERANCE}"
        problem += f", got {float(q[row].sum()):.6g}"
    elif not bool(q.min() >= 0):
        row, problem = int(q.min(dim=1).values.argmin()), "expected probabilities >= 0"
    elif not bool(q_at_tokens.min() > 0):
        row = int(q_at_tokens.argmin())
        problem = "the draft token has probability 0 under its own q"
    else:
        return
    seq, pos = [(i, j) for i in with_probs for j in range(nums[i])][row]
    check(False, "draft_probs", f"sequence {seq} position {pos}: {problem}")
