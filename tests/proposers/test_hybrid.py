"""The ``hybrid`` proposer's choice between n-gram and model drafts: the acceptance estimate
counts trials, the model is asked only for the drafts that pay, and the proposal with the
larger expected value is taken (engine-level losslessness: ``tests/engine/test_eagle.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from hybridspec.proposers.base import Proposer, ProposerContext
from hybridspec.proposers.hybrid import HybridProposer, _would_have_kept, acceptance, gain
from hybridspec.proposers.ngram import NgramProposer
from hybridspec.types import CommitInfo, Proposal, ProposeRequest, SamplingParams
from hybridspec.verifier.estimate import drafts_worth_asking

VOCAB = 100
REPEATING = [5, 6, 7, 8, 9] * 4  # the n-gram proposer continues this from its context


class Recorder(Proposer):
    """A model proposer that drafts token 1 as often as asked and records what it was asked."""

    def __init__(self, context: ProposerContext, cost_per_token: float) -> None:
        super().__init__(context)
        self.cost_per_token = cost_per_token
        self.asked: list[int] = []

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        self.asked += [r.max_num_drafts for r in requests]
        return [Proposal((1,) * r.max_num_drafts) for r in requests]


def hybrid(cost_per_token: float) -> tuple[HybridProposer, Recorder]:
    context = ProposerContext(vocab_size=VOCAB, eos_token_ids=(0,), verify_token_cost=0.03)
    model = Recorder(context, cost_per_token)
    return HybridProposer(context, NgramProposer(context), model), model


def ask(proposer: HybridProposer, tokens: list[int], k: int) -> Proposal:
    request = ProposeRequest(0, tokens, k, SamplingParams())
    return proposer.propose([request])[0]


def test_acceptance_counts_trials_not_the_share_of_drafts_kept() -> None:
    estimate = acceptance(prior=0.5)
    estimate.observe(num_drafts=8, num_accepted=2)  # kept 2, the third rejected: 2 of 3 trials
    assert estimate.rate == (2 + 0.5 * 2) / (3 + 2)
    estimate.observe(num_drafts=3, num_accepted=3)  # all kept: no rejection trial
    assert estimate.accepted == 0.7 * 2 + 3 and estimate.rejected == 0.7 * 1


def test_gain_is_the_expected_number_of_accepted_drafts() -> None:
    assert gain(0.5, 3) == 0.5 + 0.25 + 0.125


def test_the_proposal_worth_more_is_taken_and_the_model_asked_only_for_what_pays() -> None:
    proposer, model = hybrid(cost_per_token=0.05)
    proposer.start(0, REPEATING)
    proposal = ask(proposer, REPEATING, 4)
    assert list(proposal.token_ids) == [5, 6, 7, 8]  # n-gram: prior 0.6 over 4 drafts beats 0.5
    assert proposal.drafted_by == "ngram"  # reported in streams (include_drafts)
    assert model.asked == [0]  # the model follows the sequence but drafts nothing
    proposer.commit(CommitInfo(0, [5, 6, 7, 8, 9], 4))
    tokens = [*REPEATING, 5, 6, 7, 8, 9]
    proposer._choices[0].ngram = acceptance(prior=0.1)  # as if its drafts had kept failing
    proposal = ask(proposer, tokens, 4)
    # n-gram: 0.111 expected drafts for 4 x 0.03 of verification; the model at 0.5, asked only
    # for the drafts worth c + cost = 0.08 (0.5 ** 3 >= 0.08): 0.875 for 3 x 0.08
    assert list(proposal.token_ids) == [1, 1, 1]
    assert proposal.drafted_by == "model"  # a model neither eagle nor draft
    assert model.asked[-1] == drafts_worth_asking(0.5, 0.08, 4) == 3


def test_a_model_not_worth_its_cost_drafts_nothing_without_an_n_gram_match() -> None:
    proposer, model = hybrid(cost_per_token=0.6)  # 0.5 < c + cost: no model draft pays
    proposer.start(0, [1, 2, 3])
    assert list(ask(proposer, [1, 2, 3], 4).token_ids) == []
    assert model.asked == [0]


def test_the_n_gram_learns_from_the_rounds_the_model_drafted() -> None:
    proposer, _ = hybrid(cost_per_token=0.05)
    proposer.start(0, REPEATING)
    proposer._choices[0].ngram = acceptance(prior=0.1)  # as if its drafts had kept failing
    assert list(ask(proposer, REPEATING, 4).token_ids) == [1, 1, 1]  # the model drafts
    before = proposer._choices[0].ngram.rate
    # The target rejected the model's drafts and wrote what the n-gram had proposed: 5, 6, ...
    proposer.commit(CommitInfo(0, [5], 0))
    after = proposer._choices[0].ngram
    assert after.rate > before  # its draft 5 would have been kept, with no rejection seen
    assert after.accepted == 1 and after.rejected == 0


def test_an_n_gram_proposal_not_taken_is_scored_against_the_committed_tokens() -> None:
    assert _would_have_kept([5, 6, 7], [5, 6, 1]) == (3, 2)  # kept 2, the third rejected
    assert _would_have_kept([5, 6, 7], [1]) == (3, 0)
    assert _would_have_kept([5, 6, 7], [5, 6]) == (2, 2)  # past the committed: unknown
    assert _would_have_kept([5, 6], [5, 6, 7, 8]) == (2, 2)


def test_hybrid_samples_its_drafts_only_where_its_model_does() -> None:
    """With a deterministic model (``eagle``'s keyed drafts) a sampled request's text does not
    depend on its drafts, so it is priced by the engine step (``engine.speculation``); with one
    that returns q (``draft``) it is not."""
    proposer, model = hybrid(cost_per_token=0.05)
    assert not model.samples_drafts and not proposer.samples_drafts
    context = ProposerContext(vocab_size=VOCAB, eos_token_ids=(0,))
    sampling_model = Recorder(context, 0.05)
    sampling_model.samples_drafts = True
    assert HybridProposer(context, NgramProposer(context), sampling_model).samples_drafts
