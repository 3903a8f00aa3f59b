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
cost of the design is granularity: a slot holds one sequence, and an entry that another entry
extends is dropped as redundant.

Proposers that read the target's features (``Proposer.feature_layers``: ``eagle``, ``hybrid``
with a head) get them for the cached positions too where the entry kept them: an entry left by
such a request keeps the features of its positions in those layers (``CachedFeatures``), and a
hit hands the matched rows to the new request as if its prefill had computed them
(``engine.features``), so the head's own cache is rebuilt from them, never reused stale. Any
request matches any entry's keys and values: a request reading features prefers an entry that
kept them where it matches as much of the prompt, and one served from an entry that kept none
(a ``none`` request's) gets its features from the first uncached position on (its head then
drafts from the positions it has seen: its drafts may be kept less often, never wrongly),
rather than prefilling cached positions again.

Scopes: an entry keeps the ``scope`` of the request that left it (``GenerationParams.
cache_scope``: the server's tenant and ``cache_salt``), and a request matches only entries of its
own scope, so no request is served faster for text it could not have sent (the timing of a hit
would tell another tenant's prompts). Scopes share the slots and the budget: eviction is
least recently used across them all.

Exactness: the copied keys and values (and features) are the bits the prefix's own prefill
would compute on a row-invariant runtime (the native CPU one: ``engine.choices`` relies on the
same), so a request served from the cache gives the same tokens and log-probabilities as a cold
one.

Budget: the engine's runtime holds ``max_num_seqs`` slots for running requests plus
``num_slots`` for the cache. Slots are virtual: a slot costs address space for its whole
context but memory only for the pages its positions have touched (``KVCache.resident_bytes``:
with keys stored position-innermost, at least a page per key row, 23 MiB for SmolLM2-135M
however few the tokens). So the cache charges what it really keeps resident, to the page: its
entries' slots and features, and the free slots whose pages are still resident (a request
that is not retained leaves its pages for the next one to write over). When a request ends
and the charge exceeds ``budget_bytes``, free slots give their pages back first
(``release_pages``: they hold nothing reusable), then the least recently used entries are
evicted and give theirs. The keys' and values' resident memory therefore stays within
``max_num_seqs`` whole slots for the running requests plus the budget. Where the runtime cannot
count pages (the transformers one), an entry is charged its tokens' bytes.

Dimensions: ``P`` prompt tokens; ``E`` retained entries; ``L`` feature layers; ``D`` hidden size.

Worked example: turn 1 (prompt 300 tokens, answer 50) ends and its slot is retained with 349
tokens. Turn 2's prompt (420 tokens) repeats them and adds 71: turn 2 takes the slot over with
its 349 positions and prefills 71. A regenerated turn 2 (the same 420 tokens) then finds turn
2's entry (420 + 40 - 1 tokens) and matches 419 of them: those are copied into a fresh slot, and
the entry stays.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from hybridspec.model import LlamaWeights, LoadedModel, ModelRuntime

logger = logging.getLogger(__name__)

DEFAULT_SHARE_OF_RAM = 32  # the default budget: this fraction of the machine's memory ...
DEFAULT_MAX_MB = 512  # ... but no more than this
MAX_SLOTS = 64  # the most entries: the lookup scans them all


def physical_memory_bytes() -> int | None:
    """The machine's memory, or None where the system cannot say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def default_prefix_cache_mb() -> int:
    """The default budget of resident memory: a thirty-second of the machine's, at most 512 MB
    (a 3,000-token conversation of SmolLM2-135M at 8,192 positions keeps 78 MiB)."""
    total = physical_memory_bytes()
    if total is None:
        return 256
    return int(min(total // DEFAULT_SHARE_OF_RAM // 2**20, DEFAULT_MAX_MB))


def num_slots_for(
    budget_mb: int, bytes_per_token: int, max_seq_len: int, memory_bytes: int | None
) -> int:
    """The cache's virtual slots for a budget of ``budget_mb`` of resident memory: no more than
    entries of one token each could fill (an entry keeps at least its tokens' bytes), than 64
    (the lookup scans every entry), nor than whole slots of ``max_seq_len`` tokens fit in
    ``memory_bytes`` (the machine's memory; None: unknown), so that their address space stays
    within what the system lets a process commit."""
    if budget_mb == 0:
        return 0
    slots = min(MAX_SLOTS, budget_mb * 2**20 // max(1, bytes_per_token))
    if memory_bytes is not None:
        slots = min(slots, memory_bytes // max(1, bytes_per_token * max_seq_len))
    return int(slots)


@dataclass(frozen=True, slots=True)
class CachedFeatures:
    """The target's features at an entry's positions, in the layers a proposer reads."""

    layers: tuple[int, ...]  # the proposer's ``feature_layers``, in its order
    rows: torch.Tensor  # [num_positions, L, D]: row p for position p

    def serves(self, layers: tuple[int, ...]) -> bool:
        return self.layers == layers


@dataclass(frozen=True, slots=True)
class Allocation:
    """A new request's slot, how many of its prompt's positions it already holds, and, for a
    proposer reading features, their rows."""

    slot: int
    num_cached: int
    features: torch.Tensor | None = None  # [num_cached, L, D], or None


@dataclass(slots=True)
class _Entry:
    slot: int
    token_ids: np.ndarray  # [num_cached] int64: the tokens whose keys and values the slot holds
    last_used: int
    features: CachedFeatures | None  # rows for every cached position, or None
    scope: str | None  # the cache scope of the request that left it (module docstring)


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
    # What the cache charges against its budget: the memory pages that its entries' slots and
    # the free slots hold (``KVCache.resident_bytes``), and the entries' features.
    resident_bytes: int = 0
    budget_bytes: int = 0


class PrefixCache:
    """Finished requests' slots of ``runtime``, at most ``num_slots`` of them, holding at most
    ``budget_bytes`` of memory, reused by later requests that share a prefix (module docstring).
    ``bytes_per_token``: a token's keys and values, the charge where the runtime cannot count
    pages (it has no ``resident_bytes``)."""

    def __init__(
        self, runtime: ModelRuntime, num_slots: int, budget_bytes: int, bytes_per_token: int
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots: expected an integer >= 0, got {num_slots!r}")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes: expected an integer >= 0, got {budget_bytes!r}")
        self.runtime = runtime
        self.num_slots = num_slots
        self.budget_bytes = budget_bytes
        self._bytes_per_token = bytes_per_token
        self._resident = getattr(runtime, "resident_bytes", None)
        self._release_pages = getattr(runtime, "release_pages", None)
        self._entries: list[_Entry] = []
        self._running: set[int] = set()  # slots handed to requests and not yet released
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
            self.charged_bytes(),
            self.budget_bytes,
        )

    def charged_bytes(self) -> int:
        """What the cache holds against its budget: its entries, and the free slots' pages."""
        return sum(map(self._entry_bytes, self._entries)) + sum(
            map(self._slot_bytes, self._idle_slots())
        )

    def allocate(
        self,
        prompt_token_ids: list[int] | None,
        feature_layers: tuple[int, ...] = (),
        scope: str | None = None,
    ) -> Allocation:
        """A slot for a new request and how many tokens of its prompt it already caches.

        ``prompt_token_ids`` None: the request does not read the cache (a fresh slot). Else the
        longest prefix of the prompt but its last token that an entry holds is reused (with
        ``feature_layers``, an entry that kept those layers' features, handed over too), among
        the entries of ``scope`` (module docstring). An
        entry the prompt extends whole (a conversation's next turn) hands its slot over as it
        is: it would be dropped as redundant when the request ends, so nothing is copied. A
        partial match is copied into a fresh slot, the entry kept; when no slot is free, the
        least recently used entries are evicted first (the matching one last: if it must go, the
        request takes its slot over, truncated to the match).
        """
        match, length = self._best_match(prompt_token_ids, feature_layers, scope)
        if match is not None and length == len(match.token_ids):
            self._entries.remove(match)
            return self._hand_over(match.slot, match, length, feature_layers)
        while self.runtime.num_free_slots() == 0:
            victims = [e for e in self._entries if e is not match] or self._entries
            if not victims:
                break  # no entry to evict: allocate raises CapacityError
            victim = min(victims, key=lambda e: e.last_used)
            if victim is match:
                self._entries.remove(match)
                self._evicted_tokens += len(match.token_ids) - length
                self.runtime.truncate(match.slot, length)
                return self._hand_over(match.slot, match, length, feature_layers)
            self._evict(victim)
        slot = self.runtime.allocate()
        if match is None or length == 0:
            return self._hand_over(slot, None, 0, feature_layers)
        self.runtime.copy_prefix(match.slot, slot, length)
        match.last_used = self._tick()
        return self._hand_over(slot, match, length, feature_layers)

    def release(
        self,
        slot: int,
        token_ids: list[int],
        retain: bool,
        features: CachedFeatures | None = None,
        scope: str | None = None,
    ) -> None:
        """Take back a finished request's slot, which caches the first ``seq_len(slot)``
        positions of ``token_ids`` at most (the last committed token was never fed, and
        positions past the committed tokens hold rejected drafts): retained when ``retain`` and
        the cache has room, with ``features`` (rows for at least those positions) if given, in
        ``scope``, else freed. Then the cache is brought within its budget."""
        self._running.discard(slot)
        length = min(self.runtime.seq_len(slot), len(token_ids) - 1)
        if features is not None and len(features.rows) < length:
            features = None  # rows missing: the entry serves requests reading no features
        if not retain or self.num_slots == 0 or length < 1:
            self.runtime.free(slot)
            self._fit()
            return
        self.runtime.truncate(slot, length)
        tokens = np.asarray(token_ids[:length], dtype=np.int64)
        if features is not None:
            features = CachedFeatures(features.layers, features.rows[:length])
        for entry in [e for e in self._entries if e.scope == scope]:
            common = _common_prefix(entry.token_ids, tokens)
            if common == len(tokens) and _covers(entry.features, features):
                entry.last_used = self._tick()  # an entry already holds all of it
                self.runtime.free(slot)
                self._fit()
                return
            if common == len(entry.token_ids) and _covers(features, entry.features):
                self._entries.remove(entry)  # the new one extends this entry
                self.runtime.free(entry.slot)
        self._entries.append(_Entry(slot, tokens, self._tick(), features, scope))
        self._fit()

    def clear(self) -> None:
        """Free every entry (counts are kept; the free slots keep their pages)."""
        for entry in list(self._entries):
            self._entries.remove(entry)
            self.runtime.free(entry.slot)

    def reset(self) -> None:
        """Free every entry and zero the counts: the cache as just built."""
        self.clear()
        self._clock = 0
        self._lookups = self._hits = self._hit_tokens = self._evicted_tokens = 0

    def _fit(self) -> None:
        """Evict down to ``num_slots`` entries and ``budget_bytes``: the free slots' pages go
        first (largest first), then the least recently used entries with theirs."""
        while len(self._entries) > self.num_slots:
            self._evict(min(self._entries, key=lambda e: e.last_used), release=True)
        over = self.charged_bytes() - self.budget_bytes
        if over <= 0 or self.num_slots == 0:
            return
        if self._release_pages is not None:
            for slot in sorted(self._idle_slots(), key=self._slot_bytes, reverse=True):
                if over <= 0:
                    return
                over -= self._slot_bytes(slot)
                self._release_pages(slot)
        while over > 0 and self._entries:
            victim = min(self._entries, key=lambda e: e.last_used)
            over -= self._entry_bytes(victim)
            self._evict(victim, release=True)

    def _idle_slots(self) -> list[int]:
        """The runtime's slots that neither a request nor an entry holds."""
        held = self._running | {e.slot for e in self._entries}
        return [s for s in range(self.runtime.max_num_seqs) if s not in held]

    def _slot_bytes(self, slot: int) -> int:
        """The memory pages ``slot`` holds (0 where the runtime cannot count them: it frees a
        slot's memory with the slot)."""
        return self._resident(slot) if self._resident is not None else 0

    def _entry_bytes(self, entry: _Entry) -> int:
        slot = (
            self._resident(entry.slot)
            if self._resident is not None
            else len(entry.token_ids) * self._bytes_per_token
        )
        rows = entry.features.rows if entry.features is not None else None
        return slot + (rows.numel() * rows.element_size() if rows is not None else 0)

    def _best_match(
        self, prompt_token_ids: list[int] | None, feature_layers: tuple[int, ...], scope: str | None
    ) -> tuple[_Entry | None, int]:
        """The entry of ``scope`` sharing the longest prefix with the prompt but its last token
        (with ``feature_layers``, one that kept their features where it shares as much), and
        the length of that prefix (None, 0 when none shares any)."""
        if prompt_token_ids is None:
            return None, 0
        self._lookups += 1
        if not self._entries or len(prompt_token_ids) < 2:
            return None, 0
        prompt = np.asarray(prompt_token_ids[:-1], dtype=np.int64)
        best, best_length = None, 0
        for entry in self._entries:
            if entry.scope != scope:
                continue
            length = _common_prefix(entry.token_ids, prompt)
            if length > best_length or (
                length == best_length
                and length > 0
                and _serves(entry, feature_layers)
                and not _serves(best, feature_layers)
            ):
                best, best_length = entry, length
        return best, best_length

    def _hand_over(
        self, slot: int, entry: _Entry | None, length: int, feature_layers: tuple[int, ...]
    ) -> Allocation:
        """Count the hit (if any) and hand ``slot`` to a request, with the entry's features of
        the ``length`` positions it reuses where it kept those of ``feature_layers``."""
        self._running.add(slot)
        if length > 0:
            self._hits += 1
            self._hit_tokens += length
        rows = None
        if entry is not None and entry.features is not None and _serves(entry, feature_layers):
            rows = entry.features.rows[:length]
        return Allocation(slot, length, rows)

    def _evict(self, entry: _Entry, release: bool = False) -> None:
        """Drop ``entry``; with ``release``, its slot's pages go back to the system too."""
        self._entries.remove(entry)
        self._evicted_tokens += len(entry.token_ids)
        self.runtime.free(entry.slot)
        if release and self._release_pages is not None:
            self._release_pages(entry.slot)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock


def _serves(entry: _Entry | None, feature_layers: tuple[int, ...]) -> bool:
    """Whether ``entry`` kept the features of ``feature_layers`` (False for no layers: a
    request reading none gets no rows)."""
    if not feature_layers or entry is None or entry.features is None:
        return False
    return entry.features.serves(feature_layers)


def _covers(kept: CachedFeatures | None, new: CachedFeatures | None) -> bool:
    """Whether an entry with features ``kept`` serves every request one with ``new`` would."""
    return new is None or (kept is not None and kept.serves(new.layers))


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
