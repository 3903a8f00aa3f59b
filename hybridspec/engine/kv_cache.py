"""A preallocated, slot-indexed KV cache with per-slot lengths, for the native runtimes.

Dimensions: ``num_layers`` decoder layers, ``max_num_seqs`` slots, ``num_kv_heads`` key/value
heads, ``max_seq_len`` positions per slot, ``head_dim`` channels per head.

Each slot is one live sequence. Its first ``seq_len(slot)`` positions hold valid keys and values;
positions past that hold stale values from before a rollback (or were never written), and every
reader masks them out, so ``truncate`` only moves the length back.

Worked example: a slot at length 12 that verified 4 draft tokens (length 16) and accepted 1 of
them plus a correction is truncated to 14; positions 14 and 15 keep the rejected keys until the
next forward overwrites them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hybridspec.engine.runtime import ForwardBatch
from hybridspec.errors import CapacityError


class SlotTable:
    """Which cache slots are taken and how many positions each holds (host-side ints only).

    Plain Python ints, so that bookkeeping never syncs with the device.
    """

    def __init__(self, max_num_seqs: int, max_seq_len: int) -> None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected an integer >= 1, got {max_num_seqs!r}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected an integer >= 1, got {max_seq_len!r}")
        self.max_num_seqs = max_num_seqs
        self.max_seq_len = max_seq_len
        self._lengths = [0] * max_num_seqs
        self._in_use = [False] * max_num_seqs
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest slot

    def allocate(self) -> int:
        """Reserve a free slot with length 0; raises CapacityError when all are taken."""
        if not self._free:
            raise CapacityError(f"all {self.max_num_seqs} KV-cache slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = True
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot``; its contents are discarded."""
        self.check_slot(slot)
        self._in_use[slot] = False
        self._lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def num_free_slots(self) -> int:
        return len(self._free)

    def seq_len(self, slot: int) -> int:
        """Number of valid positions in ``slot``."""
        self.check_slot(slot)
        return self._lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` positions."""
        current = self.seq_len(slot)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= current:
            raise ValueError(f"length: expected an integer in [0, {current}], got {length!r}")
        self._lengths[slot] = length

    def check_slot(self, slot: int) -> None:
        """Raise ValueError unless ``slot`` is an allocated slot index."""
        if (
            isinstance(slot, bool)
            or not isinstance(slot, int)
            or not 0 <= slot < self.max_num_seqs
            or not self._in_use[slot]
        ):
            raise ValueError(
                f"slot: expected an allocated slot in [0, {self.max_num_seqs}), got {slot!r}"
            )

    def reserve(self, slots: list[int], num_new_tokens: list[int]) -> list[int]:
        """Check that each slot can take its new tokens; return the slots' current lengths.

        Raises ValueError for an unallocated or repeated slot and CapacityError when a slot would
        grow past ``max_seq_len``. Nothing changes until ``commit``.
        """
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: expected distinct slots, got {slots}")
        starts = []
        for slot, num in zip(slots, num_new_tokens, strict=True):
            start = self.seq_len(slot)
            if start + num > self.max_seq_len:
                raise CapacityError(
                    f"slot {slot} holds {start} tokens and cannot take {num} more: "
                    f"max_seq_len is {self.max_seq_len}"
                )
            starts.append(start)
        return starts

    def commit(self, slots: list[int], new_lengths: list[int]) -> None:
        """Record the lengths after a forward has written its keys and values."""
        for slot, length in zip(slots, new_lengths, strict=True):
            self._lengths[slot] = length


class KVCache:
    """Key/value tensors for every layer and slot, with a ``SlotTable`` saying how full each is.

    The tensors start uninitialised (``torch.empty``): on CPU the pages of a large allocation are
    only backed by memory once written, so a cache sized for the full context costs what the
    sequences actually use. Uninitialised memory may hold NaN bit patterns, which would survive
    masking in attention (0 * NaN = NaN); readers that look past a slot's length (the padded
    ragged path) first call ``make_finite``, which zero-fills once up to where they read.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        max_num_seqs: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slots = SlotTable(max_num_seqs, max_seq_len)
        shape = (num_layers, max_num_seqs, num_kv_heads, max_seq_len, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        # Per-layer views, indexed once here rather than on every layer of every forward.
        self.layer_keys: tuple[torch.Tensor, ...] = tuple(self.keys.unbind(0))
        self.layer_values: tuple[torch.Tensor, ...] = tuple(self.values.unbind(0))
        # Per slot: positions [0, n) have been written or zeroed at least once, so hold finite
        # values. Writes always start at the slot's length, so this is at least that length.
        self._finite_len = [0] * max_num_seqs

    def commit(self, slots: list[int], new_lengths: list[int]) -> None:
        """Record the lengths after a forward has written keys and values up to them."""
        self.slots.commit(slots, new_lengths)
        for slot, length in zip(slots, new_lengths, strict=True):
            self._finite_len[slot] = max(self._finite_len[slot], length)

    def make_finite(self, slot: int, end: int) -> None:
        """Zero-fill positions of ``slot`` never written before, up to ``end`` (all layers)."""
        start = self._finite_len[slot]
        if start < end:
            self.keys[:, slot, :, start:end].zero_()
            self.values[:, slot, :, start:end].zero_()
            self._finite_len[slot] = end


@dataclass(frozen=True, slots=True)
class HostBatch:
    """A ``ForwardBatch`` after its checks, with its bookkeeping read to host ints."""

    slots: list[int]  # [num_seqs]
    num_new_tokens: list[int]  # [num_seqs], each >= 1
    token_ids: torch.Tensor  # [num_tokens] int64, each in [0, vocab_size)
    logits_indices: torch.Tensor | None  # [num_logits] int64 in [0, num_tokens); None = all


def read_batch(batch: ForwardBatch, vocab_size: int) -> HostBatch:
    """Check ``batch`` field by field (ValueError naming the field) and read it to host ints."""
    for name in ("slots", "token_ids", "cu_num_tokens"):
        _check_index_tensor(getattr(batch, name), name)
    slots = batch.slots.tolist()
    cu = batch.cu_num_tokens.tolist()
    if not slots:
        raise ValueError("slots: expected at least one sequence, got none")
    if len(cu) != len(slots) + 1 or cu[0] != 0:
        raise ValueError(
            f"cu_num_tokens: expected {len(slots) + 1} cumulative offsets starting at 0, got {cu}"
        )
    num_new_tokens = [b - a for a, b in itertools.pairwise(cu)]
    if min(num_new_tokens) < 1:
        raise ValueError(f"cu_num_tokens: expected each sequence to add >= 1 token, got {cu}")
    token_ids = batch.token_ids
    if token_ids.numel() != cu[-1]:
        raise ValueError(
            f"token_ids: expected {cu[-1]} tokens (cu_num_tokens[-1]), got {token_ids.numel()}"
        )
    low, high = token_ids.aminmax()
    if int(low) < 0 or int(high) >= vocab_size:
        raise ValueError(
            f"token_ids: expected ids in [0, {vocab_size}), got [{int(low)}, {int(high)}]"
        )
    indices = batch.logits_indices
    if indices is not None:
        _check_index_tensor(indices, "logits_indices")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= cu[-1]):
            raise ValueError(
                f"logits_indices: expected indices in [0, {cu[-1]}), got {indices.tolist()}"
            )
    return HostBatch(slots, num_new_tokens, token_ids, indices)


def _check_index_tensor(tensor: object, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a 1-D int64 tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or tensor.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{name}: expected a 1-D int64 tensor, got shape {tuple(tensor.shape)} {tensor.dtype}"
        )
