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

Noise would still make rows free: two neighbouring counts out of order (8 rows timed at 17.9 ms,
9 at 17.1, their true gap 1 ms) pool into one flat stretch, on which a draft's row costs nothing
and is asked for at any acceptance. So a pooled stretch is priced on the weighted straight line
through its counts and the nearest measured count on either side (more, until the line rises):
the row's cost there is the neighbourhood's slope, not the noise's zero. Means already in order
are kept as measured (a real kink, the second row nearly free on the block kernel, stays).

Each count's mean is a moving average over about its last ``WINDOW`` forwards; its first two
forwards give the lesser of the two (the first at a new row count often pays one-time costs:
kernel selection, first-touched pages), and after that a forward counts at most ``OUTLIER``
times its count's mean (a step descheduled by a busy neighbour is no row's price).

The machine's speed changes faster than a count gathers ``WINDOW`` forwards, and counts are timed
at different moments: a count timed once under a busy neighbour beside counts timed quietly now
made rows look dear, the reverse nearly free. So the means are kept relative to the machine's
present ``level``: each forward of a count already timed ``MIN_FORWARDS`` times moves the level
by its ratio to that count's price (geometrically, ``LEVEL_RATE`` of the way for a count of
``WINDOW`` forwards or more, less for one of fewer, whose mean is less sure: counts timed in a
burst do not pull the level toward their own errors; the ratio clipped to ``OUTLIER``), every
forward is stored over the level at its time, and a price is the stored mean times the present
level. A count timed long ago is then priced at today's speed from its ratio to the counts
timed now. (A count whose forwards move the level also takes a little of a change of speed
into its own mean, about ``1 / (WINDOW LEVEL_RATE)`` of it: which of the two changed, one
count alone cannot tell.)

A count not timed for ``STALE`` forwards is forgotten, as if never measured: prices keep drafts
away from the counts they price dear, so a count timed dear once (under a busy neighbour, or at
another thread count, which the level does not scale alike for every count) would never be
timed again, and its price would hold every request at no drafts for good (a request's pause
then outlasts it: ``speculation``). Forgotten, the count is priced from its measured neighbours'
line or, with none, the constant path (``speculation``), drafts are asked for again, and the
count is timed afresh (its first two forwards as above).

