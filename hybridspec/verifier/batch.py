"""The verifier's hand-offs: ``VerifyInput`` (a batch's drafts and the target's logits, flat
and ragged), ``VerifyOutput`` (what each sequence commits) and ``VerifyKind``.

Layout of ``target_logits`` (as in vLLM): sequence i with k_i drafts owns the k_i + 1 rows
``cu[i] + i .. cu[i + 1] + i``; row j of them holds the target's logits after the last committed
token and d_1 .. d_j. Example: k = [2, 0, 3] gives cu = [0, 2, 2, 5] and 8 rows: seq 0 rows 0..2,
seq 1 row 3, seq 2 rows 4..7. ``VerifyInput.layout`` (``layout.DraftLayout``) holds these offsets,
built once per round; everything downstream reads them from it.

Dimensions: ``num_seqs``, ``total_num_drafts`` (sum of k_i), ``vocab_size``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridspec.errors import check
from hybridspec.types import Proposal, SamplingParams, TokenHistory
from hybridspec.verifier.checks import check_drafts, check_probs_shape
from hybridspec.verifier.layout import DraftLayout
from hybridspec.verifier.sampling import logits_to_probs
from hybridspec.verifier.uniforms import KeyedUniforms

GREEDY = SamplingParams()  # frozen, so safe to share as a default


class VerifyKind(enum.IntEnum):
    """How one sequence's drafts are decided (the module docstring has the details)."""

    GREEDY = 0  # the target's argmax
    KEYED = 1  # sampled, deterministic drafts, position-keyed uniforms
    SAMPLED = 2  # rejection sampling with the sequence's own generator

    @staticmethod
    def of(
        params: SamplingParams, keyed: KeyedUniforms | None, probs: torch.Tensor | None
    ) -> VerifyKind:
        if params.is_greedy:
            return VerifyKind.GREEDY
        return VerifyKind.KEYED if keyed is not None and probs is None else VerifyKind.SAMPLED


