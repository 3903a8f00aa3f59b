"""Continuous batching: which requests run, and what each contributes to the next forward.

Requests wait in a bounded queue and join the running batch between steps while a KV-cache slot
is free, tenants taking turns (``engine.turns``); finished ones leave. Each step, a running
request either *decodes* (feeds its uncached committed tokens plus its drafts, and is verified)
or, while its prompt is longer than what is left of the step's prefill budget, feeds a *prefill
chunk* of its prompt only.

Worked example with ``prefill_chunk_size = 512``: a decoding request has 1 uncached token
(its last committed one), so it costs 0 of the budget and always decodes. A new request with a
1300-token prompt feeds 512, then 512 prompt tokens in the next two steps; in the third its
remaining 276 tokens fit, so it decodes: it feeds them with its first drafts in one forward.

A request that asks for its prompt's log-probabilities (``GenerationParams.prompt_logprobs``)
also wants the logits of every prompt token it feeds but the last (whose row predicts the first
generated token, and is verified); ``forward_batch`` appends those rows after the verified ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridspec.engine.request import Request
from hybridspec.engine.turns import Turns, entry_size
from hybridspec.errors import CapacityError
from hybridspec.model import ForwardBatch
from hybridspec.types import Proposal


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Logits rows of one request's prompt in a forward, for ``prompt_logprobs``: those of the
    prompt tokens at positions ``start .. start + num_rows - 1``, which predict the tokens at
    ``start + 1 .. start + num_rows``."""

    request: Request
    start: int
    num_rows: int


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step's forward and the meaning of its logits rows: first each decoding request's
    ``num_drafts + 1`` verified rows, in order (``num_verify_rows`` in all), then the rows of
    ``prompt_rows``, one request after another."""

    batch: ForwardBatch
    num_verify_rows: int
    prompt_rows: list[PromptRows]

    def score_prompts(self, logits: torch.Tensor) -> torch.Tensor:
        """Hand each request of ``prompt_rows`` its rows of ``logits`` (the forward's, [num_logits,
        vocab_size]) to score its prompt; return the verified rows."""
        row = self.num_verify_rows
        for prompt in self.prompt_rows:
            prompt.request.score_prompt(logits[row : row + prompt.num_rows], prompt.start)
            row += prompt.num_rows
        return logits[: self.num_verify_rows]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the running requests do in one step."""

    decode: list[Request]  # feed every uncached token, then drafts; verified
    prefill: list[tuple[Request, int]]  # (request, number of prompt tokens to feed); no logits


class Scheduler:
    """Holds the waiting queue and the running batch."""

    def __init__(
        self, max_queue_size: int, prefill_chunk_size: int, turns: Turns | None = None
    ) -> None:
        self.max_queue_size = max_queue_size
        self.prefill_chunk_size = prefill_chunk_size
        self.turns = turns if turns is not None else Turns()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request, num_free_slots: int) -> None:
        """Queue ``request``; CapacityError when the queue is full (``add_all``)."""
        self.add_all([[request]], num_free_slots)

    def add_all(self, prompts: list[list[Request]], num_free_slots: int) -> None:
        """Queue every prompt's choices (one request each, tied by ``engine.choices``), all or
        none: CapacityError when the queue cannot take them all (TenantLimitError when their
        tenant may queue no more, ``Turns.check_queue``).

        A prompt with its choices is one queue entry. Waiting entries that the next step admits
        into the ``num_free_slots`` free slots are not queued for a slot, so a burst between
        two steps may hold that many more: with 4 free slots and ``max_queue_size = 64``, the
        69th prompt waiting is refused.
        """
        self.turns.check_queue(self.waiting, prompts)
        waiting = sum(1 for r in self.waiting if r.group is None or r.group.source is r)
        if waiting + len(prompts) > self.max_queue_size + max(0, num_free_slots):
            raise CapacityError(
                f"the request queue is full ({self.max_queue_size} waiting for a batch slot); "
                "retry later"
            )
        for choices in prompts:
            self.waiting.extend(choices)

    def admit(self, num_free_slots: int) -> list[Request]:
        """Move waiting requests into the running batch while slots are free, tenants taking
        turns (``Turns.pick``); the choices of a prompt all at once, when there is a slot for
        each."""
        admitted = []
        while (head := self.turns.pick(self.waiting, self.running, num_free_slots)) is not None:
            size = entry_size(head)
            start = self.waiting.index(head)  # a prompt's choices are queued together
            entry = [self.waiting[start + i] for i in range(size)]
            for request in entry:
                self.waiting.remove(request)
            self.running.extend(entry)
            admitted.extend(entry)
            num_free_slots -= size
            self.turns.admitted(head.params.tenant)
        return admitted

    def plan(self, cached_lengths: list[int]) -> StepPlan:
        """Split the running requests, given each one's cached length in the target's cache."""
        budget = self.prefill_chunk_size
        decode: list[Request] = []
        prefill: list[tuple[Request, int]] = []
        for request, cached in zip(self.running, cached_lengths, strict=True):
            pending_prompt = len(request.token_ids) - 1 - cached
            if request.group is not None:  # choices before their shared prefill: the source
                if request.group.source is request and min(pending_prompt, budget) > 0:
                    prefill.append((request, min(pending_prompt, budget)))  # prefills alone
                    budget -= min(pending_prompt, budget)
                continue
            if pending_prompt <= budget:
                budget -= pending_prompt
                decode.append(request)
            elif budget > 0:
                prefill.append((request, budget))
                budget = 0
        return StepPlan(decode=decode, prefill=prefill)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def find(self, request_id: str) -> Request | None:
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        return None

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)


