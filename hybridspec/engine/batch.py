"""One round's batch, built once (``build_round``), and the two steps that run on it: the target
forward (``run_forward``) and verification (``verify_round``), both timed by ``run_round``.

``RoundBatch`` holds every index a round needs, as host tuples and device tensors: the forward's
ragged layout (``ForwardBatch``, checked once here, so the runtime trusts its host ints), the
verified rows' layout (``DraftLayout``: draft and bonus rows, the same rows the forward's first
``logits_indices`` return), the drafts on the device, the prompt rows of requests that score
their prompt, and each sequence's first fed position (the feature rows' and the roll-back's).

A decoding request feeds its uncached committed tokens and its drafts, with logits at its last
``num_drafts + 1`` positions; a prefill chunk feeds the next ``n`` tokens of its prompt and wants
none. Example: a request with 1 uncached token and drafts ``d1 d2`` then a chunk of 3 give
``token_ids [t, d1, d2, p0, p1, p2]``, ``cu_num_tokens [0, 3, 6]`` and ``logits_indices
[0, 1, 2]``. Had the chunk's request asked for prompt logprobs
(``GenerationParams.prompt_logprobs``), ``logits_indices`` would be ``[0, 1, 2, 3, 4, 5]``: the
rows of every prompt token it feeds but the prompt's last (whose row predicts the first
generated token, and is verified) follow the verified rows, and its ``PromptRows`` start at
position 0 with 3 rows.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridspec.engine.request import Request
from hybridspec.engine.row_costs import TimedForwardCost
from hybridspec.engine.step_budget import attention_scores
from hybridspec.model import ForwardBatch, ForwardOutput, ModelRuntime, synchronize
from hybridspec.proposers import Proposer
from hybridspec.types import Proposal
from hybridspec.verifier import DraftLayout, VerifyInput, VerifyOutput, verify
from hybridspec.verifier.uniforms import KeyedUniforms


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Logits rows of one request's prompt in a forward, for ``prompt_logprobs``: those of the
    prompt tokens at positions ``start .. start + num_rows - 1``, which predict the tokens at
    ``start + 1 .. start + num_rows``."""

    request: Request
    start: int
    num_rows: int


@dataclass(frozen=True, slots=True)
class RoundBatch:
    """One round's sequences, decoding requests first, and where their tokens and rows sit.

    The forward's logits rows are first each decoding request's ``num_drafts + 1`` verified
    rows (``layout``'s), then the rows of ``prompt_rows``, one request after another.
    """

    drafts: tuple[tuple[Request, Proposal], ...]  # decoding requests, verified
    prefill: tuple[tuple[Request, int], ...]  # (request, prompt tokens fed)
    starts: tuple[int, ...]  # per sequence: its cached length before the round
    cu: tuple[int, ...]  # [num_seqs + 1]: each sequence's fed tokens in ``forward``
    forward: ForwardBatch  # checked once, carrying its host ints
    layout: DraftLayout | None  # the verified rows on the device; None: nothing decodes
    draft_token_ids: torch.Tensor  # [total_num_drafts] int64 on the device
    prompt_rows: tuple[PromptRows, ...]
    # the forward's query-key pairs of attention (``step_budget.attention_scores``): its cost
    num_scores: int

    @property
    def requests(self) -> list[Request]:
        """Per sequence, in the batch's order."""
        return [r for r, _ in (*self.drafts, *self.prefill)]

    @property
    def num_verify_rows(self) -> int:
        return self.layout.num_rows if self.layout is not None else 0


def build_round(
    drafts: Sequence[tuple[Request, Proposal]],
    prefill: Sequence[tuple[Request, int]],
    cached: Mapping[int, int],
    device: torch.device,
) -> RoundBatch:
    """Flatten the round's decoding spans and prefill chunks into one ``RoundBatch``
    (module docstring). ``cached``: each sequence's cached length, by ``seq_id``."""
    token_ids: list[int] = []
    logits_indices: list[int] = []
    cu, starts = [0], []
    for request, proposal in drafts:
        starts.append(cached[request.seq_id])
        token_ids += request.token_ids[starts[-1] :]
        token_ids += proposal.token_ids
        logits_indices += range(len(token_ids) - proposal.num_drafts - 1, len(token_ids))
        cu.append(len(token_ids))
    for request, num_tokens in prefill:
        starts.append(cached[request.seq_id])
        token_ids += request.token_ids[starts[-1] : starts[-1] + num_tokens]
        cu.append(len(token_ids))
    requests = [r for r, _ in (*drafts, *prefill)]
    prompt_rows = _add_prompt_rows(requests, starts, cu, logits_indices)
    forward = ForwardBatch.build(
        [r.slot for r in requests],  # type: ignore[misc]  # admitted: each holds a slot
        token_ids,
        cu,
        logits_indices,
        forward_layers(r.proposer for r in requests),
    )
    flat = [t for _, proposal in drafts for t in proposal.token_ids]
    return RoundBatch(
        drafts=tuple(drafts),
        prefill=tuple(prefill),
        starts=tuple(starts),
        cu=tuple(cu),
        forward=forward,
        layout=DraftLayout.from_counts([p.num_drafts for _, p in drafts], device)
        if drafts
        else None,
        draft_token_ids=torch.tensor(flat, dtype=torch.long, device=device),
        prompt_rows=tuple(prompt_rows),
        num_scores=sum(
            attention_scores(start, cu[i + 1] - cu[i]) for i, start in enumerate(starts)
        ),
    )


