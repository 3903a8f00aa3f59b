"""The ``grammar`` proposer: drafts the text a request's grammar forces, then lets another
proposer continue in the same round.

Where a structured-output grammar allows one continuation only (JSON punctuation, the next
key, the rest of an enum value, a fixed string), that text costs nothing to guess: it is
tokenized and drafted (``TokenConstraint.forced``). ``grammar`` alone drafts only that;
``grammar+X`` (``Proposer.compose``) drafts it, asks ``X`` to continue after it
(``ProposeRequest.draft_prefix``, for proposers that declare ``continues_prefix``), cuts X's
drafts before the first one the grammar forbids, and appends what the grammar forces after
them, up to the round's K. Requests without a grammar get X's drafts unchanged.

The forced drafts are ordinary deterministic drafts: the verifier accepts them only where the
target (under the grammar's mask) would produce them, so the output is the same as without
them. A forced text's tokenization need not be the model's (``{"name"`` may be drafted as
``{"`` ``name"`` where the model writes ``{`` ``"name``); such drafts are simply rejected.
When X samples its drafts (returns q), the forced rows' q is one-hot at the forced token, the
distribution a deterministic draft is verified with.

Worked example: K = 8, committed ``{"city": "Oslo``, schema ``{city: string, unit: enum
["C", "F"]}``: the string may go on, so nothing is forced; X drafts ``", "`` ``unit``... The
next round, committed ``{"city": "Oslo", "unit": "`` forces nothing (C or F); after ``C`` the
grammar forces ``"}``, drafted after X's drafts or alone.

Dimensions: ``num_drafts`` per sequence, ``vocab_size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hybridspec.proposers.base import NoProposer, Proposer, ProposerContext
from hybridspec.types import NO_SESSION, CommitInfo, Proposal, ProposeRequest, Session


class GrammarProposer(Proposer):
    """Drafts a grammar's forced tokens around the drafts of ``inner`` (module docstring).

    It shares ``inner``'s per-sequence state (start, commit and finish go to it) and its
    pricing; built alone (the registered ``grammar``), ``inner`` proposes nothing.
    """

    continues_prefix = True

    def __init__(self, context: ProposerContext, inner: Proposer | None = None) -> None:
        super().__init__(context)
        self.inner = inner if inner is not None else NoProposer(context)
        self.cost_per_token = self.inner.cost_per_token
        self.samples_drafts = self.inner.samples_drafts
        self.feature_layers = self.inner.feature_layers

    def compose(self, inner: Proposer) -> Proposer:
        return GrammarProposer(self.context, inner)

    def start(
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        self.inner.start(seq_id, prompt_token_ids, session)

    def commit(self, info: CommitInfo) -> None:
        self.inner.commit(info)

    def finish(self, seq_id: int) -> None:
        self.inner.finish(seq_id)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        forced = [_forced(r, r.draft_prefix, r.max_num_drafts) for r in requests]
        asks = [
            dataclasses.replace(
                r,
                draft_prefix=(*r.draft_prefix, *f),
                max_num_drafts=r.max_num_drafts - len(f) if self.inner.continues_prefix else 0,
            )
            if f
            else r
            for r, f in zip(requests, forced, strict=True)
        ]
        inner = self.inner.propose(asks)
        return [
            _combine(r, f, p, self.context.vocab_size)
            for r, f, p in zip(requests, forced, inner, strict=True)
        ]


def _forced(request: ProposeRequest, drafts: Sequence[int], max_num_tokens: int) -> list[int]:
    if request.constraint is None or max_num_tokens <= 0:
        return []
    return request.constraint.forced(drafts, max_num_tokens)


def _combine(
    request: ProposeRequest, forced: list[int], inner: Proposal, vocab_size: int
) -> Proposal:
    """``forced``, then the inner drafts the grammar allows, then what it forces after them."""
    prefix = request.draft_prefix
    own = list(inner.token_ids)[: request.max_num_drafts - len(forced)]
    if request.constraint is not None and own:
        allowed = request.constraint.num_allowed([*prefix, *forced, *own])
        own = own[: allowed - len(prefix) - len(forced)]
    drafts = [*forced, *own]
    trailing = (
        _forced(request, [*prefix, *drafts], request.max_num_drafts - len(drafts))
        if len(own) == inner.num_drafts
        else []  # a draft was cut: the grammar's text goes on from a rejected point
    )
    if inner.probs is None:
        return Proposal([*drafts, *trailing])
    rows = [_one_hot(forced, vocab_size, inner.probs), inner.probs[: len(own)]]
    rows.append(_one_hot(trailing, vocab_size, inner.probs))
    return Proposal([*drafts, *trailing], torch.cat(rows))


def _one_hot(tokens: list[int], vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """[len(tokens), vocab_size]: the q of deterministic drafts."""
    rows = torch.zeros(len(tokens), vocab_size, dtype=like.dtype, device=like.device)
    rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return rows
