"""One round of the engine after the proposers have drafted: the target forward over the
decoding spans and prefill chunks, verification, and the commit of each request's verified
tokens (``Engine.step`` calls these; ``RoundSteps`` is one of ``Engine``'s bases).

A failure stays with the request it comes from: when the shared forward or verification
raises, the round runs again one sequence at a time (``_isolate``); a commit's failure fails
its own request (``_commit_all``); ``_finish`` ends a request for any reason and releases what
it holds.

Dimensions: ``num_seqs`` decoding requests in the round; ``k_i`` drafts of request i.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from hybridspec.engine.choices import leave
from hybridspec.engine.features import (
    forward_layers,
    keep_committed_rows,
    kept_features,
    take_rows,
)
from hybridspec.engine.logprobs import Logprobs
from hybridspec.engine.prefix_cache import PrefixCache
from hybridspec.engine.request import FinishReason, Request, RequestOutput
from hybridspec.engine.scheduler import Scheduler, StepBatch, forward_batch
from hybridspec.engine.speculation import SpeculationPolicy
from hybridspec.engine.step_budget import FittedForwardCost
from hybridspec.model import ModelRuntime, synchronize
from hybridspec.proposers import Proposer
from hybridspec.types import CommitInfo, Proposal
from hybridspec.verifier import VerifyInput, VerifyOutput, verify
from hybridspec.verifier.layout import DraftLayout
from hybridspec.verifier.uniforms import KeyedUniforms

logger = logging.getLogger(__name__)

# What a request that failed inside the engine is told; the detail goes to the log.
ROUND_FAILED = "engine: this request's round failed (details in the server log)"


@dataclass(frozen=True, slots=True)
class _Round:
    """One forward's sequences and results, between verification and commit."""

    drafts: list[tuple[Request, Proposal]]  # decoding requests, verified
    prefill: list[tuple[Request, int]]  # (request, prompt tokens fed)
    fed: list[Proposer]  # per sequence of the batch: drafts then prefill
    step: StepBatch
    logits: torch.Tensor  # [num_logits, vocab_size]: the verified rows, then prompt rows
    hidden_states: torch.Tensor | None  # [num_tokens, len(batch.hidden_layers), hidden_size]
    layout: DraftLayout | None  # the decoding requests' drafts and rows; None: none decodes
    verified: VerifyOutput | None  # None: no decoding request


