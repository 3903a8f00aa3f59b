"""The end of a round: the commit of each request's verified tokens (``RoundRunner.commit``),
and the round run again one sequence at a time when its shared forward or verification failed
(``isolate``). ``Engine.step`` builds, forwards and verifies the round (``engine.batch``), then
hands it here.

A request that ends in the round (a stop condition, a failure) is handed back as an ``Ending``
in place of its output, and ends with the round's others (``Finisher.finish_round``). A failure
stays with the request it comes from: a commit's failure fails its own request; a sequence that
fails alone in ``isolate`` ends with an error, the others commit as they would have.

Dimensions: ``num_seqs`` decoding requests in the round; ``k_i`` drafts of request i.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridspec.engine.batch import RoundBatch, build_round, run_round
from hybridspec.engine.finish import Ending
from hybridspec.engine.request import FinishReason, Request, RequestOutput
from hybridspec.engine.row_costs import TimedForwardCost
from hybridspec.model import ForwardOutput, ModelRuntime
from hybridspec.types import CommitInfo, Proposal
from hybridspec.verifier import VerifyOutput

logger = logging.getLogger(__name__)

# What a request that failed inside the engine is told; the detail goes to the log.
ROUND_FAILED = "engine: this request's round failed (details in the server log)"


@dataclass(frozen=True, slots=True)
class Committed:
    """What a round's commit hands back: per request, its output or its ``Ending`` (for
    ``Finisher.finish_round``), in the round's order; and the round's yield, the tokens it
    committed from the rows it verified (for adaptive speculation; 0: nothing verified)."""

    items: list[RequestOutput | Ending]
    num_tokens: int = 0
    num_rows: int = 0


class RoundRunner:
    """Commits rounds (module docstring); its collaborators are passed in."""

    def __init__(
        self,
        runtime: ModelRuntime,
        forward_cost: TimedForwardCost,
        eos_token_ids: frozenset[int],
    ) -> None:
        """``forward_cost`` times the forwards ``isolate`` runs."""
        self.runtime = runtime
        self.forward_cost = forward_cost
        self.eos_token_ids = eos_token_ids

    def relative_time(self, batch: RoundBatch, seconds: float) -> float | None:
        """A decode round's ``seconds`` over the forward cost model's estimate of a round of
        ``batch``'s size without the load (``FittedForwardCost.relative_seconds``): what
        ``--threads auto``'s controller compares (``Engine.step``). A round's rows vary with its
        drafts and with the batch filling and emptying (8 rows, then 30 where drafts pay, then 2
        as requests end), and the controller compares windows of rounds, so raw times would
        credit a probed thread count with the rows its window happened not to have. None while
        the model cannot price the round."""
        size = self.forward_cost.relative_seconds(len(batch.forward.token_ids), batch.num_scores)
        return seconds / size if size is not None and size > 0 else None

    def commit(
        self, batch: RoundBatch, output: ForwardOutput, verified: VerifyOutput | None
    ) -> Committed:
        """Score prompts that asked, keep the features of committed tokens, then commit each
        decoding request's verified tokens; a failure fails that request only."""
        logits = _score_prompts(batch, output.logits)  # the verified rows
        accepted = verified.num_accepted.tolist() if verified is not None else []
        layout = batch.layout
        num_drafts = layout.num_drafts if layout is not None else ()
        if output.hidden_states is not None:
            rejected = [k - n for k, n in zip(num_drafts, accepted, strict=True)]
            _keep_feature_rows(batch, output.hidden_states, rejected + [0] * len(batch.prefill))
        if verified is None or layout is None:
            return Committed([])
        if verified.controlled_logits is not None:  # what p was made from: logprobs read it too
            logits = verified.controlled_logits
        items: list[RequestOutput | Ending] = []
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
                items.append(self._commit(request, tokens, num_accepted, k, rows, drafted_by))
            except Exception:
                logger.exception("committing request %s failed", request.request_id)
                items.append(Ending(request, FinishReason.ERROR, ROUND_FAILED))
        return Committed(items, committed, layout.num_rows)

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
    ) -> Committed:
        """Run a failed round again one sequence at a time, with the same drafts: those that
        succeed commit as they would have; those that fail alone end with an error. Its yield
        is the last commit's that verified rows, as if each had been a round of its own."""
        items: list[RequestOutput | Ending] = []
        num_tokens = num_rows = 0
        alone: list[tuple[list[tuple[Request, Proposal]], list[tuple[Request, int]]]] = [
            *(([entry], []) for entry in drafts),
            *(([], [entry]) for entry in prefill),
        ]
        for one_draft, one_prefill in alone:
            request = (one_draft or one_prefill)[0][0]
            try:
                batch = build_round(one_draft, one_prefill, cached, self.runtime.device)
                output, verified = run_round(
                    self.runtime, batch, self.forward_cost, self.eos_token_ids
                )
            except Exception:
                logger.exception("request %s failed alone", request.request_id)
                self.roll_back([request], cached)
                items.append(Ending(request, FinishReason.ERROR, ROUND_FAILED))
                continue
            committed = self.commit(batch, output, verified)
            items += committed.items
            if committed.num_tokens > 0 and committed.num_rows > 0:
                num_tokens, num_rows = committed.num_tokens, committed.num_rows
        return Committed(items, num_tokens, num_rows)

    def _commit(
        self,
        request: Request,
        tokens: list[int],
        num_accepted: int,
        num_drafts: int,
        logits: torch.Tensor,
        drafted_by: str,
    ) -> RequestOutput | Ending:
        """Append verified tokens, stopping at the first stop condition; roll caches back.
        ``logits`` [len(tokens), vocab_size]: the target's rows that produced ``tokens``;
        ``drafted_by``: the proposer whose drafts they are (``RequestOutput.drafted_by``)."""
        request.stats.record_round(num_drafts, num_accepted)
        shadow = request.speculation.shadow  # an unverified draft of a paused round
        hit = None if shadow is None or not tokens else tokens[0] == shadow
        request.speculation.update(num_drafts, num_accepted, len(tokens), hit)
        assert request.detokenizer is not None and request.slot is not None
        new_token_ids, consumed, reason = request.append(
            tokens, self.eos_token_ids, self.runtime.max_seq_len
        )
        logprobs = request.scores.score_committed(logits[:consumed], tokens[:consumed])
        # The accepted drafts lead the round's tokens: the first ``num_drafted`` appended.
        num_drafted = min(num_accepted, len(new_token_ids))
        if reason is not None:
            return Ending(request, reason, None, new_token_ids, logprobs, num_drafted, drafted_by)
        if request.constraint is not None:
            request.constraint.commit(new_token_ids)
        self.runtime.truncate(request.slot, len(request.token_ids) - 1)
        hidden_states, hidden_position = request.features.take()
        try:
            # a shadow's proposer learns whether its draft was kept, as if verified
            kept = num_accepted if hit is None else int(hit)
            request.proposer.commit(
                CommitInfo(request.seq_id, tokens, kept, hidden_states, hidden_position)
            )
        except Exception as exc:
            logger.exception("proposer %r failed to commit", request.proposer_name)
            return Ending(request, FinishReason.ERROR, f"proposer: {exc}", new_token_ids, logprobs)
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


