"""Compiled longest-match drafting of the ``suffix`` proposer (numba nopython, disk-cached).

Two pools of ``ngram_kernels.NgramTables`` take part: ``own``, a slot per sequence with its own
recent text (as the ``ngram`` proposer keeps it), and ``shared``, a slot per pool of recent
prompts and outputs of finished requests (``proposers.suffix``). For each sequence the context
is its last ``max_order`` tokens (committed, then any ``draft_prefix``); from the longest order
down, the first order whose context occurs in the sequence's own text or in its shared pool
(the own text first at equal order) wins, and the tokens that followed that context's latest
occurrence are copied, up to ``num_drafts`` or to the end of the text they come from.

Worked example (own orders 1..3, shared orders 2..3): a sequence ending ``4 5 6`` whose own
text has ``5 6`` once (followed by 9) and whose shared pool has ``4 5 6 7 8``: order 3 ``4 5 6``
is not in the own text but is in the pool, so ``7 8`` are copied from the pool (source 1,
order 3), although the own text matched order 2.

Dimensions: ``num_seqs`` sequences of the batch; ``max_k`` the largest ``num_drafts``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hybridspec.proposers.ngram_kernels import _best_next_token, _gather, _load_context
from hybridspec.proposers.ngram_tables import NgramTables, allocate_tables

OWN = 0  # ``out_sources``: the drafts were copied from the sequence's own text
SHARED = 1  # ... from its shared pool


@njit(cache=True)
def propose_longest(
    own,
    own_min_order,
    own_slots,
    shared,
    shared_min_order,
    shared_slots,
    num_drafts,
    prefixes,
    prefix_lengths,
    out_token_ids,
    out_num_drafts,
    out_orders,
    out_sources,
):
    """Draft for every sequence of a batch (module docstring).

    own_slots, shared_slots: [num_seqs] int64 (a shared slot < 0: the sequence drafts from its
    own text only); num_drafts: [num_seqs] int64; prefixes: [num_seqs, max_prefix] int64, row
    i's first prefix_lengths[i] are drafts chosen before this proposer; out_token_ids:
    [num_seqs, max_k] int64 (row i valid up to out_num_drafts[i]); out_orders: [num_seqs]
    int64, the order that matched (0: none); out_sources: [num_seqs] int64, OWN or SHARED.
    """
    own_max_order = own_min_order + own.keys.shape[1] - 1
    shared_max_order = shared_min_order + shared.keys.shape[1] - 1
    context = np.empty(max(own_max_order, shared_max_order), np.int64)
    for i in range(len(own_slots)):
        out_num_drafts[i], out_orders[i], out_sources[i] = 0, 0, OWN
        slot, k = own_slots[i], num_drafts[i]
        # The context is the own text's last max_order tokens: the shared pool matches against
        # at most that many, and only orders both pools key are compared at equal length.
        length, n = _load_context(own, own_min_order, slot, context, prefixes[i], prefix_lengths[i])
        if k == 0:
            continue
        for order in range(n, 0, -1):
            if own_min_order <= order <= own_max_order:
                found, _, pos = _best_next_token(
                    own, slot, order - own_min_order, order, context, n - order, False
                )
                if found:
                    num = min(k, length - pos)
                    _gather(own, slot, pos, num, out_token_ids[i])
                    out_num_drafts[i], out_orders[i], out_sources[i] = num, order, OWN
                    break
            pool = shared_slots[i]
            if pool >= 0 and shared_min_order <= order <= shared_max_order:
                found, _, pos = _best_next_token(
                    shared, pool, order - shared_min_order, order, context, n - order, False
                )
                if found:
                    num = min(k, shared.num_tokens[pool] - pos)
                    _gather(shared, pool, pos, num, out_token_ids[i])
                    out_num_drafts[i], out_orders[i], out_sources[i] = num, order, SHARED
                    break


def warmup() -> None:
    """Compile ``propose_longest`` for the argument types the proposer passes, or load it from
    disk (``cache=True``): only the first process after a change pays the compilation."""
    tables: NgramTables = allocate_tables(num_slots=1, num_orders=2, capacity=16, window=4)
    one = np.zeros(1, np.int64)
    propose_longest(
        tables,
        1,
        one,
        tables,
        1,
        one - 1,
        one + 1,
        np.ones((1, 1), np.int64),
        one,
        np.empty((1, 1), np.int64),
        np.empty(1, np.int64),
        np.empty(1, np.int64),
        np.empty(1, np.int64),
    )