def forward_batch(
    drafts: list[tuple[Request, Proposal]],
    prefill: list[tuple[Request, int]],
    seq_len: Callable[[int], int],
    hidden_layers: tuple[int, ...] = (),
) -> StepBatch:
    """Flatten the step's decoding spans and prefill chunks into one ragged batch.

    A decoding request feeds its uncached committed tokens (``seq_len(slot)`` are cached) and
    its drafts, with logits at its last ``num_drafts + 1`` positions; a chunk feeds the next
    ``n`` tokens of its prompt and wants none. Example: a request with 1 uncached token and
    drafts ``d1 d2`` then a chunk of 3 give ``token_ids [t, d1, d2, p0, p1, p2]``,
    ``cu_num_tokens [0, 3, 6]`` and ``logits_indices [0, 1, 2]``. Had the chunk's request asked
    for prompt logprobs, ``logits_indices`` would be ``[0, 1, 2, 3, 4, 5]`` and its
    ``PromptRows`` start at position 0 with 3 rows.
    """
    slots: list[int] = []
    token_ids: list[int] = []
    cu = [0]
    logits_indices: list[int] = []
    fed: list[tuple[Request, int, int]] = []  # (request, first position fed, committed fed)
    for request, proposal in drafts:
        assert request.slot is not None
        cached = seq_len(request.slot)
        token_ids.extend(request.token_ids[cached:])
        token_ids.extend(proposal.token_ids)
        logits_indices.extend(range(len(token_ids) - proposal.num_drafts - 1, len(token_ids)))
        fed.append((request, cached, len(request.token_ids) - cached))
        slots.append(request.slot)
        cu.append(len(token_ids))
    for request, num_tokens in prefill:
        assert request.slot is not None
        cached = seq_len(request.slot)
        token_ids.extend(request.token_ids[cached : cached + num_tokens])
        fed.append((request, cached, num_tokens))
        slots.append(request.slot)
        cu.append(len(token_ids))
    num_verify_rows = len(logits_indices)
    prompt_rows = _add_prompt_rows(fed, cu, logits_indices)
    batch = ForwardBatch(
        slots=torch.tensor(slots, dtype=torch.long),
        token_ids=torch.tensor(token_ids, dtype=torch.long),
        cu_num_tokens=torch.tensor(cu, dtype=torch.long),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long),
        hidden_layers=hidden_layers,
    )
    return StepBatch(batch, num_verify_rows, prompt_rows)


def _add_prompt_rows(
    fed: list[tuple[Request, int, int]], cu: list[int], logits_indices: list[int]
) -> list[PromptRows]:
    """Append to ``logits_indices`` the rows of the prompt tokens that each request asking for
    prompt logprobs feeds, but the prompt's last (it predicts no prompt token).

    ``fed``: per sequence, (request, position of its first fed token, committed tokens fed);
    ``cu``: the batch's cumulative offsets.
    """
    prompt_rows = []
    for (request, start, num_fed), offset in zip(fed, cu, strict=False):
        if request.params.prompt_logprobs is None:
            continue
        num_rows = min(start + num_fed, len(request.prompt_token_ids) - 1) - start
        if num_rows > 0:
            logits_indices.extend(range(offset, offset + num_rows))
            prompt_rows.append(PromptRows(request, start, num_rows))
    return prompt_rows