``TimedForwardCost`` is the engine's forward cost model (``step_budget.FittedForwardCost``, which
sizes prefill chunks, learning from every timed forward, ``batch.run_forward``) that also keeps a
``RowCosts`` of the rounds that fed no prompt rows, each timed with its verification
(``observe_round``: a verified row's softmax and sampling are part of its price): a prompt's
chunk of ``n`` rows costs nothing like a round of ``n`` verified rows (a first chunk runs cold, a
deep one attends over a long context), and joined by a straight line to one-row rounds it would
price every draft's row as a prompt's, so that no draft is ever asked for and no round of few
rows is ever timed.

Dimensions: ``n`` the rows (tokens) fed in one forward, every sequence's together.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from hybridspec.engine.realized_rows import RealizedRows
from hybridspec.engine.step_budget import FittedForwardCost

WINDOW = 64  # forwards a row count's mean is averaged over, about (its shape: the level moves)
OUTLIER = 3.0  # a forward counts at most this many times its row count's mean
MIN_FORWARDS = 2  # forwards of a row count before its mean outlier-clips the next
MAX_ROWS = 4096  # forwards of more rows are prefill chunks far past any round of drafts
LEVEL_RATE = 0.5  # share of a forward's (log) ratio to its price that moves the level
STALE = 256  # forwards after which a row count not timed since is forgotten


@dataclass(slots=True)
class RowCosts:
    """Measured seconds of a forward by its row count (module docstring)."""

    _means: dict[int, float] = field(default_factory=dict)  # rows -> mean seconds
    _counts: dict[int, int] = field(default_factory=dict)  # rows -> forwards seen
    _rows: list[int] = field(default_factory=list)  # the measured row counts, ascending
    _curve: list[float] | None = None  # stored seconds of 0 .. n rows, n the largest count
    _level: float = 1.0  # the machine's present speed: a price is the stored mean times it
    _forwards: int = 0  # forwards observed
    _seen: dict[int, int] = field(default_factory=dict)  # rows -> ``_forwards`` when last timed

    def observe(self, num_rows: int, seconds: float) -> None:
        """Learn from a forward of ``num_rows`` rows that took ``seconds``."""
        if not (0 < num_rows <= MAX_ROWS and math.isfinite(seconds) and seconds > 0):
            return
        count = self._counts.get(num_rows, 0)
        if count >= MIN_FORWARDS:  # a count known well enough to tell the machine's speed
            ratio = min(OUTLIER, max(1.0 / OUTLIER, seconds / self.price(num_rows)))
            self._level *= ratio ** (LEVEL_RATE * min(count, WINDOW) / WINDOW)
        seconds /= self._level  # stored at the reference speed (module docstring)
        if count == 0:
            bisect.insort(self._rows, num_rows)
            self._means[num_rows] = seconds
        elif count == 1:
            self._means[num_rows] = min(self._means[num_rows], seconds)
        else:
            mean = self._means[num_rows]
            seconds = min(seconds, OUTLIER * mean)
            self._means[num_rows] = mean + (seconds - mean) / min(count + 1, WINDOW)
        self._counts[num_rows] = count + 1
        self._curve = None
        self._forwards += 1
        self._seen[num_rows] = self._forwards
        self._forget_stale()

    def _forget_stale(self) -> None:
        """Forget the counts not timed for ``STALE`` forwards (module docstring)."""
        oldest = self._forwards - STALE
        stale = [n for n, seen in self._seen.items() if seen <= oldest]
        for n in stale:
            del self._means[n], self._counts[n], self._seen[n]
            self._rows.remove(n)

    def price(self, num_rows: int) -> float:
        """A measured count's mean at the present level (``seconds`` without the line)."""
        return self._means[num_rows] * self._level

    def seconds(self, num_rows: int) -> float | None:
        """Estimated seconds of a forward of ``num_rows`` rows; None where nothing measured
        reaches that low (the smallest count measured is above it) or only one count is
        measured above it (no slope to extend)."""
        rows = self._rows
        if not rows or num_rows < rows[0] or (num_rows > rows[-1] and len(rows) < 2):
            return None
        curve = self._monotone()
        if num_rows < len(curve):
            return curve[num_rows] * self._level
        slope = max(0.0, (curve[rows[-1]] - curve[rows[-2]]) / (rows[-1] - rows[-2]))
        return (curve[rows[-1]] + slope * (num_rows - rows[-1])) * self._level

    def _monotone(self) -> list[float]:
        """The stored means made non-decreasing (``isotonic``, weighted by forwards held), each
        pooled stretch on its neighbourhood's line (``sloped``), joined by straight lines:
        stored seconds of ``0 .. largest`` rows (below the smallest count: its mean, never
        read). Refitted after each forward, in plain floats: the counts are a few dozen, too
        few for numpy's per-call cost to pay."""
        if self._curve is None:
            means = [self._means[n] for n in self._rows]
            weights = [min(self._counts[n], WINDOW) for n in self._rows]
            self._curve = interpolated(self._rows, sloped(self._rows, means, weights))
        return self._curve

    def clear(self) -> None:
        self._means.clear()
        self._counts.clear()
        self._rows.clear()
        self._seen.clear()
        self._curve = None
        self._level = 1.0
        self._forwards = 0


def isotonic(values: list[float], weights: list[int]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in weighted least squares (pool adjacent
    violators: a run out of order becomes its weighted mean). Example: values 1, 5, 2, 3 with
    weights 1, 1, 2, 1 give 1, 3, 3, 3."""
    return [mean for mean, start, stop in pooled(values, weights) for _ in range(start, stop)]


def pooled(values: list[float], weights: list[int]) -> list[tuple[float, int, int]]:
    """``isotonic``'s blocks, in order: ``(mean, start, stop)``, ``values[start:stop]`` pooled
    into ``mean``. Example: values 1, 5, 2, 3 with weights 1, 1, 2, 1 give (1, 0, 1), (3, 1, 4)."""
    blocks: list[list[float]] = []  # [mean, weight, start, stop]
    for i, (value, weight) in enumerate(zip(values, weights, strict=True)):
        blocks.append([value, float(weight), i, i + 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, total, _, stop = blocks.pop()
            before = blocks[-1]
            joined = before[1] + total
            before[0] = (before[0] * before[1] + mean * total) / joined
            before[1], before[3] = joined, stop
    return [(mean, int(start), int(stop)) for mean, _, start, stop in blocks]


def sloped(rows: list[int], values: list[float], weights: list[int]) -> list[float]:
    """``isotonic(values, weights)`` at ``rows`` (ascending), each pooled stretch replaced by
    the weighted least-squares line through its counts and one measured count on either side,
    widened a count at a time until it rises (module docstring); then made non-decreasing.
    Example: rows 1, 2, 3, 4 at 1.0, 0.9, 1.2, 1.1 (weights 1) give 0.93, 1.03, 1.07, 1.17
    (isotonic alone: 0.95, 0.95, 1.15, 1.15)."""
    blocks = pooled(values, weights)
    fitted = [mean for mean, start, stop in blocks for _ in range(start, stop)]
    for _, start, stop in blocks:
        if stop - start < 2:
            continue
        lo, hi = start, stop
        while True:
            lo, hi = max(0, lo - 1), min(len(rows), hi + 1)
            x_mean, y_mean, slope = _line(rows[lo:hi], values[lo:hi], weights[lo:hi])
            if slope > 0 or (lo == 0 and hi == len(rows)):
                break
        for i in range(start, stop):
            fitted[i] = y_mean + max(0.0, slope) * (rows[i] - x_mean)
    return list(itertools.accumulate(fitted, max))


def _line(xs: list[int], ys: list[float], ws: list[int]) -> tuple[float, float, float]:
    """The weighted least-squares line through ``(xs, ys)`` (at least two distinct ``xs``):
    its point of means ``(x_mean, y_mean)`` and its slope."""
    total = float(sum(ws))
    x_mean = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
    y_mean = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
    spread = sum(w * (x - x_mean) ** 2 for w, x in zip(ws, xs, strict=True))
    moment = sum(w * (x - x_mean) * (y - y_mean) for w, x, y in zip(ws, xs, ys, strict=True))
    return x_mean, y_mean, moment / spread


def interpolated(rows: list[int], fitted: list[float]) -> list[float]:
    """``fitted`` (at ``rows``, ascending) at every row count ``0 .. rows[-1]``, joined by
    straight lines; below ``rows[0]``, ``fitted[0]``. Example: rows 1, 3 at 1.0, 2.0 give 1.0,
    1.0, 1.5, 2.0."""
    curve = [fitted[0]] * (rows[0] + 1)
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(rows, fitted, strict=True)):
        step = (y1 - y0) / (x1 - x0)
        curve += [y0 + step * (n - x0) for n in range(x0 + 1, x1)]
        curve.append(y1)
    return curve


@dataclass(slots=True)
class TimedForwardCost(FittedForwardCost):
    """The fitted forward cost of ``step_budget``, also keeping each row count's measured time
    (``rows``) for adaptive speculation (module docstring)."""

    rows: RowCosts = field(default_factory=RowCosts)
    realized: RealizedRows = field(default_factory=RealizedRows)

    def observe_round(
        self, num_rows: int, num_verified: int, seconds: float, num_drafts: int = 0
    ) -> None:
        """A round's forward of ``num_rows`` rows, ``num_verified`` of them decoding requests'
        verified rows (``num_drafts`` of those drafts), and its verification took ``seconds``:
        where it fed no prompt, ``realized`` checks what its drafts' rows added against what
        ``rows`` priced them at, then ``rows`` learns it (``fit``, which sizes prompt chunks,
        learns each forward alone: ``batch.run_forward``)."""
        if num_verified != num_rows:
            return
        requests = num_rows - num_drafts
        modelled = None
        if num_drafts > 0:
            with_drafts, without = self.rows.seconds(num_rows), self.rows.seconds(requests)
            if with_drafts is not None and without is not None:
                modelled = with_drafts - without
        self.realized.observe(requests, num_drafts, seconds, modelled)
        self.rows.observe(num_rows, seconds)
