"""Sampling controls through the engine: every proposer gives the text of plain decoding.

Greedy requests with penalties, a logit bias or min_tokens take the argmax of the controlled
logits, so their text changes with the controls, and ``ngram`` and ``draft`` must still give
exactly the text of ``none``. Seeded sampled requests give the same text with ``none`` and
``ngram`` (deterministic drafts, position-keyed uniforms). The draft proposer's q is its
distribution under the same controls, counted on the committed tokens and its own drafts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridspec import Engine, GenerationParams, InvalidRequestError, ProposeRequest
from hybridspec.model.loader import LoadedModel
from hybridspec.model.runtime import ForwardBatch
from hybridspec.proposers.draft import DraftModelProposer
from hybridspec.types import SamplingParams, TokenHistory
from hybridspec.verifier import apply_controls, logits_to_probs
from tests.engine.tiny import EOS, PROMPTS, VOCAB

CONTROLS: dict[str, dict[str, Any]] = {
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 1.5},
    "negative-presence": {"presence_penalty": -1.0},
    "repetition": {"repetition_penalty": 1.5},
    "logit-bias": {"logit_bias": {5: 6.0, 9: 4.0, 35: -50.0}},
    "min-p": {"min_p": 0.3},
    "min-tokens": {"min_tokens": 12, "logit_bias": {EOS: 30.0}},  # EOS wanted, masked for 12
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.8, "repetition_penalty": 1.2},
    "all": {
        "presence_penalty": -0.5,
        "frequency_penalty": 0.7,
        "repetition_penalty": 0.8,
        "logit_bias": {3: 3.0, EOS: 2.0},
        "min_p": 0.1,
        "min_tokens": 5,
    },
}
PROPOSERS = [("none", None), ("ngram", 4), ("ngram", 8), ("draft", 3), ("draft", 8)]


def texts(engine: Engine, proposer: str, k: int | None, **options: Any) -> list[list[int]]:
    return [
        engine.generate(
            prompt_token_ids=prompt,
            proposer=proposer,
            num_speculative_tokens=k,
            max_new_tokens=30,
            **options,
        ).token_ids
        for prompt in PROMPTS
    ]


@pytest.mark.parametrize("control", list(CONTROLS))
def test_greedy_text_with_controls_is_the_same_with_every_proposer(
    engine: Engine, control: str
) -> None:
    options = CONTROLS[control]
    expected = texts(engine, "none", None, **options)
    for proposer, k in PROPOSERS[1:]:
        assert texts(engine, proposer, k, **options) == expected, (proposer, k)
    if control != "min-p":  # a filter of the sampled distribution: greedy text is unchanged
        assert expected != texts(engine, "none", None), "the control changed nothing"


@pytest.mark.parametrize("control", list(CONTROLS))
def test_seeded_text_with_controls_is_the_same_with_none_and_ngram(
    engine: Engine, control: str
) -> None:
    options = {**CONTROLS[control], "temperature": 0.8, "seed": 11}
    expected = texts(engine, "none", None, **options)
    for k in (3, 8):
        assert texts(engine, "ngram", k, **options) == expected, k
    assert expected != texts(engine, "none", None, temperature=0.8, seed=11)


def test_min_tokens_holds_eos_back_then_lets_it_stop(engine: Engine) -> None:
    for proposer, k in PROPOSERS:
        eager = engine.generate(
            prompt_token_ids=PROMPTS[0],
            proposer=proposer,
            num_speculative_tokens=k,
            logit_bias={EOS: 30.0},
        )
        assert eager.token_ids == []  # EOS first
        held = engine.generate(
            prompt_token_ids=PROMPTS[0],
            proposer=proposer,
            num_speculative_tokens=k,
            logit_bias={EOS: 30.0},
            min_tokens=7,
        )
        assert len(held.token_ids) == 7 and held.finish_reason.value == "stop", proposer


def test_penalties_break_greedy_repetition(engine: Engine) -> None:
    plain = texts(engine, "none", None)[0]
    penalised = texts(engine, "ngram", 4, presence_penalty=2.0, frequency_penalty=2.0)[0]
    assert len(set(penalised)) > len(set(plain))


def test_logprobs_are_those_of_the_controlled_distribution(engine: Engine) -> None:
    """A greedy request's logprobs: the log-softmax of its controlled logits, alike for every
    proposer; the biased token is the argmax and its logprob shows the bias."""
    options = {"logit_bias": {9: 5.0}, "frequency_penalty": 0.3, "logprobs": 2}
    results = [
        engine.generate(
            prompt_token_ids=PROMPTS[1],
            proposer=proposer,
            num_speculative_tokens=k,
            max_new_tokens=12,
            **options,
        )
        for proposer, k in PROPOSERS
    ]
    first = results[0].logprobs
    assert first is not None
    for result in results[1:]:
        assert result.token_ids == results[0].token_ids
        assert result.logprobs is not None
        torch.testing.assert_close(result.logprobs.logprobs, first.logprobs)
        assert torch.equal(result.logprobs.top_token_ids, first.top_token_ids)
    # The logprob of the first token, computed from the target by hand.
    runtime = engine.target.create_runtime(1, 64)
    slot = runtime.allocate()
    prompt = PROMPTS[1]
    logits = runtime.forward(ForwardBatch.from_lists([slot], [prompt], [len(prompt) - 1])).logits
    params = SamplingParams(logit_bias=((9, 5.0),), frequency_penalty=0.3)
    history = TokenHistory(prompt, len(prompt), frozenset({EOS}))
    controlled = apply_controls(logits, [params], [history], [[]])
    expected = torch.log_softmax(controlled, dim=-1)[0, results[0].token_ids[0]]
    assert float(first.logprobs[0]) == pytest.approx(float(expected), abs=1e-5)


def test_draft_q_is_under_the_same_controls(engine: Engine, draft: LoadedModel) -> None:
    """Each row of the draft proposer's q is its own distribution under the request's controls
    after the committed tokens and its earlier drafts."""
    proposer = engine.resolve_proposer("draft")
    assert isinstance(proposer, DraftModelProposer)
    prompt, generated = PROMPTS[0][:8], PROMPTS[0][8:]
    context = [*prompt, *generated]
    params = SamplingParams(
        temperature=0.9,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias=((4, 2.0),),
        min_p=0.05,
        min_tokens=6,
    )
    proposer.start(1000, context)
    stops = frozenset({EOS})
    request = ProposeRequest(1000, context, 4, params, torch.Generator().manual_seed(3), 8, stops)
    proposal = proposer.propose([request])[0]
    proposer.finish(1000)
    assert proposal.probs is not None and proposal.num_drafts == 4
    runtime = draft.create_runtime(1, 64)
    slot = runtime.allocate()
    fed = list(context)
    for j, token in enumerate(proposal.token_ids):
        logits = runtime.forward(ForwardBatch.from_lists([slot], [fed], [len(fed) - 1])).logits
        history = TokenHistory([*context, *proposal.token_ids[:j]], len(prompt), stops)
        q = logits_to_probs(apply_controls(logits, [params], [history], [[]]), params)[0]
        torch.testing.assert_close(proposal.probs[j], q, atol=1e-5, rtol=0)
        fed = [token]
    assert float(proposal.probs[0][EOS]) == 0.0  # 4 generated < min_tokens: EOS masked


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1000.0}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ],
)
def test_bad_controls_name_the_field(options: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        GenerationParams.create(**options)
    assert error.value.param == param


def test_a_logit_bias_outside_the_vocabulary_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(PROMPTS[0], GenerationParams.create(logit_bias={VOCAB: 1.0}))
    assert error.value.param == "logit_bias"


def test_logit_bias_is_stored_sorted_and_hashable() -> None:
    params = SamplingParams(logit_bias={9: 1, 2: -3.5})  # type: ignore[arg-type]
    assert params.logit_bias == ((2, -3.5), (9, 1.0))
    assert hash(params) == hash(SamplingParams(logit_bias=((2, -3.5), (9, 1.0))))
    assert params.has_controls and not SamplingParams(min_p=0.5).has_controls
