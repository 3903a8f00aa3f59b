"""What a target forward measurably costs by how many rows it has, for adaptive speculation's
price of a draft.

A draft costs its request one more verified row, and what a row costs depends on how many rows
the forward already has: on CPU a one-row forward takes the matrix-vector path and a few rows the
block kernel (at the 3B shape 2 rows cost 1.05 decodes, 9 rows 2.25, 17 rows 3.7: 0.05 for the
first extra row, about 0.16 each after it), and 8 requests of ``K + 1`` rows each are no longer
nearly free beside one. So no constant per row prices them. ``RowCosts`` keeps the measured
seconds of the engine's forwards by their row count (``observe``: its rounds, below)
and prices a forward of ``n`` rows from them (``seconds``): the mean at ``n`` itself, a straight
line between the nearest measured counts on either side, and past the largest the slope of its
last stretch (never below 0). The means are made non-decreasing in ``n`` by pooling neighbours
that are out of order into their average, weighted by how many forwards each holds (isotonic
regression): a row is never free, and one slow count does not lift every count above it (with
each count made at least the one before it, one forward that compiled a kernel at 9 rows priced
every row from 9 to 60 alike, so that 8 requests' drafts looked free).

Each count's mean is a moving average over about its last ``WINDOW`` forwards, so that it
follows the machine's load; its first two forwards give the lesser of the two (the first at a
new row count often pays one-time costs: kernel selection, first-touched pages), and after
that a forward counts at most ``OUTLIER`` times its count's mean (a step descheduled by a busy
neighbour is no row's price).

``TimedForwardCost`` is the engine's forward cost model (``step_budget.FittedForwardCost``, which
sizes prefill chunks, learning from every timed forward, ``batch.run_forward``) that also keeps a
``RowCosts`` of the forwards that fed no prompt rows (``observe_forward``): a prompt's chunk of
``n`` rows costs nothing like a round of ``n`` verified rows (a first chunk runs cold, a deep one
attends over a long context), and joined by a straight line to one-row rounds it would price
every draft's row as a prompt's, so that no draft is ever asked for and no round of few rows is
ever timed.

Dimensions: ``n`` the rows (tokens) fed in one forward, every sequence's together.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from hybridspec.engine.step_budget import FittedForwardCost

WINDOW = 16  # forwards a row count's mean is averaged over, about
OUTLIER = 3.0  # a forward counts at most this many times its row count's mean
MIN_FORWARDS = 2  # forwards of a row count before its mean outlier-clips the next
MAX_ROWS = 4096  # forwards of more rows are prefill chunks far past any round of drafts


@dataclass(slots=True)
class RowCosts:
    """Measured seconds of a forward by its row count (module docstring)."""

    _means: dict[int, float] = field(default_factory=dict)  # rows -> mean seconds
    _counts: dict[int, int] = field(default_factory=dict)  # rows -> forwards seen
    _rows: list[int] = field(default_factory=list)  # the measured row counts, ascending
    _curve: np.ndarray | None = None  # [n + 1] seconds of 0 .. n rows, up to the largest count

    def observe(self, num_rows: int, seconds: float) -> None:
        """Learn from a forward of ``num_rows`` rows that took ``seconds``."""
        if not (0 < num_rows <= MAX_ROWS and math.isfinite(seconds) and seconds > 0):
            return
        count = self._counts.get(num_rows, 0)
        if count == 0:
            bisect.insort(self._rows, num_rows)
            self._means[num_rows] = seconds
        elif count == 1:
            self._means[num_rows] = min(self._means[num_rows], seconds)
        else:
            mean = self._means[num_rows]
            if count >= MIN_FORWARDS:
                seconds = min(seconds, OUTLIER * mean)
            self._means[num_rows] = mean + (seconds - mean) / min(count + 1, WINDOW)
        self._counts[num_rows] = count + 1
        self._curve = None

    def seconds(self, num_rows: int) -> float | None:
        """Estimated seconds of a forward of ``num_rows`` rows; None where nothing measured
        reaches that low (the smallest count measured is above it) or only one count is
        measured above it (no slope to extend)."""
        rows = self._rows
        if not rows or num_rows < rows[0] or (num_rows > rows[-1] and len(rows) < 2):
            return None
        curve = self._monotone()
        if num_rows < len(curve):
            return float(curve[num_rows])
        slope = max(0.0, (curve[rows[-1]] - curve[rows[-2]]) / (rows[-1] - rows[-2]))
        return float(curve[rows[-1]] + slope * (num_rows - rows[-1]))

    def _monotone(self) -> np.ndarray:
        """The means made non-decreasing (``isotonic``, weighted by forwards held), joined by
        straight lines: seconds of ``0 .. largest`` rows (below the smallest count: its mean,
        never read)."""
        if self._curve is None:
            means = [self._means[n] for n in self._rows]
            weights = [min(self._counts[n], WINDOW) for n in self._rows]
            fitted = isotonic(means, weights)
            self._curve = np.interp(np.arange(self._rows[-1] + 1), self._rows, fitted)
        return self._curve

    def clear(self) -> None:
        self._means.clear()
        self._counts.clear()
        self._rows.clear()
        self._curve = None


def isotonic(values: list[float], weights: list[int]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in weighted least squares (pool adjacent
    violators: a run out of order becomes its weighted mean). Example: values 1, 5, 2, 3 with
    weights 1, 1, 2, 1 give 1, 3, 3, 3."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, total, length = blocks.pop()
            before = blocks[-1]
            joined = before[1] + total
            before[0] = (before[0] * before[1] + mean * total) / joined
            before[1], before[2] = joined, before[2] + length
    return [mean for mean, _, length in blocks for _ in range(int(length))]


@dataclass(slots=True)
class TimedForwardCost(FittedForwardCost):
    """The fitted forward cost of ``step_budget``, also keeping each row count's measured time
    (``rows``) for adaptive speculation (module docstring)."""

    rows: RowCosts = field(default_factory=RowCosts)

    def observe_forward(
        self, num_rows: int, num_scores: int, num_verified: int, seconds: float
    ) -> None:
        """A forward of ``num_rows`` rows, ``num_verified`` of them decoding requests' verified
        rows, took ``seconds``: the fit learns it, and ``rows`` too where it fed no prompt."""
        self.observe(num_rows, num_scores, seconds)
        if num_verified == num_rows:
            self.rows.observe(num_rows, seconds)
