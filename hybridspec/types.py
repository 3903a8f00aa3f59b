"""Types shared by the proposers, the verifier and the engine.

Glossary of dimensions used in tensor shape comments across the package (ARCHITECTURE.md has
the whole glossary):

- ``num_seqs``: sequences verified together in one target forward.
- ``num_drafts``: draft tokens of one sequence in one round (0..K, ``k_i`` in formulas).
- ``total_num_drafts``: sum of ``num_drafts`` over a batch (flat ragged layout).
- ``vocab_size``: size of the target's (and draft's) vocabulary.
- ``cu_*``: cumulative offsets, length ``num_seqs + 1``, starting at 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridspec.errors import check

MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_SEED = 1 << 63  # torch generators take a signed 64-bit seed


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the target's next-token distribution is shaped before sampling.

    ``temperature == 0`` (or below 1e-5) means greedy decoding. ``top_k = None`` and
    ``top_p = 1.0`` disable those filters. ``seed`` makes sampling reproducible per request;
    ``None`` draws fresh entropy.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check(
            isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool),
            "temperature",
            f"expected a number, got {self.temperature!r}",
        )
        check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            f"expected a finite number >= 0, got {self.temperature!r}",
        )
        check(
            self.top_k is None
            or (
                isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 1
            ),
            "top_k",
            f"expected None or an integer >= 1, got {self.top_k!r}",
        )
        check(
            isinstance(self.top_p, (int, float))
            and not isinstance(self.top_p, bool)
            and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"expected a number in (0, 1], got {self.top_p!r}",
        )
        check(
            self.seed is None
            or (
                isinstance(self.seed, int)
                and not isinstance(self.seed, bool)
                and 0 <= self.seed < MAX_SEED
            ),
            "seed",
            f"expected None or an integer in [0, 2**63), got {self.seed!r}",
        )

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``MIN_SAMPLING_TEMPERATURE`` decode greedily, as in vLLM:
        dividing logits by them would overflow float32."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE


@dataclass(frozen=True, slots=True)
class ProposeRequest:
    """One sequence's request to a proposer for one round.

    ``token_ids`` is the committed context (prompt then generated tokens), shared with the
    engine without copying: read it, never modify it. ``max_num_drafts`` is how many drafts the
    engine asks for this round (the request's K, shrunk near the context limit and by adaptive
    speculation); a proposer may return fewer. ``generator`` is the request's random generator,
    for proposers that sample their drafts.
    """

    seq_id: int
    token_ids: Sequence[int]
    max_num_drafts: int
    sampling: SamplingParams
    generator: torch.Generator | None = None


@dataclass(frozen=True, slots=True)
class Proposal:
    """What a proposer guesses for one sequence in one round: ``num_drafts`` draft tokens.

    ``probs`` is the proposer's distribution q at each draft position, after the request's
    sampling transforms, from which each draft was drawn; ``None`` marks deterministic drafts,
    verified as one-hot draft distributions. The engine validates a proposal once, where it
    enters (``verifier.check_proposal``).
    """

    token_ids: Sequence[int]  # [num_drafts]
    probs: torch.Tensor | None = None  # [num_drafts, vocab_size] float, rows sum to 1

    @property
    def num_drafts(self) -> int:
        return len(self.token_ids)

    @property
    def is_sampled(self) -> bool:
        """True when the drafts were sampled from ``probs`` (verified by rejection sampling)."""
        return self.probs is not None


EMPTY_PROPOSAL = Proposal(token_ids=())


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """What one round committed to a sequence, handed to its proposer's ``commit``.

    ``token_ids`` are exactly the tokens appended after verification: the first
    ``num_accepted`` are accepted drafts, the last one the target's bonus or correction token
    (unless a stop condition cut the round short, when there may be fewer). A proposer rolls its
    own state back past the rejected drafts from these two fields alone.
    ``hidden_states`` is for proposers that read the target's features
    (``Proposer.hidden_layers``): the target's hidden states at the committed positions
    ``hidden_position, hidden_position + 1, ...`` that it fed since the last commit (see
    ``engine.features``: the prompt's chunks, the last committed token, accepted drafts; never a
    rejected draft). ``None`` for a proposer that asks for no layer.
    """

    seq_id: int
    token_ids: Sequence[int]  # [num_committed]
    num_accepted: int
    # [num_rows, len(Proposer.hidden_layers), hidden_size] in the target's dtype, or None
    hidden_states: torch.Tensor | None = None
    hidden_position: int = 0  # the position of hidden_states' first row


@dataclass(slots=True)
class GenerationStats:
    """Speculation and speed statistics of one request."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0  # verification forwards (each commits >= 1 token); prefill excluded
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0
    time_to_first_token_s: float | None = None

    @property
    def acceptance_rate(self) -> float:
        """Share of proposed draft tokens the target accepted (0 when nothing was proposed)."""
        if self.draft_tokens_proposed == 0:
            return 0.0
        return self.draft_tokens_accepted / self.draft_tokens_proposed

    @property
    def mean_accepted_length(self) -> float:
        """Committed tokens per target forward, counting the bonus or correction token."""
        if self.target_forwards == 0:
            return 0.0
        return self.generated_tokens / self.target_forwards

    @property
    def tokens_per_second(self) -> float:
        if self.elapsed_s <= 0:
            return 0.0
        return self.generated_tokens / self.elapsed_s

    def record_round(self, num_drafts: int, num_accepted: int) -> None:
        """Count one verification round with ``num_drafts`` drafts, ``num_accepted`` kept."""
        self.target_forwards += 1
        self.draft_tokens_proposed += num_drafts
        self.draft_tokens_accepted += num_accepted
        grow = num_drafts - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_drafts):
            self.proposed_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    def to_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "target_forwards": self.target_forwards,
            "draft_tokens_proposed": self.draft_tokens_proposed,
            "draft_tokens_accepted": self.draft_tokens_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": [
                a / p if p else 0.0
                for a, p in zip(self.accepted_per_position, self.proposed_per_position, strict=True)
            ],
            "elapsed_s": self.elapsed_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "tokens_per_second": self.tokens_per_second,
        }
