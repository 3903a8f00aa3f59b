"""Oracle drafts: a measuring tool, never a proposer a server offers.

``OracleProposer`` drafts the target's own greedy continuation of a prompt, known beforehand
from a ``none`` run of the same request (``OracleReferences``), and makes each draft right with
probability ``alpha`` and wrong otherwise. So it turns a chosen acceptance rate into drafts on
any model, random weights included, and what the runtime makes of that acceptance can be
measured apart from how well any real proposer guesses (``oracle_table``).

Which drafts are right is drawn once per sequence, by generated position, from a generator
seeded with ``seed`` and the prompt: ``round(alpha * n)`` of the continuation's ``n``
positions, chosen uniformly, so that each position is right with probability ``alpha`` (the
model adaptive speculation assumes, ``engine.speculation``) and a sequence's share of right
drafts is ``alpha`` itself. Independent draws would leave that share to luck: over a
48-token continuation it strays from ``alpha`` by about 0.07 (one standard deviation), which
moves a run's tokens per round by about a sixth at K=6. A position's draw holds whatever K
asks for it, so that runs at different K meet the same luck. A wrong draft is the right token
plus one (modulo the vocabulary): greedy verification always rejects it, and the text stays
the target's.

Only ``hybridspec bench`` builds it, registering it on its own engine
(``Engine.register_proposer``); it is not in ``proposers.registry``'s built-in names.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridspec.errors import check
from hybridspec.proposers.base import Proposer, ProposerContext, ProposerFactory
from hybridspec.types import NO_SESSION, Proposal, ProposeRequest, Session


@dataclass(slots=True)
class OracleReferences:
    """The target's greedy continuation of each prompt (from a ``none`` run), by prompt."""

    continuations: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)

    def add(self, prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        self.continuations[tuple(prompt_token_ids)] = tuple(token_ids)

    def get(self, prompt_token_ids: Sequence[int]) -> tuple[int, ...]:
        key = tuple(prompt_token_ids)
        check(
            key in self.continuations,
            "prompt",
            f"the oracle has no greedy continuation of this {len(key)}-token prompt "
            "(run it with proposer 'none' first)",
        )
        return self.continuations[key]


@dataclass(frozen=True, slots=True)
class _Sequence:
    prompt_length: int
    continuation: tuple[int, ...]
    right: np.ndarray  # [len(continuation)] bool: the draft at that position is right


class OracleProposer(Proposer):
    """Drafts a known greedy continuation, each draft right with probability ``alpha``."""

    def __init__(
        self, context: ProposerContext, references: OracleReferences, alpha: float, seed: int = 0
    ) -> None:
        super().__init__(context)
        check(0.0 <= alpha <= 1.0, "alpha", f"expected a probability in [0, 1], got {alpha}")
        self._references = references
        self._alpha = alpha
        self._seed = seed
        self._sequences: dict[int, _Sequence] = {}

    def start(
        self, seq_id: int, prompt_token_ids: Sequence[int], session: Session = NO_SESSION
    ) -> None:
        continuation = self._references.get(prompt_token_ids)
        key = zlib.crc32(np.asarray(prompt_token_ids, np.int64).tobytes())
        rng = np.random.default_rng((self._seed, key))
        right = np.zeros(len(continuation), dtype=bool)
        right[rng.permutation(len(continuation))[: round(self._alpha * len(continuation))]] = True
        self._sequences[seq_id] = _Sequence(len(prompt_token_ids), continuation, right)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return [self._propose(r) for r in requests]

    def _propose(self, request: ProposeRequest) -> Proposal:
        """Drafts for positions ``g .. g + k - 1`` of the continuation, ``g`` the tokens
        generated so far (greedy: they are its first ``g``)."""
        sequence = self._sequences[request.seq_id]
        start = len(request.token_ids) - sequence.prompt_length
        stop = min(start + request.max_num_drafts, len(sequence.continuation))
        vocab = self.context.vocab_size
        drafts = tuple(
            sequence.continuation[p]
            if sequence.right[p]
            else (sequence.continuation[p] + 1) % vocab
            for p in range(start, stop)
        )
        return Proposal(token_ids=drafts)

    def finish(self, seq_id: int) -> None:
        self._sequences.pop(seq_id, None)


def oracle_factory(references: OracleReferences, alpha: float, seed: int = 0) -> ProposerFactory:
    """A ``ProposerFactory`` of oracle drafts at ``alpha``, for ``Engine.register_proposer``."""

    def build(context: ProposerContext) -> OracleProposer:
        return OracleProposer(context, references, alpha, seed)

    return build
