"""The engine end to end on tiny random Llama models built here (float32, CPU).

Greedy parity: every proposer, every K, alone or in a mixed batch, gives exactly the tokens of
plain decoding (``proposer="none"``). Rollback: after every round the target's and the draft's
caches equal what plain decoding of the committed tokens builds.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Sequence

import pytest
import torch

from hybridspec import (
    Engine,
    FinishReason,
    GenerationParams,
    InvalidRequestError,
    Proposal,
    Proposer,
    ProposeRequest,
)
from hybridspec.engine import frozen_heap
from hybridspec.model.loader import LoadedModel
from hybridspec.model.runtime import ForwardBatch
from hybridspec.proposers.draft import DraftModelProposer
from tests.engine.tiny import PROMPTS, VOCAB, make_engine, plain, run_joining, tiny_loaded


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_speculation_equals_plain_decoding(engine: Engine, proposer: str, k: int) -> None:
    for prompt in PROMPTS:
        result = engine.generate(
            prompt_token_ids=prompt, proposer=proposer, num_speculative_tokens=k, max_new_tokens=40
        )
        expected = plain(engine, prompt)
        assert len(expected) == 40
        assert result.token_ids == expected, f"prompt {prompt}"
        assert result.stats.target_forwards <= result.stats.generated_tokens


def test_speculation_saves_forwards(engine: Engine) -> None:
    result = engine.generate(
        prompt_token_ids=PROMPTS[0], proposer="draft", num_speculative_tokens=4, max_new_tokens=40
    )
    assert result.stats.draft_tokens_accepted > 0
    assert result.stats.mean_accepted_length > 1.0
    assert 0.0 < result.stats.acceptance_rate <= 1.0


def test_mixed_batch_joining_at_different_steps_equals_solo(engine: Engine) -> None:
    expected = {i: plain(engine, p, 30) for i, p in enumerate(PROMPTS)}
    setups = [("ngram", 8), ("draft", 3), ("none", None), ("draft", 8), ("ngram", 1)]
    joins = {0: [0, 1], 2: [2], 3: [3, 4]}  # step number -> prompts that join before it
    assert run_joining(engine, setups, joins) == expected


def cache_equals_plain_prefill(
    target: LoadedModel, runtime: object, slot: int, token_ids: list[int]
) -> None:
    """The first len(token_ids) cached keys/values equal a fresh prefill of token_ids."""
    fresh = target.create_runtime(1, 256)
    fresh_slot = fresh.allocate()
    fresh.forward(ForwardBatch.from_lists([fresh_slot], [token_ids], []))
    n = len(token_ids)
    got, want = runtime._cache, fresh._cache  # type: ignore[attr-defined]
    assert runtime.seq_len(slot) == n  # type: ignore[attr-defined]
    for layer in range(got.keys.shape[0]):
        torch.testing.assert_close(
            got.key_view(layer, slot, n),
            want.key_view(layer, fresh_slot, n),
            atol=1e-4,
            rtol=1e-4,
        )
    torch.testing.assert_close(
        got.values[:, slot, :, :n], want.values[:, fresh_slot, :, :n], atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_rollback_leaves_caches_as_plain_decoding_builds_them(
    target: LoadedModel, draft: LoadedModel, proposer: str
) -> None:
    engine = make_engine(target, draft)
    draft_proposer = engine.resolve_proposer("draft")
    assert isinstance(draft_proposer, DraftModelProposer)
    engine.add_request(
        PROMPTS[3], GenerationParams(max_new_tokens=40, proposer=proposer, num_speculative_tokens=5)
    )
    rounds = 0
    while engine.has_unfinished():
        engine.step()
        for request in engine.scheduler.running:
            assert request.slot is not None
            cache_equals_plain_prefill(target, engine.runtime, request.slot, request.token_ids[:-1])
            if proposer == "draft":
                seq = draft_proposer._seqs[request.seq_id]
                cached = draft_proposer.runtime.seq_len(seq.slot)
                assert cached <= len(request.token_ids) - 1
                cache_equals_plain_prefill(
                    draft, draft_proposer.runtime, seq.slot, request.token_ids[:cached]
                )
            rounds += 1
    assert rounds > 3


def test_max_new_tokens_is_exact_even_inside_an_accepted_run(engine: Engine) -> None:
    for n in (1, 2, 7, 13):
        result = engine.generate(
            prompt_token_ids=PROMPTS[0],
            proposer="draft",
            num_speculative_tokens=8,
            max_new_tokens=n,
        )
        assert result.token_ids == plain(engine, PROMPTS[0], 40)[:n]
        assert result.finish_reason is FinishReason.LENGTH


def test_context_length_shrinks_k_then_stops(target: LoadedModel, draft: LoadedModel) -> None:
    small = make_engine(target, draft, max_seq_len=30)
    prompt = PROMPTS[2]  # 21 tokens: room for 9 more
    result = small.generate(
        prompt_token_ids=prompt, proposer="draft", num_speculative_tokens=8, max_new_tokens=100
    )
    assert result.finish_reason is FinishReason.LENGTH
    assert len(prompt) + len(result.token_ids) == 30
    big = make_engine(target)
    assert result.token_ids == plain(big, prompt, 9)


def test_eos_stops_and_is_not_returned(target: LoadedModel) -> None:
    engine = make_engine(target)
    reference = plain(engine, PROMPTS[4], 20)
    stop_token = reference[5]
    stopper = tiny_loaded(0)
    stopper = LoadedModel(
        target.weights,
        None,
        target.hf_config,
        torch.float32,  # type: ignore[arg-type]
        (stop_token,),
        "tiny:eos",
    )
    stopping = make_engine(stopper)
    result = stopping.generate(prompt_token_ids=PROMPTS[4], proposer="ngram", max_new_tokens=20)
    assert result.finish_reason is FinishReason.STOP
    assert result.token_ids == reference[: reference.index(stop_token)]
    ignored = stopping.generate(
        prompt_token_ids=PROMPTS[4], proposer="ngram", max_new_tokens=20, ignore_eos=True
    )
    assert ignored.token_ids == reference


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_seeded_sampling_is_reproducible_and_independent_of_batch(
    engine: Engine, proposer: str
) -> None:
    params = GenerationParams.create(
        max_new_tokens=20,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        proposer=proposer,
        num_speculative_tokens=4,
    )
    alone = engine.generate(prompt_token_ids=PROMPTS[0], params=params).token_ids
    assert engine.generate(prompt_token_ids=PROMPTS[0], params=params).token_ids == alone
    mine = engine.add_request(PROMPTS[0], params)
    for i, prompt in enumerate(PROMPTS[1:]):
        neighbour = GenerationParams.create(
            max_new_tokens=15, temperature=1.0, seed=i, proposer="draft", num_speculative_tokens=3
        )
        engine.add_request(prompt, neighbour)
    result = None
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == mine and output.finished:
                result = output.result
    assert result is not None and result.token_ids == alone


class RepeatLast(Proposer):
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return [Proposal([r.token_ids[-1]] * r.max_num_drafts) for r in requests]


@pytest.mark.parametrize("adaptive", [True, False])
def test_seeded_sampled_text_is_the_same_with_any_deterministic_proposer(
    target: LoadedModel, adaptive: bool
) -> None:
    engine = make_engine(target, adaptive_speculation=adaptive)
    engine.register_proposer("repeat-last", RepeatLast)
    accepted = 0
    for prompt, seed in ((PROMPTS[0], 5), (PROMPTS[2], 6)):

        def sample(proposer: str, k: int | None, prompt: list[int] = prompt, seed: int = seed):
            params = GenerationParams.create(
                max_new_tokens=30,
                temperature=0.9,
                top_p=0.95,
                seed=seed,
                proposer=proposer,
                num_speculative_tokens=k,
            )
            return engine.generate(prompt_token_ids=prompt, params=params)

        reference = sample("none", None).token_ids
        for proposer, k in (("ngram", 1), ("ngram", 4), ("ngram", 8), ("repeat-last", 3)):
            result = sample(proposer, k)
            assert result.token_ids == reference, (proposer, k)
            accepted += result.stats.draft_tokens_accepted
    assert accepted > 0  # drafts were really verified (a request pauses where they do not pay)


def test_abort_releases_the_slot(target: LoadedModel) -> None:
    engine = make_engine(target, max_num_seqs=1)
    request_id = engine.add_request(PROMPTS[0], GenerationParams(max_new_tokens=50))
    engine.step()
    assert engine.runtime.num_free_slots() == 0
    output = engine.abort(request_id)
    assert output is not None and output.finish_reason is FinishReason.ABORT
    assert engine.runtime.num_free_slots() == 1
    assert not engine.has_unfinished()
    assert engine.generate(prompt_token_ids=PROMPTS[1], max_new_tokens=3).token_ids


@pytest.mark.parametrize(
    ("prompt", "options", "param"),
    [
        ([], {}, "prompt"),
        ([VOCAB], {}, "prompt"),
        ([-1, 2], {}, "prompt"),
        (list(range(10)) * 26, {}, "prompt"),
        ([1, 2], {"proposer": "nope"}, "proposer"),
        ([1, 2], {"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ([1, 2], {"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_k": 0}, "top_k"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2], {"stop": ["x"]}, "stop"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_field(
    engine: Engine, prompt: list[int], options: dict[str, object], param: str
) -> None:
    with pytest.raises(ValueError, match=param) as info:
        engine.generate(prompt_token_ids=prompt, **options)
    assert isinstance(info.value, InvalidRequestError)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_stop_token_ids_end_the_text_as_eos_does(engine: Engine, proposer: str) -> None:
    expected = plain(engine, PROMPTS[0], 20)
    stop = expected[6]
    cut = expected.index(stop)
    result = engine.generate(
        prompt_token_ids=PROMPTS[0],
        proposer=proposer,
        max_new_tokens=20,
        stop_token_ids=[stop],
        ignore_eos=True,
    )
    assert result.token_ids == expected[:cut]
    assert result.finish_reason is FinishReason.STOP
    held = engine.generate(
        prompt_token_ids=PROMPTS[0],
        proposer=proposer,
        max_new_tokens=20,
        stop_token_ids=[stop],
        min_tokens=20,
    )
    assert stop not in held.token_ids and len(held.token_ids) == 20  # min_tokens holds it back
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.generate(prompt_token_ids=PROMPTS[0], stop_token_ids=[VOCAB])


def test_a_frozen_heap_is_frozen_for_its_block_only() -> None:
    """``setup.frozen_heap``: the objects alive at its start are frozen (no collection walks
    them) until the block ends, also when it raises; then the heap is as it was."""
    gc.unfreeze()  # whatever an earlier test froze
    for fails in (False, True):
        with contextlib.suppress(RuntimeError), frozen_heap():
            assert gc.get_freeze_count() > 1_000
            if fails:
                raise RuntimeError("the block fails")
        assert gc.get_freeze_count() == 0
