"""Several choices of one prompt (``n``): one shared prefill, each choice exactly the request
made alone (greedy under every proposer, seeded whatever the batch), caches kept apart."""

from __future__ import annotations

import pytest
import torch

from hybridspec import CapacityError, Engine, GenerationParams, InvalidRequestError
from hybridspec.engine.choices import choice_seed, combined_stats
from hybridspec.engine.stats import GenerationStats
from hybridspec.model import LoadedModel
from hybridspec.types import MAX_SEED
from tests.engine.test_engine import cache_equals_plain_prefill
from tests.engine.test_features import LastLayer, handed_rows, plain_hidden_states
from tests.engine.tiny import PROMPTS, make_engine, plain

LONG_PROMPT = (PROMPTS[0] + PROMPTS[2] + PROMPTS[3]) * 2  # 92 tokens: several prefill chunks


def run_all(engine: Engine, ids: list[str]) -> dict[str, list[int]]:
    """Step until every request of ``ids`` has finished; each one's tokens."""
    results: dict[str, list[int]] = {}
    while len(results) < len(ids):
        for output in engine.step():
            if output.result is not None and output.request_id in ids:
                results[output.request_id] = output.result.token_ids
    return results


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_greedy_choices_equal_each_other_and_the_single_request(
    engine: Engine, proposer: str
) -> None:
    for prompt in (PROMPTS[1], LONG_PROMPT):
        results = engine.generate_choices(
            prompt_token_ids=prompt, n=3, proposer=proposer, max_new_tokens=30
        )
        expected = plain(engine, prompt, 30)
        assert [r.token_ids for r in results] == [expected] * 3, f"prompt {prompt}"


def test_the_prompt_is_fed_once_for_all_choices(target: LoadedModel) -> None:
    engine = make_engine(target, prefill_chunk_size=32, prefill_step_ratio=None)
    fed: list[int] = []
    engine.runtime.add_forward_observer(lambda batch, _: fed.append(batch.token_ids.numel()))
    params = GenerationParams(max_new_tokens=1, proposer="none")
    engine.generate_choices(prompt_token_ids=LONG_PROMPT, n=4, params=params)
    shared = sum(fed)
    fed.clear()
    ids = [engine.add_request(LONG_PROMPT, params) for _ in range(4)]
    run_all(engine, ids)
    # one prefill of all tokens but the last, then each choice feeds that last token
    assert shared == len(LONG_PROMPT) - 1 + 4
    assert sum(fed) == 4 * len(LONG_PROMPT)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_each_choice_cache_is_its_own_through_rollbacks(
    target: LoadedModel, draft: LoadedModel, proposer: str
) -> None:
    """After every round, each choice's cache equals a fresh prefill of its own committed
    tokens: the copy was exact, and one choice's rollback never touched another's slot."""
    engine = make_engine(target, draft, prefill_chunk_size=32, prefill_step_ratio=None)
    params = GenerationParams.create(
        max_new_tokens=30, proposer=proposer, temperature=1.0, seed=5, num_speculative_tokens=5
    )
    ids = engine.add_choices([LONG_PROMPT], params, n=3)[0]
    texts: dict[str, list[int]] = {}
    rounds = 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.result is not None:
                texts[output.request_id] = output.result.token_ids
        for request in engine.scheduler.running:
            assert request.slot is not None
            if request.group is not None:  # before the shared prefill
                continue
            cache_equals_plain_prefill(target, engine.runtime, request.slot, request.token_ids[:-1])
            rounds += 1
    assert rounds > 10
    assert len({tuple(texts[i]) for i in ids}) == 3  # sampled choices went apart


def seeded(proposer: str, seed: int, max_new_tokens: int = 30) -> GenerationParams:
    return GenerationParams.create(
        max_new_tokens=max_new_tokens, proposer=proposer, temperature=0.8, seed=seed, logprobs=2
    )


def test_seeded_choices_are_the_single_requests_with_seeds_s_plus_i(engine: Engine) -> None:
    results = engine.generate_choices(prompt_token_ids=PROMPTS[3], n=3, params=seeded("ngram", 7))
    for i, result in enumerate(results):
        alone = engine.generate(prompt_token_ids=PROMPTS[3], params=seeded("none", 7 + i))
        assert result.token_ids == alone.token_ids
        assert result.logprobs is not None and alone.logprobs is not None
        torch.testing.assert_close(result.logprobs.logprobs, alone.logprobs.logprobs)
    assert len({tuple(r.token_ids) for r in results}) == 3


def test_seeded_choices_do_not_depend_on_the_batch(engine: Engine) -> None:
    """The same seeded request alone, then with other requests joining at different steps
    (some with n > 1 themselves): each choice's text is the same."""
    alone = engine.generate_choices(prompt_token_ids=PROMPTS[0], n=3, params=seeded("ngram", 11))
    expected = [r.token_ids for r in alone]
    for joins in ({0: 2, 3: 1}, {1: 1, 2: 3}):
        ids: list[str] = []
        step = 0
        while step <= max(joins) or engine.has_unfinished():
            if step in joins:
                engine.add_choices([PROMPTS[4]], seeded("none", step), n=joins[step])
            if step == 1:
                ids = engine.add_choices([PROMPTS[0]], seeded("ngram", 11), n=3)[0]
            results = {o.request_id: o for o in engine.step() if o.request_id in ids}
            for request_id, output in results.items():
                if output.result is not None:
                    expected_tokens = expected[ids.index(request_id)]
                    assert output.result.token_ids == expected_tokens, joins
            step += 1


def test_choice_seeds_follow_vllms_rule() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(MAX_SEED - 1, 1) == 0
    assert choice_seed(None, 2) is None


