"""Drafting with an eagle head: its keys and values per sequence (``HeadCache``) and one
cached step over a ragged batch (``forward_cached``).

Dimensions: ``N`` rows (flat, ragged over sequences), ``D`` hidden size, ``H`` query heads,
``KV`` key/value heads, ``hd`` head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridspec.proposers.eagle.config import DraftHead, HeadConfig


class HeadCache:
    """The head's keys and values, one growing buffer per slot (a sequence being drafted for).

    ``truncate`` rolls a slot back; the entries kept are exactly those a fresh prefill of the
    same inputs would write (each row's keys and values depend on its own input alone).
    """

    def __init__(self, config: HeadConfig, dtype: torch.dtype, device: torch.device) -> None:
        self._shape = (config.num_kv_heads, config.head_dim)
        self._dtype, self._device = dtype, device
        self._keys: dict[int, torch.Tensor] = {}  # slot -> [capacity, KV, hd]
        self._values: dict[int, torch.Tensor] = {}
        self._lengths: dict[int, int] = {}
        self._next_slot = 0

    def allocate(self) -> int:
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._keys[slot] = torch.empty(64, *self._shape, dtype=self._dtype, device=self._device)
        self._values[slot] = torch.empty_like(self._keys[slot])
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._keys.pop(slot, None)
        self._values.pop(slot, None)
        self._lengths.pop(slot, None)

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        assert 0 <= length <= self._lengths[slot], (length, self._lengths[slot])
        self._lengths[slot] = length

    def entries(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's keys and values ``[length, KV, hd]`` (views)."""
        n = self._lengths[slot]
        return self._keys[slot][:n], self._values[slot][:n]

    def append(
        self, slot: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[n, KV, hd]`` rows; the slot's whole keys and values after them."""
        start, n = self._lengths[slot], keys.shape[0]
        if start + n > self._keys[slot].shape[0]:
            capacity = max(2 * self._keys[slot].shape[0], start + n)
            for table in (self._keys, self._values):
                grown = torch.empty(capacity, *self._shape, dtype=self._dtype, device=self._device)
                grown[:start] = table[slot][:start]
                table[slot] = grown
        self._keys[slot][start : start + n] = keys
        self._values[slot][start : start + n] = values
        self._lengths[slot] = start + n
        return self.entries(slot)


def forward_cached(
    head: DraftHead,
    cache: HeadCache,
    slots: list[int],
    features: torch.Tensor,
    next_token_ids: torch.Tensor,
    num_rows: list[int],
) -> torch.Tensor:
    """Feed ``num_rows[i]`` pairs (feature, next token) to slot ``slots[i]``; predicted features.

    ``features [N, D]``, ``next_token_ids [N]``, flat in the order of ``slots``; returns
    ``[N, D]``. Each slot's new rows sit at positions ``cache.length(slot)`` onwards and attend
    to the slot's cached entries and, causally, to each other.
    """
    c = head.config
    rep = c.num_heads // c.num_kv_heads
    starts = [cache.length(slot) for slot in slots]
    positions = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts, num_rows, strict=True)]
    ).to(features.device)
    x = head.fuse(features, next_token_ids)  # [N, D]
    q, k, v = head.qkv(x, positions)  # [N, H, hd], [N, KV, hd] x 2
    attended = torch.empty_like(q)
    row = 0
    for slot, start, n in zip(slots, starts, num_rows, strict=True):
        keys, values = cache.append(slot, k[row : row + n], v[row : row + n])
        mask = None
        if n > 1:  # row r sees entries <= start + r
            cols = torch.arange(start + n, device=x.device)
            mask = cols[None, :] <= (start + torch.arange(n, device=x.device))[:, None]
        attended[row : row + n] = F.scaled_dot_product_attention(
            q[row : row + n].transpose(0, 1),  # [H, n, hd]
            keys.transpose(0, 1).repeat_interleave(rep, dim=0),  # [H, L, hd]
            values.transpose(0, 1).repeat_interleave(rep, dim=0),
            attn_mask=mask,
        ).transpose(0, 1)
        row += n
    return head.finish(x, attended)
