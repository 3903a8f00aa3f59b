"""The ``draft`` proposer: a small causal LM of the target's family guesses K tokens.

The draft model is the one the engine loaded (``ProposerContext.draft``); its runtime's KV cache
holds one slot per sequence. Its cache lags the
committed context: a round first feeds every committed token it has not cached (the whole
prompt on the first round: lazy prefill), then drafts K tokens autoregressively, all sequences
of the batch together. Tokens are drawn from the draft's distribution q under the request's own
sampling controls and transforms (the drafted prefix counted as generated, as the verifier
counts it at the same position), and q is returned for rejection sampling; greedy requests take
the argmax of the controlled logits and return no distribution.

Worked example of the rollback: committed length 20, K = 4. The round feeds position 19 and
the drafts d1..d3 (d4 is sampled but never fed), so the draft cache holds 23 tokens. If the
target accepts d1, d2 and corrects the third, 23 tokens are committed, of which the draft
cache holds the first 22 correctly (20 committed + d1 + d2): it is truncated to 22, and the
next round feeds the recovered token first.

Dimensions: ``num_seqs`` sequences drafted together, ``k_i`` drafts of sequence i.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridspec.errors import InvalidRequestError, ModelLoadError
from hybridspec.model import (
    ForwardBatch,
    LoadedModel,
    ModelRuntime,
    fastest_forward_seconds,
)
from hybridspec.proposers.base import ProposerContext
from hybridspec.proposers.draft_vocab import draftable_ids, fit_draft_logits
from hybridspec.proposers.sequences import SeqState, SequenceProposer
from hybridspec.types import CommitInfo, Proposal, ProposeRequest, SamplingParams
from hybridspec.verifier.acceptance import draw_token
from hybridspec.verifier.controls import apply_controls
from hybridspec.verifier.sampling import logits_to_probs

logger = logging.getLogger(__name__)

PROBE_TEXT = "Speculative decoding: the draft proposes, the target verifies. 1234 ünïcödé\n\tdone."


@dataclass(slots=True)
class _DraftSeq(SeqState):
    num_drafted_fed: int = 0  # drafts of the last round that were fed into the draft cache


def check_tokenizer_compatible(target: ProposerContext, draft: LoadedModel) -> int:
    """Raise ModelLoadError unless the draft shares the target's tokenizer and vocabulary (up
    to unused padding rows: ``draft_vocab``); returns how many ids it may draft."""
    draftable = draftable_ids(target, draft)
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        raise ModelLoadError(
            f"draft model: EOS token ids {sorted(draft.eos_token_ids)} differ from the target's "
            f"{sorted(target.eos_token_ids)}"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        target_ids = list(target.tokenizer.encode(PROBE_TEXT))
        draft_ids = list(draft.tokenizer.encode(PROBE_TEXT))
        if target_ids != draft_ids:
            raise ModelLoadError(
                "draft model: its tokenizer encodes a probe text differently from the target's "
                f"({draft_ids[:8]}... vs {target_ids[:8]}...)"
            )
    return draftable


class DraftModelProposer(SequenceProposer[_DraftSeq]):
    """Drafts with a small model sharing the target's tokenizer: the engine's ``DraftModel``
    (``context.draft_model``), whose runtime it shares with any other proposer drafting with it.

    ``cost_per_token`` is ``DraftConfig.cost_per_token`` or, when that is None, measured when
    the proposer is built: a one-token forward of the draft over one of the target
    (``context.target_forward_s``), both timed in place.
    """

    samples_drafts = True  # sampled requests get drafts drawn from q, returned as probs
    continues_prefix = True  # it feeds the prefix after the committed tokens, then drafts
    tracker_name = "the draft"

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        if context.draft_model is None:
            reason = context.draft_error or (
                "none is configured (pass --draft MODEL on the command line, or "
                "DraftConfig(model=...))"
            )
            raise InvalidRequestError(
                f"proposer: 'draft' needs a draft model: {reason}", "proposer"
            )
        self._draftable = check_tokenizer_compatible(context, context.draft_model.model)
        self.model = context.draft_model.model
        self.runtime: ModelRuntime = context.draft_model.runtime
        configured = context.draft.cost_per_token
        self.cost_per_token = (
            configured if configured is not None else self._measure_cost_per_token()
        )

    def _measure_cost_per_token(self) -> float:
        """One draft forward of one token relative to one of the target (0 if not timeable)."""
        target_forward_s = self.context.target_forward_s
        if target_forward_s is None:
            return 0.0
        draft_s = fastest_forward_seconds(self.runtime)
        target_s = target_forward_s()
        if draft_s is None or target_s <= 0:
            return 0.0
        cost = draft_s / target_s
        logger.info("draft model: %.3f of a target forward per draft token", cost)
        return cost

    def _new_seq(self, prompt_token_ids: Sequence[int]) -> _DraftSeq:
        return _DraftSeq(slot=self.runtime.allocate(), committed_len=len(prompt_token_ids))

    def _free_seq(self, seq: _DraftSeq) -> None:
        self.runtime.free(seq.slot)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Draft for all requests together: one ragged catch-up step, then one token a step."""
        seqs = self._tracked(requests)
        # The draft's cache ends at len(context) + len(prefix) + k - 1 (the last draft is
        # never fed).
        room = self.runtime.max_seq_len + 1
        wanted = [
            max(0, min(r.max_num_drafts, room - len(r.token_ids) - len(r.draft_prefix)))
            for r in requests
        ]
        drafted: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(wanted) if k > 0]
        feed = {
            i: [
                *requests[i].token_ids[self.runtime.seq_len(seqs[i].slot) :],
                *requests[i].draft_prefix,
            ]
            for i in active
        }
        # A token past the draft's rows (the target's own padding, with a smaller draft) cannot
        # be fed: that sequence gets no drafts this round.
        active = [i for i in active if max(feed[i], default=0) < self.model.vocab_size]
        while active:
            logits = self.runtime.forward(
                ForwardBatch.from_lists(
                    [seqs[i].slot for i in active],
                    [feed[i] for i in active],
                    _last_indices([len(feed[i]) for i in active]),
                )
            ).logits  # [len(active), the draft's vocab_size]
            logits = fit_draft_logits(logits, self._draftable, self.context.vocab_size)
            # The request's controls at each sequence's next position: after its committed
            # tokens and its drafts so far, as the verifier will count them.
            logits = apply_controls(
                logits,
                [requests[i].sampling for i in active],
                [requests[i].history() for i in active],
                [[*requests[i].draft_prefix, *drafted[i]] for i in active],
            )
            for row, i in enumerate(active):
                token, q = _sample(logits[row], requests[i].sampling, requests[i].generator)
                drafted[i].append(token)
                if q is not None:
                    probs[i].append(q)
                feed[i] = [token]
            active = [i for i in active if len(drafted[i]) < wanted[i]]
        for seq, request, tokens in zip(seqs, requests, drafted, strict=True):
            # Fed: the prefix and every draft but the last, in the proposal's order.
            seq.num_drafted_fed = len(request.draft_prefix) + len(tokens) - 1 if tokens else 0
        return [
            Proposal(tokens, torch.stack(p) if p else None)
            for tokens, p in zip(drafted, probs, strict=True)
        ]

    def commit(self, info: CommitInfo) -> None:
        seq = self._seq(info.seq_id)
        # The cache keeps the committed prefix plus the accepted drafts that were fed.
        keep = seq.committed_len + min(info.num_accepted, seq.num_drafted_fed)
        self.runtime.truncate(seq.slot, min(keep, self.runtime.seq_len(seq.slot)))
        seq.committed_len += len(info.token_ids)
        seq.num_drafted_fed = 0


def _last_indices(lengths: list[int]) -> list[int]:
    """Flat index of each sequence's last token: lengths [3, 1, 2] -> [2, 3, 5]."""
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total - 1)
    return out


def _sample(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """One draft token from ``logits`` [vocab_size]; its distribution q unless greedy."""
    if sampling.is_greedy:
        return int(torch.argmax(logits)), None
    q = logits_to_probs(logits.unsqueeze(0), sampling)[0]  # [vocab_size]
    token = draw_token(q, generator)
    return token, q
