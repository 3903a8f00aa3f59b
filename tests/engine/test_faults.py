"""A failure while handling one request's round fails that request alone: its batch neighbours
keep running and their texts are those they get alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hybridspec import Engine
from hybridspec.engine import FinishReason, GenerationParams, RequestOutput
from hybridspec.engine.engine import ROUND_FAILED
from hybridspec.model import ForwardBatch, ForwardOutput
from hybridspec.model.loader import LoadedModel
from tests.engine.tiny import PROMPTS, make_engine, plain

POISON = 50  # a token id no test prompt holds but the poisoned one


def run_all(engine: Engine, prompts: list[list[int]], proposers: list[str]) -> dict[str, Any]:
    ids = [
        engine.add_request(
            prompt, GenerationParams.create(max_new_tokens=24, proposer=proposer, ignore_eos=True)
        )
        for prompt, proposer in zip(prompts, proposers, strict=True)
    ]
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return {i: finals[i] for i in ids}


def poison_forward(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the target's forward raise whenever it is fed POISON; return the sizes of the
    batches it was called with."""
    forward: Callable[[ForwardBatch], ForwardOutput] = engine.runtime.forward
    calls: list[int] = []

    def failing(batch: ForwardBatch) -> ForwardOutput:
        calls.append(len(batch.slots))
        if POISON in batch.token_ids.tolist():
            raise RuntimeError("poisoned batch")
        return forward(batch)

    monkeypatch.setattr(engine.runtime, "forward", failing)
    return calls


@pytest.mark.parametrize("poisoned", [0, 2])
def test_forward_failure_fails_only_the_sequence_that_causes_it(
    target: LoadedModel, draft: LoadedModel, monkeypatch: pytest.MonkeyPatch, poisoned: int
) -> None:
    engine = make_engine(target, draft)
    expected = [plain(engine, prompt, 24) for prompt in PROMPTS[:4]]
    prompts = [list(p) for p in PROMPTS[:4]]
    prompts[poisoned] = [*prompts[poisoned], POISON]
    calls = poison_forward(engine, monkeypatch)
    finals = list(run_all(engine, prompts, ["none", "ngram", "draft", "ngram"]).values())
    assert 1 in calls and max(calls) == 4  # batched, then each sequence alone
    for i, final in enumerate(finals):
        assert final.result is not None
        if i == poisoned:
            assert final.finish_reason is FinishReason.ERROR
            assert final.result.error == ROUND_FAILED
        else:
            assert final.finish_reason is FinishReason.LENGTH, final.result.error
            assert final.result.token_ids == expected[i]
    assert not engine.has_unfinished()
    assert engine.runtime.num_free_slots() == engine.runtime.max_num_seqs
    # The engine keeps serving: the batch that failed left no cache behind.
    monkeypatch.undo()
    assert plain(engine, PROMPTS[1], 24) == expected[1]


def test_commit_failure_fails_only_its_request(
    target: LoadedModel, draft: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose commit raises (here its stop-string detector) ends with an error in
    the round it raised; the others of its batch finish as they would alone."""
    engine = make_engine(target, draft)
    expected = [plain(engine, prompt, 24) for prompt in PROMPTS[:3]]
    ids = [
        engine.add_request(
            prompt, GenerationParams.create(max_new_tokens=24, proposer="ngram", ignore_eos=True)
        )
        for prompt in PROMPTS[:3]
    ]
    broken = engine.scheduler.find(ids[1])
    assert broken is not None and broken.detokenizer is not None

    def fail(token_id: int) -> bool:
        raise RuntimeError("detokenizer broke")

    monkeypatch.setattr(broken.detokenizer, "append", fail)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals[ids[1]].finish_reason is FinishReason.ERROR
    for i in (0, 2):
        result = finals[ids[i]].result
        assert result is not None and result.token_ids == expected[i]
    assert engine.runtime.num_free_slots() == engine.runtime.max_num_seqs
