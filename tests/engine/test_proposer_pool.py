"""The engine's proposers: failures isolated to their own requests, the draft model's cost,
the validation of proposals where they enter, composition of the engine's own proposers, and
the session a proposer starts with."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from hybridspec import (
    Engine,
    EngineConfig,
    FinishReason,
    GenerationParams,
    HybridSpecError,
    ModelConfig,
    Proposal,
    Proposer,
    ProposeRequest,
)
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers import NoProposer, ProposerContext
from hybridspec.proposers.hybrid import HybridProposer
from hybridspec.proposers.ngram import NgramProposer
from hybridspec.types import NO_SESSION, Session
from tests.engine.tiny import PROMPTS, VOCAB, make_engine, plain


class TooMany(Proposer):
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return [Proposal([1] * (r.max_num_drafts + 1)) for r in requests]


def test_broken_custom_proposer_fails_only_its_own_request(engine: Engine) -> None:
    engine.register_proposer("too-many", TooMany, replace=True)
    bad = engine.add_request(PROMPTS[0], GenerationParams(max_new_tokens=10, proposer="too-many"))
    good = engine.add_request(PROMPTS[1], GenerationParams(max_new_tokens=10, proposer="draft"))
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.result
    assert finished[bad].finish_reason is FinishReason.ERROR
    assert "at most" in (finished[bad].error or "")
    assert finished[good].token_ids == plain(engine, PROMPTS[1], 10)
    with pytest.raises(HybridSpecError):
        engine.generate(prompt_token_ids=PROMPTS[0], proposer="too-many", max_new_tokens=4)


def test_draft_without_a_draft_model_is_a_clear_error(target: LoadedModel) -> None:
    engine = make_engine(target)
    assert "draft" not in engine.available_proposers()
    with pytest.raises(ValueError, match="needs a draft model"):
        engine.generate(prompt_token_ids=[1, 2], proposer="draft")


def test_draft_cost_per_token_is_measured_unless_configured(
    target: LoadedModel, draft: LoadedModel
) -> None:
    config = EngineConfig(target=ModelConfig(dtype="float32", max_seq_len=256, max_num_seqs=2))
    measured = Engine(config, target=target, draft=draft).resolve_proposer("draft")
    # Measured (a configured cost is used as is): the tiny draft has the target's shape, so
    # about one target forward per draft token.
    assert 0.25 < measured.cost_per_token < 4
    assert make_engine(target, draft).resolve_proposer("draft").cost_per_token == 0.0


class UndeclaredSampler(Proposer):
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        probs = torch.full((1, VOCAB), 1 / VOCAB)
        return [Proposal([1], probs) if r.max_num_drafts else Proposal([]) for r in requests]


def test_sampled_drafts_from_a_proposer_that_does_not_declare_them_fail_its_request(
    engine: Engine,
) -> None:
    engine.register_proposer("undeclared", UndeclaredSampler, replace=True)
    params = GenerationParams.create(
        max_new_tokens=8, temperature=1.0, seed=0, proposer="undeclared"
    )
    with pytest.raises(HybridSpecError, match="declares samples_drafts = False"):
        engine.generate(prompt_token_ids=PROMPTS[0], params=params)
    assert not engine.has_unfinished()


class Pair(Proposer):
    """Composes the engine's ``ngram`` proposer, as ``hybrid`` does."""

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.inner = context.proposers["ngram"]

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return self.inner.propose(requests)


def test_hybrid_composes_the_engines_own_ngram_and_draft(engine: Engine) -> None:
    hybrid = engine.resolve_proposer("hybrid")
    assert isinstance(hybrid, HybridProposer)  # no head for the tiny target: the draft model
    assert hybrid.ngram is engine.resolve_proposer("ngram")
    assert hybrid.model is engine.resolve_proposer("draft")


