"""What verification tells about a proposer: its acceptance rate, estimated from the rounds it
drafted in, and how many drafts are worth asking for at that rate.

Drafts are modelled as kept one after another with a constant probability ``alpha`` each
(Leviathan et al. 2023, section 3.3), so draft ``j`` (1-based) is kept with ``alpha ** j``.
``AcceptanceEstimate`` counts the evidence: accepted drafts, and one rejection for a round that
stopped before the end of its proposal, both decayed by ``decay`` each round, with prior
pseudo-counts that keep the estimate defined. Adaptive speculation (``engine.speculation``)
keeps one per request; the ``hybrid`` proposer one per request and proposer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class AcceptanceEstimate:
    """Decayed counts of accepted and rejected drafts; ``rate`` is the estimated ``alpha``.

    With the defaults the prior is one accept and one reject: 0.5 with no history.
    """

    accepted: float = 0.0
    rejected: float = 0.0
    decay: float = 0.8  # weight of a round's evidence after each later observed round
    prior_accepted: float = 1.0
    prior_rejected: float = 1.0

    @property
    def rate(self) -> float:
        """The estimated probability that a draft is accepted, given its predecessor."""
        return (self.accepted + self.prior_accepted) / (
            self.accepted + self.rejected + self.prior_accepted + self.prior_rejected
        )

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Decay the evidence, then add a round's: ``num_accepted`` of ``num_drafts`` kept (a
        round that proposed nothing only decays it)."""
        self.accepted *= self.decay
        self.rejected *= self.decay
        if num_drafts > 0:
            self.accepted += num_accepted
            self.rejected += 1.0 if num_accepted < num_drafts else 0.0


def drafts_worth_asking(rate: float, threshold: float, max_drafts: int) -> int:
    """The largest ``k <= max_drafts`` with ``rate ** k >= threshold`` (0 if even k = 1 fails).

    Example: rate 0.8, threshold 0.094, max_drafts 8: 0.8 ** 8 = 0.168 >= 0.094, so 8.
    """
    if max_drafts <= 0 or rate <= 0.0 or rate < threshold:
        return 0
    if rate >= 1.0 or threshold <= 0.0:
        return max_drafts
    return min(max_drafts, int(math.log(threshold) / math.log(rate) + 1e-9))
