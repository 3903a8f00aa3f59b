"""The prefix cache across requests: reuse is exact, bounded, and off when asked."""

from __future__ import annotations

import pytest
import torch

from hybridspec import Engine, EngineConfig, GenerationParams
from hybridspec.config import EagleConfig
from hybridspec.engine.prefix_cache import kv_bytes_per_token, num_slots_for
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers import NoProposer
from hybridspec.proposers.base import ProposerContext
from hybridspec.types import CommitInfo
from tests.engine.tiny import make_engine, tiny_loaded
from tests.model.test_kv_cache_memory import PAGE, resident_pages
from tests.proposers.eagle_helpers import random_head, use_head

FREE_HEAD = EagleConfig(cost_per_token=0.0)  # the tiny head costs what the tiny target does
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
    return result.token_ids, result.logprobs, result.stats.cached_tokens, result.stats


def conversation(engine: Engine, proposer: str, turns: int = 3, **options: object) -> list:
    """Turns of a conversation: each prompt is the last prompt, its answer and a new message."""
    prompt, outputs = list(SYSTEM), []
    for turn in range(turns):
        tokens, logprobs, cached, stats = run(engine, prompt, proposer, **options)
        drafts = (stats.draft_tokens_proposed, stats.draft_tokens_accepted)
        outputs.append((tokens, logprobs.logprobs.tolist(), cached, drafts))
        prompt = prompt + tokens + [turn + 41, 17, turn + 2]
    return outputs


def engine_for(target: LoadedModel, draft: LoadedModel, proposer: str, cache_mb: int) -> Engine:
    """An engine for ``proposer``: ``eagle`` and ``hybrid`` draft with a random head (the
    eagle tests' fixture)."""
    engine = make_engine(target, draft, prefix_cache_mb=cache_mb, eagle=FREE_HEAD)
    if proposer in ("eagle", "hybrid"):
        head = random_head(target, 48)
        use_head(engine, head)
    return engine


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft", "eagle", "hybrid"])
def test_cached_turns_equal_cold_ones(
    exact_target: LoadedModel, draft: LoadedModel, proposer: str
) -> None:
    cold = conversation(engine_for(exact_target, draft, proposer, 0), proposer)
    warm = conversation(engine_for(exact_target, draft, proposer, 64), proposer)
    assert [t for t, *_ in warm] == [t for t, *_ in cold]
    assert [lp for _, lp, *_ in warm] == [lp for _, lp, *_ in cold]
    assert [c for _, _, c, _ in cold] == [0, 0, 0]
    # Turn 2 reuses turn 1's prompt and answer but the answer's last token (never fed).
    assert warm[0][2] == 0 and warm[1][2] == len(SYSTEM) + 24 - 1
    assert warm[2][2] > warm[1][2]
    # The same drafts, accepted alike: a feature-reading head got the features a cold
    # prefill computes (stale or missing ones would draft differently).
    assert [d for *_, d in warm] == [d for *_, d in cold]
    if proposer in ("eagle", "hybrid"):
        assert sum(proposed for *_, (proposed, _) in warm) > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_seeded_sampled_text_equals_a_cold_request(
    exact_target: LoadedModel, draft: LoadedModel, proposer: str
) -> None:
    sampling = {"temperature": 0.9, "seed": 5}
    cold = conversation(make_engine(exact_target, draft, prefix_cache_mb=0), proposer, **sampling)
    warm = conversation(make_engine(exact_target, draft, prefix_cache_mb=64), proposer, **sampling)
    assert [t for t, *_ in warm] == [t for t, *_ in cold]


def test_cache_prompt_false_neither_reads_nor_leaves(target: LoadedModel) -> None:
    engine = make_engine(target, prefix_cache_mb=64)
    run(engine, [*SYSTEM, 1], "none", cache_prompt=False)
    assert engine.prefix_cache.stats().num_entries == 0
    run(engine, [*SYSTEM, 1], "none")
    assert run(engine, [*SYSTEM, 2], "none", cache_prompt=False)[2] == 0
    assert run(engine, [*SYSTEM, 2], "none")[2] == len(SYSTEM)


def test_a_request_reads_only_its_own_scopes_entries(target: LoadedModel) -> None:
    """Counted hits: a scope's entry serves its own scope's next request, never another's, and
    the text is the same either way."""
    engine = make_engine(target, prefix_cache_mb=64)
    tokens, _, _, _ = run(engine, [*SYSTEM, 1], "none", cache_scope="A")
    other, _, cached, _ = run(engine, [*SYSTEM, 1], "none", cache_scope="B")
    assert cached == 0 and other == tokens
    assert run(engine, [*SYSTEM, 1], "none")[2] == 0  # the shared scope is a scope too
    assert run(engine, [*SYSTEM, 2], "none", cache_scope="A")[2] == len(SYSTEM)
    assert run(engine, [*SYSTEM, 2], "none", cache_scope="B")[2] == len(SYSTEM)


