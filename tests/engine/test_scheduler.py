"""The scheduler's admission, bounded queue, prefill chunking and the forward's layout."""

from __future__ import annotations

import pytest
import torch

from hybridspec.engine.request import GenerationParams, Request
from hybridspec.engine.resolution import ResolvedProposer
from hybridspec.engine.scheduler import Scheduler, forward_batch
from hybridspec.errors import CapacityError
from hybridspec.proposers import NoProposer, ProposerContext
from hybridspec.types import Proposal

NONE = ResolvedProposer("none", NoProposer(ProposerContext(vocab_size=8, eos_token_ids=())), 4)


def make_request(seq_id: int, prompt_len: int, params: GenerationParams | None = None) -> Request:
    return Request(
        request_id=f"r{seq_id}",
        seq_id=seq_id,
        prompt_token_ids=list(range(prompt_len)),
        params=params or GenerationParams(),
        resolved=NONE,
        generator=torch.Generator(),
    )


def test_queue_full_raises_capacity_error() -> None:
    scheduler = Scheduler(max_queue_size=2, prefill_chunk_size=16)
    scheduler.add(make_request(0, 3), num_free_slots=0)
    scheduler.add(make_request(1, 3), num_free_slots=0)
    with pytest.raises(CapacityError, match="queue is full"):
        scheduler.add(make_request(2, 3), num_free_slots=0)


def test_burst_fills_free_slots_then_the_queue() -> None:
    """Between two steps, requests that the next step admits do not count as queued: with 3
    free slots and a queue of 2, the 6th request is refused, not the 3rd."""
    scheduler = Scheduler(max_queue_size=2, prefill_chunk_size=16)
    for i in range(5):
        scheduler.add(make_request(i, 3), num_free_slots=3)
    with pytest.raises(CapacityError, match="queue is full"):
        scheduler.add(make_request(5, 3), num_free_slots=3)
    assert [r.seq_id for r in scheduler.admit(num_free_slots=3)] == [0, 1, 2]
    assert len(scheduler.waiting) == 2


def test_admits_only_into_free_slots_in_arrival_order() -> None:
    scheduler = Scheduler(max_queue_size=8, prefill_chunk_size=16)
    for i in range(3):
        scheduler.add(make_request(i, 3), num_free_slots=0)
    admitted = scheduler.admit(num_free_slots=2)
    assert [r.seq_id for r in admitted] == [0, 1]
    assert [r.seq_id for r in scheduler.waiting] == [2]
    assert len(scheduler) == 3


def test_long_prompt_is_chunked_and_decoding_requests_never_wait() -> None:
    scheduler = Scheduler(max_queue_size=8, prefill_chunk_size=16)
    decoding, long_prompt = make_request(0, 5), make_request(1, 40)
    scheduler.add(decoding, num_free_slots=2)
    scheduler.add(long_prompt, num_free_slots=2)
    scheduler.admit(2)
    # The decoding request has all but its last token cached; the new one has nothing cached.
    plan = scheduler.plan([4, 0])
    assert plan.decode == [decoding]
    assert plan.prefill == [(long_prompt, 16)]
    assert plan.feeds_prompt
    plan = scheduler.plan([4, 32])  # 7 prompt tokens left before its last: it fits, so it decodes
    assert plan.decode == [decoding, long_prompt]
    assert plan.prefill == []
    assert plan.feeds_prompt  # the rest of a prompt: not a decode round to time
    plan = scheduler.plan([4, 39])  # both have all but their last token cached
    assert plan.decode == [decoding, long_prompt]
    assert not plan.feeds_prompt


def test_budget_is_shared_between_new_requests() -> None:
    scheduler = Scheduler(max_queue_size=8, prefill_chunk_size=16)
    first, second = make_request(0, 11), make_request(1, 11)
    scheduler.add(first, num_free_slots=2)
    scheduler.add(second, num_free_slots=2)
    scheduler.admit(2)
    plan = scheduler.plan([0, 0])  # the first costs 10 of 16, the second gets the last 6
    assert plan.decode == [first]
    assert plan.prefill == [(second, 6)]


def test_prompt_rows_are_computed_only_for_requests_that_ask() -> None:
    """A request asking for prompt logprobs adds the rows of the prompt tokens it feeds, but the
    prompt's last, after every verified row; one that does not ask adds none."""
    scoring = GenerationParams(max_new_tokens=0, prompt_logprobs=2)
    asks_chunk, plain_chunk = make_request(0, 40, scoring), make_request(1, 40)
    asks_decode, plain_decode = make_request(2, 10, scoring), make_request(3, 10)
    cached = {0: 16, 1: 16, 2: 6, 3: 6}
    for slot, request in enumerate((asks_chunk, plain_chunk, asks_decode, plain_decode)):
        request.slot = slot
    drafts = [(asks_decode, Proposal([7, 8])), (plain_decode, Proposal([9]))]
    step = forward_batch(drafts, [(asks_chunk, 5), (plain_chunk, 5)], cached.__getitem__)
    # Decoding spans: [p6 p7 p8 p9 d d] at 0..5 and [p6 p7 p8 p9 d] at 6..10; chunks at 11, 16.
    assert step.batch.cu_num_tokens.tolist() == [0, 6, 11, 16, 21]
    assert step.num_verify_rows == 3 + 2
    verified = [3, 4, 5, 9, 10]
    # asks_decode's p6 p7 p8 (p9 predicts the first new token: a verified row); the chunk's 5.
    assert step.batch.logits_indices.tolist() == [*verified, 0, 1, 2, 11, 12, 13, 14, 15]
    assert [(r.request, r.start, r.num_rows) for r in step.prompt_rows] == [
        (asks_decode, 6, 3),
        (asks_chunk, 16, 5),
    ]
    nothing_asked = forward_batch(drafts[1:], [(plain_chunk, 5)], cached.__getitem__)
    assert nothing_asked.batch.logits_indices.tolist() == [3, 4]
    assert nothing_asked.prompt_rows == []