def test_replacing_a_composed_proposer_rebuilds_what_composes_it(target: LoadedModel) -> None:
    engine = make_engine(target)
    engine.register_proposer("pair", Pair)
    first = engine.resolve_proposer("pair")
    assert isinstance(first, Pair) and first.inner is engine.resolve_proposer("ngram")
    engine.register_proposer("ngram", NgramProposer, replace=True)
    second = engine.resolve_proposer("pair")
    assert isinstance(second, Pair) and second is not first
    assert second.inner is engine.resolve_proposer("ngram") is not first.inner


class Sessions(Proposer):
    """Records the session each sequence starts with."""

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.sessions: list[Session] = []

    def start(
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        self.sessions.append(session)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return [Proposal(()) for _ in requests]


def test_a_proposer_starts_with_the_requests_session(target: LoadedModel) -> None:
    engine = make_engine(target)
    engine.register_proposer("sessions", Sessions)
    for params in (
        GenerationParams(max_new_tokens=2, proposer="sessions"),
        GenerationParams(
            max_new_tokens=2,
            proposer="sessions",
            session="alice",
            cache_prompt=False,
            cache_scope="tenant A",
        ),
    ):
        engine.generate(prompt_token_ids=PROMPTS[0], params=params)
    proposer = engine.resolve_proposer("sessions")
    assert isinstance(proposer, Sessions)
    assert proposer.sessions == [NO_SESSION, Session("alice", False, "tenant A")]


class Counting(Proposer):
    """Counts its ``propose`` calls and the drafts asked in them."""

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.asked: list[int] = []

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        self.asked += [r.max_num_drafts for r in requests]
        return [Proposal([1] * min(1, r.max_num_drafts)) for r in requests]


def test_a_round_in_which_no_request_asks_for_drafts_does_not_call_the_proposer(
    target: LoadedModel,
) -> None:
    engine = make_engine(target)
    engine.register_proposer("counting", Counting)
    proposer = engine.resolve_proposer("counting")
    assert isinstance(proposer, Counting)
    params = GenerationParams(max_new_tokens=6, proposer="counting", num_speculative_tokens=2)
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, params)
    engine.draft_counts.speculation = None  # every request asks for its K ...
    engine.step()
    assert proposer.asked and all(k > 0 for k in proposer.asked)
    proposer.asked.clear()
    asks = engine.draft_counts.num_drafts
    engine.draft_counts.num_drafts = lambda request, proposer: 0  # type: ignore[method-assign]
    while engine.has_unfinished():  # ... then none does: the proposer is never called
        engine.step()
    engine.draft_counts.num_drafts = asks  # type: ignore[method-assign]
    assert proposer.asked == []


class NeverDrafting(Counting):
    never_drafts = True


def test_a_proposer_that_never_drafts_is_neither_priced_nor_called(target: LoadedModel) -> None:
    """``none``'s requests pay for no speculation: their drafts are not priced, and the
    proposer is not called, whatever their K."""
    engine = make_engine(target)
    engine.register_proposer("never", NeverDrafting)
    engine.register_proposer("counting", Counting)
    proposer = engine.resolve_proposer("never")
    assert isinstance(proposer, NeverDrafting)
    assert engine.resolve_proposer("none").never_drafts
    drafting = type("Drafting", (NoProposer,), {"propose": Counting.propose})
    assert not drafting.never_drafts  # a subclass of none's that proposes is called
    priced: list[str] = []
    asks = engine.draft_counts.num_drafts
    engine.draft_counts.num_drafts = (  # type: ignore[method-assign]
        lambda request, p: priced.append(request.proposer_name) or asks(request, p)
    )
    for name in ("never", "none"):
        params = GenerationParams(max_new_tokens=6, proposer=name, num_speculative_tokens=4)
        engine.add_request(PROMPTS[0], params)
    engine.add_request(PROMPTS[1], GenerationParams(max_new_tokens=6, proposer="counting"))
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    assert proposer.asked == [] and set(priced) == {"counting"}
    assert all(o.result is not None and len(o.result.token_ids) == 6 for o in outputs)
    assert len(outputs) == 3
