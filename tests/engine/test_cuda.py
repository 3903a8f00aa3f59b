"""The engine on a CUDA device (skipped without one): every proposer's greedy text equals
``none``'s there, alone and in one mixed batch; seeded sampled requests, drafted by the eagle
head too, repeat exactly; the eagle head times its drafting on the device."""

from __future__ import annotations

import pytest
import torch

from hybridspec import GenerationParams
from hybridspec.config import EagleConfig
from hybridspec.model.loader import LoadedModel
from hybridspec.types import SamplingParams
from tests.engine.tiny import PROMPTS, make_engine, plain, run_joining, tiny_loaded
from tests.proposers.eagle_helpers import random_head, use_head

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROPOSERS = ("ngram", "eagle", "hybrid")


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_loaded(0, device="cuda")


def cuda_engine(target: LoadedModel, **config: object):  # type: ignore[no-untyped-def]
    engine = make_engine(target, eagle=EagleConfig(cost_per_token=0.0), **config)
    head = random_head(target, 48)
    use_head(engine, head)
    return engine


def test_every_proposer_writes_none_s_greedy_text_on_the_device(target: LoadedModel) -> None:
    engine = cuda_engine(target)
    for prompt in PROMPTS:
        expected = plain(engine, prompt, 30)
        for proposer in PROPOSERS:
            result = engine.generate(prompt_token_ids=prompt, proposer=proposer, max_new_tokens=30)
            assert result.token_ids == expected, (proposer, prompt)


def test_a_mixed_batch_on_the_device_writes_each_request_s_own_text(
    target: LoadedModel,
) -> None:
    engine = cuda_engine(target)
    expected = [plain(engine, prompt, 30) for prompt in PROMPTS]
    setups = [(("none", *PROPOSERS)[i % 4], None) for i in range(len(PROMPTS))]
    results = run_joining(engine, setups, {0: list(range(len(PROMPTS)))})
    assert [results[i] for i in range(len(PROMPTS))] == expected


@pytest.mark.parametrize("proposer", ["none", *PROPOSERS])
def test_seeded_sampled_requests_repeat_exactly_on_the_device(
    target: LoadedModel, proposer: str
) -> None:
    engine = cuda_engine(target)
    texts = []
    for _ in range(2):
        sampling = SamplingParams(temperature=0.8, seed=7)
        params = GenerationParams(max_new_tokens=30, sampling=sampling, proposer=proposer)
        texts.append(engine.generate(prompt_token_ids=PROMPTS[0], params=params).token_ids)
    assert texts[0] == texts[1]
    assert texts[0]


def test_the_eagle_head_times_its_drafting_on_the_device(target: LoadedModel) -> None:
    from hybridspec.proposers.eagle import EagleProposer

    engine = make_engine(target)
    head = random_head(target, 48)
    engine.register_proposer("eagle", lambda context: EagleProposer(context, head), replace=True)
    proposer = engine.resolve_proposer("eagle")
    assert 0.0 < proposer.cost_per_token < 100.0
