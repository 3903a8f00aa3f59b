"""The ngram kernels: FNV-1a keys, exact window tables, proposals equal to the plain reference,
and compiled kernels cached on disk."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridspec.config import NgramConfig
from hybridspec.proposers import ngram_kernels as kernels
from hybridspec.proposers.ngram_reference import NgramCounts, ngram_counts, reference_proposal
from hybridspec.proposers.ngram_tables import packed, plain_token_ids
from tests.proposers.ngram_helpers import (
    REPO_ROOT,
    commit,
    is_sound,
    make_proposer,
    propose_one,
    request,
)


def fnv1a_64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % (1 << 64)
    return h


def smallest_power_of_two_at_least(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def table_contents(
    tables: kernels.NgramTables, slot: int, order: int, min_order: int
) -> NgramCounts:
    """The LIVE entries of one table as the reference's counts, checking their keys on the way."""
    o, window = order - min_order, tables.history.shape[1]
    contents: NgramCounts = {}
    for index in np.flatnonzero(tables.state[slot, o] == kernels.LIVE):
        last_pos = int(tables.last_pos[slot, o, index])
        context = [int(tables.history[slot, p % window]) for p in range(last_pos - order, last_pos)]
        key = kernels.fnv1a_context(order, np.array(context, np.int64), 0)
        assert tables.keys[slot, o, index] == key
        continuations = contents.setdefault(tuple(context), {})
        next_token = int(tables.next_token_ids[slot, o, index])
        assert next_token not in continuations, "one entry per (context, next token)"
        continuations[next_token] = (int(tables.counts[slot, o, index]), last_pos)
    return contents


def assert_tables_exact(tables: kernels.NgramTables, token_ids: list[int], config: NgramConfig):
    capacity = config.table_capacity
    for order in range(config.min_order, config.max_order + 1):
        o = order - config.min_order
        assert table_contents(tables, 0, order, config.min_order) == ngram_counts(
            token_ids, order, config.window
        )
        states = tables.state[0, o]
        assert tables.num_tombstones[0, o] == np.count_nonzero(states == kernels.TOMBSTONE)
        assert tables.num_used[0, o] == np.count_nonzero(states != kernels.EMPTY)
        assert tables.num_used[0, o] <= capacity // 2


# --- hashing -------------------------------------------------------------------------------


def test_fnv1a_helper_matches_published_vectors():
    assert fnv1a_64(b"") == 0xCBF29CE484222325
    assert fnv1a_64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a_64(b"foobar") == 0x85944171F73967E8


@pytest.mark.parametrize(
    "order, context", [(1, [0]), (2, [5, 7]), (3, [9, 5, 7]), (4, [2**31 - 1, 256, 65536, 1])]
)
def test_kernel_hash_is_fnv1a_of_order_byte_then_token_bytes(order, context):
    data = bytes([order]) + b"".join(t.to_bytes(4, "little") for t in context)
    buffer = np.array([123, *context], np.int64)  # the context starts at index 1
    assert int(kernels.fnv1a_context(order, buffer, 1)) == fnv1a_64(data)


def test_docstring_worked_example_of_the_layout():
    key = int(kernels.fnv1a_context(2, np.array([5, 7], np.int64), 0))
    assert key == 0xD1CDFE027291CB37
    assert key & (16384 - 1) == 2871
    token_ids = [5, 7, 9] + [1] * 35 + [5, 7, 2]  # 9 at position 2, 2 at position 40
    tables = kernels.allocate_tables(1, num_orders=3, capacity=16384, window=512)
    kernels.seed_slot(tables, 2, 0, np.array(token_ids, np.int64))
    assert table_contents(tables, 0, 2, 2)[(5, 7)] == {9: (1, 2), 2: (1, 40)}


