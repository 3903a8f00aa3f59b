"""A request's speculation and speed statistics (``GenerationStats``): what the engine counts
each round (``record_round``) and hands out with every output, the server's metrics and the
benchmarks read. Engine-side, not a hand-off below it: ``types`` keeps those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What ``GenerationStats.to_dict`` reports, in order: the per-position counts are reported as
# their rates (``acceptance_per_position``).
REPORTED = (
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "target_forwards",
    "draft_tokens_proposed",
    "draft_tokens_accepted",
    "acceptance_rate",
    "mean_accepted_length",
    "acceptance_per_position",
    "elapsed_s",
    "time_to_first_token_s",
    "tokens_per_second",
)


@dataclass(slots=True)
class GenerationStats:
    """Speculation and speed statistics of one request."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache, not prefilled
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
        return _share(self.draft_tokens_accepted, self.draft_tokens_proposed)

    @property
    def acceptance_per_position(self) -> list[float]:
        """Per draft position ``i``: the share of drafts proposed there that were accepted
        (``accepted_per_position[i] / proposed_per_position[i]``, 0 where none was proposed):
        the counts are ``accepted_per_position``, their rates this."""
        return [
            _share(a, p)
            for a, p in zip(self.accepted_per_position, self.proposed_per_position, strict=True)
        ]

    @property
    def mean_accepted_length(self) -> float:
        """Committed tokens per target forward, counting the bonus or recovered token."""
        return _share(self.generated_tokens, self.target_forwards)

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
        """The reported figures (``REPORTED``, in that order), counts and rates."""
        return {name: getattr(self, name) for name in REPORTED}


def _share(part: int, whole: int) -> float:
    """``part / whole``, 0 where ``whole`` is 0 (nothing counted yet)."""
    return part / whole if whole else 0.0
