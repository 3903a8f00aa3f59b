"""A preallocated, slot-indexed KV cache with per-slot lengths, and attention over it.

Contents: ``SlotTable`` (which slots are taken, how full: host ints), ``KVCache`` (the tensors),
the two ways of attending over the cache (``OneSequenceAttention`` reads slice views of one slot;
``RaggedAttention`` gathers several into a padded block), and ``read_batch``, which checks a
``ForwardBatch`` for any runtime.

Dimensions: ``num_layers`` decoder layers, ``max_num_seqs`` slots, ``num_kv_heads`` (``KV``)
key/value heads, ``max_seq_len`` (``S``) positions per slot, ``head_dim`` (``hd``) channels per
head; in attention ``T`` new tokens, ``B`` sequences, ``H`` query heads, ``rep = H // KV``,
``L`` keys attended.

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
import torch.nn.functional as F

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


class OneSequenceAttention:
    """Attention for a batch of one sequence: writes and reads slice views of its cache slot.

    The ``rep`` query heads sharing a key/value head become ``rep`` extra query rows: ``q [n, H,
    hd]`` is laid out as ``[1, KV, n * rep, hd]``, where row ``i * rep + r`` is token ``i``'s
    head ``kv * rep + r`` (transformers' ``repeat_kv`` grouping), against keys ``[1, KV, L, hd]``.
    """

    def __init__(self, cache: KVCache, slot: int, start: int, num_new: int, rep: int) -> None:
        self.cache, self.slot, self.start, self.end, self.rep = (
            cache,
            slot,
            start,
            start + num_new,
            rep,
        )
        self.mask: torch.Tensor | None = None  # [n * rep, L] bool; None when all keys are visible
        if num_new > 1:
            device = cache.keys.device
            key_pos = torch.arange(self.end, device=device)
            query_pos = torch.arange(start, self.end, device=device)
            self.mask = (key_pos[None, :] <= query_pos[:, None]).repeat_interleave(rep, dim=0)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [n, H, hd], k and v [n, KV, hd] -> [n, H hd]
        n, num_heads, hd = q.shape
        num_kv = k.shape[1]
        keys = self.cache.layer_keys[layer][self.slot]  # [KV, S, hd]
        values = self.cache.layer_values[layer][self.slot]
        keys[:, self.start : self.end] = k.transpose(0, 1)
        values[:, self.start : self.end] = v.transpose(0, 1)
        q = q.view(n, num_kv, self.rep, hd).transpose(0, 1).reshape(1, num_kv, n * self.rep, hd)
        out = F.scaled_dot_product_attention(
            q, keys[None, :, : self.end], values[None, :, : self.end], attn_mask=self.mask
        )  # [1, KV, n * rep, hd]
        return out.view(num_kv, n, self.rep, hd).transpose(0, 1).reshape(n, num_heads * hd)


class RaggedAttention:
    """Attention for several sequences: scatters new keys by (slot, position), gathers each
    sequence's keys into a padded ``[B, KV, L, hd]`` block and masks each row to its own past.

    Queries are padded to ``[B, KV, max_n * rep, hd]`` (rows folded as in
    ``OneSequenceAttention``). A padding row attends to key 0 alone, so no row is fully masked
    (a fully masked softmax row is NaN); its output is dropped.
    """

    def __init__(
        self, cache: KVCache, slots: list[int], starts: list[int], num_new: list[int], rep: int
    ) -> None:
        device = cache.keys.device
        ends = [s + n for s, n in zip(starts, num_new, strict=True)]
        for slot in slots:  # the padded reads below reach up to max(ends) in every slot
            cache.make_finite(slot, max(ends))
        self.cache, self.rep, self.max_new, self.max_end = cache, rep, max(num_new), max(ends)
        self.slots = torch.tensor(slots, device=device)  # [B]
        seq_of_token = torch.repeat_interleave(torch.arange(len(slots)), torch.tensor(num_new))
        first_token = torch.tensor([0, *num_new[:-1]]).cumsum(0)
        row = torch.arange(len(seq_of_token)) - first_token[seq_of_token]  # [T] index in its seq
        self.positions = (torch.tensor(starts)[seq_of_token] + row).to(device)  # [T]
        self.token_slots = self.slots[seq_of_token.to(device)]  # [T]
        self.seq_of_token, self.row = seq_of_token.to(device), row.to(device)
        query_pos = torch.tensor(starts)[:, None] + torch.arange(self.max_new)  # [B, max_n]
        key_pos = torch.arange(self.max_end)
        is_real = torch.arange(self.max_new)[None, :] < torch.tensor(num_new)[:, None]  # [B, max_n]
        mask = torch.where(is_real[..., None], key_pos <= query_pos[..., None], key_pos == 0)
        self.mask = mask.repeat_interleave(rep, dim=1)[:, None].to(device)  # [B, 1, max_n rep, L]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [T, H, hd], k and v [T, KV, hd] -> [T, H hd]
        num_tokens, num_heads, hd = q.shape
        num_kv, batch = k.shape[1], self.slots.numel()
        layer_keys, layer_values = self.cache.layer_keys[layer], self.cache.layer_values[layer]
        layer_keys[self.token_slots, :, self.positions] = k  # advanced dims first: [T, KV, hd]
        layer_values[self.token_slots, :, self.positions] = v
        keys = layer_keys[self.slots, :, : self.max_end]  # [B, KV, L, hd]
        values = layer_values[self.slots, :, : self.max_end]
        padded = q.new_zeros(batch, self.max_new, num_heads, hd)
        padded[self.seq_of_token, self.row] = q
        padded = padded.view(batch, self.max_new, num_kv, self.rep, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            padded.reshape(batch, num_kv, self.max_new * self.rep, hd),
            keys,
            values,
            attn_mask=self.mask,
        )
        out = out.view(batch, num_kv, self.max_new, self.rep, hd).transpose(1, 2)
        return out[self.seq_of_token, self.row].reshape(num_tokens, num_heads * hd)


Attention = OneSequenceAttention | RaggedAttention


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
    ids = token_ids.tolist()  # host ints: cheaper than a tensor reduction for a few tokens
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(
            f"token_ids: expected ids in [0, {vocab_size}), got [{min(ids)}, {max(ids)}]"
        )
    indices = batch.logits_indices
    if indices is not None:
        _check_index_tensor(indices, "logits_indices")
        rows = indices.tolist()
        if rows and (min(rows) < 0 or max(rows) >= cu[-1]):
            raise ValueError(f"logits_indices: expected indices in [0, {cu[-1]}), got {rows}")
    return HostBatch(slots, num_new_tokens, token_ids, indices)


def _check_index_tensor(tensor: object, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a 1-D int64 tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or tensor.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{name}: expected a 1-D int64 tensor, got shape {tuple(tensor.shape)} {tensor.dtype}"
        )