def test_hash_collision_is_caught_by_reading_the_context_back():
    tables = kernels.allocate_tables(1, num_orders=1, capacity=64, window=16)
    kernels.seed_slot(tables, 2, 0, np.array([5, 7, 9, 3, 5, 7], np.int64))  # "5 7 -> 9" once
    # Forge, on the probe path of "5 7", an entry with its key but whose stored occurrence is
    # "9 3 -> 5" at position 4: what a full 64-bit collision of "9 3" with "5 7" would look like.
    key = kernels.fnv1a_context(2, np.array([5, 7], np.int64), 0)
    index = int(key) & 63
    while tables.state[0, 0, index] != kernels.EMPTY:
        index = (index + 1) & 63
    tables.keys[0, 0, index], tables.next_token_ids[0, 0, index] = key, 42
    tables.counts[0, 0, index], tables.last_pos[0, 0, index] = 5, 4
    tables.state[0, 0, index] = kernels.LIVE
    tables.num_used[0, 0] += 1
    out_token_ids, out_num_tokens = np.empty((1, 1), np.int64), np.empty(1, np.int64)
    slots, ks = np.zeros(1, np.int64), np.ones(1, np.int64)
    no_prefix = (np.zeros((1, 1), np.int64), np.zeros(1, np.int64))
    for copy in (True, False):  # not the forged entry: likelier (42) and more recent (at 4)
        kernels.propose_batch(tables, 2, copy, slots, ks, *no_prefix, out_token_ids, out_num_tokens)
        assert out_token_ids[0, : out_num_tokens[0]].tolist() == [9]


# --- kernels against the reference ---------------------------------------------------------


@st.composite
def streams(draw, max_window: int = 40):
    min_order = draw(st.integers(1, 3))
    max_order = draw(st.integers(min_order, 4))
    window = draw(st.integers(max_order + 1, max_window))
    vocab = draw(st.integers(2, 5))
    tokens = st.integers(0, vocab - 1)
    prompt = draw(st.lists(tokens, max_size=60))
    chunks = draw(st.lists(st.lists(tokens, min_size=1, max_size=9), max_size=12))
    return min_order, max_order, window, prompt, chunks


@settings(max_examples=200, deadline=None)
@given(streams())
def test_tables_hold_exactly_the_window_counts_when_capacity_is_4x_window(stream):
    min_order, max_order, window, prompt, chunks = stream
    # Small enough that tombstones pile up and tables are rebuilt often, never overflowing.
    config = NgramConfig(min_order, max_order, window, smallest_power_of_two_at_least(4 * window))
    tables = kernels.allocate_tables(1, max_order - min_order + 1, config.table_capacity, window)
    kernels.seed_slot(tables, min_order, 0, np.array(prompt, np.int64))
    token_ids = list(prompt)
    assert_tables_exact(tables, token_ids, config)
    for chunk in chunks:
        kernels.append_tokens(tables, min_order, 0, np.array(chunk, np.int64))
        token_ids += chunk
        assert_tables_exact(tables, token_ids, config)


def test_evictions_trigger_rebuilds_and_tables_stay_exact():
    config = NgramConfig(min_order=2, max_order=3, window=8, table_capacity=32)
    tables = kernels.allocate_tables(1, 2, 32, 8)
    token_ids = np.random.default_rng(0).integers(0, 6, 400).tolist()
    kernels.seed_slot(tables, 2, 0, np.array(token_ids[:5], np.int64))
    num_rebuilds = 0
    for end in range(6, len(token_ids) + 1):
        used_before = tables.num_used[0].copy()
        kernels.append_tokens(tables, 2, 0, np.array(token_ids[end - 1 : end], np.int64))
        num_rebuilds += int(np.sum(tables.num_used[0] < used_before))  # only a rebuild shrinks it
        assert_tables_exact(tables, token_ids[:end], config)
    assert num_rebuilds >= 10


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), max_size=12), min_size=1, max_size=4))
def test_a_batch_learns_as_each_slot_alone(chunks):
    """``append_batch`` over slots with ``packed``'s arguments leaves the tables as
    ``append_tokens`` slot by slot does (an empty chunk included)."""
    window, capacity = 8, 32
    alone = kernels.allocate_tables(len(chunks), 2, capacity, window)
    batched = kernels.allocate_tables(len(chunks), 2, capacity, window)
    for tables in (alone, batched):
        for slot in range(len(chunks)):
            kernels.seed_slot(tables, 2, slot, np.array([1, 2, 3], np.int64))
    for slot, chunk in enumerate(chunks):
        kernels.append_tokens(alone, 2, slot, np.array(chunk, np.int64))
    order = list(reversed(range(len(chunks))))  # slots in any order
    kernels.append_batch(batched, 2, *packed([(slot, chunks[slot]) for slot in order]))
    for a, b in zip(alone, batched, strict=True):
        np.testing.assert_array_equal(a, b)


