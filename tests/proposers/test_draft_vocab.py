"""Draft pairs across padded vocabularies (``proposers.draft_vocab``): a draft whose vocabulary
is the target's padded, or the target's truncated, by unused rows drafts with those rows
masked; greedy text equals plain decoding and sampled text follows the target's distribution
(the chi-square test of ``tests/engine/test_losslessness.py``); a draft whose tokens differ is
refused, naming the first differing id."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hybridspec import GenerationParams, InvalidRequestError, SamplingParams
from hybridspec.model import LlamaWeights
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers.draft_vocab import fit_draft_logits
from tests.engine.test_losslessness import (
    NUM_SAMPLES,
    PROMPT,
    VOCAB,
    build_engine,
    chi_square,
    exact_two_token_distribution,
    sample_counts,
)

WORDS = [f"w{i}" for i in range(VOCAB)]


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=words[-1])


def padded(seed: int, rows: int, base: dict[str, torch.Tensor] | None = None) -> LoadedModel:
    """A tiny Llama over ``VOCAB`` tokens with ``rows`` embedding and LM-head rows: rows past
    ``VOCAB`` are padding: zeros in a target, large random LM-head rows in a draft (``base``'s
    weights with noise), which would draft them all the time if they were not masked."""
    config = LlamaConfig(
        vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=VOCAB - 1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    state = LlamaForCausalLM(config).state_dict()
    if base is not None:
        for name, value in base.items():
            noisy = (
                value + 0.5 * value.std() * torch.randn_like(value) if value.dim() > 1 else value
            )
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                state[name][:VOCAB] = noisy[:VOCAB]
            else:
                state[name] = noisy
    else:
        state["lm_head.weight"] = state["lm_head.weight"] * 4
    if base is None:  # a target's padding rows are zeros, as in Qwen's checkpoints
        state["lm_head.weight"][VOCAB:] = 0
    else:
        state["lm_head.weight"][VOCAB:] = 20 * state["lm_head.weight"][VOCAB:]
    weights = LlamaWeights.from_hf_state_dict(state, config, dtype=torch.float32)
    tokenizer = word_tokenizer(WORDS)
    return LoadedModel(weights, tokenizer, config, torch.float32, (VOCAB - 1,), f"tiny:{rows}")


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return padded(0, VOCAB)


def test_fit_draft_logits_cuts_and_pads() -> None:
    logits = torch.arange(6.0).reshape(1, 6)
    assert fit_draft_logits(logits, 6, 6) is logits
    assert fit_draft_logits(logits, 4, 5).tolist() == [[0, 1, 2, 3, float("-inf")]]
    assert fit_draft_logits(logits[:, :3], 3, 4).tolist() == [[0, 1, 2, float("-inf")]]


@pytest.mark.parametrize(("target_rows", "draft_rows"), [(VOCAB, VOCAB + 4), (VOCAB + 3, VOCAB)])
def test_greedy_text_equals_plain_decoding(target_rows: int, draft_rows: int) -> None:
    target = padded(0, target_rows)
    assert isinstance(target.weights, LlamaWeights)
    draft = padded(1, draft_rows, base=target.weights.hf_state_dict())
    engine = build_engine(target, draft)
    accepted = 0
    for prompt in (PROMPT, [3, 4, 5, 6, 3, 4]):
        options = {"prompt_token_ids": prompt, "max_new_tokens": 12, "ignore_eos": True}
        expected = engine.generate(proposer="none", **options)  # type: ignore[arg-type]
        result = engine.generate(proposer="draft", num_speculative_tokens=3, **options)  # type: ignore[arg-type]
        assert result.token_ids == expected.token_ids
        assert len(result.token_ids) == 12 and all(t < VOCAB for t in result.token_ids)
        accepted += result.stats.draft_tokens_accepted
    assert accepted > 0  # the masked draft agrees with the target at times


def test_sampled_text_follows_the_target_distribution(target: LoadedModel) -> None:
    assert isinstance(target.weights, LlamaWeights)
    draft = padded(1, VOCAB + 4, base=target.weights.hf_state_dict())
    sampling = SamplingParams(temperature=1.0)
    params = GenerationParams(
        max_new_tokens=2, sampling=sampling, proposer="draft", num_speculative_tokens=2,
        ignore_eos=True,
    )  # fmt: skip
    counts = sample_counts(build_engine(target, draft), params)
    assert counts.sum() == NUM_SAMPLES
    stat, critical = chi_square(counts, exact_two_token_distribution(target, sampling))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def test_a_draft_with_other_tokens_is_refused_naming_the_first(target: LoadedModel) -> None:
    assert isinstance(target.weights, LlamaWeights)
    draft = padded(1, VOCAB + 4, base=target.weights.hf_state_dict())
    other = [*WORDS[:5], "other", *WORDS[6:]]
    draft = dataclasses.replace(draft, tokenizer=word_tokenizer(other))
    engine = build_engine(target, draft)
    with pytest.raises(InvalidRequestError, match="at token id 5: 'other' in the draft, 'w5'"):
        engine.generate(prompt_token_ids=PROMPT, proposer="draft", max_new_tokens=2)
    no_tokenizers = dataclasses.replace(draft, tokenizer=None)
    with pytest.raises(InvalidRequestError, match="cannot be told unused"):
        build_engine(target, no_tokenizers).generate(
            prompt_token_ids=PROMPT, proposer="draft", max_new_tokens=2
        )


def test_a_target_that_emits_its_padding_is_not_drafted_for() -> None:
    """A target whose padding rows win (untrained rows can) feeds the smaller draft an id it
    has no row for: that sequence gets no drafts, and its text is plain decoding's."""
    target = padded(0, VOCAB + 3)
    assert isinstance(target.weights, LlamaWeights)
    state = target.weights.hf_state_dict()
    state["lm_head.weight"][VOCAB + 1] = 50 * state["lm_head.weight"][0].sign()
    target = dataclasses.replace(
        target,
        weights=LlamaWeights.from_hf_state_dict(state, target.hf_config, dtype=torch.float32),
    )
    draft = padded(1, VOCAB, base=state)
    engine = build_engine(target, draft)
    options = {"prompt_token_ids": PROMPT, "max_new_tokens": 8, "ignore_eos": True}
    expected = engine.generate(proposer="none", **options)  # type: ignore[arg-type]
    assert VOCAB + 1 in expected.token_ids
    result = engine.generate(proposer="draft", num_speculative_tokens=3, **options)  # type: ignore[arg-type]
    assert result.error is None and result.token_ids == expected.token_ids
