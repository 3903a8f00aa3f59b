"""What drafts' rows measurably added to their rounds, against what the row table said they
would: a check on ``row_costs`` that does not rest on its model.

``RowCosts`` prices a draft's row from each row count's mean, kept relative to the machine's
present speed, and from lines through counts it pooled; at 8 requests the count without drafts
holds nearly every forward and sets the level, the counts of a few drafts more hold few, and
the price of the row between them can come out at half what the rounds show (the table priced
a ninth row at 1 ms where 8-row and 9-row rounds interleaved in the same seconds differed by
1.5 to 2). A round's realised cost needs no such model: ``RealizedRows`` keeps, per count of
decoding requests, a recent moving average of the rounds in which none of them drafted (the
step without drafts), and for every round with drafts adds up how much longer it took than that
average (``realized``) beside how much longer the row table priced it (``modelled``: ``t(B +
D) - t(B)`` for ``B`` requests and ``D`` drafts, read before the round is learned), each sum
decayed by ``DECAY`` a drafting round so that it follows the machine. ``extra_per_draft`` is
their difference over the drafts: the seconds per draft the table leaves out, never below 0 (a
table that prices rows too dear already keeps drafts away; this check only adds). Adaptive
speculation adds it to every draft's price (``drafts.DraftCounts``), so that where drafts cost
more than the table says, a request asks for fewer, down to none and a pause.

Rounds with and without drafts interleave within seconds, so the machine's load changes both
alike; a step without drafts last seen more than ``STALE`` rounds ago prices nothing (the load
may have changed since). A round counts within ``OUTLIER`` times of what was expected of it
either way (a round without drafts: its count's average; one with drafts: that average plus
the table's price of its drafts): a step descheduled by a busy neighbour, or one that ran
while the neighbour slept, is nobody's draft, and one such step must not outweigh dozens.
Before ``MIN_DRAFTS`` decayed drafts are counted the check adds nothing: a few rounds' noise
is no price.

Worked example: 8 requests without drafts take 20 ms; a round of 8 requests and 2 drafts takes
24 ms where the table said 22: realised 4 ms, modelled 2, so each draft costs 1 ms more than
the table's price.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.97  # weight of a drafting round's evidence after each later drafting round
BASE_RATE = 0.2  # share of a round without drafts that moves its count's average
MIN_BASE = 2  # rounds without drafts at a count before its average prices a drafting round
STALE = 32  # rounds after which a count's average without drafts prices nothing
OUTLIER = 1.5  # a round counts within this factor of what was expected of it, either way
MIN_DRAFTS = 8.0  # decayed drafts counted before ``extra_per_draft`` adds anything


@dataclass(slots=True)
class _Base:
    """A count of requests' rounds without drafts: their moving average, how many, and the
    round (of ``RealizedRows``' count) last seen."""

    seconds: float
    count: int
    seen: int


@dataclass(slots=True)
class RealizedRows:
    """Drafting rounds' measured cost over the same rounds without drafts (module docstring)."""

    _bases: dict[int, _Base] = field(default_factory=dict)  # decoding requests -> average
    _realized: float = 0.0  # decayed seconds drafting rounds took over their step without
    _modelled: float = 0.0  # decayed seconds the row table priced the same drafts at
    _drafts: float = 0.0  # decayed drafts of those rounds
    _rounds: int = 0  # rounds observed

    def observe(
        self, num_requests: int, num_drafts: int, seconds: float, modelled: float | None
    ) -> None:
        """Learn from a round of ``num_requests`` decoding requests and ``num_drafts`` drafts
        that took ``seconds``; ``modelled``: the row table's price of its drafts' rows (None
        where it cannot price them: the round then adds nothing)."""
        if num_requests <= 0 or num_drafts < 0 or not seconds > 0:
            return
        self._rounds += 1
        base = self._bases.get(num_requests)
        if num_drafts == 0:
            if base is None:
                self._bases[num_requests] = _Base(seconds, 1, self._rounds)
            elif base.count < MIN_BASE:  # the first few: their mean, none yet to clip to
                base.seconds += (seconds - base.seconds) / (base.count + 1)
            else:
                base.seconds += BASE_RATE * (_within(seconds, base.seconds) - base.seconds)
            if base is not None:
                base.count, base.seen = base.count + 1, self._rounds
            return
        if base is None or base.count < MIN_BASE or self._rounds - base.seen > STALE:
            return
        if modelled is None:
            return
        modelled = max(0.0, modelled)
        realized = _within(seconds, base.seconds + modelled) - base.seconds
        self._realized = DECAY * self._realized + realized
        self._modelled = DECAY * self._modelled + modelled
        self._drafts = DECAY * self._drafts + num_drafts

    def extra_per_draft(self) -> float:
        """Seconds per draft that the drafting rounds took beyond the row table's price of
        them, at least 0; 0 before ``MIN_DRAFTS`` drafts are counted."""
        if self._drafts < MIN_DRAFTS:
            return 0.0
        return max(0.0, (self._realized - self._modelled) / self._drafts)

    def clear(self) -> None:
        self._bases.clear()
        self._realized = self._modelled = self._drafts = 0.0
        self._rounds = 0


def _within(seconds: float, expected: float) -> float:
    """``seconds`` clipped to within ``OUTLIER`` times ``expected``, either way."""
    return min(OUTLIER * expected, max(expected / OUTLIER, seconds))
