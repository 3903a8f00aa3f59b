"""The ``eagle`` proposer: a feature-level draft head (``head``) drafts from the target's
own hidden states, all sequences of a batch together.

Per sequence the head's cache holds one entry per real pair ``(f_j, x_{j+1})``: the target's
feature at ``j`` (handed by ``commit``, ``CommitInfo.hidden_states``) and the committed token
after it. A round first feeds the real pairs it has not cached (``f_{L-2}`` is the last one
known after ``L`` committed tokens: the last token is fed by the next verify forward), whose
last output gives ``d_1``; then each further draft feeds ``(h, d_i)``, ``h`` the head's own
prediction. The commit drops those draft entries (the cache goes back to its real pairs,
exactly what a fresh prefill of them writes) and takes the new features.

The pairs start at the first position whose feature the engine hands: 0, or after a
prefix-cache hit on an entry that kept no features, the first uncached one (``first``; the head
then drafts from the positions it has seen, and its positions count from there: its rotary
attention sees only their differences).

Worked example: 20 committed tokens, features ``f_0 .. f_18`` known, 17 pairs cached. The
round feeds pairs 17, 18 (``(f_17, x_18), (f_18, x_19)``), drafts ``d1`` from the last, then
feeds ``(h, d1), (h', d2)`` and drafts ``d2, d3``: 21 entries. The target keeps ``d1`` and
corrects ``d2`` with ``c``; the commit brings ``f_19, f_20`` (rows of ``x_19`` and ``d1``) and
truncates the cache to its 19 real pairs; the next round feeds pairs 19, 20 (``x_20 = d1``,
``x_21 = c``).

A round that would feed more than ``catch_up`` real pairs (``EagleConfig.catch_up``: the
request's first round feeds its whole prompt; one after a pause of adaptive speculation feeds
every round of it) feeds only the last ``catch_up``, on an emptied cache: the head starts over
from the pairs just before its drafts, its ``first`` moved to the first of them. A round's head
work grows with the pairs it feeds (each a pass through its decoder layer), so without the
bound a probe after a long pause, which adaptive speculation prices as one round of drafts,
would cost more the longer the pause, and a long prompt's first round as much as a forward.
Its drafts come from the target's features, each of which already reads the whole context;
the head's own attention over its earlier pairs adds little beyond the last few (on the
shipped head, drafts kept with every pair and with the last 8 are alike), and the drafts
never change what is committed. Example, ``catch_up`` 16: a request paused for 40 rounds has
41 pending pairs at its probe; the probe empties the cache, feeds the last 16 and drafts.

Drafts come from the head's logits over its draft vocabulary, scattered into the target's
vocabulary (``-inf`` elsewhere) and put under the request's controls and sampling transforms as
the verifier puts the target's; greedy requests take the argmax. A sampled request's draft at
position ``p`` is the inverse-CDF sample of ``q`` (zero outside the draft vocabulary) at the
request's position-keyed uniform ``u(key, p)`` (``verifier.uniforms``, the key from
``ProposeRequest.uniform_key``), returned as a deterministic draft: the verifier keeps it
exactly when the target's own inverse-CDF sample at ``u(key, p)`` is the same token. So the
text is the target's keyed sample whatever the head drafted (a seeded request's text is
``none``'s, for any K), and the proposer never returns ``q`` (``samples_drafts`` False): its
requests are priced by measured costs, as a deterministic proposer's are. Where ``q`` is close
to ``p`` the two inverse CDFs mostly land on the same token; the coupling keeps fewer drafts
than rejection sampling's ``sum(min(p, q))`` would, losing at each token the mass by which the
two cumulative sums (in token-id order) differ before it. Without a key (a proposer driven
outside the engine) the uniform comes from the request's generator; the draft is still
deterministic, so verification stays exact.

Dimensions: ``n`` sequences drafted together, ``D`` hidden size, ``V`` the target's vocabulary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridspec.errors import InvalidRequestError
from hybridspec.model import (
    LlamaWeights,
    LoadedModel,
    MappedRows,
    PackedWeight,
    QuantizedWeight,
    block_kernel,
    dense,
    synchronize,
)
from hybridspec.proposers.base import ProposerContext
from hybridspec.proposers.eagle.cache import HeadCache, forward_cached
from hybridspec.proposers.eagle.config import (
    CONFIG_FILE,
    DraftHead,
    HeadConfig,
    TargetParts,
    target_fingerprint,
)
from hybridspec.proposers.eagle.files import load_head
from hybridspec.proposers.eagle.int8 import quantize_matmuls
from hybridspec.proposers.eagle.published import is_eagle_checkpoint, load_eagle_checkpoint
from hybridspec.proposers.sequences import SeqState, SequenceProposer
from hybridspec.types import CommitInfo, Proposal, ProposeRequest, SamplingParams
from hybridspec.verifier.acceptance import draw_uniforms, sample_from_probs
from hybridspec.verifier.controls import apply_controls, is_controlled
from hybridspec.verifier.sampling import logits_to_probs_by_row
from hybridspec.verifier.uniforms import KeyedUniforms

logger = logging.getLogger(__name__)

SHIPPED_HEADS = Path(__file__).resolve().parents[2] / "heads"
TIMING_REPEATS = 5


def target_parts(model: LoadedModel) -> TargetParts:
    """The target's embedding, final norm, LM head and final soft cap, as the head borrows
    them."""
    weights = model.weights
    if isinstance(weights, LlamaWeights):  # quantized matrices dequantized (tied: once)
        table = dense(weights.embed, weights.dtype)
        lm_head = (
            table if weights.lm_head is weights.embed else dense(weights.lm_head, weights.dtype)
        )
        return TargetParts(table, weights.norm, lm_head, weights.dims.final_softcap)
    embed = weights.get_input_embeddings()
    head = weights.get_output_embeddings()
    norm = getattr(getattr(weights, "model", None), "norm", None)
    if head is None or norm is None or not hasattr(norm, "weight"):
        raise InvalidRequestError(
            f"proposer: 'eagle' needs a Llama-like target (embedding, final RMS norm, LM head); "
            f"{model.source} has none",
            "proposer",
        )
    tensors: list[torch.Tensor] = []
    for module in (embed, norm, head):
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        tensors.append(weight.detach())
    cap = getattr(model.hf_config.get_text_config(), "final_logit_softcapping", None)
    embed_weight, norm_weight, head_weight = tensors
    return TargetParts(embed_weight, norm_weight, head_weight, float(cap or 0.0))


def leading_embedding_rows(model: LoadedModel, count: int = 64) -> torch.Tensor:
    """The target's first ``count`` embedding rows, as ``target_parts`` has them: all that
    ``target_fingerprint`` reads, dequantized alone (a 128k-row table is gigabytes dense, and
    a target with no head never needs it)."""
    weights = model.weights
    if isinstance(weights, LlamaWeights):
        embed, index = weights.embed, torch.arange(min(count, weights.dims.vocab_size))
        kernel = block_kernel()
        if isinstance(embed, PackedWeight) and kernel is not None:
            return kernel.dequantize_rows(embed, index).to(weights.dtype)
        if isinstance(embed, (QuantizedWeight, MappedRows)):
            return embed.dequantize_rows(index, weights.dtype)
    return target_parts(model).embed[:count]


def find_head(configured: str | None, embed_rows: torch.Tensor) -> Path:
    """The head directory: ``configured``, or the shipped head trained for the target whose
    first embedding rows are ``embed_rows`` (``leading_embedding_rows``)."""
    if configured is not None:
        path = Path(configured).expanduser()
        if not (path / CONFIG_FILE).is_file():
            raise InvalidRequestError(f"eagle.head: no {CONFIG_FILE} in {configured!r}", "head")
        return path
    fingerprint = target_fingerprint(embed_rows)
    for candidate in sorted(SHIPPED_HEADS.glob(f"*/{CONFIG_FILE}")):
        config = HeadConfig.from_json(candidate.read_text())
        if config.target_fingerprint == fingerprint:
            return candidate.parent
    raise InvalidRequestError(
        "proposer: 'eagle' has no head for this target; train one with `hybridspec distill` "
        "and pass it with --eagle-head DIR (EagleConfig(head=...))",
        "proposer",
    )


@dataclass(slots=True)
class _EagleSeq(SeqState):
    first: int = 0  # position of the first feature handed (``engine.features``: after a
    # prefix-cache hit that kept none, the first uncached one); the pairs start there
    num_real: int = 0  # real pairs in the head's cache
    # the target's rows not yet fed, [rows, len(feature_layers), D] as the commits hand them
    features: list[torch.Tensor] = field(default_factory=list)
    num_features: int = 0  # rows in ``features`` (kept, not summed: rounds without drafts
    # append one entry each, and a sum over them every round would grow with the pause)


class EagleProposer(SequenceProposer[_EagleSeq]):
    """Drafts with a feature-level head over the target's hidden states (module docstring).

    ``cost_per_token``: ``EagleConfig.cost_per_token`` or, when that is None, a one-token head
    step (fusion, layer, draft-vocabulary logits) over a one-token target forward, both timed
    here when the proposer is built.
    """

    tracker_name = "the eagle head"
    feature_layers: tuple[int, ...] = (-1,)  # the head's ``feature_layers``, set when it loads

    def __init__(self, context: ProposerContext, head: DraftHead | None = None) -> None:
        super().__init__(context)
        if head is None:
            if context.target is None:
                raise InvalidRequestError("proposer: 'eagle' needs the target model", "proposer")
            path = find_head(context.eagle.head, leading_embedding_rows(context.target))
            parts = target_parts(context.target)
            if is_eagle_checkpoint(path):
                layers = int(context.target.hf_config.num_hidden_layers)
                head = load_eagle_checkpoint(path, parts, layers)
            else:
                head = load_head(path, parts)
        if head.config.vocab_size != context.vocab_size:
            raise InvalidRequestError(
                f"proposer: the eagle head's vocabulary ({head.config.vocab_size}) differs from "
                f"the target's ({context.vocab_size})",
                "proposer",
            )
        embed = head.parts.embed
        kernel = block_kernel()
        if kernel is not None and embed.device.type == "cpu" and embed.dtype == torch.bfloat16:
            quantize_matmuls(head, kernel)  # type: ignore[arg-type]  # a DraftHead is a Module
        self.head = head
        self.feature_layers = head.feature_layers
        self.cache = HeadCache(head.config, head.parts.embed.dtype, head.parts.embed.device)
        self.catch_up = context.eagle.catch_up
        configured = context.eagle.cost_per_token
        self.cost_per_token = configured if configured is not None else self._measure_cost()

    def _measure_cost(self) -> float:
        """One head step of one token over one target forward (0 when the target has none)."""
        target_forward_s = self.context.target_forward_s
        if target_forward_s is None:
            return 0.0
        target_s = target_forward_s()
        if target_s <= 0:
            return 0.0
        requests = [ProposeRequest(-1, [0, 0], 1, SamplingParams())]
        seq = _EagleSeq(self.cache.allocate(), committed_len=2)
        embed = self.head.parts.embed
        feature = torch.zeros(  # one row of the target's, as a commit hands it
            1,
            len(self.feature_layers),
            self.head.config.hidden_size,
            dtype=embed.dtype,
            device=embed.device,
        )
        best = float("inf")
        try:
            for _ in range(TIMING_REPEATS):
                seq.features, seq.num_features, seq.num_real = [feature], feature.shape[0], 0
                self.cache.truncate(seq.slot, 0)
                synchronize(embed.device)
                start = time.perf_counter()
                self._draft(requests, [seq], [1])
                synchronize(embed.device)
                best = min(best, time.perf_counter() - start)
        finally:
            self.cache.free(seq.slot)
        cost = best / target_s
        logger.info("eagle head: %.3f of a target forward per draft token", cost)
        return cost

    def _new_seq(self, prompt_token_ids: Sequence[int]) -> _EagleSeq:
        return _EagleSeq(self.cache.allocate(), len(prompt_token_ids))

    def _free_seq(self, seq: _EagleSeq) -> None:
        self.cache.free(seq.slot)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Draft for every request whose features reach its last committed token but one."""
        seqs = self._tracked(requests)
        wanted = []
        for request, seq in zip(requests, seqs, strict=True):
            known = seq.first + seq.num_real + seq.num_features
            # The first round (before any verify forward) has no features yet: no drafts.
            ready = seq.num_features > 0 and known == seq.committed_len - 1
            wanted.append(request.max_num_drafts if ready else 0)
        return self._draft(requests, seqs, wanted)

    def _draft(
        self, requests: Sequence[ProposeRequest], seqs: list[_EagleSeq], wanted: list[int]
    ) -> list[Proposal]:
        drafted: list[list[int]] = [[] for _ in requests]
        active = [i for i, k in enumerate(wanted) if k > 0]
        if not active:
            return [Proposal(()) for _ in requests]
        # The first step feeds each sequence's uncached real pairs (their features fused here:
        # a round without drafts does no work on them).
        features, tokens, rows = [], [], []
        for i in active:
            seq, ids = seqs[i], requests[i].token_ids
            new = torch.cat(seq.features) if len(seq.features) > 1 else seq.features[0]
            if self.catch_up is not None and new.shape[0] > self.catch_up:
                new = self._start_over(seq, new)
            features.append(new)
            start = seq.first + seq.num_real + 1
            tokens.append(torch.as_tensor(ids[start : seq.committed_len]))
            rows.append(new.shape[0])
            seq.num_real += new.shape[0]
            seq.features, seq.num_features = [], 0
        device = self.head.parts.embed.device
        token_in = torch.cat(tokens).to(device)
        with torch.inference_mode():
            feature_in = self.head.target_features(torch.cat(features))  # [N, D]
            while active:
                predicted = forward_cached(
                    self.head,
                    self.cache,
                    [seqs[i].slot for i in active],
                    feature_in,
                    token_in,
                    rows,
                )
                last = torch.tensor(rows, device=device).cumsum(0) - 1
                predicted = predicted[last]  # [len(active), D]
                next_tokens = self._sample(requests, active, drafted, predicted)
                keep = [j for j, i in enumerate(active) if len(drafted[i]) < wanted[i]]
                active = [active[j] for j in keep]
                feature_in = predicted[keep]
                token_in = torch.tensor(next_tokens, device=device)[keep]
                rows = [1] * len(active)
        return [Proposal(tokens_i) for tokens_i in drafted]

    def _start_over(self, seq: _EagleSeq, pending: torch.Tensor) -> torch.Tensor:
        """Empty ``seq``'s cache and keep the last ``catch_up`` of its ``pending`` rows, the
        pairs starting at the first of them (module docstring); those rows."""
        assert self.catch_up is not None
        kept = pending[-self.catch_up :]
        seq.first += seq.num_real + pending.shape[0] - kept.shape[0]
        seq.num_real = 0
        self.cache.truncate(seq.slot, 0)
        return kept

    def _sample(
        self,
        requests: Sequence[ProposeRequest],
        active: list[int],
        drafted: list[list[int]],
        predicted: torch.Tensor,  # [len(active), D]
    ) -> list[int]:
        """One draft per active sequence from the head's logits under the request's controls:
        the argmax for a greedy request, the keyed inverse-CDF sample for a sampled one.

        Only the rows of requests with controls (``verifier.controls``) are scattered into the
        target's vocabulary to be controlled there (-inf elsewhere); the others' controlled
        logits are the head's own over the draft vocabulary, whose argmax is that of the
        scattered row (the vocabulary is sorted, so the first of equal maxima is the same id).
        """
        vocab = self.head.draft_vocab
        draft_logits = self.head.logits(predicted).float()  # [len(active), S]
        tokens = vocab[draft_logits.argmax(dim=-1).to(vocab.device)].tolist()
        draft_logits = self._control(requests, active, drafted, draft_logits, tokens)
        sampled = [row for row, i in enumerate(active) if not requests[i].sampling.is_greedy]
        if sampled:
            asks = [requests[active[row]] for row in sampled]
            offsets = [len(drafted[active[row]]) for row in sampled]  # this draft's, from 0
            uniforms = [_uniform(ask, j) for ask, j in zip(asks, offsets, strict=True)]
            picks = self._keyed_drafts(draft_logits[sampled], [a.sampling for a in asks], uniforms)
            for row, token in zip(sampled, picks, strict=True):
                tokens[row] = token
        for i, token in zip(active, tokens, strict=True):
            drafted[i].append(token)
        return tokens

    def _control(
        self,
        requests: Sequence[ProposeRequest],
        active: list[int],
        drafted: list[list[int]],
        draft_logits: torch.Tensor,  # [len(active), S]
        tokens: list[int],
    ) -> torch.Tensor:
        """``draft_logits`` under the controls of the requests that have some, over the whole
        vocabulary (-inf outside the draft vocabulary); their greedy drafts set in ``tokens``.
        ``draft_logits`` itself where none has controls."""
        histories = [requests[i].history() for i in active]
        controlled = [
            row
            for row, i in enumerate(active)
            if is_controlled(requests[i].sampling, histories[row])
        ]
        if not controlled:
            return draft_logits
        vocab = self.head.draft_vocab
        logits = torch.full(
            (len(controlled), self.context.vocab_size), float("-inf"), device=draft_logits.device
        )
        logits[:, vocab] = draft_logits[controlled]
        logits = apply_controls(
            logits,
            [requests[active[row]].sampling for row in controlled],
            [histories[row] for row in controlled],
            [drafted[active[row]] for row in controlled],
        )
        for row, token in zip(controlled, logits.argmax(dim=-1).tolist(), strict=True):
            tokens[row] = token
        draft_logits = draft_logits.clone()
        draft_logits[controlled] = logits[:, vocab]
        return draft_logits

    def _keyed_drafts(
        self, logits: torch.Tensor, sampling: list[SamplingParams], uniforms: list[float]
    ) -> list[int]:
        """The inverse-CDF samples at ``uniforms`` of q, the controlled ``logits`` [n, S] under
        each row's sampling transforms over the draft vocabulary, as target ids.

        Outside the draft vocabulary every logit is -inf (controls add to finite logits and
        mask), so the transforms run on the draft vocabulary's columns alone, a sixth of the
        target's vocabulary for the shipped head: softmax and top-k/top-p over -inf columns
        give them probability 0, so this is the same distribution, for less work. The draft
        vocabulary is sorted, so q's cumulative sum over its columns is the one over the whole
        vocabulary (zero elsewhere): the sample is the token ``verifier.sample_from_probs``
        gives for q at the same uniform."""
        q = logits_to_probs_by_row(logits, sampling)  # [n, S]
        u = torch.tensor(uniforms, dtype=torch.float64, device=q.device)
        return self.head.draft_vocab[
            sample_from_probs(q, u).to(self.head.draft_vocab.device)
        ].tolist()

    def commit(self, info: CommitInfo) -> None:
        seq = self._seq(info.seq_id)
        self.cache.truncate(seq.slot, seq.num_real)  # drop the drafts' entries
        if info.hidden_states is not None and info.hidden_states.shape[0] > 0:
            if seq.num_real == 0 and seq.num_features == 0:  # the first rows: pairs start there
                seq.first = info.hidden_position
            expected = seq.first + seq.num_real + seq.num_features
            if info.hidden_position != expected:
                raise InvalidRequestError(
                    f"seq_id: {info.seq_id}: features from position {info.hidden_position}, "
                    f"expected {expected}",
                    "seq_id",
                )
            seq.features.append(info.hidden_states)  # fused when the request next drafts
            seq.num_features += info.hidden_states.shape[0]
        seq.committed_len += len(info.token_ids)


def _uniform(request: ProposeRequest, offset: int) -> float:
    """The uniform of the request's position ``len(token_ids) + offset``: keyed by
    ``uniform_key`` as the verifier's (``verifier.uniforms``), or drawn from its generator
    where it has no key."""
    if request.uniform_key is not None:
        return KeyedUniforms(request.uniform_key, len(request.token_ids)).uniform(offset)
    return float(draw_uniforms(1, request.generator)[0])
