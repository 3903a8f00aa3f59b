"""The prefix cache across requests: reuse is exact, bounded, and off when asked."""

from __future__ import annotations

import pytest

from hybridspec import Engine, EngineConfig, GenerationParams
from hybridspec.engine.prefix_cache import kv_bytes_per_token, num_slots_for
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers import NoProposer
from tests.engine.tiny import make_engine, tiny_loaded

SYSTEM = [3, 9, 14, 2, 27, 5, 11, 40, 8, 19, 33, 6, 21, 12, 30, 7, 25, 16]


@pytest.fixture(scope="module")
def exact_target() -> LoadedModel:
    """A bfloat16 target on the block kernel: row-invariant, as a GGUF model runs by default, so
    that a token's keys and values are the same bits whether it was decoded or prefilled."""
    return tiny_loaded(0, quantize_bits=8)


def run(engine: Engine, prompt: list[int], proposer: str, **options: object) -> tuple:
    result = engine.generate(
        prompt_token_ids=prompt,
        proposer=proposer,
        max_new_tokens=24,
        logprobs=2,
        ignore_eos=True,
        **options,  # type: ignore[arg-type]
    )
    assert result.logprobs is not None
    return result.token_ids, result.logprobs, result.stats.cached_tokens


def conversation(engine: Engine, proposer: str, turns: int = 3, **options: object) -> list:
    """Turns of a conversation: each prompt is the last prompt, its answer and a new message."""
    prompt, outputs = list(SYSTEM), []
    for turn in range(turns):
        tokens, logprobs, cached = run(engine, prompt, proposer, **options)
        outputs.append((tokens, logprobs.logprobs.tolist(), cached))
        prompt = prompt + tokens + [turn + 41, 17, turn + 2]
    return outputs


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_cached_turns_equal_cold_ones(
    exact_target: LoadedModel, draft: LoadedModel, proposer: str
) -> None:
    cold = conversation(make_engine(exact_target, draft, prefix_cache_mb=0), proposer)
    warm = conversation(make_engine(exact_target, draft, prefix_cache_mb=64), proposer)
    assert [t for t, _, _ in warm] == [t for t, _, _ in cold]
    assert [lp for _, lp, _ in warm] == [lp for _, lp, _ in cold]
    assert [c for _, _, c in cold] == [0, 0, 0]
    # Turn 2 reuses turn 1's prompt and answer but the answer's last token (never fed).
    assert warm[0][2] == 0 and warm[1][2] == len(SYSTEM) + 24 - 1
    assert warm[2][2] > warm[1][2]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_seeded_sampled_text_equals_a_cold_request(
    exact_target: LoadedModel, draft: LoadedModel, proposer: str
) -> None:
    sampling = {"temperature": 0.9, "seed": 5}
    cold = conversation(make_engine(exact_target, draft, prefix_cache_mb=0), proposer, **sampling)
    warm = conversation(make_engine(exact_target, draft, prefix_cache_mb=64), proposer, **sampling)
    assert [t for t, _, _ in warm] == [t for t, _, _ in cold]


def test_cache_prompt_false_neither_reads_nor_leaves(target: LoadedModel) -> None:
    engine = make_engine(target, prefix_cache_mb=64)
    run(engine, [*SYSTEM, 1], "none", cache_prompt=False)
    assert engine.prefix_cache.stats().num_entries == 0
    run(engine, [*SYSTEM, 1], "none")
    assert run(engine, [*SYSTEM, 2], "none", cache_prompt=False)[2] == 0
    assert run(engine, [*SYSTEM, 2], "none")[2] == len(SYSTEM)


def test_prompt_logprobs_prefill_everything(target: LoadedModel) -> None:
    engine = make_engine(target, prefix_cache_mb=64)
    run(engine, [*SYSTEM, 1], "none")
    params = GenerationParams(max_new_tokens=4, proposer="none", prompt_logprobs=1)
    result = engine.generate(prompt_token_ids=[*SYSTEM, 2], params=params)
    assert result.stats.cached_tokens == 0
    assert result.prompt_logprobs is not None
    assert len(result.prompt_logprobs.token_ids) == len(SYSTEM)


def test_entries_are_evicted_least_recent_first_and_slots_never_leak(
    target: LoadedModel,
) -> None:
    # 2048 tokens of 512 bytes (2 layers, 2 heads of 16, float32 keys and values): 1 MiB a slot.
    engine = make_engine(target, max_num_seqs=2, max_seq_len=2048, prefix_cache_mb=2)
    cache = engine.prefix_cache
    assert cache.num_slots == 2 and engine.runtime.max_num_seqs == 4
    for first in (50, 51, 52):
        run(engine, [first, *SYSTEM], "none")
    assert cache.stats().num_entries == 2
    assert cache.stats().evicted_tokens == len(SYSTEM) + 24  # the first, least recent
    assert run(engine, [50, *SYSTEM, 1], "none")[2] == 0
    assert run(engine, [52, *SYSTEM, 1], "none")[2] == len(SYSTEM) + 1
    # A full batch and a waiting request, then nothing running: only the entries hold slots.
    for first in (60, 61, 62):
        engine.add_request([first, 1, 2], GenerationParams(max_new_tokens=3))
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_slots() == 2
    held = engine.runtime.max_num_seqs - engine.runtime.num_free_slots()
    assert held == cache.stats().num_entries == 2


