"""Log-probabilities through the engine on tiny random Llamas (float32, CPU).

Each returned token's log-probability, and its prompt's, must be the target's at that position
under the request's sampling transforms (greedy: the plain log-softmax), whatever proposer ran:
the reference is one plain forward over the prompt and the output, teacher-forced.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from hybridspec import Engine, FinishReason, GenerationParams, SamplingParams
from hybridspec.engine.logprobs import Logprobs
from hybridspec.model.loader import LoadedModel
from hybridspec.model.runtime import ForwardBatch
from hybridspec.verifier import logits_to_probs
from tests.engine.tiny import PROMPTS, make_engine

GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}


def reference_logprobs(target: LoadedModel, ids: Sequence[int], sampling: SamplingParams):
    """[len(ids) - 1, vocab_size]: row i scores ids[i + 1], from one plain forward of ``ids``."""
    runtime = target.create_runtime(1, 256)
    logits = runtime.forward(ForwardBatch.from_lists([runtime.allocate()], [list(ids)])).logits
    logits = logits[:-1]
    if sampling.is_greedy:
        return torch.log_softmax(logits, dim=-1)
    return logits_to_probs(logits, sampling).log()


def assert_matches(scored: Logprobs, reference: torch.Tensor, token_ids: Sequence[int]) -> None:
    """``scored`` holds ``token_ids``, their log-probabilities and the top ones of ``reference``."""
    assert scored.token_ids.tolist() == list(token_ids)
    index = torch.arange(len(token_ids))
    torch.testing.assert_close(
        scored.logprobs, reference[index, scored.token_ids], rtol=0, atol=1e-5
    )
    top = reference.topk(scored.num_top, dim=-1)
    torch.testing.assert_close(scored.top_logprobs, top.values, rtol=0, atol=1e-5)
    gathered = reference.gather(1, scored.top_token_ids)  # ties may come in any order
    torch.testing.assert_close(gathered, top.values, rtol=0, atol=1e-5)


def assert_equal(a: Logprobs, b: Logprobs) -> None:
    """The same tokens and alternatives, and log-probabilities equal but for the rounding of
    different batch shapes (a few 1e-7 here)."""
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.top_token_ids, b.top_token_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.top_logprobs, b.top_logprobs, rtol=0, atol=1e-5)


def params(proposer: str, options: dict[str, object], **extra: object) -> GenerationParams:
    """24 new tokens, K = 4, 5 alternatives per token and 3 per prompt token unless ``extra``
    says otherwise."""
    fields: dict[str, object] = {
        "max_new_tokens": 24,
        "proposer": proposer,
        "num_speculative_tokens": 4,
        "logprobs": 5,
        "prompt_logprobs": 3,
    }
    return GenerationParams.create(**{**fields, **options, **extra})  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_logprobs_are_the_targets_whatever_the_proposer(
    engine: Engine, target: LoadedModel, proposer: str, options: dict[str, object]
) -> None:
    prompt = PROMPTS[0]
    result = engine.generate(prompt_token_ids=prompt, params=params(proposer, options))
    assert result.logprobs is not None and result.prompt_logprobs is not None
    sampling = params(proposer, options).sampling
    reference = reference_logprobs(target, [*prompt, *result.token_ids], sampling)
    assert_matches(result.prompt_logprobs, reference[: len(prompt) - 1], prompt[1:])
    assert_matches(result.logprobs, reference[len(prompt) - 1 :], result.token_ids)
    assert result.logprobs.num_top == 5 and result.prompt_logprobs.num_top == 3
    if proposer != "draft" or options is GREEDY:  # deterministic drafts: the same text as none
        solo = engine.generate(prompt_token_ids=prompt, params=params("none", options))
        assert solo.logprobs is not None and solo.prompt_logprobs is not None
        assert_equal(result.logprobs, solo.logprobs)
        assert_equal(result.prompt_logprobs, solo.prompt_logprobs)
    if proposer != "none":  # drafts were really verified (and, greedy, some kept; sampled
        # drafts that are all rejected pause the request: it may keep none in 24 tokens)
        assert result.stats.draft_tokens_proposed > 0
        assert options is SAMPLED or result.stats.draft_tokens_accepted > 0


def test_batched_and_chunked_requests_score_as_alone(
    target: LoadedModel, draft: LoadedModel
) -> None:
    """Requests asking and not asking, mixed proposers and transforms, long prompts fed in
    prefill chunks of at most 16: each request's logprobs are those of a plain forward."""
    engine = make_engine(target, draft, prefill_chunk_size=16, prefill_step_ratio=None)
    cases = [
        (PROMPTS[2], params("ngram", SAMPLED)),
        (PROMPTS[0], GenerationParams.create(max_new_tokens=20, proposer="draft")),
        (PROMPTS[3], params("draft", GREEDY, logprobs=0, prompt_logprobs=None)),
        (PROMPTS[1], params("none", SAMPLED, max_new_tokens=0, logprobs=None)),
        (PROMPTS[2] * 2, params("none", GREEDY, prompt_logprobs=20)),
    ]
    ids = [engine.add_request(prompt, p) for prompt, p in cases]
    results = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.result
    for request_id, (prompt, p) in zip(ids, cases, strict=True):
        result = results[request_id]
        assert result.logprobs is None if p.logprobs is None else result.logprobs is not None
        full = [*prompt, *result.token_ids]
        reference = reference_logprobs(target, full, p.sampling)
        if p.prompt_logprobs is not None:
            assert_matches(result.prompt_logprobs, reference[: len(prompt) - 1], prompt[1:])
        else:
            assert result.prompt_logprobs is None
        if p.logprobs is not None:
            assert_matches(result.logprobs, reference[len(prompt) - 1 :], result.token_ids)


