"""The ``hybrid`` proposer: per request and per round, the n-gram proposal or the model's.

``hybrid`` composes the engine's own ``ngram`` proposer and its ``eagle`` one, else its
``draft`` one (the instances every request naming them shares: ``ProposerContext.proposers``),
rather than building its own.

n-gram speculation is nearly free and often right where the output copies its context; a
model (the ``eagle`` head, or the ``draft`` model when the target has no head) costs a few
percent of a forward per draft and wins on open text. Each round, each request takes the
proposal with the larger *expected value*: accepted drafts expected, less what drafting and
verifying them costs (in target forwards, as adaptive speculation counts it):

    gain(alpha, k) = alpha + alpha^2 + ... + alpha^k
    value(ngram) = gain(alpha_n, k_n) - c k_n
    value(model) = gain(alpha_m, k_m) - (c + cost) k_m

with ``c`` the verification cost of one more token (``ProposerContext.verify_token_cost``),
``cost`` the model's ``cost_per_token``, ``k_n`` the n-gram proposal's length and ``k_m`` the
model drafts worth asking for: those ``j`` (up to the round's ``max_num_drafts``) with
``alpha_m^j >= c + cost``, which is also how many the model is asked for. ``alpha`` is the
request's acceptance of that proposer, each draft kept given the one before: decayed counts of
the drafts it had accepted over its *trials* (accepted drafts, plus the rejection that ended a
round early; ``verifier.estimate.AcceptanceEstimate``, as adaptive speculation keeps it),
started at ``NGRAM_PRIOR`` and ``MODEL_PRIOR`` worth ``PRIOR_TRIALS`` trials. (The share of
drafts accepted would understate the acceptance of long proposals: 2 kept of 8 is 2 trials out
of 3, not a quarter.) The n-gram's estimate also learns from the rounds the model drafted: its
proposal, made anyway and free to score, is checked against the tokens the target committed
(kept while equal to them), so that a request the model took over goes back to n-gram as soon
as its text starts copying again; the model's estimate learns only when it drafts. With no
n-gram match and no model draft worth its cost, the request decodes plainly this round. Both
proposers follow every hybrid sequence (``start``, ``commit``, ``finish``) whichever drafted,
so that either can take over the next round; both keep their state per sequence, so sharing
them with the requests that name them directly changes nothing for either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridspec.errors import InvalidRequestError
from hybridspec.proposers.base import Proposer, ProposerContext
from hybridspec.types import NO_SESSION, CommitInfo, Proposal, ProposeRequest, Session
from hybridspec.verifier.estimate import AcceptanceEstimate, drafts_worth_asking

NGRAM_PRIOR = 0.6  # a fresh request's n-gram acceptance estimate
MODEL_PRIOR = 0.5
PRIOR_TRIALS = 2.0  # how many trials a prior counts for
DECAY = 0.7  # weight of a proposer's past evidence each time it drafts again
NGRAM_NAME = "ngram"  # the registered names it composes, which ``Proposal.drafted_by`` reports
MODEL_NAMES = ("eagle", "draft")  # the model proposers it takes, the first built one


def pooled_hybrid(context: ProposerContext) -> HybridProposer:
    """The registered ``hybrid``: the engine's ``ngram`` proposer and its ``eagle`` one, else
    its ``draft`` one (``ProposerContext.proposers``); InvalidRequestError saying why each is
    missing when there is no model proposer."""
    shared = context.proposers
    ngram = shared.get(NGRAM_NAME)
    if ngram is None:
        raise InvalidRequestError("proposer: 'hybrid' needs the 'ngram' proposer", "proposer")
    for name in MODEL_NAMES:
        model = shared.get(name)
        if model is not None:
            return HybridProposer(context, ngram, model, name)
    reasons = [context.unavailable.get(name, f"{name!r} is not registered") for name in MODEL_NAMES]
    raise InvalidRequestError(
        "proposer: 'hybrid' needs an eagle head or a draft model: " + "; ".join(reasons),
        "proposer",
    )


def gain(alpha: float, k: int) -> float:
    """Expected accepted drafts out of ``k`` when each is kept with ``alpha`` given the last."""
    return sum(alpha**i for i in range(1, k + 1))


def acceptance(prior: float) -> AcceptanceEstimate:
    """A fresh estimate at ``prior``, worth ``PRIOR_TRIALS`` trials."""
    return AcceptanceEstimate(
        decay=DECAY,
        prior_accepted=prior * PRIOR_TRIALS,
        prior_rejected=(1 - prior) * PRIOR_TRIALS,
    )


@dataclass(slots=True)
class _Choice:
    ngram: AcceptanceEstimate = field(default_factory=lambda: acceptance(NGRAM_PRIOR))
    model: AcceptanceEstimate = field(default_factory=lambda: acceptance(MODEL_PRIOR))
    used_model: bool | None = None  # last round's pick; None: it drafted nothing
    num_drafts: int = 0
    ngram_drafts: Sequence[int] = ()  # the n-gram's proposal in a round the model drafted


class HybridProposer(Proposer):
    """n-gram or model per request and round (module docstring)."""

    def __init__(
        self, context: ProposerContext, ngram: Proposer, model: Proposer, model_name: str = "model"
    ) -> None:
        """``ngram`` and ``model`` (the proposer of open text) are composed, not owned: closing
        this proposer leaves them open. ``model_name`` is what ``Proposal.drafted_by`` reports
        for the model's rounds (its registered name)."""
        super().__init__(context)
        self.ngram = ngram
        self.model = model
        self.model_name = model_name
        self.feature_layers = model.feature_layers
        # deterministic with ``eagle`` (its keyed drafts), sampled with ``draft``
        self.samples_drafts = model.samples_drafts or ngram.samples_drafts
        self.cost_per_token = model.cost_per_token
        self.verify_token_cost = context.verify_token_cost
        self._choices: dict[int, _Choice] = {}

    def start(
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        self.ngram.start(seq_id, prompt_token_ids, session)
        self.model.start(seq_id, prompt_token_ids, session)
        self._choices[seq_id] = _Choice()

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        ngram = self.ngram.propose(requests)
        model_asks = []
        picks: list[bool] = []
        c = self.verify_token_cost
        model_price = c + self.model.cost_per_token
        for request, proposal in zip(requests, ngram, strict=True):
            choice = self._choices[request.seq_id]
            alpha_m, k_n = choice.model.rate, proposal.num_drafts
            k_m = drafts_worth_asking(alpha_m, model_price, request.max_num_drafts)
            model_value = gain(alpha_m, k_m) - model_price * k_m
            use_model = k_m > 0 and model_value > gain(choice.ngram.rate, k_n) - c * k_n
            picks.append(use_model)
            model_asks.append(_asking(request, k_m if use_model else 0))
        # The model sees every request (it checks that it follows each), and drafts for those
        # it was picked for: one asked for none catches up only when it is next asked.
        model = self.model.propose(model_asks)
        out = []
        for request, use_model, from_ngram, from_model in zip(
            requests, picks, ngram, model, strict=True
        ):
            proposal = from_model if use_model else from_ngram
            choice = self._choices[request.seq_id]
            choice.used_model = use_model if proposal.num_drafts else None
            choice.num_drafts = proposal.num_drafts
            choice.ngram_drafts = from_ngram.token_ids if use_model else ()
            drafter = self.model_name if use_model else NGRAM_NAME
            out.append(dataclasses.replace(proposal, drafted_by=drafter))
        return out

    def commit(self, info: CommitInfo) -> None:
        self.ngram.commit(info)
        self.model.commit(info)
        choice = self._choices[info.seq_id]
        if choice.used_model is not None and choice.num_drafts:
            used = choice.model if choice.used_model else choice.ngram
            used.observe(choice.num_drafts, min(info.num_accepted, choice.num_drafts))
        if choice.ngram_drafts:
            choice.ngram.observe(*_would_have_kept(choice.ngram_drafts, info.token_ids))
        choice.used_model, choice.ngram_drafts = None, ()

    def finish(self, seq_id: int) -> None:
        self.ngram.finish(seq_id)
        self.model.finish(seq_id)
        self._choices.pop(seq_id, None)


def _would_have_kept(drafts: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """(drafts, accepted) as the n-gram's proposal would have fared in a round the model
    drafted: its drafts are kept while they equal the committed tokens (the target's own
    tokens: greedy, or sampled with position-keyed uniforms, see ``verifier.verify``). Past the
    committed tokens nothing is known, so a proposal that matched all of them counts as that
    many drafts, all kept."""
    kept = 0
    for draft, token in zip(drafts, committed, strict=False):
        if draft != token:
            return len(drafts), kept
        kept += 1
    return kept, kept


def _asking(request: ProposeRequest, num_drafts: int) -> ProposeRequest:
    """``request``, asking for ``num_drafts`` drafts."""
    if num_drafts == request.max_num_drafts:
        return request
    return dataclasses.replace(request, max_num_drafts=num_drafts)