def test_plain_token_ids_takes_only_a_list_of_ints_in_range():
    assert plain_token_ids([0, 4], 5) == [0, 4]
    assert plain_token_ids([], 5) == []
    for other in ([5], [-1], [1.0], [True], (1, 2), np.array([1]), [np.int64(1)]):
        assert plain_token_ids(other, 5) is None


@st.composite
def scenarios(draw):
    min_order, max_order, window, _, _ = draw(streams())
    capacity = draw(st.sampled_from([1 << 14, smallest_power_of_two_at_least(4 * window)]))
    continuation = draw(st.sampled_from(["copy", "frequency"]))
    config = NgramConfig(min_order, max_order, window, capacity, continuation)
    tokens = st.integers(0, draw(st.integers(2, 5)) - 1)
    prompts = draw(st.lists(st.lists(tokens, max_size=50), min_size=1, max_size=3))
    # Each round: per sequence, the K to propose, the drafts chosen before the proposer
    # (``draft_prefix``), then the tokens to commit.
    step = st.tuples(st.integers(0, 16), st.lists(tokens, max_size=4), st.lists(tokens, max_size=9))
    num_seqs = len(prompts)
    rounds = draw(st.lists(st.lists(step, min_size=num_seqs, max_size=num_seqs), max_size=10))
    return config, prompts, rounds


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_proposals_equal_the_reference(scenario):
    # Capacity >= 4 * window, so no occurrence is dropped, and a matching 64-bit key is confirmed
    # against the tokens in the ring: hash collisions cannot change a proposal.
    config, prompts, rounds = scenario
    proposer = make_proposer(config)
    histories = [list(prompt) for prompt in prompts]
    for seq_id, prompt in enumerate(prompts):
        proposer.start(seq_id, prompt)
    for steps in [[(16, [], [])] * len(prompts), *rounds]:
        requests = [
            request(i, history, k, prefix)
            for i, (history, (k, prefix, _)) in enumerate(zip(histories, steps, strict=True))
        ]
        proposals = proposer.propose(requests)
        for history, (k, prefix, _), proposal in zip(histories, steps, proposals, strict=True):
            assert list(proposal.token_ids) == reference_proposal(history, k, config, prefix)
        for seq_id, (_, _, committed) in enumerate(steps):
            commit(proposer, seq_id, committed, num_accepted=0)
            histories[seq_id] += committed


@settings(max_examples=150, deadline=None)
@given(streams(max_window=120), st.integers(0, 16), st.sampled_from(["copy", "frequency"]))
def test_full_tables_still_give_sound_proposals(stream, k, continuation):
    min_order, max_order, window, prompt, chunks = stream
    config = NgramConfig(min_order, max_order, window, 16, continuation)
    proposer = make_proposer(config)
    proposer.start(7, prompt)
    history = list(prompt)
    for chunk in [[], *chunks]:
        commit(proposer, 7, chunk, num_accepted=len(chunk))
        history += chunk
        proposal = propose_one(proposer, 7, history, k)
        assert len(proposal) <= k
        assert is_sound(history, proposal, config)


# --- scenarios -----------------------------------------------------------------------------


def test_kernels_load_from_disk_cache_in_a_new_process():
    kernels.warmup()  # compiled or loaded here, so the cache files exist
    package = REPO_ROOT / "hybridspec"
    code = (
        "import sys, types\n"
        # Bare parent packages: the kernels need numpy and numba only, not torch and the engine.
        f"for name, path in [('hybridspec', {str(package)!r}),"
        f" ('hybridspec.proposers', {str(package / 'proposers')!r})]:\n"
        "    sys.modules[name] = types.ModuleType(name)\n"
        "    sys.modules[name].__path__ = [path]\n"
        "from hybridspec.proposers import ngram_kernels as k\n"
        "k.warmup()\n"
        "fs = (k.seed_slot, k.append_tokens, k.append_batch, k.propose_batch)\n"
        "print(sum(sum(f.stats.cache_misses.values()) for f in fs),"
        " sum(sum(f.stats.cache_hits.values()) for f in fs))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    misses, hits = map(int, result.stdout.split()[-2:])
    assert (misses, hits) == (0, 4)
