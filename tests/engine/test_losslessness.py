"""Empirical losslessness through the whole engine, with tiny random Llamas (vocabulary 8).

Thousands of seeded requests generate two tokens each, sixteen at a time in mixed batches; the
counts of the 64 possible two-token outputs must fit the target's exact distribution
p(x1) p(x2 | x1), computed from the target alone, by a chi-square test at alpha = 1e-6. Seeds
are fixed, so the test is deterministic; a control shows the test rejects a wrong distribution.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridspec import (
    DraftConfig,
    Engine,
    EngineConfig,
    GenerationParams,
    ModelConfig,
    SamplingParams,
)
from hybridspec.model import LlamaWeights
from hybridspec.model.loader import LoadedModel
from hybridspec.model.runtime import ForwardBatch
from hybridspec.types import TokenHistory
from hybridspec.verifier import apply_controls, logits_to_probs

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2]
NUM_SAMPLES = 2400
Z_ONE_MINUS_1E6 = 4.753424  # standard normal quantile at 1 - 1e-6


def tiny(seed: int, base: dict[str, torch.Tensor] | None = None) -> LoadedModel:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=VOCAB - 1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    state = (
        LlamaForCausalLM(config).state_dict()
        if base is None
        else {
            k: v + 0.5 * v.std() * torch.randn_like(v) if v.dim() > 1 else v
            for k, v in base.items()
        }
    )
    if base is None:
        state["lm_head.weight"] = state["lm_head.weight"] * 4
    weights = LlamaWeights.from_hf_state_dict(state, config, dtype=torch.float32)
    return LoadedModel(weights, None, config, torch.float32, (VOCAB - 1,), f"tiny:{seed}")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def models() -> tuple[LoadedModel, LoadedModel]:
    target = tiny(0)
    assert isinstance(target.weights, LlamaWeights)
    return target, tiny(1, base=target.weights.hf_state_dict())


def exact_two_token_distribution(
    target: LoadedModel, sampling: SamplingParams, ignore_eos: bool = True
) -> torch.Tensor:
    """p(x1, x2) for every pair, [VOCAB, VOCAB], from the target alone, under the request's
    controls counted on the true history (the prompt, then x1)."""
    runtime = target.create_runtime(1, 64)
    slot = runtime.allocate()
    stops = frozenset() if ignore_eos else frozenset({VOCAB - 1})

    def probs(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        history = TokenHistory([*PROMPT, *generated], len(PROMPT), stops)
        return logits_to_probs(apply_controls(logits, [sampling], [history], [[]]), sampling)[0]

    first = runtime.forward(ForwardBatch.from_lists([slot], [PROMPT], [len(PROMPT) - 1])).logits
    p1 = probs(first, [])
    joint = torch.zeros(VOCAB, VOCAB)
    for x1 in range(VOCAB):
        runtime.truncate(slot, len(PROMPT))
        second = runtime.forward(ForwardBatch.from_lists([slot], [[x1]], [0])).logits
        joint[x1] = p1[x1] * probs(second, [x1])
    return joint


def sample_counts(engine: Engine, params: GenerationParams) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB)
    submitted = 0
    while submitted < NUM_SAMPLES or engine.has_unfinished():
        while submitted < NUM_SAMPLES and engine.num_waiting < 16:
            sampling = dataclasses.replace(params.sampling, seed=submitted)
            engine.add_request(
                PROMPT, dataclasses.replace(params, max_new_tokens=2, sampling=sampling)
            )
            submitted += 1
        for output in engine.step():
            if output.finished:
                assert output.result is not None
                x1, x2 = output.result.token_ids
                counts[x1, x2] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """The statistic (cells with expected count < 5 pooled) and its critical value at 1e-6."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten()
    small = expected < 5
    exp_cells = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    obs_cells = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    keep = exp_cells > 0
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    df = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square quantile.
    h = 2 / (9 * df)
    critical = df * (1 - h + Z_ONE_MINUS_1E6 * math.sqrt(h)) ** 3
    return stat, critical


