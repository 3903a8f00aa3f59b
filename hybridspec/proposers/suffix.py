"""The ``suffix`` proposer: drafts from the sequence's own text and from recent requests' text.

Suffix decoding (as vLLM's and llama.cpp's shared n-gram pool do): besides what the ``ngram``
proposer matches in the request's own text, the prompts and outputs of finished requests are
kept in a bounded store, so that an answer repeating an earlier one (a regenerated answer, an
agent's next edit of the same file, a second summary of one document) drafts it whole.

- **Longest match.** The request's last tokens are looked up, longest context first, in its own
  text and in its pool of recent text; the first hit's continuation is copied
  (``suffix_kernels``). Drafts are deterministic, so the request's text is what it would be
  without them (lossless, as ``ngram``).
- **Confidence.** How often drafts were kept is counted per source (own text, pool) and matched
  order (``AcceptanceEstimate``, whose prior trusts a match of ``n`` tokens ``n / (n + 1)``); a
  proposal is cut to the drafts whose chance of acceptance, ``rate ** j``, stays above
  ``MIN_CONFIDENCE``: a long match that has been kept drafts many, a one-token match of new
  text few (3 at the prior). Adaptive speculation then prices what is left against the
  request's own rate.
- **Learning.** Committed tokens wait, checked, until the sequence's next proposal (or its
  finish) and enter its tables there, the batch's sequences in one compiled call: a round
  without drafts does not call ``propose`` (``Proposer``), and costs no table work.
- **Bound.** The store is ``SuffixConfig.max_tokens`` tokens (``--suffix-cache-tokens``): the
  oldest leave first, a sliding window over n-gram tables (``ngram_kernels``).
- **Isolation** (``SuffixConfig.isolation``): ``per-server``, one pool for every request;
  ``per-session``, a pool per session (``GenerationParams.session``, the server's ``user``
  field; at most ``MAX_SESSIONS``, least recent evicted, the bound shared among them) and none
  for a request without one; ``off``, no pool (the own text only). Drafts never change output,
  but they change timing: a request that drafts from another user's text runs faster when it
  repeats it, which tells that user's text to whoever measures.
- **Scopes** (``GenerationParams.cache_scope``, the server's tenant and ``cache_salt``): under
  ``per-session`` a pool is a session's within a scope (a request with a scope and no session
  has its scope's pool); under ``per-server`` the one pool is the shared scope's, and a
  request with a scope drafts from no pool. A request with ``cache_prompt`` off neither drafts
  from a pool nor feeds one.

Dimensions: ``num_seqs`` sequences of a batch; ``K`` the most drafts asked.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hybridspec.config import MAX_SPECULATIVE_TOKENS
from hybridspec.errors import check
from hybridspec.proposers.base import Proposer, ProposerContext
from hybridspec.proposers.lazy_kernels import compiled_ngram, compiled_suffix
from hybridspec.proposers.ngram_tables import allocate_tables, packed, plain_token_ids
from hybridspec.types import NO_SESSION, CommitInfo, Proposal, ProposeRequest, Session
from hybridspec.verifier.estimate import AcceptanceEstimate, drafts_worth_asking

logger = logging.getLogger(__name__)

MIN_CONFIDENCE = 0.1  # the lowest chance of acceptance a draft is proposed with
MAX_SESSIONS = 8  # pools kept under per-session isolation
SHARED_MIN_ORDER = 2  # a one-token context in other requests' text predicts little
NO_POOL = -1
_Key = tuple[str | None, str | None]  # a pool's (cache scope, session)


def _capacity(window: int) -> int:
    """A table capacity of at least ``4 * window`` (a power of two): no occurrence dropped."""
    return 1 << max(4, (4 * window - 1).bit_length())


class SuffixProposer(Proposer):
    """Deterministic drafts from the sequence's own text and its pool (module docstring)."""

    continues_prefix = True
    shadow_checked = True  # a lookup in its tables; commit learns the tokens and the draft's fate

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        ngram, config = context.ngram, context.suffix
        self.config = config
        self._vocab_size = int(context.vocab_size)
        self._own_min_order = ngram.min_order
        self._max_order = ngram.max_order
        self._own = allocate_tables(
            context.max_num_seqs,
            ngram.max_order - ngram.min_order + 1,
            ngram.table_capacity,
            ngram.window,
        )
        self._free = list(range(context.max_num_seqs - 1, -1, -1))
        num_pools = {"per-server": 1, "per-session": MAX_SESSIONS, "off": 0}[config.isolation]
        window = max(self._max_order + 1, config.max_tokens // max(1, num_pools))
        shared_orders = max(1, self._max_order - SHARED_MIN_ORDER + 1)
        # each pool as seeded with no tokens; the kernels come with the first ``start``
        self._shared = allocate_tables(max(1, num_pools), shared_orders, _capacity(window), window)
        self._pools: OrderedDict[_Key, int] = OrderedDict()  # (scope, session) -> pool, LRU first
        self._num_pools = num_pools
        # seq -> own slot, pool, pool key, tokens (prompt and output)
        self._seqs: dict[int, tuple[int, int, _Key | None, list[int]]] = {}
        self._last: dict[int, tuple[int, int, int]] = {}  # seq -> source, order, drafts
        self._unlearned: dict[int, list[int]] = {}  # seq -> tokens committed since
        self._rates: dict[tuple[int, int], AcceptanceEstimate] = {}

    def _key_of(self, session: Session) -> _Key | None:
        """The pool key of a sequence of ``session``, (scope, session); None: it has no pool."""
        if self._num_pools == 0 or not session.shares:
            return None
        scope = session.scope
        if self.config.isolation == "per-server":
            return None if scope is not None else (None, None)
        return None if scope is None and session.name is None else (scope, session.name)

    def _pool_of(self, key: _Key | None) -> int:
        """The pool a request with pool key ``key`` drafts from and feeds (NO_POOL: none)."""
        if key is None:
            return NO_POOL
        pool = self._pools.get(key)
        if pool is None:
            if len(self._pools) < self._num_pools:
                pool = len(self._pools)
            else:  # the least recent session's pool starts over for this one
                _, pool = self._pools.popitem(last=False)
                compiled_ngram().seed_slot(
                    self._shared, SHARED_MIN_ORDER, pool, np.empty(0, np.int64)
                )
        self._pools[key] = pool
        self._pools.move_to_end(key)
        return pool

    def start(
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        check(seq_id not in self._seqs, "seq_id", f"sequence {seq_id} is already started")
        prompt = self._tokens(prompt_token_ids)
        check(bool(self._free), "seq_id", "more sequences than the engine's max_num_seqs")
        slot = self._free.pop()
        compiled_ngram().seed_slot(self._own, self._own_min_order, slot, prompt)
        key = self._key_of(session)
        self._seqs[seq_id] = (slot, self._pool_of(key), key, [int(t) for t in prompt])

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        if not requests:
            return []
        num = len(requests)
        own_slots, pools = np.empty(num, np.int64), np.empty(num, np.int64)
        num_drafts = np.empty(num, np.int64)
        for i, request in enumerate(requests):
            own_slots[i], pools[i] = self._slots(request.seq_id)
            k = request.max_num_drafts
            check(
                0 <= k <= MAX_SPECULATIVE_TOKENS,
                "max_num_drafts",
                f"expected an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}",
            )
            num_drafts[i] = k
        self._learn([r.seq_id for r in requests], own_slots.tolist())
        prefix_lengths = np.array([len(r.draft_prefix) for r in requests], np.int64)
        prefixes = np.zeros((num, max(1, int(prefix_lengths.max()))), np.int64)
        for i, request in enumerate(requests):
            prefixes[i, : len(request.draft_prefix)] = request.draft_prefix
        out = np.empty((num, max(1, int(num_drafts.max()))), np.int64)
        out_num, orders, sources = (np.empty(num, np.int64) for _ in range(3))
        compiled_suffix().propose_longest(
            self._own, self._own_min_order, own_slots, self._shared, SHARED_MIN_ORDER, pools,
            num_drafts, prefixes, prefix_lengths, out, out_num, orders, sources,
        )  # fmt: skip
        proposals = []
        for i, request in enumerate(requests):
            key = (int(sources[i]), int(orders[i]))
            rate = self._rate(*key).rate
            n = drafts_worth_asking(rate, MIN_CONFIDENCE, int(out_num[i]))
            self._last[request.seq_id] = (*key, n)
            proposals.append(Proposal(token_ids=out[i, :n].tolist()))
        return proposals

    def _rate(self, source: int, order: int) -> AcceptanceEstimate:
        """The acceptance of drafts from ``source`` after a match of ``order`` tokens; before
        any evidence, ``order / (order + 1)``: the longer the match, the more it is trusted."""
        key = (source, order)
        if key not in self._rates:
            self._rates[key] = AcceptanceEstimate(prior_accepted=float(max(1, order)))
        return self._rates[key]

    def commit(self, info: CommitInfo) -> None:
        """Learn the appended tokens, and how many of the last proposal's drafts were kept."""
        self._seq(info.seq_id)
        new = plain_token_ids(info.token_ids, self._vocab_size)
        if new is None:
            new = self._tokens(info.token_ids).tolist()
        if new:  # learned at the next proposal (module docstring, "Learning")
            self._unlearned.setdefault(info.seq_id, []).extend(new)
        last = self._last.pop(info.seq_id, None)
        if last is not None and last[2] > 0:
            source, order, num = last
            self._rate(source, order).observe(num, min(num, info.num_accepted))

    def finish(self, seq_id: int) -> None:
        """Release the sequence, adding its prompt and output to its pool."""
        state = self._seqs.get(seq_id)
        self._last.pop(seq_id, None)
        if state is None:
            return
        tokens = state[3]
        tokens.extend(self._unlearned.pop(seq_id, ()))
        slot, pool, key, _ = self._seqs.pop(seq_id)
        self._free.append(slot)
        if key is not None and self._pools.get(key) == pool:  # else its session was evicted
            compiled_ngram().append_tokens(
                self._shared, SHARED_MIN_ORDER, pool, np.asarray(tokens, np.int64)
            )

    def _learn(self, seq_ids: list[int], slots: list[int]) -> None:
        """Append the tokens committed to each of ``seq_ids`` since its last proposal to its
        own tables (in its slot of ``slots``), in one compiled call, and to its text."""
        batch = []
        for seq_id, slot in zip(seq_ids, slots, strict=True):
            new = self._unlearned.pop(seq_id, None)
            if new:
                batch.append((slot, new))
                self._seqs[seq_id][3].extend(new)
        if batch:
            compiled_ngram().append_batch(self._own, self._own_min_order, *packed(batch))

    def _slots(self, seq_id: int) -> tuple[int, int]:
        """The sequence's own slot, and its pool while its session still holds it."""
        slot, pool, key, _ = self._seq(seq_id)
        return slot, pool if key is not None and self._pools.get(key) == pool else NO_POOL

    def _seq(self, seq_id: int) -> tuple[int, int, _Key | None, list[int]]:
        state = self._seqs.get(seq_id)
        check(state is not None, "seq_id", f"unknown sequence {seq_id!r}; start() it first")
        assert state is not None
        return state

    def _tokens(self, token_ids: Sequence[int]) -> np.ndarray:
        array = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        check(
            array.size == 0 or (int(array.min()) >= 0 and int(array.max()) < self._vocab_size),
            "token_ids",
            f"expected token ids in [0, {self._vocab_size})",
        )
        return array
