"""The ``eagle`` proposer through the engine: greedy text equals plain decoding (float32 and
bfloat16, alone and in mixed batches), the head's cache after every commit equals a fresh
prefill of the target's real features, and seeded sampled requests follow the target's law
and, with the head's keyed drafts, give ``none``'s text for every K."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridspec import EngineConfig, GenerationParams, ModelConfig, SamplingParams
from hybridspec.config import EagleConfig
from hybridspec.engine import Engine
from hybridspec.model import ForwardBatch, LlamaWeights
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers.eagle import EagleProposer, HeadCache, forward_cached
from hybridspec.proposers.eagle.proposer import _uniform
from hybridspec.types import Proposal, ProposeRequest
from hybridspec.verifier import VerifyInput, verify
from hybridspec.verifier.uniforms import KeyedUniforms
from tests.engine import test_controls as controls
from tests.engine import test_losslessness as lossless
from tests.engine.tiny import PROMPTS, make_engine, plain, run_joining, tiny_loaded
from tests.proposers.eagle_helpers import random_head, use_head

FREE = EagleConfig(cost_per_token=0.0)  # the tiny head costs what the tiny target does


@pytest.fixture(scope="module")
def engine(target: LoadedModel) -> Engine:
    engine = make_engine(target, eagle=FREE)
    head = random_head(target, 48)
    use_head(engine, head)
    return engine


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_eagle_equals_plain_decoding(engine: Engine, k: int) -> None:
    drafted = 0
    for prompt in PROMPTS:
        params = GenerationParams(max_new_tokens=40, proposer="eagle", num_speculative_tokens=k)
        result = engine.generate(prompt_token_ids=prompt, params=params)
        assert result.token_ids == plain(engine, prompt)
        drafted += result.stats.draft_tokens_proposed
    assert drafted > 0


@pytest.mark.parametrize("control", ["penalties", "logit-bias", "min-tokens", "all"])
def test_greedy_text_with_controls_is_the_same_with_eagle_and_hybrid(
    engine: Engine, control: str
) -> None:
    """The head's drafts go under the request's controls as the target's rows do."""
    options = controls.CONTROLS[control]
    expected = controls.texts(engine, "none", None, **options)
    for proposer in ("eagle", "hybrid"):
        assert controls.texts(engine, proposer, 4, **options) == expected, proposer


def test_mixed_batch_with_eagle_equals_solo(engine: Engine) -> None:
    expected = {i: plain(engine, p, 30) for i, p in enumerate(PROMPTS)}
    setups = [("eagle", 8), ("ngram", 3), ("eagle", 2), ("none", None), ("eagle", 5)]
    joins = {0: [0, 1], 2: [2], 3: [3, 4]}  # step number -> prompts that join before it
    assert run_joining(engine, setups, joins) == expected


