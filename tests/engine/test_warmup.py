"""The warm-up runs every built-in proposer the engine has and leaves the engine as built: the
same requests give the same tokens and the same speculation statistics, warmed up or not."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hybridspec import Engine, GenerationParams, InvalidRequestError
from hybridspec.engine import warm_up
from hybridspec.model import LoadedModel
from hybridspec.proposers import ProposerContext, default_registry
from hybridspec.proposers.ngram import NgramProposer
from hybridspec.types import NO_SESSION, Session
from tests.engine.tiny import PROMPTS, make_engine

REQUESTS = [
    GenerationParams.create(max_new_tokens=24, proposer="ngram"),
    GenerationParams.create(max_new_tokens=24, proposer="draft", temperature=0.8, seed=5),
    GenerationParams.create(max_new_tokens=24, proposer="none", temperature=0.7, seed=9),
    GenerationParams.create(max_new_tokens=24, proposer="draft", num_speculative_tokens=3),
]


def run_all(engine: Engine) -> list[tuple[list[int], int, int, int]]:
    """Every REQUESTS entry on PROMPTS[0] and PROMPTS[3] at once: tokens and speculation."""
    ids = [
        engine.add_request(prompt, params)
        for params in REQUESTS
        for prompt in (PROMPTS[0], PROMPTS[3])
    ]
    results = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.result is not None:
                results[output.request_id] = output.result
    return [
        (
            results[i].token_ids,
            results[i].stats.draft_tokens_proposed,
            results[i].stats.draft_tokens_accepted,
            results[i].stats.target_forwards,
        )
        for i in ids
    ]


def test_a_warmed_engine_gives_what_a_fresh_one_gives(
    target: LoadedModel, draft: LoadedModel
) -> None:
    fresh = run_all(make_engine(target, draft))
    warmed = make_engine(target, draft)
    assert warm_up(warmed) > 0
    assert not warmed.has_unfinished()
    assert warmed.runtime.num_free_slots() == warmed.runtime.max_num_seqs
    request_id = warmed.add_request(PROMPTS[1], GenerationParams.create(max_new_tokens=1))
    request = warmed.scheduler.find(request_id)
    assert request is not None and request.seq_id == 0  # the request counter starts afresh
    warmed.abort(request_id)
    warmed.reset()
    assert run_all(warmed) == fresh
    warmed.reset()  # forgets what those requests taught adaptive speculation
    assert run_all(warmed) == fresh


class CountingNgram(NgramProposer):
    started: list[int]

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.started = []

    def start(
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        self.started.append(seq_id)
        super().start(seq_id, prompt_token_ids, session)


@pytest.mark.parametrize("with_draft", [False, True])
def test_every_built_in_proposer_available_is_warmed_and_no_other(
    target: LoadedModel, draft: LoadedModel, with_draft: bool
) -> None:
    registry = default_registry()
    registry.register("ngram", CountingNgram, replace=True)
    registry.register("custom", CountingNgram)
    engine = Engine(
        make_engine(target).config,
        target=target,
        draft=draft if with_draft else None,
        registry=registry,
    )
    assert ("draft" in engine.available_proposers()) == with_draft
    warm_up(engine)
    ngram = engine.resolve_proposer("ngram")
    custom = engine.resolve_proposer("custom")
    assert isinstance(ngram, CountingNgram) and isinstance(custom, CountingNgram)
    # alone greedy, then greedy and sampled among the others; never a custom proposer
    assert len(ngram.started) == 3 and custom.started == []


def test_warming_a_busy_engine_is_refused(target: LoadedModel) -> None:
    engine = make_engine(target)
    engine.add_request(PROMPTS[0], GenerationParams.create(max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="before it takes requests"):
        warm_up(engine)
    with pytest.raises(InvalidRequestError, match="requests still in the engine"):
        engine.reset()
