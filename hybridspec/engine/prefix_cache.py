"""A prefix cache across requests: finished requests' KV-cache slots kept, and reused.

When a request ends, its slot is not freed but *retained* with the tokens it caches (its prompt
and output, but the last token, which was never fed). A later request whose prompt starts with
some of those tokens reuses that longest common prefix (the entry's slot taken over, or the
prefix copied into its own slot with ``ModelRuntime.copy_prefix``) and prefills only the
rest: a conversation's next turn, an agent resending its system prompt and its previous answer,
a retried or regenerated request.

Design: retained slots rather than a separate block store keyed by hash chains. The runtime's
cache is slot-indexed, ``copy_prefix`` already exists for every runtime (``engine.choices``
shares a prompt's prefill with it), and a finished request's keys and values are then kept where
they lie at no cost: a block store would copy every finished request out and every hit back in.
A hit costs a lookup, a longest-common-prefix scan over the retained entries' token arrays (a
few dozen at most), and at most one copy of the matched prefix: a prompt that extends an entry
whole (a conversation's next turn) takes that entry's slot over as it lies, with no copy. The
cost of the design is granularity: a slot holds one sequence, so the budget buys whole slots
(``num_slots_for``), and an entry that another entry extends is dropped as redundant.

Exactness: the copied keys and values are the bits the prefix's own prefill would write on a
row-invariant runtime (the native CPU one: ``engine.choices`` relies on the same), so a request
served from the cache gives the same tokens and log-probabilities as a cold one.

Budget: the engine's runtime holds ``max_num_seqs`` slots for running requests plus
``num_slots`` for the cache; entries fill any slot that no running request holds, and the least
recently used one is evicted when a running request needs its slot or the cache holds more than
``num_slots`` entries. Resident memory for keys and values is therefore at most ``max_num_seqs +
num_slots`` slots of ``max_seq_len`` tokens, and the cache's share at most its budget.

Dimensions: ``P`` prompt tokens; ``E`` retained entries.

Worked example: turn 1 (prompt 300 tokens, answer 50) ends and its slot is retained with 349
tokens. Turn 2's prompt (420 tokens) repeats them and adds 71: turn 2 takes the slot over with
its 349 positions and prefills 71. A regenerated turn 2 (the same 420 tokens) then finds turn
2's entry (420 + 40 - 1 tokens) and matches 419 of them: those are copied into a fresh slot, and
the entry stays.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hybridspec.model import LlamaWeights, LoadedModel, ModelRuntime

logger = logging.getLogger(__name__)

DEFAULT_SHARE_OF_RAM = 8  # the default budget: this fraction of the machine's memory ...
DEFAULT_MAX_MB = 4096  # ... but no more than this
MAX_SLOTS = 64  # the most entries: the lookup scans them all


def default_prefix_cache_mb() -> int:
    """The default budget: an eighth of the machine's memory, at most 4 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return 1024
    return int(min(total // DEFAULT_SHARE_OF_RAM // 2**20, DEFAULT_MAX_MB))


def num_slots_for(budget_mb: int, bytes_per_token: int, max_seq_len: int) -> int:
    """How many whole slots of ``max_seq_len`` tokens fit in ``budget_mb`` (at most 64)."""
    slot_bytes = max(1, bytes_per_token * max_seq_len)
    return int(min(MAX_SLOTS, budget_mb * 2**20 // slot_bytes))


@dataclass(slots=True)
class _Entry:
    slot: int
    token_ids: np.ndarray  # [num_cached] int64: the tokens whose keys and values the slot holds
    last_used: int


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counts since the cache was built (``hit_tokens`` and ``evicted_tokens`` are what the
    server's ``/metrics`` exposes)."""

    lookups: int
    hits: int
    hit_tokens: int  # prompt tokens copied instead of prefilled
    evicted_tokens: int  # tokens of entries evicted (LRU, or to free a slot)
    num_entries: int
    num_cached_tokens: int
    # Bytes of memory pages the entries' slots hold (``KVCache.resident_bytes``: whole pages,
    # at least a page per key row on the native runtime); 0 where the runtime cannot say.
    resident_bytes: int = 0


class PrefixCache:
    """Finished requests' slots of ``runtime``, at most ``num_slots`` of them, reused by later
    requests that share a prefix (see the module docstring)."""

    def __init__(
        self,
        runtime: ModelRuntime,
        num_slots: int,
        resident_bytes: Callable[[int], int] | None = None,
    ) -> None:
        """``resident_bytes(slot)``: the memory a slot holds (``LlamaRuntime.resident_bytes``),
        for ``stats``; None where the runtime cannot say."""
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots: expected an integer >= 0, got {num_slots!r}")
        self.runtime = runtime
        self._resident_bytes = resident_bytes
        self.num_slots = num_slots
        self._entries: list[_Entry] = []
        self._clock = 0
        self._lookups = self._hits = self._hit_tokens = self._evicted_tokens = 0

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self._lookups,
            self._hits,
            self._hit_tokens,
            self._evicted_tokens,
            len(self._entries),
            sum(len(e.token_ids) for e in self._entries),
            sum(map(self._resident_bytes, (e.slot for e in self._entries)))
            if self._resident_bytes is not None
            else 0,
        )

    def allocate(self, prompt_token_ids: list[int] | None) -> tuple[int, int]:
        """A slot for a new request and how many tokens of its prompt it already caches.

        ``prompt_token_ids`` None: the request does not read the cache (a fresh slot). Else the
        longest prefix of the prompt but its last token that an entry holds is reused. An entry
        the prompt extends whole (a conversation's next turn) hands its slot over as it is: it
        would be dropped as redundant when the request ends, so nothing is copied. A partial
        match is copied into a fresh slot, the entry kept; when no slot is free, the least
        recently used entries are evicted first (the matching one last: if it must go, the
        request takes its slot over, truncated to the match).
        """
        match, length = self._best_match(prompt_token_ids)
        if match is not None and length == len(match.token_ids):
            self._entries.remove(match)
            self._count_hit(length)
            return match.slot, length
        while self.runtime.num_free_slots() == 0:
            victims = [e for e in self._entries if e is not match] or self._entries
            if not victims:
                break  # no entry to evict: allocate raises CapacityError
            victim = min(victims, key=lambda e: e.last_used)
            if victim is match:
                self._entries.remove(match)
                self._evicted_tokens += len(match.token_ids) - length
                self.runtime.truncate(match.slot, length)
                self._count_hit(length)
                return match.slot, length
            self._evict(victim)
        slot = self.runtime.allocate()
        if match is not None and length > 0:
            self.runtime.copy_prefix(match.slot, slot, length)
            match.last_used = self._tick()
            self._count_hit(length)
        return slot, length

    def release(self, slot: int, token_ids: list[int], retain: bool) -> None:
        """Take back a finished request's slot, which caches the first ``seq_len(slot)``
        positions of ``token_ids`` at most (the last committed token was never fed, and
        positions past the committed tokens hold rejected drafts): retained when ``retain`` and
        the cache has room, else freed."""
        length = min(self.runtime.seq_len(slot), len(token_ids) - 1)
        if not retain or self.num_slots == 0 or length < 1:
            self.runtime.free(slot)
            return
        self.runtime.truncate(slot, length)
        tokens = np.asarray(token_ids[:length], dtype=np.int64)
        for entry in list(self._entries):
            common = _common_prefix(entry.token_ids, tokens)
            if common == len(tokens):  # an entry already holds all of it
                entry.last_used = self._tick()
                self.runtime.free(slot)
                return
            if common == len(entry.token_ids):  # the new one extends this entry
                self._entries.remove(entry)
                self.runtime.free(entry.slot)
        self._entries.append(_Entry(slot, tokens, self._tick()))
        while len(self._entries) > self.num_slots:
            self._evict(min(self._entries, key=lambda e: e.last_used))

    def clear(self) -> None:
        """Free every entry (counts are kept)."""
        for entry in list(self._entries):
            self._entries.remove(entry)
            self.runtime.free(entry.slot)

    def reset(self) -> None:
        """Free every entry and zero the counts: the cache as just built."""
        self.clear()
        self._clock = 0
        self._lookups = self._hits = self._hit_tokens = self._evicted_tokens = 0

    def _best_match(self, prompt_token_ids: list[int] | None) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with the prompt but its last token, and the
        length of that prefix (None, 0 when none shares any)."""
        if prompt_token_ids is None:
            return None, 0
        self._lookups += 1
        if not self._entries or len(prompt_token_ids) < 2:
            return None, 0
        prompt = np.asarray(prompt_token_ids[:-1], dtype=np.int64)
        best, best_length = None, 0
        for entry in self._entries:
            length = _common_prefix(entry.token_ids, prompt)
            if length > best_length:
                best, best_length = entry, length
        return best, best_length

    def _evict(self, entry: _Entry) -> None:
        self._entries.remove(entry)
        self._evicted_tokens += len(entry.token_ids)
        self.runtime.free(entry.slot)

    def _count_hit(self, length: int) -> None:
        if length > 0:
            self._hits += 1
            self._hit_tokens += length

    def _tick(self) -> int:
        self._clock += 1
        return self._clock


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def kv_bytes_per_token(target: LoadedModel) -> int:
    """Bytes of keys and values one cached token takes in ``target``'s runtime."""
    if isinstance(target.weights, LlamaWeights):
        dims = target.weights.dims
        layers, kv_heads, head_dim = dims.num_layers, dims.num_kv_heads, dims.head_dim
    else:
        text = target.hf_config.get_text_config()
        heads = int(text.num_attention_heads)
        layers = int(text.num_hidden_layers)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    itemsize = torch.empty((), dtype=target.dtype).element_size()
    return 2 * layers * kv_heads * head_dim * itemsize