def test_prompt_logprobs_reach_every_choice(engine: Engine) -> None:
    params = GenerationParams(max_new_tokens=3, proposer="ngram", logprobs=1, prompt_logprobs=1)
    alone = engine.generate(prompt_token_ids=LONG_PROMPT, params=params)
    results = engine.generate_choices(prompt_token_ids=LONG_PROMPT, n=2, params=params)
    assert alone.prompt_logprobs is not None
    for result in results:
        assert result.prompt_logprobs is not None
        assert torch.equal(result.prompt_logprobs.token_ids, alone.prompt_logprobs.token_ids)
        torch.testing.assert_close(result.prompt_logprobs.logprobs, alone.prompt_logprobs.logprobs)


def test_features_cover_every_position_of_every_choice(target: LoadedModel) -> None:
    """A proposer reading target features gets each choice's rows from position 0, the
    shared prompt's included, as if the choice had prefilled alone."""
    engine = make_engine(target, prefill_chunk_size=32, prefill_step_ratio=None)
    engine.register_proposer("last-layer", LastLayer)
    params = GenerationParams(max_new_tokens=20, proposer="last-layer")
    results = engine.generate_choices(prompt_token_ids=LONG_PROMPT, n=2, params=params)
    proposer = engine.resolve_proposer("last-layer")
    assert isinstance(proposer, LastLayer)
    expected = plain_hidden_states(target, LONG_PROMPT + results[0].token_ids, (-1,))
    for seq_id in sorted({c.seq_id for c in proposer.commits}):
        rows = handed_rows(proposer.commits, seq_id)
        torch.testing.assert_close(rows, expected[: rows.shape[0]], atol=1e-5, rtol=1e-5)


def test_a_group_waits_for_a_slot_per_choice(target: LoadedModel) -> None:
    engine = make_engine(target, max_num_seqs=4)
    params = GenerationParams(max_new_tokens=10, proposer="ngram")
    singles = [engine.add_request(PROMPTS[i], params) for i in range(3)]
    group = engine.add_choices([PROMPTS[0]], params, n=3)[0]
    engine.step()
    assert engine.num_running == 3 and engine.num_waiting == 3  # 1 slot free: not enough
    results = run_all(engine, singles + group)
    assert [results[i] for i in group] == [plain(engine, PROMPTS[0], 10)] * 3


def test_an_aborted_source_hands_the_prefill_to_the_next_choice(target: LoadedModel) -> None:
    engine = make_engine(target, prefill_chunk_size=16, prefill_step_ratio=None)
    params = GenerationParams(max_new_tokens=10, proposer="ngram")
    ids = engine.add_choices([LONG_PROMPT], params, n=3)[0]
    engine.step()  # the source prefills its first chunk
    aborted = engine.abort(ids[0])
    assert aborted is not None and aborted.finished
    results = run_all(engine, ids[1:])
    assert list(results.values()) == [plain(engine, LONG_PROMPT, 10)] * 2
    assert engine.runtime.num_free_slots() == engine.runtime.max_num_seqs


def test_bad_n_and_too_many_prompts_are_refused_and_queue_nothing(
    target: LoadedModel,
) -> None:
    engine = make_engine(target, max_num_seqs=4, max_queue_size=2)
    for n in (0, 5, True, 2.0):
        with pytest.raises(InvalidRequestError, match="n: expected an integer in \\[1, 4\\]"):
            engine.add_choices([PROMPTS[0]], None, n=n)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="prompt: expected 1 to 6 prompts"):
        engine.add_choices([PROMPTS[0]] * 7, None, n=1)
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.add_choices([PROMPTS[0], []], None, n=2)
    assert not engine.has_unfinished()
    engine.add_choices([PROMPTS[0]] * 6, None, n=4)  # 4 free slots and 2 waiting: fits
    with pytest.raises(CapacityError):
        engine.add_choices([PROMPTS[1]], None, n=1)
    assert engine.num_waiting == 24
    engine.abort_all()


def test_many_prompts_queue_as_one_request_beside_a_running_one(target: LoadedModel) -> None:
    """The most prompts a request may hold (queue and slots: 6) while another request holds a
    slot and one waits: the queue has room, so they queue, and all of them finish."""
    engine = make_engine(target, max_num_seqs=4, max_queue_size=2)
    params = GenerationParams(max_new_tokens=2, proposer="none")
    engine.add_choices([PROMPTS[0]], params, n=1)
    engine.step()  # it holds a slot
    engine.add_choices([PROMPTS[1]], params, n=4)  # waits for all 4 slots
    ids = engine.add_choices([PROMPTS[2]] * 6, params, n=1)
    with pytest.raises(CapacityError):
        engine.add_choices([PROMPTS[1]], params, n=1)  # now the queue is full
    finished = set()
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert {rid for choices in ids for rid in choices} <= finished


def test_combined_stats_sum_counts_and_span_the_choices() -> None:
    one = GenerationStats(generated_tokens=4, target_forwards=2, elapsed_s=1.0)
    one.record_round(2, 1)
    two = GenerationStats(generated_tokens=6, target_forwards=3, elapsed_s=2.0)
    two.time_to_first_token_s = 0.5
    two.record_round(3, 3)
    combined = combined_stats([one, two], prompt_tokens=9)
    assert combined.generated_tokens == 10 and combined.target_forwards == 7
    assert combined.proposed_per_position == [2, 2, 1]
    assert combined.accepted_per_position == [2, 1, 1]
    assert combined.elapsed_s == 2.0 and combined.time_to_first_token_s == 0.5
    assert combined.prompt_tokens == 9