def test_prompt_logprobs_prefill_everything(target: LoadedModel) -> None:
    engine = make_engine(target, prefix_cache_mb=64)
    run(engine, [*SYSTEM, 1], "none")
    params = GenerationParams(max_new_tokens=4, proposer="none", prompt_logprobs=1)
    result = engine.generate(prompt_token_ids=[*SYSTEM, 2], params=params)
    assert result.stats.cached_tokens == 0
    assert result.prompt_logprobs is not None
    assert len(result.prompt_logprobs.token_ids) == len(SYSTEM)


def test_entries_are_evicted_least_recent_first_and_slots_never_leak(
    exact_target: LoadedModel,
) -> None:
    # Transposed bfloat16 keys, 2048 positions: a key row is a page, so an entry of under 128
    # tokens holds 64 pages of keys (2 layers x 2 heads x 16 rows) and 4 of values.
    engine = make_engine(exact_target, max_num_seqs=2, max_seq_len=2048, prefix_cache_mb=1)
    cache = engine.prefix_cache
    entry_bytes = 68 * PAGE
    cache.budget_bytes = 2 * entry_bytes + entry_bytes // 2
    for first in (50, 51, 52):
        run(engine, [first, *SYSTEM], "none")
        assert cache.stats().resident_bytes <= cache.budget_bytes
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


def test_the_keys_and_values_resident_stay_within_the_budget(exact_target: LoadedModel) -> None:
    """What the cache charges is what the process holds, to the page (``mincore``), and it
    stays within the budget however many different requests come: free slots give their pages
    back, then the least recent entries go."""
    engine = make_engine(exact_target, max_num_seqs=2, max_seq_len=2048, prefix_cache_mb=1)
    cache = engine.prefix_cache
    kv = engine.runtime._cache  # type: ignore[attr-defined]
    slots = range(engine.runtime.max_num_seqs)
    for first in range(40, 52):
        prompt = [first, *SYSTEM] * (1 + first % 3)
        run(engine, prompt, "none", cache_prompt=first % 4 != 0)
        held = sum(map(engine.runtime.resident_bytes, slots))  # type: ignore[attr-defined]
        assert held == cache.stats().resident_bytes <= cache.budget_bytes == 2**20
        assert held == (resident_pages(kv.keys) + resident_pages(kv.values)) * PAGE
    assert 2 <= cache.stats().num_entries < cache.num_slots
    assert cache.stats().evicted_tokens > 0


def test_the_matching_entry_is_taken_over_when_no_slot_is_free(target: LoadedModel) -> None:
    engine = make_engine(target, max_num_seqs=1, max_seq_len=2048, prefix_cache_mb=1)
    tokens = run(engine, SYSTEM, "none")[0]
    cache = engine.prefix_cache
    busy = [engine.runtime.allocate() for _ in range(engine.runtime.num_free_slots())]
    allocation = cache.allocate([*SYSTEM, *tokens[:5], 1])
    slot, cached = allocation.slot, allocation.num_cached
    assert cached == len(SYSTEM) + 5 and engine.runtime.seq_len(slot) == cached
    assert slot not in busy and cache.stats().num_entries == 0
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


def test_the_budget_bounds_the_virtual_slots() -> None:
    # 1 MiB of 512-byte tokens: 2048 one-token entries could fill it, but the lookup scans 64.
    assert num_slots_for(1, 512, 1024, None) == 64
    assert num_slots_for(1, 2**19, 1024, None) == 2  # entries of at least 512 KiB
    assert num_slots_for(0, 1024, 512, None) == 0
    # Their address space stays within the machine's memory: 3 slots of 512 KiB in 1.5 MiB.
    assert num_slots_for(10**6, 512, 1024, 3 * 2**19) == 3


