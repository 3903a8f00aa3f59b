"""Continuous batching: which requests run, and what each contributes to the next forward.

Requests wait in a bounded queue and join the running batch between steps while a KV-cache slot
is free, tenants taking turns (``engine.turns``); finished ones leave. Each step, a running
request either *decodes* (feeds its uncached committed tokens plus its drafts, and is verified)
or, while its prompt is longer than what is left of the step's prefill budget, feeds a *prefill
chunk* of its prompt only.

Worked example with ``prefill_chunk_size = 512`` and no other request: a new request with a
1300-token prompt feeds 512, then 512 prompt tokens in the next two steps; in the third its
remaining 276 tokens fit, so it decodes: it feeds them with its first drafts in one forward.
A decoding request has 1 uncached token (its last committed one) and always decodes. While
one does, the step is bounded in time instead (``engine.step_budget``): the prompt's chunks
are as many tokens as the step's estimated forward allows, fewer the deeper they sit.

What each one feeds becomes the round's batch in ``engine.batch``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from hybridspec.engine.request import Request, RequestOutput
from hybridspec.engine.step_budget import StepBudget, StepChunks
from hybridspec.engine.turns import Turns, entry_size
from hybridspec.errors import CapacityError


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the running requests do in one step."""

    decode: list[Request]  # feed every uncached token, then drafts; verified
    prefill: list[tuple[Request, int]]  # (request, number of prompt tokens to feed); no logits
    # prompt tokens fed in the step (a chunk, or a decoding request's rest of its prompt): the
    # step is not a decode round to time (``ThreadController`` compares decode rounds only)
    feeds_prompt: bool = False


class Seats(Protocol):
    """Where admitted requests take their seats (``Admission.seat``)."""

    def seat(self, admitted: list[Request]) -> tuple[list[RequestOutput], list[int]]:
        """Give each admitted request a KV-cache slot and start its proposer. Returns the
        outputs of those that could not start (they have ended and left the running batch),
        and the cached length of every running request, in the running batch's order."""
        ...


class Scheduler:
    """Holds the waiting queue and the running batch."""

    def __init__(
        self,
        max_queue_size: int,
        prefill_chunk_size: int,
        step_budget: StepBudget | None = None,
        *,
        turns: Turns | None = None,
    ) -> None:
        """``step_budget``: the time bound of steps shared with decoding requests (None: every
        step counts ``prefill_chunk_size`` tokens); ``turns``: the tenants' turns in admission
        (None: one anonymous tenant, first come first served)."""
        self.max_queue_size = max_queue_size
        self.prefill_chunk_size = prefill_chunk_size
        self.step_budget = step_budget
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
        69th prompt waiting is refused. The prompts of one add came as one request: they are
        queued together whenever the queue has room for one entry, so that a request of many
        prompts (``check_choices`` bounds them by the queue and slots) is never refused by a
        queue with room; the queue may then hold that request's prompts beyond its bound.
        """
        self.turns.check_queue(self.waiting, prompts)
        waiting = sum(1 for r in self.waiting if r.group is None or r.group.source is r)
        if prompts and waiting >= self.max_queue_size + max(0, num_free_slots):
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

    def schedule(self, num_slots: int, seats: Seats) -> tuple[StepPlan, list[RequestOutput]]:
        """One step's schedule, in one call: admit waiting requests into the free ones of the
        ``num_slots`` slots (``admit``), have ``seats`` seat them, then plan every running
        request by its cached length (``plan``). Returns the plan and the outputs of the
        admitted requests that could not start."""
        outputs, cached_lengths = seats.seat(self.admit(num_slots - len(self.running)))
        return self.plan(cached_lengths), outputs

    def plan(self, cached_lengths: list[int]) -> StepPlan:
        """Split the running requests, given each one's cached length in the target's cache: a
        request whose prompt is fed decodes; another feeds what the step grants it
        (``_chunks``), and decodes if that is the rest of its prompt."""
        pending = [
            len(r.token_ids) - 1 - c for r, c in zip(self.running, cached_lengths, strict=True)
        ]
        grant = self._chunks(cached_lengths, pending)
        decode: list[Request] = []
        prefill: list[tuple[Request, int]] = []
        feeds_prompt = False
        for request, cached, num_pending in zip(self.running, cached_lengths, pending, strict=True):
            if request.group is not None:  # choices before their shared prefill: the source
                if request.group.source is request and num_pending > 0:
                    num_tokens = grant(cached, num_pending)
                    if num_tokens > 0:
                        prefill.append((request, num_tokens))  # prefills alone
                continue
            num_tokens = grant(cached, num_pending) if num_pending > 0 else 0
            if num_tokens >= num_pending:
                decode.append(request)
                feeds_prompt = feeds_prompt or num_pending > 0
            elif num_tokens > 0:
                prefill.append((request, num_tokens))
        return StepPlan(decode, prefill, feeds_prompt=feeds_prompt or bool(prefill))

    def _chunks(self, cached_lengths: list[int], pending: list[int]) -> Callable[[int, int], int]:
        """The step's grants, ``grant(cached, pending) -> tokens``, in running order: timed
        (``StepChunks``) when requests decode in this step and the cost model can tell, else
        ``prefill_chunk_size`` tokens shared first come first served. A decoding request is
        expected to feed as many rows as it verified in its last round; a starting one (a rest
        of a prompt fed whole, ``StepBudget.starts``) its rest too."""
        step_budget = self.step_budget
        chunks: StepChunks | None = None
        if step_budget is not None and any(p > 0 for p in pending):  # a prompt to feed
            decoding, starting = self._spans(step_budget, cached_lengths, pending)
            chunks = step_budget.start(decoding, self.prefill_chunk_size, starting)
        if chunks is not None:
            return chunks.grant
        budget = self.prefill_chunk_size

        def grant(cached: int, num_pending: int) -> int:
            nonlocal budget
            if num_pending <= budget:  # the rest fits: the request decodes, its drafts beyond
                budget -= num_pending
                return num_pending
            granted, budget = budget, 0
            return granted

        return grant

    def _spans(
        self, step_budget: StepBudget, cached_lengths: list[int], pending: list[int]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(cached tokens, rows expected) of the decoding requests and of the starting ones (a
        rest fed whole with its first drafts, ``StepBudget.starts``); choices before their
        shared prefill are neither (their source feeds a chunk)."""
        decoding: list[tuple[int, int]] = []
        starting: list[tuple[int, int]] = []
        for request, cached, num_pending in zip(self.running, cached_lengths, pending, strict=True):
            if request.group is not None:
                continue
            rows = max(0, num_pending) + request.speculation.last_verified
            if num_pending <= 0:
                decoding.append((cached, rows))
            elif step_budget.starts(cached, num_pending):
                starting.append((cached, rows))
        return decoding, starting

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
