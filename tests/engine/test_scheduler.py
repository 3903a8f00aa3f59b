"""The scheduler's admission, bounded queue and prefill chunking."""

from __future__ import annotations

import pytest
import torch

from hybridspec.engine.request import GenerationParams, Request
from hybridspec.engine.resolution import ResolvedProposer
from hybridspec.engine.scheduler import Scheduler
from hybridspec.errors import CapacityError
from hybridspec.proposers import NoProposer, ProposerContext

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