def test_the_matching_entry_is_taken_over_when_no_slot_is_free(target: LoadedModel) -> None:
    engine = make_engine(target, max_num_seqs=1, max_seq_len=2048, prefix_cache_mb=1)
    tokens = run(engine, SYSTEM, "none")[0]
    cache = engine.prefix_cache
    busy = engine.runtime.allocate()  # the runtime's other slot: none is free now
    slot, cached = cache.allocate([*SYSTEM, *tokens[:5], 1])
    assert cached == len(SYSTEM) + 5 and engine.runtime.seq_len(slot) == cached
    assert slot != busy and cache.stats().num_entries == 0
    assert cache.stats().evicted_tokens == len(tokens) - 1 - 5


def test_an_entry_extended_by_a_later_one_is_dropped(target: LoadedModel) -> None:
    engine = make_engine(target, prefix_cache_mb=64)
    outputs = conversation(engine, "none", turns=4)
    assert engine.prefix_cache.stats().num_entries == 1
    assert outputs[3][2] > 0


def test_off_when_the_budget_is_zero(target: LoadedModel) -> None:
    engine = make_engine(target, prefix_cache_mb=0)
    assert engine.runtime.max_num_seqs == engine.max_num_seqs
    assert conversation(engine, "none", turns=2)[1][2] == 0


def test_the_budget_buys_whole_slots() -> None:
    assert num_slots_for(1, 1024, 512) == 2  # 1 MiB of 512 KiB slots
    assert num_slots_for(0, 1024, 512) == 0
    assert num_slots_for(10**6, 1, 1) == 64


def test_bad_settings_raise_naming_the_field() -> None:
    with pytest.raises(ValueError, match="cache_prompt"):
        GenerationParams(cache_prompt=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        EngineConfig(prefix_cache_mb=-1)


class _ReadsFeatures(NoProposer):
    feature_layers = (-1,)


def test_a_proposer_reading_features_prefills_everything(exact_target: LoadedModel) -> None:
    engine = make_engine(exact_target, prefix_cache_mb=64)
    engine.register_proposer("features", _ReadsFeatures)
    run(engine, SYSTEM, "none")
    tokens, _, cached = run(engine, [*SYSTEM, 1], "features")
    assert cached == 0
    assert tokens == run(make_engine(exact_target, prefix_cache_mb=0), [*SYSTEM, 1], "none")[0]


def test_choices_share_a_cached_prefix(exact_target: LoadedModel) -> None:
    def choices(engine: Engine) -> list[list[int]]:
        run(engine, SYSTEM, "none")
        results = engine.generate_choices(
            prompt_token_ids=[*SYSTEM, 1], n=3, max_new_tokens=12, temperature=0.9, seed=7
        )
        return [r.token_ids for r in results]

    warm = make_engine(exact_target, prefix_cache_mb=64)
    assert choices(warm) == choices(make_engine(exact_target, prefix_cache_mb=0))
    assert warm.prefix_cache.stats().hit_tokens >= len(SYSTEM)


def test_a_next_turn_takes_the_entry_over_without_a_copy(
    exact_target: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(exact_target, prefix_cache_mb=64)
    copies: list[tuple[int, int, int]] = []
    copy_prefix = engine.runtime.copy_prefix
    monkeypatch.setattr(
        engine.runtime, "copy_prefix", lambda *a: copies.append(a) or copy_prefix(*a)
    )
    tokens = run(engine, SYSTEM, "none")[0]
    cache = engine.prefix_cache
    (entry,) = cache._entries
    slot, cached = cache.allocate([*SYSTEM, *tokens, 1, 2])  # the next turn
    assert (slot, cached) == (entry.slot, len(SYSTEM) + len(tokens) - 1)
    assert engine.runtime.seq_len(slot) == cached and copies == []
    assert cache.stats().num_entries == 0 and cache.stats().hit_tokens == cached
    cache.release(slot, [*SYSTEM, *tokens, 1, 2], retain=True)
    # A partial match (a regenerated turn: the same prompt) copies and keeps the entry.
    slot, cached = cache.allocate([*SYSTEM, 1])
    assert cached == len(SYSTEM) and slot != entry.slot and len(copies) == 1
    assert cache.stats().num_entries == 1


def test_stats_count_the_memory_the_entries_hold(exact_target: LoadedModel) -> None:
    engine = make_engine(exact_target, max_seq_len=2048, prefix_cache_mb=64)
    cache = engine.prefix_cache
    assert cache.stats().resident_bytes == 0
    run(engine, SYSTEM, "none")
    run(engine, [51, *SYSTEM], "none")
    slots = [entry.slot for entry in cache._entries]
    held = cache.stats().resident_bytes
    assert len(slots) == 2 and held == sum(map(engine.runtime.resident_bytes, slots)) > 0
    # Whole pages, at least one per key row of each slot; never more than whole slots.
    assert held <= len(slots) * kv_bytes_per_token(exact_target) * 2048
    engine.reset()
    assert cache.stats().resident_bytes == 0 and cache.stats().lookups == 0
