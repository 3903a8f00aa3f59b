"""The n-gram tables' arrays (``ngram_kernels`` describes their layout), allocated with numpy
alone: a proposer holds them from its construction, and imports the compiled kernels that work
on them only when it starts a sequence (``lazy_kernels``).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import numpy.typing as npt


class NgramTables(NamedTuple):
    """The state of every sequence in the pool; row ``slot`` of each array belongs to one."""

    history: npt.NDArray[np.int32]  # [num_slots, window], position p at column p % window
    num_tokens: npt.NDArray[np.int64]  # [num_slots], committed tokens seen so far (L)
    keys: npt.NDArray[np.uint64]  # [num_slots, num_orders, capacity], FNV-1a of the context
    next_token_ids: npt.NDArray[np.int32]  # [num_slots, num_orders, capacity]
    counts: npt.NDArray[np.int32]  # [num_slots, num_orders, capacity], occurrences in window
    last_pos: npt.NDArray[np.int64]  # [num_slots, num_orders, capacity], latest next-token pos
    state: npt.NDArray[np.int8]  # [num_slots, num_orders, capacity], EMPTY / LIVE / TOMBSTONE
    num_used: npt.NDArray[np.int64]  # [num_slots, num_orders], LIVE + TOMBSTONE entries
    num_tombstones: npt.NDArray[np.int64]  # [num_slots, num_orders]


def allocate_tables(num_slots: int, num_orders: int, capacity: int, window: int) -> NgramTables:
    """Zeroed tables: every slot as ``seed_slot`` leaves it with no tokens (empty, nothing
    seen)."""
    shape = (num_slots, num_orders, capacity)
    return NgramTables(
        history=np.zeros((num_slots, window), np.int32),
        num_tokens=np.zeros(num_slots, np.int64),
        keys=np.zeros(shape, np.uint64),
        next_token_ids=np.zeros(shape, np.int32),
        counts=np.zeros(shape, np.int32),
        last_pos=np.zeros(shape, np.int64),
        state=np.zeros(shape, np.int8),
        num_used=np.zeros((num_slots, num_orders), np.int64),
        num_tombstones=np.zeros((num_slots, num_orders), np.int64),
    )


def grow_tables(tables: NgramTables, num_slots: int) -> NgramTables:
    """A copy of ``tables`` with ``num_slots`` slots; the old slots keep their state."""
    old = tables.history.shape[0]
    assert num_slots >= old, f"cannot shrink the pool from {old} to {num_slots} slots"
    _, num_orders, capacity = tables.keys.shape
    grown = allocate_tables(num_slots, num_orders, capacity, tables.history.shape[1])
    for new_array, old_array in zip(grown, tables, strict=True):
        new_array[:old] = old_array  # type: ignore[index]  # NamedTuple iteration loses field types
    return grown


def plain_token_ids(token_ids: object, vocab_size: int) -> list[int] | None:
    """``token_ids`` itself where it is a list of plain ints in ``[0, vocab_size)``, what the
    engine commits each round; None for anything else, which the caller then converts and
    checks with numpy (and says what is wrong). Checking a round's few tokens this way costs
    a fraction of numpy's conversion and reductions."""
    if type(token_ids) is not list:
        return None
    for token_id in token_ids:
        if type(token_id) is not int or not 0 <= token_id < vocab_size:
            return None
    return token_ids


def packed(
    batch: list[tuple[int, list[int]]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(slots, token_ids, offsets)`` of ``ngram_kernels.append_batch`` for ``batch`` (not
    empty), each ``(slot, tokens)`` one slot's tokens to learn. Example:
    ``[(2, [5, 6]), (0, [7])]`` gives ``[2, 0]``, ``[5, 6, 7]``, ``[0, 2, 3]``."""
    slots = np.array([slot for slot, _ in batch], np.int64)
    ends = list(itertools.accumulate(len(tokens) for _, tokens in batch))
    offsets = np.array([0, *ends], np.int64)
    token_ids = np.fromiter(
        itertools.chain.from_iterable(tokens for _, tokens in batch), np.int64, ends[-1]
    )
    return slots, token_ids, offsets
