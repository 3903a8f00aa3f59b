"""Helpers of the ngram proposer's tests: a proposer over a small vocabulary, one-call rounds,
and the soundness of a proposal."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybridspec.config import NgramConfig
from hybridspec.proposers.base import ProposerContext
from hybridspec.proposers.ngram import NgramProposer
from hybridspec.proposers.ngram_reference import ngram_counts
from hybridspec.types import CommitInfo, ProposeRequest, SamplingParams

VOCAB_SIZE = 1000
FREQUENCY = NgramConfig(min_order=2, max_order=4, continuation="frequency")
COPY = NgramConfig(min_order=1, max_order=8, continuation="copy")
REPO_ROOT = Path(__file__).resolve().parents[2]


def make_proposer(config: NgramConfig | None = None) -> NgramProposer:
    return NgramProposer(
        ProposerContext(vocab_size=VOCAB_SIZE, eos_token_ids=(0,), ngram=config or NgramConfig())
    )


def commit(
    proposer: NgramProposer, seq_id: int, token_ids: Sequence[int], num_accepted: int
) -> None:
    proposer.commit(CommitInfo(seq_id, token_ids, num_accepted))


def request(
    seq_id: int, token_ids: Sequence[int], k: int, prefix: Sequence[int] = ()
) -> ProposeRequest:
    return ProposeRequest(
        seq_id=seq_id,
        token_ids=token_ids,
        max_num_drafts=k,
        sampling=SamplingParams(),
        draft_prefix=tuple(prefix),
    )


def propose_one(
    proposer: NgramProposer, seq_id: int, token_ids: Sequence[int], k: int
) -> list[int]:
    [proposal] = proposer.propose([request(seq_id, token_ids, k)])
    assert proposal.probs is None
    return list(proposal.token_ids)


def is_sound(token_ids: Sequence[int], proposal: Sequence[int], config: NgramConfig) -> bool:
    """Whether each proposed token followed, in the window, the n tokens before it (some n)."""
    orders = range(config.min_order, config.max_order + 1)
    counts = {n: ngram_counts(token_ids, n, config.window) for n in orders}
    context = list(token_ids)
    for token in proposal:
        if not any(token in counts[n].get(tuple(context[-n:]), {}) for n in orders):
            return False
        context.append(token)
    return True