def fresh_prefill_entries(
    target: LoadedModel,
    proposer: EagleProposer,
    token_ids: list[int],
    num_pairs: int,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's keys and values after a fresh prefill of the pairs (f_j, x_{j+1}), first <= j
    < first + num_pairs, with f from a plain teacher-forced forward of the target."""
    runtime = target.create_runtime(1, 256)
    slot = runtime.allocate()
    batch = ForwardBatch.from_lists([slot], [token_ids], [0], hidden_layers=(-1,))
    features = runtime.forward(batch).hidden_states
    assert features is not None
    cache = HeadCache(proposer.head.config, torch.float32, torch.device("cpu"))
    fresh = cache.allocate()
    with torch.no_grad():
        forward_cached(
            proposer.head,
            cache,
            [fresh],
            features[first : first + num_pairs, 0],
            torch.tensor(token_ids[first + 1 : first + num_pairs + 1]),
            [num_pairs],
        )
    return cache.entries(fresh)


@pytest.mark.parametrize("catch_up", [None, 4])
def test_rollback_leaves_the_head_cache_equal_to_a_fresh_prefill(
    target: LoadedModel, catch_up: int | None
) -> None:
    """Also where rounds feed at most ``catch_up`` pairs: the cache is then a fresh prefill of
    the pairs from ``first``, which moves past the prompt's start."""
    engine = make_engine(target, eagle=dataclasses.replace(FREE, catch_up=catch_up))
    proposer = use_head(engine, random_head(target, 64, seed=3))
    params = GenerationParams(max_new_tokens=40, proposer="eagle", num_speculative_tokens=5)
    engine.add_request(PROMPTS[2], params)
    checked, firsts = 0, set()
    while engine.has_unfinished():
        engine.step()
        for request in engine.scheduler.running:
            seq = proposer._seqs[request.seq_id]
            if seq.num_real == 0:
                continue
            firsts.add(seq.first)
            keys, values = proposer.cache.entries(seq.slot)
            assert keys.shape[0] == seq.num_real  # the drafts' entries are gone
            want_keys, want_values = fresh_prefill_entries(
                target, proposer, list(request.token_ids), seq.num_real, seq.first
            )
            torch.testing.assert_close(keys, want_keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values, want_values, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked > 3
    assert proposer.cost_per_token == 0.0
    assert (firsts == {0}) if catch_up is None else (len(firsts) > 1 and 0 not in firsts)


def bf16_target() -> LoadedModel:
    base = tiny_loaded(0)
    assert isinstance(base.weights, LlamaWeights)
    weights = LlamaWeights.from_hf_state_dict(
        base.weights.hf_state_dict(), base.hf_config, dtype=torch.bfloat16
    )
    return dataclasses.replace(base, weights=weights, dtype=torch.bfloat16)


def test_greedy_eagle_equals_plain_decoding_in_bfloat16() -> None:
    target = bf16_target()
    engine = Engine(
        EngineConfig(
            target=ModelConfig(dtype="bfloat16", max_seq_len=256, max_num_seqs=4),
            eagle=FREE,
            measure_proposer_costs=False,  # drafts that never depend on timing
        ),
        target=target,
    )
    use_head(engine, random_head(target, 48))
    drafted = 0
    for prompt in PROMPTS[:3]:
        for k in (2, 6):
            params = GenerationParams(max_new_tokens=40, proposer="eagle", num_speculative_tokens=k)
            result = engine.generate(prompt_token_ids=prompt, params=params)
            assert result.token_ids == plain(engine, prompt)
            drafted += result.stats.draft_tokens_proposed
    assert drafted > 0


def exact_second_and_third(target: LoadedModel, sampling: SamplingParams) -> torch.Tensor:
    """p(x2, x3) = sum over x1 of p(x1) p(x2 | x1) p(x3 | x1, x2), [VOCAB, VOCAB]."""
    vocab = lossless.VOCAB
    runtime = target.create_runtime(1, 64)
    slot = runtime.allocate()

    def probs(prefix: list[int]) -> torch.Tensor:
        runtime.truncate(slot, 0)
        batch = ForwardBatch.from_lists([slot], [lossless.PROMPT + prefix], [len(prefix) + 4])
        return lossless.logits_to_probs(runtime.forward(batch).logits, sampling)[0]

    joint = torch.zeros(vocab, vocab)
    p1 = probs([])
    for x1 in range(vocab):
        p2 = probs([x1])
        for x2 in range(vocab):
            joint[x2] += p1[x1] * p2[x2] * probs([x1, x2])
    return joint


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
)
def test_sampled_eagle_follows_the_target_distribution(sampling: SamplingParams) -> None:
    """Four tokens per request: the first round has no features yet, the second drafts x2 and
    x3 from q (zero outside a draft vocabulary of 6 of the 8 tokens) at the positions' keyed
    uniforms; their joint law must be the target's, with some drafts kept."""
    target, _ = lossless.tiny(0), None
    engine = lossless.build_engine(target, lossless.tiny(1))
    engine = Engine(dataclasses.replace(engine.config, eagle=FREE), target=target)
    proposer = use_head(engine, random_head(target, 6))
    counts = torch.zeros(lossless.VOCAB, lossless.VOCAB)
    submitted = accepted = 0
    while submitted < lossless.NUM_SAMPLES or engine.has_unfinished():
        while submitted < lossless.NUM_SAMPLES and engine.num_waiting < 16:
            params = GenerationParams(
                max_new_tokens=4,
                sampling=dataclasses.replace(sampling, seed=submitted),
                proposer="eagle",
                num_speculative_tokens=3,
                ignore_eos=True,
            )
            engine.add_request(lossless.PROMPT, params)
            submitted += 1
        for output in engine.step():
            if output.finished:
                assert output.result is not None
                _, x2, x3, _ = output.result.token_ids
                counts[x2, x3] += 1
                accepted += output.result.stats.draft_tokens_accepted
    assert proposer.cost_per_token == 0.0
    assert accepted > lossless.NUM_SAMPLES / 10
    stat, critical = lossless.chi_square(counts, exact_second_and_third(target, sampling))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def test_greedy_hybrid_equals_plain_decoding_and_uses_both(target: LoadedModel) -> None:
    from hybridspec.proposers.hybrid import HybridProposer

    engine = make_engine(target, eagle=FREE)
    eagle = use_head(engine, random_head(target, 48))
    picked = {True: 0, False: 0}
    proposer = engine.resolve_proposer("hybrid")
    assert isinstance(proposer, HybridProposer)
    assert proposer.model is eagle and proposer.ngram is engine.resolve_proposer("ngram")
    original = proposer.propose

    def counting(requests):  # type: ignore[no-untyped-def]
        out = original(requests)
        for request in requests:
            choice = proposer._choices[request.seq_id]
            if choice.used_model is not None:
                picked[choice.used_model] += 1
        return out

    proposer.propose = counting  # type: ignore[method-assign]
    for prompt in PROMPTS:
        params = GenerationParams(max_new_tokens=40, proposer="hybrid", num_speculative_tokens=4)
        result = engine.generate(prompt_token_ids=prompt, params=params)
        assert result.token_ids == plain(engine, prompt)
    assert picked[True] > 0 and picked[False] > 0  # n-gram and the head both drafted


def test_hybrid_is_unavailable_without_a_head_or_a_draft(target: LoadedModel) -> None:
    engine = make_engine(target)
    assert "eagle" in engine.unavailable_proposers()
    assert "hybrid" in engine.unavailable_proposers()


def test_draft_probabilities_on_the_draft_vocabulary_equal_the_whole_vocabulary_s(
    target: LoadedModel,
) -> None:
    from hybridspec.verifier.sampling import logits_to_probs_by_row

    engine = make_engine(target, eagle=EagleConfig(cost_per_token=0.0))
    proposer = use_head(engine, random_head(target, 48))
    vocab = proposer.head.draft_vocab
    logits = torch.full((4, target.vocab_size), float("-inf"))
    logits[:, vocab] = torch.randn(4, len(vocab), generator=torch.Generator().manual_seed(3))
    whole = logits_to_probs_by_row(logits, SAMPLINGS)
    draft = logits_to_probs_by_row(logits[:, vocab], SAMPLINGS)  # what ``_keyed_drafts`` samples
    torch.testing.assert_close(draft, whole[:, vocab])
    assert whole.sum(dim=-1).sub(1).abs().max() < 1e-5  # nothing outside the draft vocabulary


SAMPLINGS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=60, min_p=0.05, top_p=0.9),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "top-k", "top-p", "all"])
def test_a_head_whose_q_is_p_has_every_keyed_draft_kept(
    target: LoadedModel, sampling: SamplingParams
) -> None:
    """The keyed draft at each position is the inverse-CDF sample of q at the verifier's
    uniform of that position (``_uniform``: from the committed length on, as the engine's
    ``KeyedUniforms``), under the same transforms: where q is the target's p the verifier
    keeps all of them, and its final token is its own sample after them."""

    engine = make_engine(target, eagle=FREE)
    proposer = use_head(engine, random_head(target, 48))
    vocab, k, context = proposer.head.draft_vocab, 6, [3, 1, 4, 1, 5]
    for key in range(20):
        logits = torch.full((k + 1, target.vocab_size), float("-inf"))
        rng = torch.Generator().manual_seed(key)
        logits[:, vocab] = torch.randn(k + 1, len(vocab), generator=rng) * 2
        ask = ProposeRequest(0, context, k, sampling, uniform_key=key)
        keyed = KeyedUniforms(key, len(context))
        uniforms = [_uniform(ask, j) for j in range(k)]
        assert uniforms == [keyed.uniform(j) for j in range(k)]
        drafts = proposer._keyed_drafts(logits[:k, vocab], [sampling] * k, uniforms)
        out = verify(
            VerifyInput.from_proposals([Proposal(drafts)], logits, [sampling], keyed=[keyed])
        )
        assert out.num_accepted.tolist() == [k], key


