"""The suffix proposer in the engine: lossless, and a repeated request drafts its answer whole."""

from __future__ import annotations

from hybridspec import Engine, GenerationParams
from hybridspec.model.loader import LoadedModel
from tests.engine.tiny import PROMPTS, make_engine


def generate(engine: Engine, prompt: list[int], proposer: str, **options: object):
    return engine.generate(
        prompt_token_ids=prompt, proposer=proposer, max_new_tokens=40, ignore_eos=True, **options
    )


def test_greedy_and_seeded_text_equal_plain_decoding(engine: Engine) -> None:
    for prompt, options in ((PROMPTS[0], {}), (PROMPTS[3], {"temperature": 0.8, "seed": 3})):
        plain = generate(engine, prompt, "none", **options).token_ids
        assert generate(engine, prompt, "suffix", **options).token_ids == plain
        assert generate(engine, prompt, "suffix", **options).token_ids == plain  # repeated


def test_a_repeated_request_drafts_its_earlier_answer(target: LoadedModel) -> None:
    engine = make_engine(target)
    prompt = [20, 3, 41, 7, 19, 2]
    first = generate(engine, prompt, "suffix")
    again = generate(engine, prompt, "suffix")
    assert again.token_ids == first.token_ids
    assert again.stats.target_forwards * 3 <= first.stats.target_forwards


def test_a_batch_of_suffix_requests_matches_each_alone(engine: Engine) -> None:
    alone = [generate(engine, p, "none").token_ids for p in PROMPTS[:3]]
    params = GenerationParams(max_new_tokens=40, proposer="suffix", ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.result is not None:
                outputs[output.request_id] = output.result.token_ids
    assert [outputs[i] for i in ids] == alone