def test_bad_settings_raise_naming_the_field() -> None:
    with pytest.raises(ValueError, match="cache_prompt"):
        GenerationParams(cache_prompt=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        EngineConfig(prefix_cache_mb=-1)


class _ReadsFeatures(NoProposer):
    """Records the features each commit hands it: (position of the first row, rows)."""

    feature_layers = (-1, 0)

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.handed: list[tuple[int, torch.Tensor]] = []

    def commit(self, info: CommitInfo) -> None:
        assert info.hidden_states is not None
        self.handed.append((info.hidden_position, info.hidden_states.clone()))


def features_of(engine: Engine, prompt: list[int]) -> tuple[list[int], torch.Tensor, int, int]:
    """A request's tokens, the rows of every position its proposer got, its cached tokens and
    the position of its first row."""
    proposer = engine.resolve_proposer("features")
    assert isinstance(proposer, _ReadsFeatures)
    proposer.handed.clear()
    tokens, _, cached, _ = run(engine, prompt, "features")
    first = position = proposer.handed[0][0]
    for start, rows in proposer.handed:  # consecutive positions, without gap or overlap
        assert start == position
        position += len(rows)
    return tokens, torch.cat([rows for _, rows in proposer.handed]), cached, first


def feature_engines(target: LoadedModel) -> tuple[Engine, Engine]:
    """Engines with the "features" proposer: without a prefix cache, and with one."""
    engines = make_engine(target, prefix_cache_mb=0), make_engine(target, prefix_cache_mb=64)
    for engine in engines:
        engine.register_proposer("features", _ReadsFeatures)
    return engines


def test_a_proposer_reading_features_gets_the_cached_positions_rows(
    exact_target: LoadedModel,
) -> None:
    cold_engine, engine = feature_engines(exact_target)
    cold_tokens, cold_rows, cold_cached, cold_first = features_of(cold_engine, [*SYSTEM, 1])
    assert cold_cached == 0 and cold_first == 0
    # Served by an entry that kept its features: the rows of every position, a cold request's.
    features_of(engine, [*SYSTEM, 1])
    tokens, rows, cached, first = features_of(engine, [*SYSTEM, 1])
    assert cached == len(SYSTEM) and first == 0 and tokens == cold_tokens
    assert rows.shape == cold_rows.shape and torch.equal(rows, cold_rows)
    # Any request reads an entry's keys and values, features or not.
    assert run(engine, [*SYSTEM, 1, 5], "none")[2] > len(SYSTEM)


def test_an_entry_without_features_serves_their_reader_from_its_first_uncached_position(
    exact_target: LoadedModel,
) -> None:
    cold_engine, engine = feature_engines(exact_target)
    cold_tokens, cold_rows, *_ = features_of(cold_engine, [*SYSTEM, 1])
    run(engine, SYSTEM, "none")  # an entry that kept no features
    tokens, rows, cached, first = features_of(engine, [*SYSTEM, 1])
    assert cached == len(SYSTEM) and first == len(SYSTEM) and tokens == cold_tokens
    assert torch.equal(rows, cold_rows[len(SYSTEM) :])
    # It kept none for its own entry either (it lacks the cached positions' rows): the next
    # reader is served from there too, the same way.
    assert features_of(engine, [*SYSTEM, 1])[2:] == (len(SYSTEM), len(SYSTEM))


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
    allocation = cache.allocate([*SYSTEM, *tokens, 1, 2])  # the next turn
    slot, cached = allocation.slot, allocation.num_cached
    assert (slot, cached) == (entry.slot, len(SYSTEM) + len(tokens) - 1)
    assert engine.runtime.seq_len(slot) == cached and copies == []
    assert cache.stats().num_entries == 0 and cache.stats().hit_tokens == cached
    cache.release(slot, [*SYSTEM, *tokens, 1, 2], retain=True)
    # A partial match (a regenerated turn: the same prompt) copies and keeps the entry.
    allocation = cache.allocate([*SYSTEM, 1])
    slot, cached = allocation.slot, allocation.num_cached
    assert cached == len(SYSTEM) and slot != entry.slot and len(copies) == 1
    assert cache.stats().num_entries == 1


def test_stats_count_the_memory_the_entries_and_free_slots_hold(
    exact_target: LoadedModel,
) -> None:
    engine = make_engine(exact_target, max_seq_len=2048, prefix_cache_mb=64)
    cache = engine.prefix_cache
    run(engine, SYSTEM, "none")
    run(engine, [51, *SYSTEM], "none")
    slots = range(engine.runtime.max_num_seqs)
    held = cache.stats().resident_bytes
    assert cache.stats().num_entries == 2
    assert held == sum(map(engine.runtime.resident_bytes, slots)) > 0  # type: ignore[attr-defined]
    # Whole pages, at least one per key row of each slot; never more than whole slots.
    assert held <= len(slots) * kv_bytes_per_token(exact_target) * 2048
    assert cache.stats().budget_bytes == 64 * 2**20
    engine.reset()
    assert cache.stats().num_entries == 0 and cache.stats().lookups == 0


@pytest.mark.parametrize("proposer", ["eagle", "hybrid"])
def test_a_head_served_by_an_entry_without_features_drafts_and_keeps_the_text(
    exact_target: LoadedModel, draft: LoadedModel, proposer: str
) -> None:
    cold = run(engine_for(exact_target, draft, proposer, 0), [*SYSTEM, 1], proposer)
    engine = engine_for(exact_target, draft, proposer, 64)
    run(engine, SYSTEM, "none")  # an entry that kept no features
    tokens, logprobs, cached, stats = run(engine, [*SYSTEM, 1], proposer)
    assert cached == len(SYSTEM) and tokens == cold[0]
    assert torch.equal(logprobs.logprobs, cold[1].logprobs)
    assert stats.draft_tokens_proposed > 0  # the head drafted from the positions it was handed
