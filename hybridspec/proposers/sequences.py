"""``SequenceProposer``: the per-sequence bookkeeping of a proposer that keeps state per
sequence in a cache of its own (``draft``: the draft model's KV cache; ``eagle``: the head's):
``start`` takes a slot, ``_tracked`` finds each request's state and checks that no commit was
missed, ``finish`` and ``close`` free the slots.

Worked example: ``start(7, prompt of 12 tokens)`` makes ``_seqs[7]`` with a new slot and
``committed_len = 12``; a ``propose`` whose request 7 holds 15 committed tokens raises
InvalidRequestError (param ``seq_id``: ``commit()`` was missed), as does any call for a
sequence never started; ``finish(7)`` frees the slot, and a second ``finish(7)`` does nothing.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from hybridspec.errors import InvalidRequestError
from hybridspec.proposers.base import Proposer, ProposerContext
from hybridspec.types import NO_SESSION, ProposeRequest, Session


@dataclass(slots=True)
class SeqState:
    """A sequence's state in its proposer: its slot and the tokens committed so far."""

    slot: int
    committed_len: int


S = TypeVar("S", bound=SeqState)


class SequenceProposer(Proposer, Generic[S]):
    """A proposer with one ``S`` per started sequence (module docstring)."""

    # what the proposer calls itself in a missed-commit message ("the draft")
    tracker_name = "the proposer"

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self._seqs: dict[int, S] = {}

    @abstractmethod
    def _new_seq(self, prompt_token_ids: Sequence[int]) -> S:
        """The state of a sequence started with ``prompt_token_ids``: a slot taken."""

    @abstractmethod
    def _free_seq(self, seq: S) -> None:
        """Release what ``_new_seq`` took."""

    def start(
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        if seq_id in self._seqs:
            raise InvalidRequestError(f"seq_id: {seq_id} was already started", "seq_id")
        self._seqs[seq_id] = self._new_seq(prompt_token_ids)

    def _seq(self, seq_id: int) -> S:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise InvalidRequestError(f"seq_id: {seq_id} is not started", "seq_id") from None

    def _tracked(self, requests: Sequence[ProposeRequest]) -> list[S]:
        """Each request's state, checked against its committed tokens."""
        seqs = [self._seq(r.seq_id) for r in requests]
        for request, seq in zip(requests, seqs, strict=True):
            if len(request.token_ids) != seq.committed_len:
                raise InvalidRequestError(
                    f"seq_id: {request.seq_id} has {len(request.token_ids)} committed tokens, "
                    f"{self.tracker_name} tracked {seq.committed_len}; commit() was missed",
                    "seq_id",
                )
        return seqs

    def finish(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free_seq(seq)

    def close(self) -> None:
        for seq_id in list(self._seqs):
            self.finish(seq_id)
