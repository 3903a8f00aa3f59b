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
last stretch (never below 0). The means are taken as non-decreasing in ``n`` (each at least the
one before it), so that noise never makes a row free.

Each count's mean is a moving average over about its last ``WINDOW`` forwards, so that it
follows the machine's load, and a forward counts at most ``OUTLIER`` times its count's mean (a
step descheduled by a busy neighbour, or one that compiled a kernel, is no row's price).

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
        """The means, each at least the one of fewer rows, joined by straight lines: seconds
        of ``0 .. largest`` rows (below the smallest count: its mean, never read)."""
        if self._curve is None:
            means = np.maximum.accumulate([self._means[n] for n in self._rows])
            self._curve = np.interp(np.arange(self._rows[-1] + 1), self._rows, means)
        return self._curve

    def clear(self) -> None:
        self._means.clear()
        self._counts.clear()
        self._rows.clear()
        self._curve = None


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