def build_engine(target: LoadedModel, draft: LoadedModel) -> Engine:
    config = EngineConfig(
        target=ModelConfig(dtype="float32", max_seq_len=64, max_num_seqs=16),
        draft=DraftConfig(cost_per_token=0.0),  # the tiny draft costs what the target does
        measure_proposer_costs=False,  # drafts that never depend on timing
    )
    return Engine(config, target=target, draft=draft)


@pytest.mark.parametrize(
    ("proposer", "k", "sampling"),
    [
        ("draft", 2, SamplingParams(temperature=1.0)),
        ("draft", 3, SamplingParams(temperature=0.7, top_k=5, top_p=0.9)),
        ("ngram", 2, SamplingParams(temperature=1.0)),
        ("none", None, SamplingParams(temperature=1.0)),
    ],
)
def test_speculative_samples_follow_the_target_distribution(
    models: tuple[LoadedModel, LoadedModel],
    proposer: str,
    k: int | None,
    sampling: SamplingParams,
) -> None:
    target, draft = models
    engine = build_engine(target, draft)
    params = GenerationParams(
        max_new_tokens=2,
        sampling=sampling,
        proposer=proposer,
        num_speculative_tokens=k,
        ignore_eos=True,
    )
    counts = sample_counts(engine, params)
    assert counts.sum() == NUM_SAMPLES
    stat, critical = chi_square(counts, exact_two_token_distribution(target, sampling))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def test_the_chi_square_test_rejects_the_drafts_distribution(
    models: tuple[LoadedModel, LoadedModel],
) -> None:
    """A verifier that accepted every draft would emit the draft's distribution: detected."""
    target, draft = models
    engine = build_engine(target, draft)
    sampling = SamplingParams(temperature=1.0)
    counts = sample_counts(
        engine,
        GenerationParams(max_new_tokens=2, sampling=sampling, proposer="none", ignore_eos=True),
    )
    stat, critical = chi_square(counts, exact_two_token_distribution(draft, sampling))
    assert stat > critical


# Each control with a seeded sampled request; the draft proposer (whose q must be under the same
# controls) for the penalties that count its own drafts, n-gram (keyed) for the others.
CONTROLLED = [
    ("draft", SamplingParams(temperature=1.0, presence_penalty=1.5), True),
    ("ngram", SamplingParams(temperature=1.0, frequency_penalty=1.0), True),
    ("draft", SamplingParams(temperature=1.0, repetition_penalty=1.6), True),
    ("ngram", SamplingParams(temperature=1.0, logit_bias=((2, 2.0), (5, -1.0))), True),
    ("ngram", SamplingParams(temperature=0.8, min_p=0.1), True),
    ("ngram", SamplingParams(temperature=1.0, min_tokens=2), False),  # EOS masked: 2 tokens
    (
        "draft",
        SamplingParams(
            temperature=0.9,
            top_k=6,
            presence_penalty=0.4,
            frequency_penalty=0.6,
            repetition_penalty=1.2,
            logit_bias=((4, 1.0),),
            min_p=0.02,
            min_tokens=2,
        ),
        False,
    ),
]


@pytest.mark.parametrize(
    ("proposer", "sampling", "ignore_eos"),
    CONTROLLED,
    ids=["presence", "frequency", "repetition", "logit-bias", "min-p", "min-tokens", "all"],
)
def test_controlled_samples_follow_the_controlled_target(
    models: tuple[LoadedModel, LoadedModel],
    proposer: str,
    sampling: SamplingParams,
    ignore_eos: bool,
) -> None:
    target, draft = models
    engine = build_engine(target, draft)
    params = GenerationParams(
        max_new_tokens=2,
        sampling=sampling,
        proposer=proposer,
        num_speculative_tokens=3,
        ignore_eos=ignore_eos,
    )
    counts = sample_counts(engine, params)
    assert counts.sum() == NUM_SAMPLES
    expected = exact_two_token_distribution(target, sampling, ignore_eos)
    stat, critical = chi_square(counts, expected)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"
    plain = exact_two_token_distribution(target, SamplingParams(temperature=1.0), ignore_eos)
    assert (expected - plain).abs().sum() > 0.05  # the control changes the law