def test_outputs_carry_logprobs_piece_by_piece(engine: Engine) -> None:
    """Each output's logprobs score its new tokens; the prompt's come once, on the first."""
    p = params("ngram", GREEDY)
    outputs = list(engine.stream(prompt_token_ids=PROMPTS[2], params=p))
    result = outputs[-1].result
    assert result is not None and result.logprobs is not None
    assert [o.prompt_logprobs is not None for o in outputs] == [True] + [False] * (len(outputs) - 1)
    assert_equal(outputs[0].prompt_logprobs, result.prompt_logprobs)  # type: ignore[arg-type]
    pieces = [o.logprobs for o in outputs if o.logprobs is not None]
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in outputs if o.logprobs)
    assert_equal(Logprobs.cat(pieces, 5), result.logprobs)
    assert len(outputs) > 2  # several rounds, so the pieces were really joined


def test_max_new_tokens_zero_scores_the_prompt_only(engine: Engine, target: LoadedModel) -> None:
    prompt = PROMPTS[2]
    result = engine.generate(
        prompt_token_ids=prompt, max_new_tokens=0, prompt_logprobs=0, proposer="ngram"
    )
    assert result.token_ids == [] and result.finish_reason is FinishReason.LENGTH
    assert result.prompt_logprobs is not None and result.prompt_logprobs.num_top == 0
    reference = reference_logprobs(target, prompt, SamplingParams())
    assert_matches(result.prompt_logprobs, reference, prompt[1:])
    assert not engine.has_unfinished() and engine.runtime.num_free_slots() == 8
    one = engine.generate(prompt_token_ids=[7], max_new_tokens=0, prompt_logprobs=2)
    assert one.prompt_logprobs is not None and len(one.prompt_logprobs) == 0


def test_eos_is_scored_though_not_returned(target: LoadedModel) -> None:
    """The EOS that ends a request is not among its tokens, but its logprob is reported (as
    clients scoring an echoed prompt with one generated token expect it to be)."""
    engine = make_engine(target)
    reference_ids = engine.generate(prompt_token_ids=PROMPTS[4], max_new_tokens=20).token_ids
    stop_token = reference_ids[5]
    stopper = LoadedModel(
        target.weights,
        None,
        target.hf_config,
        torch.float32,  # type: ignore[arg-type]
        (stop_token,),
        "tiny:eos",
    )
    result = make_engine(stopper).generate(
        prompt_token_ids=PROMPTS[4], max_new_tokens=20, proposer="ngram", logprobs=1
    )
    assert result.finish_reason is FinishReason.STOP and result.logprobs is not None
    assert result.logprobs.token_ids.tolist() == [*result.token_ids, stop_token]
    reference = reference_logprobs(target, [*PROMPTS[4], *reference_ids], SamplingParams())
    scored = reference[len(PROMPTS[4]) - 1 :][: len(result.logprobs)]
    assert_matches(result.logprobs, scored, [*result.token_ids, stop_token])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprobs", 21, "logprobs"),
        ("logprobs", -1, "logprobs"),
        ("prompt_logprobs", True, "prompt_logprobs"),
        ("max_new_tokens", 0, "max_new_tokens"),
    ],
)
def test_bad_logprobs_options_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationParams.create(**{field: value})  # type: ignore[arg-type]
