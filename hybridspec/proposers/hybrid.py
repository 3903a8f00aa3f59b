"""The ``hybrid`` proposer: per request and per round, the n-gram proposal or the model's.

n-gram speculation is nearly free and often right where the output copies its context; a
model (the ``eagle`` head, or the ``draft`` model when the target has no head) costs a few
percent of a forward per draft and wins on open text. Each round, each request takes the one
whose *expected accepted drafts* is larger, from its own measured acceptance:

    gain(alpha, k) = alpha + alpha^2 + ... + alpha^k

with ``k`` the drafts the proposer would give (the n-gram proposal's length; the model's: the
number asked) and ``alpha`` the request's running acceptance of that proposer (an exponential
average of accepted / drafted over the rounds it drafted; ``NGRAM_PRIOR`` and ``MODEL_PRIOR``
before the first). The model's gain is reduced by its cost (``cost_per_token`` per draft, in
forwards, as adaptive speculation counts it). A request with no n-gram match always takes the
model. Both proposers follow every sequence (``start``, ``commit``, ``finish``) whichever
drafted, so that either can take over the next round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridspec.errors import HybridSpecError, InvalidRequestError
from hybridspec.proposers.base import Proposer, ProposerContext
from hybridspec.proposers.draft import DraftModelProposer
from hybridspec.proposers.eagle import EagleProposer
from hybridspec.proposers.ngram import NgramProposer
from hybridspec.types import CommitInfo, Proposal, ProposeRequest

NGRAM_PRIOR = 0.6  # a fresh request's n-gram acceptance estimate
MODEL_PRIOR = 0.5
DECAY = 0.6  # weight of the past in the running acceptance


def gain(alpha: float, k: int) -> float:
    """Expected accepted drafts out of ``k`` when each is kept with ``alpha`` given the last."""
    return sum(alpha**i for i in range(1, k + 1))


@dataclass(slots=True)
class _Choice:
    ngram_alpha: float = NGRAM_PRIOR
    model_alpha: float = MODEL_PRIOR
    used_model: bool | None = None  # last round's pick; None: it drafted nothing
    num_drafts: int = 0


class HybridProposer(Proposer):
    """n-gram or model per request and round (module docstring)."""

    samples_drafts = True

    def __init__(self, context: ProposerContext, model: Proposer | None = None) -> None:
        """``model``: the proposer of open text; None builds ``eagle``, else ``draft``."""
        super().__init__(context)
        self.ngram = NgramProposer(context)
        self.model = model
        reasons = []
        for build in () if model is not None else (EagleProposer, DraftModelProposer):
            try:
                self.model = build(context)
                break
            except HybridSpecError as exc:
                reasons.append(str(exc))
        if self.model is None:
            raise InvalidRequestError(
                "proposer: 'hybrid' needs an eagle head or a draft model: " + "; ".join(reasons),
                "proposer",
            )
        self.hidden_layers = self.model.hidden_layers
        self.cost_per_token = self.model.cost_per_token
        self._choices: dict[int, _Choice] = {}

    def start(self, seq_id: int, prompt_token_ids: Sequence[int]) -> None:
        self.ngram.start(seq_id, prompt_token_ids)
        assert self.model is not None
        self.model.start(seq_id, prompt_token_ids)
        self._choices[seq_id] = _Choice()

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        assert self.model is not None
        ngram = self.ngram.propose(requests)
        model_asks = []
        picks: list[bool] = []
        for request, proposal in zip(requests, ngram, strict=True):
            choice = self._choices[request.seq_id]
            k = request.max_num_drafts
            model_gain = gain(choice.model_alpha, k) - self.model.cost_per_token * k
            use_model = k > 0 and gain(choice.ngram_alpha, proposal.num_drafts) < model_gain
            picks.append(use_model)
            model_asks.append(request if use_model else _no_drafts(request))
        # The model sees every request (it catches up on the features of all of them), and
        # drafts for those it was picked for.
        model = self.model.propose(model_asks)
        out = []
        for request, use_model, from_ngram, from_model in zip(
            requests, picks, ngram, model, strict=True
        ):
            proposal = from_model if use_model else from_ngram
            choice = self._choices[request.seq_id]
            choice.used_model = use_model if proposal.num_drafts else None
            choice.num_drafts = proposal.num_drafts
            out.append(proposal)
        return out

    def commit(self, info: CommitInfo) -> None:
        assert self.model is not None
        self.ngram.commit(info)
        self.model.commit(info)
        choice = self._choices[info.seq_id]
        if choice.used_model is not None and choice.num_drafts:
            rate = min(info.num_accepted, choice.num_drafts) / choice.num_drafts
            if choice.used_model:
                choice.model_alpha = DECAY * choice.model_alpha + (1 - DECAY) * rate
            else:
                choice.ngram_alpha = DECAY * choice.ngram_alpha + (1 - DECAY) * rate
        choice.used_model = None

    def finish(self, seq_id: int) -> None:
        self.ngram.finish(seq_id)
        if self.model is not None:
            self.model.finish(seq_id)
        self._choices.pop(seq_id, None)

    def close(self) -> None:
        self.ngram.close()
        if self.model is not None:
            self.model.close()


def _no_drafts(request: ProposeRequest) -> ProposeRequest:
    return ProposeRequest(
        request.seq_id,
        request.token_ids,
        0,
        request.sampling,
        request.generator,
        request.num_prompt_tokens,
        request.stop_token_ids,
    )
