"""The ``ngram`` proposer: guesses the next tokens from n-grams of the sequence's own recent text.

Prompt-lookup decoding: the latest tokens are matched against earlier contexts of the same
sequence, and what followed them is proposed. It needs no model, so it costs microseconds per
round; it shines on text that repeats its context (code edits, summaries, retrieval answers)
and proposes nothing where no context matches.

Two continuations (``NgramConfig.continuation``):

- ``"copy"`` (the default, with orders 1..8): find the longest order whose last-``n``-token
  context has an occurrence, take its latest occurrence, and propose the tokens that followed
  it, verbatim, up to K or to the end of the committed text.
- ``"frequency"``: each token is the continuation seen most often after the longest matching
  context, predictions chained; defined in the glossary below.

``"copy"`` is the default because on input-grounded prompts it yields more tokens per forward
than ``"frequency"``, greedy and sampled (figures: ``benchmarks/results/model.md``, "Figures
that docstrings used to carry").

Glossary:

- position: index of a committed token of the sequence, prompt first, counted from 0.
- ``L``: committed tokens so far; the *window* is positions ``max(0, L - window) .. L - 1``.
- order ``n``: the length of a context, ``min_order <= n <= max_order``.
- occurrence: a window position ``p`` whose ``n`` preceding positions are in the window too;
  they are its *context*, the token at ``p`` its *next token*. ``count(context, next)`` is the
  number of such occurrences; once a position leaves the window, its occurrences stop counting.
- prediction: for the longest order whose last-``n``-token context has any occurrence (backing
  off from ``max_order`` to ``min_order``), the next token with the highest count; ties go to
  the one whose latest occurrence is the most recent (tie-break).
- chaining: each predicted token is appended to a scratch copy of the context to predict the
  next one (predictions are never counted); the proposal stops at the first position without a
  prediction, or after K tokens.

Worked example (``min_order=2, max_order=3``), committed context
``5 7 9 1 5 7 2 8 5 7 2 3 5 7`` and K = 4:

1. order 3, context ``3 5 7``: never seen; order 2, ``5 7``: followed by 9 once and 2 twice: 2.
2. order 3, ``5 7 2``: followed by 8 (position 7) and 3 (position 11), once each: 3, the later.
3. ``7 2 3`` is followed by 5; 4. ``2 3 5`` by 7. The proposal is ``2 3 5 7``.

With ``"copy"`` and the same orders, ``3 5 7`` has no occurrence; ``5 7`` occurs latest at
positions 8-9, followed by ``2 3 5 7`` (positions 10-13): the same proposal here, but taken in
one piece from position 10, and cut short when the committed text ends.

How the tables are laid out and hashed is described in ``ngram_kernels``; ``ngram_reference``
is the same semantics in plain Python, which the tests compare against.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hybridspec.config import MAX_SPECULATIVE_TOKENS
from hybridspec.errors import InvalidRequestError, check
from hybridspec.proposers.base import Proposer, ProposerContext
from hybridspec.proposers.lazy_kernels import compiled_ngram
from hybridspec.proposers.ngram_tables import (
    allocate_tables,
    grow_tables,
    packed,
    plain_token_ids,
)
from hybridspec.types import NO_SESSION, CommitInfo, Proposal, ProposeRequest, Session

__all__ = ["NgramProposer"]

logger = logging.getLogger(__name__)

INITIAL_NUM_SLOTS = 4  # the pool doubles whenever a sequence starts and no slot is free
MAX_VOCAB_SIZE = 1 << 31  # token ids are stored as int32


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _invalid(param: str, message: str) -> InvalidRequestError:
    """The error ``check`` raises; hot paths build it only on failure, not the message each call."""
    return InvalidRequestError(f"{param}: {message}", param=param)


class NgramProposer(Proposer):
    """Deterministic proposer over per-sequence n-gram tables (see the module docstring).

    Its options are the configuration's ``ngram`` section (``context.ngram``).
    Each started sequence holds one slot of a pool of preallocated tables; ``propose`` serves a
    whole batch with one compiled call. ``commit`` checks the tokens and keeps them; the tables
    learn them when the sequence is next proposed for (one compiled call for the batch's
    sequences and every round since, so that rounds in which the engine does not call
    ``propose``, without drafts or a shadow probe, cost none).
    It continues a ``ProposeRequest.draft_prefix``: the prefix ends the context it matches, and
    what it copies or predicts follows it.
    """

    continues_prefix = True
    shadow_checked = True  # a lookup in its tables; commit only appends the tokens

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        config = context.ngram
        check(
            _is_int(context.vocab_size) and 1 <= context.vocab_size <= MAX_VOCAB_SIZE,
            "vocab_size",
            f"expected an integer in [1, {MAX_VOCAB_SIZE}], got {context.vocab_size!r}",
        )
        if config.table_capacity < 4 * config.window:
            logger.warning(
                "ngram: table_capacity %d < 4 * window %d: full tables will drop n-grams, "
                "which lowers acceptance (never correctness)",
                config.table_capacity,
                config.window,
            )
        self.config = config
        self._vocab_size = int(context.vocab_size)
        self._tables = allocate_tables(
            INITIAL_NUM_SLOTS,
            num_orders=config.max_order - config.min_order + 1,
            capacity=config.table_capacity,
            window=config.window,
        )
        self._slot_of_seq: dict[int, int] = {}
        self._unlearned: dict[int, list[int]] = {}  # by slot: committed tokens
        self._free_slots = list(range(INITIAL_NUM_SLOTS - 1, -1, -1))  # pop() takes slot 0 first

    def start(
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        check(_is_int(seq_id), "seq_id", f"expected an integer, got {seq_id!r}")
        check(
            seq_id not in self._slot_of_seq,
            "seq_id",
            f"sequence {seq_id} is already started; finish() it before starting it again",
        )
        prompt = self._token_array(prompt_token_ids, "prompt_token_ids")
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        compiled_ngram().seed_slot(self._tables, self.config.min_order, slot, prompt)
        self._slot_of_seq[seq_id] = slot

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        if not requests:
            return []
        slots, num_drafts = [], []
        for request in requests:
            slot = self._slot(request.seq_id, "propose")
            k = request.max_num_drafts
            if not (_is_int(k) and 0 <= k <= MAX_SPECULATIVE_TOKENS):
                raise _invalid(
                    "max_num_drafts",
                    f"expected an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}",
                )
            slots.append(slot)
            num_drafts.append(k)
        self._learn(slots)
        for request, slot in zip(requests, slots, strict=True):
            seen = int(self._tables.num_tokens[slot])
            if len(request.token_ids) != seen:
                raise _invalid(
                    "token_ids",
                    f"sequence {request.seq_id} has {len(request.token_ids)} committed tokens "
                    f"but the proposer has seen {seen}; was a commit() missed?",
                )
        out_token_ids = np.empty((len(requests), max(num_drafts)), np.int64)
        out_num_drafts = np.empty(len(requests), np.int64)
        prefix_lengths = np.array([len(r.draft_prefix) for r in requests], np.int64)
        prefixes = np.zeros((len(requests), max(1, int(prefix_lengths.max()))), np.int64)
        for i, request in enumerate(requests):
            prefixes[i, : len(request.draft_prefix)] = request.draft_prefix
        compiled_ngram().propose_batch(
            self._tables,
            self.config.min_order,
            self.config.continuation == "copy",
            np.array(slots, np.int64),
            np.array(num_drafts, np.int64),
            prefixes,
            prefix_lengths,
            out_token_ids,
            out_num_drafts,
        )
        rows = out_token_ids.tolist()
        return [
            Proposal(token_ids=row[:n])
            for row, n in zip(rows, out_num_drafts.tolist(), strict=True)
        ]

    def commit(self, info: CommitInfo) -> None:
        """Learn the appended tokens. Proposals are never counted, so nothing is rolled back
        and ``num_accepted`` is only checked."""
        slot = self._slot(info.seq_id, "commit")
        tokens = plain_token_ids(info.token_ids, self._vocab_size)
        if tokens is None:
            tokens = self._token_array(info.token_ids, "token_ids").tolist()
        num_accepted = info.num_accepted
        if not (_is_int(num_accepted) and 0 <= num_accepted <= len(tokens)):
            raise _invalid(
                "num_accepted", f"expected an integer in [0, {len(tokens)}], got {num_accepted!r}"
            )
        if tokens:
            self._unlearned.setdefault(slot, []).extend(tokens)

    def _learn(self, slots: list[int]) -> None:
        """Append the tokens committed to each of ``slots`` since it was last proposed for, in
        one compiled call."""
        batch = [(slot, tokens) for slot in slots if (tokens := self._unlearned.pop(slot, None))]
        if batch:
            compiled_ngram().append_batch(self._tables, self.config.min_order, *packed(batch))

    def finish(self, seq_id: int) -> None:
        """Release the sequence's slot. Unknown ids are ignored: the engine's clean-up paths
        call ``finish`` for every failed request, including one whose ``start`` failed."""
        slot = self._slot_of_seq.pop(seq_id, None)
        if slot is not None:
            self._unlearned.pop(slot, None)
            self._free_slots.append(slot)

    @property
    def num_active(self) -> int:
        """Sequences started and not yet finished."""
        return len(self._slot_of_seq)

    @property
    def num_slots(self) -> int:
        """Sequences the preallocated pool can hold before it grows."""
        return int(self._tables.history.shape[0])

    def _slot(self, seq_id: int, method: str) -> int:
        slot = self._slot_of_seq.get(seq_id)
        if slot is None:
            raise _invalid("seq_id", f"unknown sequence {seq_id!r} in {method}(); start() it first")
        return slot

    def _token_array(self, token_ids: Sequence[int], param: str) -> npt.NDArray[np.int64]:
        """``token_ids`` as a contiguous int64 array, each checked to be in [0, vocab_size)."""
        array = np.asarray(token_ids)
        if array.ndim != 1:
            raise _invalid(param, f"expected a flat sequence of token ids, got shape {array.shape}")
        if array.size == 0:
            return np.empty(0, np.int64)
        if array.dtype.kind not in "iu":
            raise _invalid(param, f"expected integer token ids, got dtype {array.dtype}")
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= self._vocab_size:
            bad = low if low < 0 else high
            raise _invalid(param, f"expected token ids in [0, {self._vocab_size}), got {bad}")
        return np.ascontiguousarray(array, dtype=np.int64)

    def _grow(self) -> None:
        old = self.num_slots
        self._tables = grow_tables(self._tables, 2 * old)
        self._free_slots.extend(range(2 * old - 1, old - 1, -1))
        logger.debug("ngram: slot pool grown from %d to %d sequences", old, 2 * old)