def _score_prompts(batch: RoundBatch, logits: torch.Tensor) -> torch.Tensor:
    """Hand each request of the batch's ``prompt_rows`` its rows of ``logits`` (the forward's,
    [num_logits, vocab_size]) to score its prompt; return the verified rows."""
    num_verify_rows = batch.layout.num_rows if batch.layout is not None else 0
    row = num_verify_rows
    for prompt in batch.prompt_rows:
        prompt.request.scores.score_prompt(logits[row : row + prompt.num_rows], prompt.start)
        row += prompt.num_rows
    return logits[:num_verify_rows]


def _keep_feature_rows(
    batch: RoundBatch, hidden_states: torch.Tensor, rejected: Sequence[int]
) -> None:
    """Keep, until its next commit, each request's rows of the forward's ``hidden_states``
    [num_tokens, len(forward.hidden_layers), hidden_size] that hold committed tokens: all it
    fed but its last ``rejected[i]`` (rejected drafts, per sequence), in its proposer's columns
    (``engine.features``)."""
    cu, layers = batch.cu, batch.forward.hidden_layers
    for i, (request, _) in enumerate((*batch.drafts, *batch.prefill)):
        proposer = request.proposer
        end = cu[i + 1] - rejected[i]
        if not proposer.feature_layers or end <= cu[i]:
            continue
        rows = hidden_states[cu[i] : end]
        if proposer.feature_layers != layers:
            rows = rows[:, [layers.index(layer) for layer in proposer.feature_layers]]
        request.features.pending.append(rows)
