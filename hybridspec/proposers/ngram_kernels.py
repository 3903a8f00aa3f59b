"""Compiled n-gram tables and predictor of the ``ngram`` proposer (numba nopython, disk-cached).

The semantics (window, occurrences, backoff, tie-break, chaining) are defined in
``hybridspec.proposers.ngram`` and, executably, in ``ngram_reference``; this module only makes
them fast. Every kernel works on one ``NgramTables``, a pool of per-sequence state indexed by an
internal slot, whose arrays ``ngram_tables`` allocates. The kernels stay in one module (about
370 lines) because numba compiles and caches each with the helpers it calls, and they share the
table layout described below.

Glossary of dimensions:

- ``num_slots``: sequences the pool can hold; the proposer maps each ``seq_id`` to one slot.
- ``window``: committed tokens each sequence remembers (``NgramConfig.window``).
- ``num_orders``: ``max_order - min_order + 1``; order ``n`` lives at index ``n - min_order``.
- ``capacity``: entries of one open-addressing table, a power of two (``table_capacity``).
- ``max_k``: the largest number of draft tokens requested from one batch.

Layout. Position ``p`` of a sequence (0 = first prompt token) is kept in the history ring at
column ``p % window`` while it is one of the last ``window`` positions. Each (slot, order) owns
one table of ``capacity`` entries; an entry is one (context, next token) pair of that order with
its count and the position of its latest occurrence's next token (``last_pos``). The key of an
entry is the 64-bit FNV-1a hash of its *context only*, so all continuations of a context lie on
the probe path of the same key: a lookup walks linear probing from ``key & (capacity - 1)`` up to
the first EMPTY entry and picks the best LIVE entry whose key matches. FNV-1a runs over the order
as one byte, then each token id as 4 little-endian bytes; the order is hashed too, so that equal
token runs of different orders get unrelated keys.

Worked example (order 2, context (5, 7), capacity 16384): the bytes ``02 05 00 00 00 07 00 00
00`` hash to ``0xd1cdfe027291cb37``, whose low 14 bits give home index 2871. If the window holds
``5 7 9 ... 5 7 2`` with 9 at position 2 and 2 at position 40, the order-2 table of that slot has
two LIVE entries on the probe path from 2871, both keyed ``0xd1cdfe027291cb37``: (next 9,
count 1, last_pos 2) and (next 2, count 1, last_pos 40); the lookup for context (5, 7) returns 2
(equal counts, more recent). A matching key is confirmed by reading the context back from the
ring at ``last_pos - 2, last_pos - 1``, so even a full 64-bit hash collision cannot make the
tables disagree with the reference.

Capacity. ``num_used`` (LIVE + TOMBSTONE entries) never exceeds ``capacity // 2``, so every
probe ends at an EMPTY entry. Forgetting an occurrence whose count drops to 0 leaves a
TOMBSTONE; a table at that limit with at least ``capacity // 4`` tombstones is rebuilt from the
ring. A table holds fewer than ``window`` LIVE entries, so with ``capacity >= 4 * window`` (the
default: 16384 >= 2048) a table at the limit always has enough tombstones to be rebuilt, and no
occurrence is ever dropped. With a smaller capacity an occurrence that finds no room is dropped:
proposals get worse, never wrong, since each proposed pair was still seen in the window.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hybridspec.proposers.ngram_tables import NgramTables as NgramTables  # the kernels' argument
from hybridspec.proposers.ngram_tables import allocate_tables

FNV_OFFSET_BASIS = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)

EMPTY = np.int8(0)  # never written since the slot was seeded or rebuilt: ends every probe
LIVE = np.int8(1)
TOMBSTONE = np.int8(2)  # count fell to 0: probes go on past it until the table is rebuilt


@njit(cache=True)
def fnv1a_context(order, token_ids, start):
    """FNV-1a 64 of ``order`` (1 byte), then ``token_ids[start:start+order]`` (4 LE bytes each)."""
    h = (FNV_OFFSET_BASIS ^ np.uint64(order)) * FNV_PRIME
    for i in range(start, start + order):
        t = token_ids[i]
        h = (h ^ np.uint64(t & 0xFF)) * FNV_PRIME
        h = (h ^ np.uint64((t >> 8) & 0xFF)) * FNV_PRIME
        h = (h ^ np.uint64((t >> 16) & 0xFF)) * FNV_PRIME
        h = (h ^ np.uint64((t >> 24) & 0xFF)) * FNV_PRIME
    return h


@njit(cache=True)
def _context_matches(tables, slot, o, index, order, token_ids, start):
    """Whether the context of entry ``index``, read from the ring, is ``token_ids[start:][:order]``.

    A LIVE entry's latest occurrence is inside the window, so its context is still in the ring.
    """
    window = tables.history.shape[1]
    first = tables.last_pos[slot, o, index] - order
    for j in range(order):
        if tables.history[slot, (first + j) % window] != token_ids[start + j]:
            return False
    return True


@njit(cache=True)
def _locate(tables, slot, o, order, key, ngram):
    """Probe for the entry of the n-gram ``ngram[:order + 1]`` (context, then next token).

    Returns ``(found, index)``: the entry's index if found, else the EMPTY entry ending the probe.
    """
    mask = tables.keys.shape[2] - 1
    index = np.int64(key & np.uint64(mask))
    while True:
        state = tables.state[slot, o, index]
        if state == EMPTY:
            return False, index
        if (
            state == LIVE
            and tables.keys[slot, o, index] == key
            and tables.next_token_ids[slot, o, index] == ngram[order]
            and _context_matches(tables, slot, o, index, order, ngram, 0)
        ):
            return True, index
        index = (index + 1) & mask


@njit(cache=True)
def _add_occurrence(tables, slot, o, order, ngram, pos):
    """Count one occurrence of ``ngram[:order + 1]`` whose next token is at position ``pos``."""
    key = fnv1a_context(order, ngram, 0)
    found, index = _locate(tables, slot, o, order, key, ngram)
    if found:
        tables.counts[slot, o, index] += 1
        tables.last_pos[slot, o, index] = pos
        return
    if tables.num_used[slot, o] >= tables.keys.shape[2] // 2:
        return  # full: drop the occurrence (keeps EMPTY entries to end every probe)
    tables.num_used[slot, o] += 1
    tables.keys[slot, o, index] = key
    tables.next_token_ids[slot, o, index] = ngram[order]
    tables.counts[slot, o, index] = 1
    tables.last_pos[slot, o, index] = pos
    tables.state[slot, o, index] = LIVE


@njit(cache=True)
def _remove_occurrence(tables, slot, o, order, ngram):
    """Uncount the oldest occurrence of ``ngram[:order + 1]``; a dropped one is not found."""
    key = fnv1a_context(order, ngram, 0)
    found, index = _locate(tables, slot, o, order, key, ngram)
    if found:
        tables.counts[slot, o, index] -= 1
        if tables.counts[slot, o, index] == 0:
            tables.state[slot, o, index] = TOMBSTONE
            tables.num_tombstones[slot, o] += 1


@njit(cache=True)
def _gather(tables, slot, first_pos, length, out):
    """``out[:length]`` = the tokens at positions ``first_pos .. first_pos + length - 1``."""
    window = tables.history.shape[1]
    for j in range(length):
        out[j] = tables.history[slot, (first_pos + j) % window]


@njit(cache=True)
def _rebuild(tables, slot, o, order, first_pos, end_pos, ngram):
    """Refill one table from the occurrences inside positions ``[first_pos, end_pos)``."""
    tables.state[slot, o, :] = EMPTY
    tables.num_used[slot, o] = 0
    tables.num_tombstones[slot, o] = 0
    for pos in range(first_pos + order, end_pos):
        _gather(tables, slot, pos - order, order + 1, ngram)
        _add_occurrence(tables, slot, o, order, ngram, pos)


@njit(cache=True)
def _forget_oldest(tables, min_order, slot, ngram):
    """Slide the window by one: uncount the occurrences whose context starts at ``L - window``."""
    window = tables.history.shape[1]
    num_orders, capacity = tables.keys.shape[1], tables.keys.shape[2]
    length = tables.num_tokens[slot]
    oldest = length - window
    for o in range(num_orders):
        order = min_order + o
        _gather(tables, slot, oldest, order + 1, ngram)
        _remove_occurrence(tables, slot, o, order, ngram)
        if (
            tables.num_used[slot, o] >= capacity // 2
            and tables.num_tombstones[slot, o] >= capacity // 4
        ):
            _rebuild(tables, slot, o, order, oldest + 1, length, ngram)


@njit(cache=True)
def _learn(tables, min_order, slot, token_id, first_pos, ngram):
    """Append ``token_id`` at position L, counting its occurrences whose context is held.

    Positions before ``first_pos`` are not in the ring (a seeded prompt's cut-off start).
    """
    window = tables.history.shape[1]
    length = tables.num_tokens[slot]
    tables.history[slot, length % window] = token_id
    for o in range(tables.keys.shape[1]):
        order = min_order + o
        if length - order >= first_pos:
            _gather(tables, slot, length - order, order + 1, ngram)
            _add_occurrence(tables, slot, o, order, ngram, length)
    tables.num_tokens[slot] = length + 1


@njit(cache=True)
def seed_slot(tables, min_order, slot, prompt_token_ids):
    """Reset ``slot`` and learn the prompt; only its last ``window`` tokens are kept."""
    window = tables.history.shape[1]
    max_order = min_order + tables.keys.shape[1] - 1
    tables.state[slot, :, :] = EMPTY
    tables.num_used[slot, :] = 0
    tables.num_tombstones[slot, :] = 0
    first_pos = max(0, len(prompt_token_ids) - window)
    tables.num_tokens[slot] = first_pos
    ngram = np.empty(max_order + 1, np.int64)
    for pos in range(first_pos, len(prompt_token_ids)):
        _learn(tables, min_order, slot, prompt_token_ids[pos], first_pos, ngram)


@njit(cache=True)
def append_tokens(tables, min_order, slot, token_ids):
    """Learn committed ``token_ids`` of ``slot``, forgetting what slides out of the window."""
    window = tables.history.shape[1]
    max_order = min_order + tables.keys.shape[1] - 1
    ngram = np.empty(max_order + 1, np.int64)
    for token_id in token_ids:
        length = tables.num_tokens[slot]
        if length >= window:
            _forget_oldest(tables, min_order, slot, ngram)
        _learn(tables, min_order, slot, token_id, max(0, length + 1 - window), ngram)


@njit(cache=True)
def append_batch(tables, min_order, slots, token_ids, offsets):
    """``append_tokens`` for several slots in one call: ``slots[i]`` learns
    ``token_ids[offsets[i] : offsets[i + 1]]`` (a call costs more than a round's few tokens)."""
    for i in range(len(slots)):
        append_tokens(tables, min_order, slots[i], token_ids[offsets[i] : offsets[i + 1]])


@njit(cache=True)
def _best_next_token(tables, slot, o, order, context, start, by_count):
    """``(found, token, pos)``: the context's best continuation and its latest position.

    ``by_count``: the most frequent, then most recent ("frequency"); otherwise the most recent
    alone, i.e. the context's latest occurrence ("copy").
    """
    mask = tables.keys.shape[2] - 1
    key = fnv1a_context(order, context, start)
    index = np.int64(key & np.uint64(mask))
    best_token, best_count, best_pos = 0, 0, np.int64(-1)
    while tables.state[slot, o, index] != EMPTY:
        if (
            tables.state[slot, o, index] == LIVE
            and tables.keys[slot, o, index] == key
            and _context_matches(tables, slot, o, index, order, context, start)
        ):
            count = tables.counts[slot, o, index] if by_count else 1
            pos = tables.last_pos[slot, o, index]
            if count > best_count or (count == best_count and pos > best_pos):
                best_token = tables.next_token_ids[slot, o, index]
                best_count, best_pos = count, pos
        index = (index + 1) & mask
    return best_count > 0, best_token, best_pos


@njit(cache=True)
def _load_context(tables, min_order, slot, context, prefix, num_prefix):
    """``context[:n]`` = the last ``n = min(L + num_prefix, max_order)`` tokens of the committed
    ones followed by ``prefix[:num_prefix]`` (drafts chosen before the proposer, which it
    continues); returns (L, n). Example: committed ``... 4 5``, prefix ``[6]``, max_order 3:
    the context is ``4 5 6``."""
    window = tables.history.shape[1]
    max_order = min_order + tables.keys.shape[1] - 1
    length = tables.num_tokens[slot]
    total = length + num_prefix
    num_context = min(total, max_order)
    for j in range(num_context):
        pos = total - num_context + j
        if pos < length:
            context[j] = tables.history[slot, pos % window]
        else:
            context[j] = prefix[pos - length]
    return length, num_context


@njit(cache=True)
def _copy_one(tables, min_order, slot, num_drafts, context, prefix, num_prefix, out):
    """Copy what followed the latest occurrence of the longest matching context into ``out``."""
    window = tables.history.shape[1]
    length, num_context = _load_context(tables, min_order, slot, context, prefix, num_prefix)
    if num_drafts == 0:
        return 0
    for order in range(num_context, min_order - 1, -1):
        found, _, pos = _best_next_token(
            tables, slot, order - min_order, order, context, num_context - order, False
        )
        if found:
            # Positions pos .. length - 1 are committed and inside the window: the occurrence's
            # context, which starts before pos, is.
            num = min(num_drafts, length - pos)
            for j in range(num):
                out[j] = tables.history[slot, (pos + j) % window]
            return num
    return 0


@njit(cache=True)
def _propose_one(tables, min_order, slot, num_drafts, context, prefix, num_prefix, out):
    """Chain up to ``num_drafts`` predictions into ``out``; returns how many were made."""
    max_order = min_order + tables.keys.shape[1] - 1
    # context[:num_context] = the last max_order committed (and prefix) tokens, then the
    # predictions so far.
    _, num_context = _load_context(tables, min_order, slot, context, prefix, num_prefix)
    for k in range(num_drafts):
        found, token = False, 0
        for order in range(min(max_order, num_context), min_order - 1, -1):
            found, token, _ = _best_next_token(
                tables, slot, order - min_order, order, context, num_context - order, True
            )
            if found:
                break
        if not found:
            return k
        out[k] = token
        context[num_context] = token
        num_context += 1
    return num_drafts


@njit(cache=True)
def propose_batch(
    tables,
    min_order,
    copy,
    slots,
    num_drafts,
    prefixes,
    prefix_lengths,
    out_token_ids,
    out_num_drafts,
):
    """Propose for every sequence of a batch in one call.

    copy: True for the "copy" continuation, False for "frequency";
    slots: [num_seqs] int64; num_drafts: [num_seqs] int64, each <= max_k;
    prefixes: [num_seqs, max_prefix] int64, row i's first prefix_lengths[i] are drafts chosen
    before this proposer (``ProposeRequest.draft_prefix``), which it continues;
    prefix_lengths: [num_seqs] int64;
    out_token_ids: [num_seqs, max_k] int64 (row i valid up to out_num_drafts[i]);
    out_num_drafts: [num_seqs] int64.
    """
    max_order = min_order + tables.keys.shape[1] - 1
    context = np.empty(max_order + out_token_ids.shape[1], np.int64)
    out = out_token_ids
    for i in range(len(slots)):
        slot, k, prefix, num_prefix = slots[i], num_drafts[i], prefixes[i], prefix_lengths[i]
        if copy:
            n = _copy_one(tables, min_order, slot, k, context, prefix, num_prefix, out[i])
        else:
            n = _propose_one(tables, min_order, slot, k, context, prefix, num_prefix, out[i])
        out_num_drafts[i] = n


def warmup() -> None:
    """Compile every kernel for the argument types the proposer passes, or load it from disk.

    numba caches the machine code next to this module (``cache=True``), so only the first
    process after a change pays the compilation (seconds); later ones load it (milliseconds).
    """
    tables = allocate_tables(num_slots=1, num_orders=2, capacity=16, window=4)
    seed_slot(tables, 1, 0, np.array([1, 2, 1, 2], np.int64))
    append_tokens(tables, 1, 0, np.array([1], np.int64))
    append_batch(
        tables, 1, np.zeros(1, np.int64), np.array([2], np.int64), np.array([0, 1], np.int64)
    )
    out_token_ids = np.empty((1, 2), np.int64)
    out_num_drafts = np.empty(1, np.int64)
    for copy in (True, False):
        propose_batch(
            tables,
            1,
            copy,
            np.zeros(1, np.int64),
            np.full(1, 2, np.int64),
            np.ones((1, 1), np.int64),
            np.ones(1, np.int64),
            out_token_ids,
            out_num_drafts,
        )
