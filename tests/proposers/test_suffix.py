"""The suffix proposer: longest match over its own text and its pool, isolation, the bound."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from hybridspec.config import SuffixConfig
from hybridspec.errors import InvalidRequestError
from hybridspec.proposers.base import ProposerContext
from hybridspec.proposers.suffix import SuffixProposer
from hybridspec.types import CommitInfo, Session
from tests.proposers.ngram_helpers import request

VOCAB_SIZE = 1000
ANSWER = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]


def make(isolation: str = "per-server", max_tokens: int = 4096) -> SuffixProposer:
    sessions: dict[int, str | None] = {}
    scopes: dict[int, tuple[bool, str | None]] = {}
    proposer = SuffixProposer(
        ProposerContext(
            vocab_size=VOCAB_SIZE, eos_token_ids=(0,), suffix=SuffixConfig(max_tokens, isolation)
        )
    )
    proposer.sessions = sessions  # type: ignore[attr-defined]  # the tests set them
    proposer.scopes = scopes  # type: ignore[attr-defined]
    return proposer


def start(proposer: SuffixProposer, seq_id: int, prompt: list[int]) -> None:
    """Start ``seq_id`` with the session and scope the test set for it (``Session``)."""
    shares, scope = proposer.scopes.get(seq_id, (True, None))  # type: ignore[attr-defined]
    proposer.start(seq_id, prompt, Session(proposer.sessions.get(seq_id), shares, scope))  # type: ignore[attr-defined]


def serve(proposer: SuffixProposer, seq_id: int, prompt: list[int], output: list[int],
          session: str | None = None) -> None:  # fmt: skip
    """A whole request: started, its output committed one token a round, finished."""
    proposer.sessions[seq_id] = session  # type: ignore[attr-defined]
    start(proposer, seq_id, prompt)
    for token in output:
        proposer.commit(CommitInfo(seq_id, [token], 0))
    proposer.finish(seq_id)


def drafts(proposer: SuffixProposer, seq_id: int, tokens: list[int], k: int = 8,
           session: str | None = None) -> list[int]:  # fmt: skip
    proposer.sessions[seq_id] = session  # type: ignore[attr-defined]
    start(proposer, seq_id, tokens)
    [proposal] = proposer.propose([request(seq_id, tokens, k)])
    proposer.finish(seq_id)
    return list(proposal.token_ids)


def test_an_earlier_requests_answer_is_drafted_again() -> None:
    proposer = make()
    serve(proposer, 0, [5, 6, 7, 8], ANSWER)
    assert drafts(proposer, 1, [9, 9, 5, 6, 7, 8]) == ANSWER[:8]
    assert drafts(proposer, 2, [7, 8, *ANSWER[:3]], k=4) == ANSWER[3:7]


def test_the_own_text_wins_at_equal_order_and_the_longer_match_wins() -> None:
    proposer = make()
    serve(proposer, 0, [1, 2, 3, 4, 50, 51], [])
    # Own text: "3 4" then 60; pool: "2 3 4" then 50 (longer) -> the pool's.
    assert drafts(proposer, 1, [3, 4, 60, 61, 2, 3, 4], k=2) == [50, 51]
    # Own text "2 3 4" then 70; the pool's match is as long -> the own text's.
    assert drafts(proposer, 2, [2, 3, 4, 70, 71, 2, 3, 4], k=2) == [70, 71]


def test_nothing_to_match_drafts_nothing() -> None:
    proposer = make()
    serve(proposer, 0, [1, 2, 3], [4, 5])
    assert drafts(proposer, 1, [200, 201, 202]) == []


def test_per_session_pools_keep_sessions_apart() -> None:
    proposer = make("per-session")
    serve(proposer, 0, [5, 6, 7, 8], ANSWER, session="alice")
    assert drafts(proposer, 1, [5, 6, 7, 8], session="bob") == []
    assert drafts(proposer, 2, [5, 6, 7, 8], session=None) == []
    assert drafts(proposer, 3, [5, 6, 7, 8], session="alice") == ANSWER[:8]


def test_the_least_recent_session_is_evicted_and_never_leaks() -> None:
    proposer = make("per-session")
    proposer.sessions[0] = "s0"  # type: ignore[attr-defined]
    start(proposer, 0, [5, 6, 7, 8])  # s0 live while 8 other sessions take every pool
    for i in range(1, 9):
        serve(proposer, i, [5, 6, 7, 8], [300 + i, 301 + i], session=f"s{i}")
    [proposal] = proposer.propose([request(0, [5, 6, 7, 8], 4)])
    assert list(proposal.token_ids) == []  # s0's pool went to s8: nothing of s8's
    proposer.finish(0)  # and nothing of s0's goes into s8's pool
    assert drafts(proposer, 9, [5, 6, 7, 8], session="s8") == [308, 309]


def test_isolation_off_drafts_from_the_own_text_only() -> None:
    proposer = make("off")
    serve(proposer, 0, [5, 6, 7, 8], ANSWER)
    assert drafts(proposer, 1, [5, 6, 7, 8]) == []
    assert drafts(proposer, 2, [5, 6, 9, 5, 6]) == [9, 5, 6]


def test_the_oldest_text_leaves_the_bounded_store() -> None:
    proposer = make(max_tokens=1024)
    serve(proposer, 0, [5, 6, 7, 8], ANSWER)
    assert drafts(proposer, 1, [5, 6, 7, 8], k=2) == ANSWER[:2]
    rng = random.Random(0)
    serve(proposer, 2, [rng.randrange(200, 1000) for _ in range(1100)], [])
    assert drafts(proposer, 3, [5, 6, 7, 8], k=2) == []


def test_rejected_drafts_cut_later_proposals() -> None:
    proposer = make()
    serve(proposer, 0, [5, 6, 7, 8], ANSWER)
    lengths = []
    for seq_id in range(1, 8):  # a new request each time, whose drafts are all rejected
        proposer.start(seq_id, [500 + seq_id, 5, 6, 7, 8])
        [proposal] = proposer.propose([request(seq_id, [500 + seq_id, 5, 6, 7, 8], 8)])
        lengths.append(len(proposal.token_ids))
        proposer.commit(CommitInfo(seq_id, [999], 0))
        proposer.finish(seq_id)
    assert lengths[0] == 8 and lengths[-1] < 3


def brute_force(own: Sequence[int], pool: Sequence[int], k: int, max_order: int = 8) -> list[int]:
    """The longest-match rule in plain Python (own orders 1..8, pool orders 2..8)."""
    for order in range(min(max_order, len(own)), 0, -1):
        context = list(own[-order:])
        for text, least in ((own, 1), (pool, 2)):
            if order < least:
                continue
            ends = [p for p in range(order, len(text)) if list(text[p - order : p]) == context]
            if ends:
                return list(text[ends[-1] : ends[-1] + k])
    return []


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_brute_force_rule(seed: int) -> None:
    rng = random.Random(seed)
    proposer = make(max_tokens=4096)
    pool = [rng.randrange(1, 6) for _ in range(300)]
    serve(proposer, 0, pool, [])
    for i in range(1, 20):
        own = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 40))]
        expected, got = brute_force(own, pool, 5), drafts(proposer, i, own, k=5)
        assert got == expected[: len(got)] and len(got) >= min(len(expected), 3)
        pool += own  # a finished request's text joins the pool


def test_bad_input_is_refused_naming_the_field() -> None:
    proposer = make()
    with pytest.raises(InvalidRequestError, match="token_ids"):
        proposer.start(0, [VOCAB_SIZE])
    with pytest.raises(InvalidRequestError, match="seq_id"):
        proposer.propose([request(7, [1], 2)])
    with pytest.raises(ValueError, match="isolation"):
        SuffixConfig(isolation="everyone")


def scoped(proposer: SuffixProposer, seq_id: int, scope: str | None, shares: bool = True) -> int:
    proposer.scopes[seq_id] = (shares, scope)  # type: ignore[attr-defined]
    return seq_id


@pytest.mark.parametrize("isolation", ["per-server", "per-session"])
def test_a_scope_never_drafts_from_another_scopes_text(isolation: str) -> None:
    proposer = make(isolation)
    serve(proposer, scoped(proposer, 0, "tenant A"), [5, 6, 7, 8], ANSWER)
    assert drafts(proposer, scoped(proposer, 1, "tenant B"), [5, 6, 7, 8]) == []
    assert drafts(proposer, scoped(proposer, 2, None), [5, 6, 7, 8]) == []
    own = ANSWER[:8] if isolation == "per-session" else []  # per-server: the shared pool only
    assert drafts(proposer, scoped(proposer, 3, "tenant A"), [5, 6, 7, 8]) == own


def test_the_shared_scope_drafts_from_the_shared_pool() -> None:
    proposer = make("per-server")
    serve(proposer, scoped(proposer, 0, None), [5, 6, 7, 8], ANSWER)
    assert drafts(proposer, scoped(proposer, 1, None), [5, 6, 7, 8]) == ANSWER[:8]


def test_a_request_that_shares_no_text_neither_feeds_nor_reads_a_pool() -> None:
    proposer = make("per-server")
    serve(proposer, scoped(proposer, 0, None, shares=False), [5, 6, 7, 8], ANSWER)
    assert drafts(proposer, scoped(proposer, 1, None), [5, 6, 7, 8]) == []
    serve(proposer, scoped(proposer, 2, None), [5, 6, 7, 8], ANSWER)
    assert drafts(proposer, scoped(proposer, 3, None, shares=False), [5, 6, 7, 8]) == []


def test_commits_between_proposals_are_learned_at_the_next_one() -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(1, 6) for _ in range(12)]
    every, skipping = make(), make()
    for proposer in (every, skipping):
        start(proposer, 0, prompt)
    text = list(prompt)
    for round_ in range(18):
        committed = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 4))]
        for proposer in (every, skipping):
            proposer.commit(CommitInfo(0, committed, 0))
        text += committed
        every.propose([request(0, text, 4)])
        if round_ % 4 == 3:  # the engine calls propose only in rounds that ask for drafts
            skipping.propose([request(0, text, 4)])
            for mine, theirs in zip(skipping._own, every._own, strict=True):
                assert np.array_equal(mine, theirs)  # the same tables, learned at once
    assert skipping._unlearned  # the last rounds' tokens wait for the next proposal
    assert int(skipping._own.num_tokens[0]) < int(every._own.num_tokens[0])
    for proposer in (every, skipping):
        proposer.finish(0)  # the whole text, pending tokens too, enters the pool
    for mine, theirs in zip(skipping._shared, every._shared, strict=True):
        assert np.array_equal(mine, theirs)