class RoundSteps:
    """The forward, verification, commit and finish of ``Engine``'s rounds (module docstring),
    over the engine's state that ``Engine.__init__`` sets (annotated here for the type checker).
    """

    runtime: ModelRuntime
    scheduler: Scheduler
    prefix_cache: PrefixCache
    speculation: SpeculationPolicy | None
    forward_cost: FittedForwardCost
    eos_token_ids: frozenset[int]
    max_seq_len: int

    def _forward_and_verify(
        self, drafts: list[tuple[Request, Proposal]], prefill: list[tuple[Request, int]]
    ) -> _Round:
        """One target forward over the decoding spans and prefill chunks, and verification of
        the drafts. Changes nothing but the fed sequences' target caches (and the forward's
        time goes to the cost model that sizes prefill chunks)."""
        fed = [r.proposer for r, _ in (*drafts, *prefill)]
        step = forward_batch(drafts, prefill, self.runtime.seq_len, forward_layers(fed))
        start = time.perf_counter()
        output = self.runtime.forward(step.batch)
        synchronize(output.logits.device)
        self.forward_cost.observe(
            len(step.batch.token_ids), step.num_scores, time.perf_counter() - start
        )
        logits = output.logits[: step.num_verify_rows]  # the verified rows
        inp = self._verify_input(drafts, logits) if drafts else None
        verified = verify(inp) if inp is not None else None
        layout = inp.layout if inp is not None else None
        hidden = output.hidden_states
        return _Round(drafts, prefill, fed, step, output.logits, hidden, layout, verified)

    def _commit_all(self, round_: _Round) -> list[RequestOutput]:
        """Score prompts that asked, then commit each decoding request's verified tokens; a
        failure fails that request only."""
        drafts, verified, layout = round_.drafts, round_.verified, round_.layout
        logits = round_.step.score_prompts(round_.logits)  # the verified rows
        accepted = verified.num_accepted.tolist() if verified is not None else []
        num_drafts = layout.num_drafts if layout is not None else ()
        outputs: list[RequestOutput] = []
        if round_.hidden_states is not None:
            rejected = [k - n for k, n in zip(num_drafts, accepted, strict=True)]
            requests = [r for r, _ in (*drafts, *round_.prefill)]
            rejected += [0] * len(round_.prefill)
            keep_committed_rows(
                round_.step.batch, round_.hidden_states, requests, round_.fed, rejected
            )
        if verified is None or layout is None:
            return outputs
        if verified.controlled_logits is not None:  # what p was made from: logprobs read it too
            logits = verified.controlled_logits
        committed = 0
        for (request, proposal), k, row, tokens, num_accepted in zip(
            drafts,
            num_drafts,
            layout.row_offsets,
            verified.output_token_ids,
            accepted,
            strict=False,
        ):  # row_offsets has one entry more
            committed += len(tokens)
            rows = logits[row : row + len(tokens)]  # the rows that produced ``tokens``
            try:
                drafted_by = proposal.drafted_by or request.proposer_name
                outputs.append(self._commit(request, tokens, num_accepted, k, rows, drafted_by))
            except Exception:
                logger.exception("committing request %s failed", request.request_id)
                outputs.append(self._finish(request, FinishReason.ERROR, ROUND_FAILED))
        if self.speculation is not None:
            self.speculation.record_step(committed, layout.num_rows)
        return outputs

    def _roll_back(self, cached: dict[int, int]) -> None:
        """Return the target cache of every sequence in ``cached`` (seq_id -> length) to its
        length before a failed round."""
        for request in self.scheduler.running:
            length = cached.get(request.seq_id)
            slot = request.slot
            if length is not None and slot is not None and self.runtime.seq_len(slot) > length:
                self.runtime.truncate(slot, length)

    def _isolate(
        self,
        drafts: list[tuple[Request, Proposal]],
        prefill: list[tuple[Request, int]],
        cached: dict[int, int],
    ) -> list[RequestOutput]:
        """Run a failed round again one sequence at a time, with the same drafts: those that
        succeed commit as they would have; those that fail alone end with an error."""
        outputs: list[RequestOutput] = []
        alone: list[tuple[list[tuple[Request, Proposal]], list[tuple[Request, int]]]] = [
            *(([entry], []) for entry in drafts),
            *(([], [entry]) for entry in prefill),
        ]
        for one_draft, one_prefill in alone:
            request = (one_draft or one_prefill)[0][0]
            try:
                verified = self._forward_and_verify(one_draft, one_prefill)
            except Exception:
                logger.exception("request %s failed alone", request.request_id)
                self._roll_back({request.seq_id: cached[request.seq_id]})
                outputs.append(self._finish(request, FinishReason.ERROR, ROUND_FAILED))
                continue
            outputs += self._commit_all(verified)
        return outputs

    def _verify_input(
        self, drafts: list[tuple[Request, Proposal]], logits: torch.Tensor
    ) -> VerifyInput:
        """Every decoding request's drafts against ``logits`` [sum(k_i + 1), vocab_size], with
        the round's ``DraftLayout`` (built here, once; the commit reads it too)."""
        return VerifyInput.from_proposals(
            [p for _, p in drafts],
            logits,
            [r.params.sampling for r, _ in drafts],
            [r.generator for r, _ in drafts],
            [KeyedUniforms(r.uniform_key, len(r.token_ids)) for r, _ in drafts],
            checked=True,  # by the proposer pool, where they entered
            histories=[r.history(self.eos_token_ids) for r, _ in drafts],
        )

    def _commit(
        self,
        request: Request,
        tokens: list[int],
        num_accepted: int,
        num_drafts: int,
        logits: torch.Tensor,
        drafted_by: str,
    ) -> RequestOutput:
        """Append verified tokens, stopping at the first stop condition; roll caches back.
        ``logits`` [len(tokens), vocab_size]: the target's rows that produced ``tokens``;
        ``drafted_by``: the proposer whose drafts they are (``RequestOutput.drafted_by``)."""
        request.stats.record_round(num_drafts, num_accepted)
        request.speculation.update(num_drafts, num_accepted, len(tokens))
        assert request.detokenizer is not None and request.slot is not None
        new_token_ids, consumed, reason = request.append(
            tokens, self.eos_token_ids, self.max_seq_len
        )
        logprobs = request.score_committed(logits[:consumed], tokens[:consumed])
        # The accepted drafts lead the round's tokens: the first ``num_drafted`` appended.
        num_drafted = min(num_accepted, len(new_token_ids))
        if reason is not None:
            output = self._finish(request, reason, new_token_ids=new_token_ids, logprobs=logprobs)
            return dataclasses.replace(output, num_drafted=num_drafted, drafted_by=drafted_by)
        if request.constraint is not None:
            request.constraint.commit(new_token_ids)
        self.runtime.truncate(request.slot, len(request.token_ids) - 1)
        hidden_states, hidden_position = take_rows(request)
        try:
            request.proposer.commit(
                CommitInfo(request.seq_id, tokens, num_accepted, hidden_states, hidden_position)
            )
        except Exception as exc:
            logger.exception("proposer %r failed to commit", request.proposer_name)
            return self._finish(
                request, FinishReason.ERROR, f"proposer: {exc}", new_token_ids, logprobs
            )
        return RequestOutput(
            request.request_id,
            new_token_ids,
            request.detokenizer.stream_text(),
            False,
            logprobs=logprobs,
            prompt_logprobs=request.take_prompt_logprobs(),
            num_drafted=num_drafted,
            drafted_by=drafted_by,
        )

    def _finish(
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
            features = kept_features(request) if retain else None
            self.prefix_cache.release(
                request.slot, request.token_ids, retain, features, request.params.cache_scope
            )
            request.slot = None
            try:
                request.proposer.finish(request.seq_id)
            except Exception:
                logger.exception("proposer %r failed to finish", request.proposer_name)
        leave(request)
        self.scheduler.remove(request)
        return request.final_output(new_token_ids or [], logprobs)