@pytest.fixture(scope="module")
def fixed_k_engine(target: LoadedModel) -> Engine:
    """Every request asks for its K each round (no adaptive speculation)."""
    engine = make_engine(target, eagle=FREE, adaptive_speculation=False, max_num_seqs=17)
    use_head(engine, random_head(target, 48))
    return engine


@pytest.mark.parametrize("prompt", [2, 3])
def test_seeded_sampled_text_of_eagle_and_hybrid_is_none_s_for_every_k(
    fixed_k_engine: Engine, prompt: int
) -> None:
    """The head's keyed drafts leave the text to the target's keyed samples: K = 1..8 of both,
    all in one batch beside a ``none`` request, give ``none``'s text alone. (At temperature
    0.5 the random head's drafts are kept now and then: every K keeps some.)"""
    engine = fixed_k_engine

    def params(proposer: str, k: int | None) -> GenerationParams:
        return GenerationParams(
            max_new_tokens=24,
            sampling=SamplingParams(temperature=0.5, top_p=0.95, seed=7),
            proposer=proposer,
            num_speculative_tokens=k,
            ignore_eos=True,
        )

    alone = engine.generate(prompt_token_ids=PROMPTS[prompt], params=params("none", None))
    setups = [("none", None)] + [(p, k) for p in ("eagle", "hybrid") for k in range(1, 9)]
    ids = {engine.add_request(PROMPTS[prompt], params(p, k)): (p, k) for p, k in setups}
    results = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                assert output.result is not None
                results[ids[output.request_id]] = output.result
    for setup, result in results.items():
        assert result.token_ids == alone.token_ids, setup
    for setup in setups[1:]:
        assert results[setup].stats.draft_tokens_accepted > 0, setup  # the drafts took part


@pytest.mark.parametrize("catch_up", [0, -3, 2.5, True, "16"])
def test_a_catch_up_that_is_not_a_positive_integer_is_refused(catch_up: object) -> None:
    with pytest.raises(ValueError, match="catch_up"):
        EagleConfig(catch_up=catch_up)  # type: ignore[arg-type]  # the wrong types on purpose