@dataclass(frozen=True, slots=True)
class VerifyInput:
    """One batch to verify: flat ragged drafts and the target's logits at every position."""

    draft_token_ids: torch.Tensor  # [total_num_drafts] int64
    layout: DraftLayout  # the batch's offsets, on the logits' device
    draft_probs: Sequence[torch.Tensor | None]  # per seq: q [k_i, vocab_size], None = deterministic
    target_logits: torch.Tensor  # [total_num_drafts + num_seqs, vocab_size] float
    sampling: Sequence[SamplingParams]  # per seq
    generators: Sequence[torch.Generator | None]  # per seq; draws move to the logits' device
    # per seq: position-keyed randomness, used when its drafts are deterministic; () = all None
    keyed: Sequence[KeyedUniforms | None] = ()
    # per seq: the tokens before its round, which its sampling controls count (``controls``);
    # None for a sequence without controls; () = all None
    histories: Sequence[TokenHistory | None] = ()
    # True when each sequence's drafts and q were validated where they entered
    # (``check_proposal``, as the engine does): the per-sequence checks are not repeated.
    checked: bool = False

    def __post_init__(self) -> None:
        layout = self.layout
        if not isinstance(layout, DraftLayout):  # the message formatted only on failure
            check(False, "layout", f"expected a DraftLayout, got {layout!r}")
        counts, num_seqs = layout.num_drafts, layout.num_seqs
        if not self.keyed:
            object.__setattr__(self, "keyed", (None,) * num_seqs)
        if not self.histories:
            object.__setattr__(self, "histories", (None,) * num_seqs)
        check_drafts(
            self.draft_token_ids,
            layout.total_num_drafts,
            num_seqs,
            self.target_logits,
            self.checked,
        )
        check(
            layout.device == self.target_logits.device,
            "layout",
            f"expected device {self.target_logits.device}, got {layout.device}",
        )
        for name, values in (
            ("draft_probs", self.draft_probs),
            ("sampling", self.sampling),
            ("generators", self.generators),
            ("keyed", self.keyed),
            ("histories", self.histories),
        ):
            check(
                len(values) == num_seqs,
                name,
                f"expected one entry per sequence ({num_seqs}), got {len(values)}",
            )
        if self.checked:
            return
        # Per-sequence checks test first and format a message only on failure: batches can
        # hold thousands of sequences.
        shape = (0, self.target_logits.shape[1])
        device = self.target_logits.device
        per_seq = zip(self.sampling, self.generators, self.draft_probs, strict=True)
        for i, (params, gen, probs) in enumerate(per_seq):
            if not isinstance(params, SamplingParams):
                check(False, "sampling", f"sequence {i}: expected SamplingParams, got {params!r}")
            if gen is not None and not isinstance(gen, torch.Generator):
                check(False, "generators", f"sequence {i}: expected a Generator, got {gen!r}")
            if self.keyed[i] is not None and not isinstance(self.keyed[i], KeyedUniforms):
                check(
                    False, "keyed", f"sequence {i}: expected KeyedUniforms, got {self.keyed[i]!r}"
                )
            if probs is None:
                continue
            shape = (counts[i], shape[1])
            if not (probs.shape == shape and probs.is_floating_point() and probs.device == device):
                check_probs_shape(probs, i, shape, device)

    @property
    def num_drafts(self) -> tuple[int, ...]:
        """Per sequence, k_i."""
        return self.layout.num_drafts

    @property
    def cu_num_drafts(self) -> torch.Tensor:
        """[num_seqs + 1] int64: the cumulative draft counts, from 0."""
        return self.layout.cu_num_drafts

    @property
    def num_seqs(self) -> int:
        return self.layout.num_seqs

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[1]

    @staticmethod
    def from_proposals(
        proposals: Sequence[Proposal],
        target_logits: torch.Tensor,
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        keyed: Sequence[KeyedUniforms | None] = (),
        checked: bool = False,
        histories: Sequence[TokenHistory | None] = (),
    ) -> VerifyInput:
        """Flatten one ``Proposal`` per sequence; ``generators`` None means all None.

        ``checked``: every proposal already passed ``check_proposal``.
        """
        device = target_logits.device
        flat = [int(t) for proposal in proposals for t in proposal.token_ids]
        return VerifyInput(
            draft_token_ids=torch.tensor(flat, dtype=torch.long, device=device),
            layout=DraftLayout.from_counts([p.num_drafts for p in proposals], device),
            draft_probs=[p.probs for p in proposals],
            target_logits=target_logits,
            sampling=list(sampling),
            generators=[None] * len(proposals) if generators is None else list(generators),
            keyed=list(keyed),
            checked=checked,
            histories=list(histories),
        )

    @staticmethod
    def dummy(
        num_drafts: Sequence[int] = (3,),
        vocab_size: int = 32,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        probabilistic: bool | Sequence[bool] = False,
        seed: int = 0,
    ) -> VerifyInput:
        """A random valid batch for tests; sequence i's generator is seeded ``seed + i``.

        The draft's logits are the target's plus noise, so that drafts are often accepted:
        a deterministic draft is their argmax, a probabilistic one a sample of q, their softmax
        under the sequence's transforms (temperature 1 for a greedy sequence).
        """
        num_seqs = len(num_drafts)
        params = [sampling] * num_seqs if isinstance(sampling, SamplingParams) else list(sampling)
        kinds = [probabilistic] * num_seqs if isinstance(probabilistic, bool) else probabilistic
        rng = torch.Generator().manual_seed(seed)
        logits = torch.randn(sum(num_drafts) + num_seqs, vocab_size, generator=rng) * 2
        rows = DraftLayout.from_counts(num_drafts).row_offsets
        proposals = []
        for i, (k, sp, kind) in enumerate(zip(num_drafts, params, kinds, strict=True)):
            draft_logits = logits[rows[i] : rows[i] + k] + torch.randn(k, vocab_size, generator=rng)
            if not kind:
                proposals.append(Proposal(draft_logits.argmax(dim=-1).tolist()))
                continue
            q = logits_to_probs(
                draft_logits, SamplingParams(temperature=1.0) if sp.is_greedy else sp
            )
            tokens = torch.multinomial(q, 1, generator=rng).squeeze(1).tolist() if k else []
            proposals.append(Proposal(tokens, q))
        gens = [torch.Generator().manual_seed(seed + i) for i in range(num_seqs)]
        return VerifyInput.from_proposals(proposals, logits, params, gens)


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    """What each sequence commits: its accepted drafts, then one recovered or bonus token."""

    num_accepted: torch.Tensor  # [num_seqs] int64, accepted drafts per sequence, 0..k_i
    output_token_ids: list[list[int]]  # per seq: num_accepted[i] + 1 token ids
    # [total_num_drafts + num_seqs, vocab_size]: the target's logits after the sequences'
    # sampling controls, which p was made from; None when no sequence has controls (p was made
    # from ``VerifyInput.target_logits`` itself)
    controlled_logits: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.output_token_ids)
