"""The ngram proposer's behaviour: scenarios, windows, batches and errors."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from hybridspec.config import NgramConfig
from hybridspec.errors import InvalidRequestError
from hybridspec.proposers.base import ProposerContext
from hybridspec.proposers.ngram import NgramProposer
from hybridspec.proposers.ngram_reference import reference_proposal
from tests.proposers.ngram_helpers import (
    COPY,
    FREQUENCY,
    VOCAB_SIZE,
    commit,
    is_sound,
    make_proposer,
    propose_one,
    request,
)


def test_copies_prompt_continuation():
    proposer = make_proposer()
    prompt = [10, 11, 12, 13, 14, 15, 20, 10, 11, 12]
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, 4) == [13, 14, 15, 20]


def test_backs_off_to_shorter_order():
    proposer = make_proposer(FREQUENCY)
    prompt = [1, 2, 3, 50, 60, 2, 3]  # "60 2 3" and "3 50 60 2 3" are new; "2 3" was seen
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, 2) == [50, 60]


def test_longest_match_beats_more_frequent_shorter_one():
    proposer = make_proposer(FREQUENCY)
    prompt = [7, 8, 1, 7, 8, 1, 9, 7, 8, 2, 9, 7, 8]  # "7 8" -> 1 twice, "9 7 8" -> 2 once
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, 1) == [2]


def test_prefers_most_frequent_continuation():
    proposer = make_proposer(FREQUENCY)
    prompt = [4, 5, 6, 4, 5, 6, 4, 5, 7, 4, 5]
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, 1) == [6]


@pytest.mark.parametrize(
    "prompt, expected", [([4, 5, 6, 4, 5, 7, 4, 5], 7), ([4, 5, 7, 4, 5, 6, 4, 5], 6)]
)
def test_ties_go_to_most_recent_continuation(prompt, expected):
    proposer = make_proposer(FREQUENCY)
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, 1) == [expected]


@pytest.mark.parametrize("k", [0, 1, 3, 8, 16])
def test_chains_predictions_up_to_k(k):
    proposer = make_proposer(FREQUENCY)
    prompt = [1, 2, 3, 4, 1, 2]  # from the 3rd guess on, contexts include guessed tokens
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, k) == ([3, 4, 1, 2] * 4)[:k]
    assert propose_one(proposer, 0, prompt, k) == ([3, 4, 1, 2] * 4)[:k], "guesses not learned"


@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_copy_stops_where_the_committed_text_ends(k):
    proposer = make_proposer(COPY)
    prompt = [1, 2, 3, 4, 1, 2]  # "1 2" last seen at 0-1: copies 3 4 1 2, then nothing is left
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, k) == [3, 4, 1, 2][:k]


def test_copy_follows_the_latest_occurrence_not_the_most_frequent():
    proposer = make_proposer(COPY)
    prompt = [4, 5, 6, 9, 4, 5, 6, 9, 4, 5, 7, 8, 4, 5]  # "4 5" -> 6 twice, latest -> 7 8
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, 3) == [7, 8, 4]
    frequency = make_proposer(FREQUENCY)
    frequency.start(0, prompt)
    assert propose_one(frequency, 0, prompt, 3) == [6, 9, 4]


def test_copy_prefers_the_longest_matching_context():
    proposer = make_proposer(COPY)
    prompt = [3, 1, 2, 10, 11, 9, 1, 2, 20, 21, 3, 1, 2]  # "3 1 2" -> 10 11 beats later "1 2"
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, 2) == [10, 11]


def test_no_match_proposes_nothing():
    proposer = make_proposer()
    proposer.start(0, [])
    assert propose_one(proposer, 0, [], 8) == []
    commit(proposer, 0, [1, 2, 3], num_accepted=0)
    assert propose_one(proposer, 0, [1, 2, 3], 8) == []


def test_commit_teaches_new_ngrams():
    proposer = make_proposer()
    proposer.start(0, [1, 2, 3])
    commit(proposer, 0, [7, 1, 2], num_accepted=2)
    assert propose_one(proposer, 0, [1, 2, 3, 7, 1, 2], 2) == [3, 7]


@pytest.mark.parametrize("window, expected", [(9, [3]), (8, [])])
def test_window_forgets_old_ngrams(window, expected):
    proposer = make_proposer(NgramConfig(min_order=2, max_order=3, window=window))
    proposer.start(0, [1, 2, 3, 20, 21, 22, 23])
    commit(proposer, 0, [1, 2], num_accepted=1)  # with window 8, "1 2 -> 3" has slid out
    assert propose_one(proposer, 0, [1, 2, 3, 20, 21, 22, 23, 1, 2], 1) == expected


def test_prompt_longer_than_window_keeps_only_its_end():
    config = NgramConfig(min_order=2, max_order=3, window=6)
    proposer = make_proposer(config)
    prompt = [1, 2, 3, 9, 9, 9, 9, 9, 1, 2]  # "1 2 -> 3" lies before the last 6 tokens
    proposer.start(0, prompt)
    assert propose_one(proposer, 0, prompt, 4) == reference_proposal(prompt, 4, config) == []


def test_full_table_does_not_crash(caplog):
    config = NgramConfig(min_order=2, max_order=4, window=512, table_capacity=16)
    with caplog.at_level(logging.WARNING, logger="hybridspec.proposers.ngram"):
        proposer = make_proposer(config)
    assert "full tables will drop n-grams" in caplog.text
    rng = np.random.default_rng(1)
    history = rng.integers(0, 40, 300).tolist()
    proposer.start(0, history)
    for _ in range(150):
        proposal = propose_one(proposer, 0, history, 8)
        assert is_sound(history, proposal, config)
        committed = rng.integers(0, 40, int(rng.integers(1, 10))).tolist()
        commit(proposer, 0, committed, num_accepted=0)
        history += committed
    tables = proposer._tables
    assert (tables.num_used[0] == 16 // 2).all(), "every table is at its limit"


def test_finish_releases_state():
    proposer = make_proposer()
    proposer.start(5, [1, 2, 3, 1, 2])
    assert propose_one(proposer, 5, [1, 2, 3, 1, 2], 1) == [3]
    proposer.finish(5)
    assert proposer.num_active == 0
    with pytest.raises(InvalidRequestError, match="unknown sequence 5"):
        proposer.propose([request(5, [1, 2, 3, 1, 2], 1)])
    proposer.finish(5)  # already finished: nothing to do
    proposer.start(5, [1, 2])  # same id, same slot, none of the old n-grams
    assert propose_one(proposer, 5, [1, 2], 1) == []
    assert proposer.num_slots == 4


@pytest.mark.parametrize("num_seqs", [1, 5, 20])
def test_many_sequences_batched_equals_one_by_one(num_seqs):
    config = NgramConfig(min_order=1, max_order=3, window=24)
    proposer = make_proposer(config)
    rng = np.random.default_rng(num_seqs)
    histories = [rng.integers(0, 6, int(rng.integers(0, 40))).tolist() for _ in range(num_seqs)]
    for seq_id, history in enumerate(histories):
        proposer.start(100 + seq_id, history)
    assert proposer.num_slots >= num_seqs
    for _ in range(6):
        ks = rng.integers(0, 17, num_seqs).tolist()
        batch = proposer.propose(
            [request(100 + i, h, k) for i, (h, k) in enumerate(zip(histories, ks, strict=True))]
        )
        for i, (history, k) in enumerate(zip(histories, ks, strict=True)):
            assert list(batch[i].token_ids) == propose_one(proposer, 100 + i, history, k)
            assert list(batch[i].token_ids) == reference_proposal(history, k, config)
            committed = rng.integers(0, 6, int(rng.integers(1, 9))).tolist()
            commit(proposer, 100 + i, committed, num_accepted=0)
            history += committed


# --- bad arguments -------------------------------------------------------------------------


@pytest.fixture
def started() -> NgramProposer:
    proposer = make_proposer()
    proposer.start(1, [1, 2, 3])
    return proposer


@pytest.mark.parametrize(
    "call, param, message",
    [
        (lambda p: p.propose([request(9, [], 1)]), "seq_id", "unknown sequence 9 in propose"),
        (lambda p: commit(p, 9, [1], 0), "seq_id", "unknown sequence 9 in commit"),
        (lambda p: p.start(1, [4]), "seq_id", "sequence 1 is already started"),
        (lambda p: p.start(True, [4]), "seq_id", "expected an integer"),
        (lambda p: p.propose([request(1, [1, 2, 3], -1)]), "max_num_drafts", "got -1"),
        (lambda p: p.propose([request(1, [1, 2, 3], 17)]), "max_num_drafts", r"\[0, 16\], got 17"),
        (lambda p: p.propose([request(1, [1, 2], 1)]), "token_ids", "2 committed tokens but"),
        (lambda p: commit(p, 1, [4, VOCAB_SIZE], 0), "token_ids", "got 1000"),
        (lambda p: commit(p, 1, [4, -3], 0), "token_ids", "got -3"),
        (lambda p: commit(p, 1, [4.0], 0), "token_ids", "integer token ids"),
        (lambda p: commit(p, 1, [4, 5], 3), "num_accepted", r"\[0, 2\], got 3"),
        (lambda p: commit(p, 1, [4, 5], -1), "num_accepted", "got -1"),
        (lambda p: p.start(2, [[1, 2]]), "prompt_token_ids", "flat sequence"),
        (lambda p: p.start(2, [1, VOCAB_SIZE + 5]), "prompt_token_ids", "got 1005"),
    ],
)
def test_bad_arguments_raise_invalid_request(started, call, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        call(started)
    assert isinstance(info.value, ValueError)
    assert info.value.param == param


def test_failed_call_leaves_state_untouched(started):
    with pytest.raises(InvalidRequestError):
        commit(started, 1, [1, 2, VOCAB_SIZE], 0)
    with pytest.raises(InvalidRequestError):
        started.start(2, [-1])
    assert started.num_active == 1
    assert propose_one(started, 1, [1, 2, 3], 4) == []


@pytest.mark.parametrize(
    "context, param",
    [
        (ProposerContext(vocab_size=0, eos_token_ids=()), "vocab_size"),
    ],
)
def test_bad_construction_raises_invalid_request(context, param):
    with pytest.raises(InvalidRequestError) as info:
        NgramProposer(context)
    assert info.value.param == param


def test_commits_between_proposals_are_learned_at_the_next_one():
    config = NgramConfig(min_order=1, max_order=3, window=16)
    rng = np.random.default_rng(7)
    history = rng.integers(0, 5, 10).tolist()
    every, skipping = make_proposer(config), make_proposer(config)
    every.start(0, history)
    skipping.start(0, history)
    for round_ in range(14):
        committed = rng.integers(0, 5, int(rng.integers(1, 4))).tolist()
        for proposer in (every, skipping):
            commit(proposer, 0, committed, num_accepted=0)
        history += committed
        expected = propose_one(every, 0, history, 4)
        assert expected == reference_proposal(history, 4, config)
        if round_ % 4 == 3:  # the engine calls propose only in rounds that ask for drafts
            assert propose_one(skipping, 0, history, 4) == expected
    assert int(skipping._tables.num_tokens[0]) < int(every._tables.num_tokens[0])  # not yet
    assert propose_one(skipping, 0, history, 4) == propose_one(every, 0, history, 4)
