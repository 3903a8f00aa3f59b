"""How a request ends, for any reason (a stop condition, an abort, an error): ``Finisher``
releases its KV-cache slot (to the prefix cache, which may keep its prompt's entry), its
proposer's state and its place in the scheduler, and returns its final output.

A round's requests end together, at the round's end (``Finisher.finish_round``): the propose
and commit stages hand back an ``Ending`` where a request ends, in place of its output."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hybridspec.engine.choices import leave
from hybridspec.engine.logprobs import Logprobs
from hybridspec.engine.prefix_cache import CachedFeatures, PrefixCache
from hybridspec.engine.request import FinishReason, Request, RequestOutput
from hybridspec.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ending:
    """A request that ends in this round, and what its final output carries (``finish``'s
    arguments); ``drafted_by`` None: the round's drafts are not counted in the output."""

    request: Request
    reason: FinishReason
    error: str | None = None
    new_token_ids: list[int] | None = None
    logprobs: Logprobs | None = None
    num_drafted: int = 0
    drafted_by: str | None = None


class Finisher:
    """Ends requests; shared by admission (a proposer that fails to start), the round's end
    and the engine's ``abort``."""

    def __init__(self, scheduler: Scheduler, prefix_cache: PrefixCache) -> None:
        self.scheduler = scheduler
        self.prefix_cache = prefix_cache

    def finish_round(self, items: Sequence[RequestOutput | Ending]) -> list[RequestOutput]:
        """A round's outputs, in order: each ``Ending`` replaced by the final output of its
        request, ended here."""
        return [item if isinstance(item, RequestOutput) else self._end(item) for item in items]

    def _end(self, ending: Ending) -> RequestOutput:
        output = self.finish(
            ending.request, ending.reason, ending.error, ending.new_token_ids, ending.logprobs
        )
        if ending.drafted_by is None:
            return output
        return dataclasses.replace(
            output, num_drafted=ending.num_drafted, drafted_by=ending.drafted_by
        )

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        error: str | None = None,
        new_token_ids: list[int] | None = None,
        logprobs: Logprobs | None = None,
    ) -> RequestOutput:
        """End a request for ``reason`` and release its slot and its proposer's state."""
        request.finish_reason = reason
        request.error = error
        if request.slot is not None:
            retain = request.params.cache_prompt and reason is not FinishReason.ERROR
            rows = request.features.all_rows() if retain else None
            layers = request.proposer.feature_layers
            features = CachedFeatures(layers, rows) if rows is not None else None
            self.prefix_cache.release(
                request.slot, request.token_ids, retain, features, request.params.cache_scope
            )
            request.slot = None
            try:
                request.proposer.finish(request.seq_id)
            except Exception:
                logger.exception("proposer %r failed to finish", request.proposer_name)
        if request.group is not None:  # a choice before its prompt's prefill was shared
            leave(request)
        self.scheduler.remove(request)
        return request.final_output(new_token_ids or [], logprobs)
