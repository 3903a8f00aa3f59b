"""The end of a round: the commit of each request's verified tokens (``RoundRunner.commit``),
and the round run again one sequence at a time when its shared forward or verification failed
(``isolate``). ``Engine.step`` builds, forwards and verifies the round (``engine.batch``), then
hands it here.

A failure stays with the request it comes from: a commit's failure fails its own request; a
sequence that fails alone in ``isolate`` ends with an error, the others commit as they would
have.

Dimensions: ``num_seqs`` decoding requests in the round; ``k_i`` drafts of request i.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch

from hybridspec.engine.batch import RoundBatch, build_round, run_forward, verify_round
from hybridspec.engine.drafts import DraftCounts
from hybridspec.engine.finish import Finisher
from hybridspec.engine.request import FinishReason, Request, RequestOutput
from hybridspec.engine.step_budget import FittedForwardCost
from hybridspec.model import ForwardOutput, ModelRuntime
from hybridspec.types import CommitInfo, Proposal
from hybridspec.verifier import VerifyOutput

logger = logging.getLogger(__name__)

# What a request that failed inside the engine is told; the detail goes to the log.
ROUND_FAILED = "engine: this request's round failed (details in the server log)"


class RoundRunner:
    """Commits rounds (module docstring); its collaborators are passed in."""

    def __init__(
        self,
        runtime: ModelRuntime,
        forward_cost: FittedForwardCost,
        draft_counts: DraftCounts,
        finisher: Finisher,
        eos_token_ids: frozenset[int],
    ) -> None:
        """``draft_counts`` learns each round's committed tokens (adaptive speculation);
        ``forward_cost`` times the forwards ``isolate`` runs."""
        self.runtime = runtime
        self.forward_cost = forward_cost
        self.draft_counts = draft_counts
        self.finisher = finisher
        self.eos_token_ids = eos_token_ids

    def commit(
        self, batch: RoundBatch, output: ForwardOutput, verified: VerifyOutput | None
    ) -> list[RequestOutput]:
        """Score prompts that asked, keep the features of committed tokens, then commit each
        decoding request's verified tokens; a failure fails that request only."""
        logits = batch.score_prompts(output.logits)  # the verified rows
        accepted = verified.num_accepted.tolist() if verified is not None else []
        layout = batch.layout
        num_drafts = layout.num_drafts if layout is not None else ()
        if output.hidden_states is not None:
            rejected = [k - n for k, n in zip(num_drafts, accepted, strict=True)]
            batch.keep_feature_rows(output.hidden_states, rejected + [0] * len(batch.prefill))
        if verified is None or layout is None:
            return []
        if verified.controlled_logits is not None:  # what p was made from: logprobs read it too
            logits = verified.controlled_logits
        outputs: list[RequestOutput] = []
        committed = 0
        for (request, proposal), k, row, tokens, num_accepted in zip(
            batch.drafts,
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
                outputs.append(self.finisher.finish(request, FinishReason.ERROR, ROUND_FAILED))
        self.draft_counts.record(committed, layout.num_rows)
        return outputs

    def roll_back(self, requests: Sequence[Request], cached: Mapping[int, int]) -> None:
        """Return the target cache of each of ``requests`` to its length before a failed round
        (``cached``: by ``seq_id``)."""
        for request in requests:
            length, slot = cached[request.seq_id], request.slot
            if slot is not None and self.runtime.seq_len(slot) > length:
                self.runtime.truncate(slot, length)

    def isolate(
        self,
        drafts: list[tuple[Request, Proposal]],
        prefill: list[tuple[Request, int]],
        cached: Mapping[int, int],
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
                batch = build_round(one_draft, one_prefill, cached, self.runtime.device)
                output = run_forward(self.runtime, batch, self.forward_cost)
                verified = verify_round(batch, output.logits, self.eos_token_ids)
            except Exception:
                logger.exception("request %s failed alone", request.request_id)
                self.roll_back([request], cached)
                outputs.append(self.finisher.finish(request, FinishReason.ERROR, ROUND_FAILED))
                continue
            outputs += self.commit(batch, output, verified)
        return outputs

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
            tokens, self.eos_token_ids, self.runtime.max_seq_len
        )
        logprobs = request.scores.score_committed(logits[:consumed], tokens[:consumed])
        # The accepted drafts lead the round's tokens: the first ``num_drafted`` appended.
        num_drafted = min(num_accepted, len(new_token_ids))
        if reason is not None:
            output = self.finisher.finish(
                request, reason, new_token_ids=new_token_ids, logprobs=logprobs
            )
            return dataclasses.replace(output, num_drafted=num_drafted, drafted_by=drafted_by)
        if request.constraint is not None:
            request.constraint.commit(new_token_ids)
        self.runtime.truncate(request.slot, len(request.token_ids) - 1)
        hidden_states, hidden_position = request.features.take()
        try:
            request.proposer.commit(
                CommitInfo(request.seq_id, tokens, num_accepted, hidden_states, hidden_position)
            )
        except Exception as exc:
            logger.exception("proposer %r failed to commit", request.proposer_name)
            return self.finisher.finish(
                request, FinishReason.ERROR, f"proposer: {exc}", new_token_ids, logprobs
            )
        return RequestOutput(
            request.request_id,
            new_token_ids,
            request.detokenizer.stream_text(),
            False,
            logprobs=logprobs,
            prompt_logprobs=request.scores.take_prompt_logprobs(),
            num_drafted=num_drafted,
            drafted_by=drafted_by,
        )