def _add_prompt_rows(
    requests: list[Request], starts: list[int], cu: list[int], logits_indices: list[int]
) -> list[PromptRows]:
    """Append to ``logits_indices`` the rows of the prompt tokens that each request asking for
    prompt logprobs feeds, but the prompt's last (it predicts no prompt token).

    Per sequence: ``starts``, the position of its first fed token; ``cu``, the batch's
    cumulative offsets.
    """
    prompt_rows = []
    for i, (request, start) in enumerate(zip(requests, starts, strict=True)):
        if request.params.prompt_logprobs is None:
            continue
        # (a decoding request feeds the rest of its prompt at most: its drafts are beyond)
        num_rows = min(cu[i + 1] - cu[i], len(request.prompt_token_ids) - 1 - start)
        if num_rows > 0:
            logits_indices.extend(range(cu[i], cu[i] + num_rows))
            prompt_rows.append(PromptRows(request, start, num_rows))
    return prompt_rows


def forward_layers(proposers: Iterable[Proposer]) -> tuple[int, ...]:
    """The union, in order of first appearance, of the layers ``proposers`` ask for (one
    entry per sequence of the forward; ``features``)."""
    layers: dict[int, None] = {}
    for proposer in proposers:
        layers.update(dict.fromkeys(proposer.feature_layers))
    return tuple(layers)


def run_round(
    runtime: ModelRuntime,
    batch: RoundBatch,
    forward_cost: TimedForwardCost,
    eos_token_ids: frozenset[int],
) -> tuple[ForwardOutput, VerifyOutput | None]:
    """The round's target forward and its verification (``run_forward``, ``verify_round``);
    for a round that fed no prompt, their time together prices its verified rows
    (``row_costs``: a draft's row costs its verification too, a softmax over the vocabulary a
    row where the request samples)."""
    start = time.perf_counter()
    output = run_forward(runtime, batch, forward_cost)
    verified = verify_round(batch, output.logits, eos_token_ids)
    seconds = time.perf_counter() - start
    num_drafts = sum(proposal.num_drafts for _, proposal in batch.drafts)
    forward_cost.observe_round(
        len(batch.forward.token_ids), batch.num_verify_rows, seconds, num_drafts
    )
    return output, verified


def run_forward(
    runtime: ModelRuntime, batch: RoundBatch, forward_cost: TimedForwardCost
) -> ForwardOutput:
    """The round's target forward; its time goes to the cost model that sizes prefill
    chunks."""
    start = time.perf_counter()
    output = runtime.forward(batch.forward)
    synchronize(output.logits.device)
    seconds = time.perf_counter() - start
    forward_cost.observe(len(batch.forward.token_ids), batch.num_scores, seconds)
    return output


def verify_round(
    batch: RoundBatch, logits: torch.Tensor, eos_token_ids: frozenset[int]
) -> VerifyOutput | None:
    """Verify every decoding request's drafts against the forward's ``logits`` (its verified
    rows lead), with the batch's layout; None where no request decodes."""
    if batch.layout is None:
        return None
    drafts = batch.drafts
    return verify(
        VerifyInput(
            draft_token_ids=batch.draft_token_ids,
            layout=batch.layout,
            draft_probs=[p.probs for _, p in drafts],
            target_logits=logits[: batch.num_verify_rows],
            sampling=[r.params.sampling for r, _ in drafts],
            generators=[r.generator for r, _ in drafts],
            keyed=[KeyedUniforms(r.uniform_key, len(r.token_ids)) for r, _ in drafts],
            histories=[r.history(eos_token_ids) for r, _ in drafts],
            checked=True,  # by the proposer pool, where they entered
        )
    )
