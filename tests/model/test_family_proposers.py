"""Greedy parity of every proposer on every family of ``model.families``: each gives exactly
the tokens of plain decoding, on tiny random models built here (float32), the ``draft``
proposer drafting with the target itself and ``eagle``/``hybrid`` with a random head over it
(the head reads the family's hidden states). A mixed batch runs on the families whose layer
differs from Llama's (``qwen2``'s biases, ``qwen3``'s q/k norms, Gemma's windows of 8 keys and
soft caps, which the prompts and generated texts outgrow)."""

from __future__ import annotations

import functools

import pytest
import torch

from hybridspec import Engine, GenerationParams
from hybridspec.model import LlamaWeights
from hybridspec.model.loader import LoadedModel
from tests.engine.tiny import PROMPTS, VOCAB, make_engine, plain
from tests.model.tiny_families import FAMILY_NAMES, tiny_family
from tests.proposers.eagle_helpers import random_head, use_head

PROPOSERS = ("ngram", "suffix", "draft", "eagle", "hybrid")


def family_loaded(family: str, seed: int = 0) -> LoadedModel:
    """A tiny random model of ``family`` over ``VOCAB`` ids (EOS the last), its LM head
    sharpened so that greedy text has structure worth speculating on."""
    model = tiny_family(family, seed=seed, vocab_size=VOCAB)
    state = dict(model.state_dict())
    eos = VOCAB - 1
    state["lm_head.weight"] = state["lm_head.weight"] * 8
    state["lm_head.weight"][eos] = 0  # logit 0: below the largest of 63 others, never greedy
    weights = LlamaWeights.from_hf_state_dict(state, model.config, dtype=torch.float32)
    return LoadedModel(weights, None, model.config, torch.float32, (eos,), f"tiny-{family}")  # type: ignore[arg-type]


@functools.cache
def family_engine(family: str) -> Engine:
    target = family_loaded(family)
    engine = make_engine(target, target)  # the target drafts for itself
    head = random_head(target, VOCAB)
    use_head(engine, head)
    return engine


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_proposer_equals_plain_decoding(family: str) -> None:
    engine = family_engine(family)
    for prompt in (PROMPTS[0],):
        expected = plain(engine, prompt, max_new_tokens=16)
        assert len(expected) == 16
        for proposer in PROPOSERS:
            result = engine.generate(
                prompt_token_ids=prompt,
                proposer=proposer,
                num_speculative_tokens=4,
                max_new_tokens=16,
            )
            assert result.token_ids == expected, (proposer, prompt)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "gemma3"])  # not Llama's layer
def test_a_mixed_batch_of_proposers_equals_each_alone(family: str) -> None:
    engine = family_engine(family)
    expected = {p: plain(engine, PROMPTS[i], max_new_tokens=12) for i, p in enumerate(PROPOSERS)}
    ids = {
        engine.add_request(
            PROMPTS[i], GenerationParams(max_new_tokens=12, proposer=p, num_speculative_tokens=3)
        ): p
        for i, p in enumerate(PROPOSERS)
    }
    results: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                assert output.result is not None
                results[ids[output.request_id]] = output.result.token_ids
    assert results == expected
