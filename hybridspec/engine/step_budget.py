"""A step's prefill sized in time: how many prompt tokens each prefilling request feeds in a
step that decoding requests share.

A chunk of ``n`` prompt tokens after ``s`` cached ones costs more the deeper it sits: each of its
rows attends over every key before it, ``n s + n (n + 1) / 2`` query-key pairs in all
(``attention_scores``), besides the ``n`` rows' matmuls. A fixed number of tokens per step therefore
makes every decoding request that shares the step wait for a forward that grows with the prompt's
depth. Instead, ``StepBudget`` prices the step with a cost model of the forward (``ForwardCost``)
and grants each prefilling request the most tokens that keep the step within a bound: ``ratio``
times what the decoding requests' forward alone is estimated to take, at least ``min_seconds`` and
at most ``max_seconds`` (a decoding request's tokens come a step apart, so this caps its gaps while
prompts prefill, however many decode beside it), unless the decoding requests' forward alone takes
more than all of it: a prompt then gets as much of a step as they do (``FAIR_SHARE``), so a
slow model's or a large batch's streams never starve it. (Below the cap the bound stays the cap:
every shared step is sized to end at the bound, so the fit sees nearly one time for every shape
and cannot tell its fixed cost from its per-row cost well; the decoding requests alone are then
priced high, and a share of twice that would let steps run past the cap.) Where no prompt is
fed yet in a step, the first prefilling request gets at least ``min_chunk`` tokens, so a prompt
always progresses; the floor is small, since 32 tokens 7,800 deep already cost more than a bound
of 0.15 s.

A request with at most ``short_prompt`` prompt tokens left and at most ``START_DEPTH`` cached (a
short prompt just admitted) *starts*: it feeds all of it at once, priced first, and its first
token comes after this step whatever the prompts beside it (counted in tokens, first come first
served, a long prompt admitted before it would take every step's whole budget until its own
rest fit). A starting rest is priced within the step's bound but does not set it: the bound
follows the decoding requests alone, or is ``min_seconds`` where none decodes. A long prompt's
last tokens do not start: 7,800 deep they cost a whole bound, so they are granted like any
chunk, what fits. A step with no decoding request is bounded too for
``LINGER_S`` after the last one priced with decoding or starting requests: a stream's client
sends its next request as its answer ends, so the step running when it arrives is short.
Otherwise a step with no decoding request is not bounded in time: prompts then feed
``prefill_chunk_size`` tokens per step, at full speed (``Scheduler.plan``).

``FittedForwardCost`` is the cost model the engine uses: ``seconds = load (a + b rows + c
scores)``, fitted to the measured time of every forward the engine runs (``batch.run_forward``).
The shape ``a, b, c`` comes from about the last ``1 / (1 - DECAY)`` forwards, so that it keeps
the varied shapes that tell its three parts apart (a prompt alone's full chunks, decoding's
single rows) when every recent step was sized to the same bound and so took about the same
time; ``load`` follows the last few forwards (their time over the shape's estimate), so that
the estimate moves with the machine's load and with a context that deepens from step to step.
It prices no forward of more than ``EXTRAPOLATION`` times the most rows it has timed: a fit to
small forwards (the warm-up's, decoding's) may price a large one far off, so a prompt's chunks
beside decoding requests grow at most that fast from step to step, each step's time teaching
the fit the next size. Nor may a shared step feed more than ``GROWTH`` times the prompt tokens
of the shared step before it (plus ``min_chunk``): an estimate is trusted only near what was
just timed, so one loose fit never prices twice the rows as cheap at once.

Dimensions: ``rows`` tokens fed in a forward; ``scores`` their query-key pairs of attention.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

MIN_PREFILL_CHUNK = 8  # tokens the first prefilling request gets in a step, whatever it costs
SHORT_PROMPT = 32  # a rest of at most this many prompt tokens, shallow, is fed whole (``starts``)
START_DEPTH = 1024  # a rest after more cached tokens than this is granted like any chunk
MIN_OBSERVATIONS = 8  # forwards timed before the fitted model prices anything
DECAY = 0.995  # the shape's weight of a timed forward after each later one: about 200 count
LOAD_WEIGHT = 0.4  # the newest forward's part in ``load``: about the last 3 count
LOAD_CHANGE = 2.0  # one forward moves ``load`` by at most this factor's LOAD_WEIGHT power
OUTLIER = 3.0  # the shape learns a priced forward's time within this factor of its estimate
SCORES_UNIT = 1000.0  # the fit's unit of query-key pairs, so its three columns are alike
# The prior where the timings do not tell (all forwards shallow): a row's attention over this
# many cached tokens costs as much as the row's matmuls. Timed on SmolLM2-135M on CPU; the
# timings of deep forwards replace it.
PRIOR_DOUBLING_CONTEXT = 2048
PRIOR_FIXED_ROWS = 8  # and a forward's fixed cost is that of this many rows (weakly held)
EXTRAPOLATION = 2  # the most rows priced, in multiples of the most timed
FAIR_SHARE = 2  # a shared step may always take this many times its decoding requests' forward
GROWTH = 1.5  # a shared step's prompt tokens, at most this times the last shared step's
# Seconds after a step priced with decoding requests during which steps stay bounded: the next
# request of a stream (on loopback: milliseconds; over a network: a round trip) finds a short step
LINGER_S = 1.0


def attention_scores(cached: int, num_rows: int) -> int:
    """Query-key pairs of ``num_rows`` new tokens after ``cached`` ones: row ``j`` (from 0)
    attends over ``cached + j + 1`` keys. Example: 3 rows after 10 cached: 11 + 12 + 13 = 36."""
    return num_rows * cached + num_rows * (num_rows + 1) // 2


class ForwardCost(Protocol):
    """Estimated seconds of a target forward over ``num_rows`` tokens with ``num_scores``
    query-key pairs; None while it cannot tell (the scheduler then counts tokens)."""

    def seconds(self, num_rows: int, num_scores: int) -> float | None: ...


@dataclass(slots=True)
class FittedForwardCost:
    """``load (a + b rows + c scores)``: the shape ``a, b, c`` by least squares over the timed
    forwards, each weighted ``DECAY ** age``, with two pseudo-observations as a prior (module
    constants) that keep the fit defined where the forwards do not vary enough (coefficients
    below zero are clamped); ``load`` a moving geometric mean of each forward's time over the
    shape's estimate of it, each ratio within ``1 / LOAD_CHANGE .. LOAD_CHANGE``, and the shape
    a priced forward's time within ``OUTLIER`` times its estimate (one forward descheduled for a
    second is no measure of the next, nor of the ~200 after it). A forward past what is priced
    (``EXTRAPOLATION``) is learned as timed: its size is new, not its time suspect."""

    # sum w x x^T and sum w x y, for x = (1, rows, scores / SCORES_UNIT), as plain floats: a
    # 3 x 3 system refitted twice a step costs microseconds so, tens of them through numpy
    _gram: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _moment: list[float] = field(default_factory=lambda: [0.0] * 3)
    _count: int = 0
    _most_rows: int = 0  # the largest forward timed
    _coefficients: tuple[float, float, float] | None = None  # a, b, c per SCORES_UNIT
    _log_load: float = 0.0  # log of ``load``

    def observe(self, num_rows: int, num_scores: int, seconds: float) -> None:
        """Learn from a forward over ``num_rows`` tokens and ``num_scores`` pairs that took
        ``seconds``: ``load`` from its time over the shape's estimate (once it is priced), then
        the shape from its time over ``load`` (so that a load that lasts moves ``load``, and not
        the split of the shape's parts: steps sized to one bound all have one time)."""
        if num_rows <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        estimate = self.seconds(num_rows, num_scores)
        if estimate is not None and estimate > 0:  # a shape priced: the load learns, clipped
            limit = math.log(LOAD_CHANGE)
            ratio = math.log(seconds / self._shape(num_rows, num_scores))
            self._log_load += LOAD_WEIGHT * (min(max(ratio, -limit), limit) - self._log_load)
            seconds = min(max(seconds, estimate / OUTLIER), OUTLIER * estimate)
        x = (1.0, float(num_rows), num_scores / SCORES_UNIT)
        y = seconds * math.exp(-self._log_load)
        for i in range(3):
            row = self._gram[i]
            for j in range(3):
                row[j] = DECAY * row[j] + x[i] * x[j]
            self._moment[i] = DECAY * self._moment[i] + x[i] * y
        self._count += 1
        self._most_rows = max(self._most_rows, num_rows)
        self._coefficients = None

    def seconds(self, num_rows: int, num_scores: int) -> float | None:
        """None before ``MIN_OBSERVATIONS`` forwards, and past ``EXTRAPOLATION`` times the
        largest."""
        shape = self._priced_shape(num_rows, num_scores)
        return None if shape is None else math.exp(self._log_load) * shape

    def relative_seconds(self, num_rows: int, num_scores: int) -> float | None:
        """The shape's estimate alone, ``a + b rows + c scores`` without ``load``: how a
        forward of this size compares with one of another size under one load (a round's time
        over it measures the load and the thread count, not the round's size); None where
        ``seconds`` is."""
        return self._priced_shape(num_rows, num_scores)

    def _priced_shape(self, num_rows: int, num_scores: int) -> float | None:
        """``_shape`` where the fit can price a forward of this size (``seconds``), else None."""
        if self._count < MIN_OBSERVATIONS or num_rows > EXTRAPOLATION * self._most_rows:
            return None
        return self._shape(num_rows, num_scores)

    def _shape(self, num_rows: int, num_scores: int) -> float:
        """``a + b rows + c scores`` (the fit made when first needed after an observation)."""
        if self._coefficients is None:
            self._coefficients = self._fit()
        a, b, c = self._coefficients
        return a + b * num_rows + c * num_scores / SCORES_UNIT

    def _fit(self) -> tuple[float, float, float]:
        """Solve the weighted normal equations with the prior's rows added (unweighted: about
        one forward's worth against the ~200 that the decay keeps)."""
        rows = 512.0  # the prior rows are stated for a forward of this many tokens, in seconds
        doubling = (0.0, rows, -rows * PRIOR_DOUBLING_CONTEXT / SCORES_UNIT)
        fixed = (0.1, -0.1 * PRIOR_FIXED_ROWS, 0.0)
        gram = [
            [
                self._gram[i][j]
                + doubling[i] * doubling[j]
                + fixed[i] * fixed[j]
                + (1e-12 if i == j else 0.0)  # nonsingular even with a single shape observed
                for j in range(3)
            ]
            for i in range(3)
        ]
        a, b, c = solve3(gram, self._moment)
        return max(0.0, a), max(0.0, b), max(0.0, c)


def solve3(matrix: list[list[float]], rhs: list[float]) -> tuple[float, float, float]:
    """``x`` with ``matrix x = rhs`` for a nonsingular 3 x 3 ``matrix``: Gaussian elimination
    with partial pivoting (what ``numpy.linalg.solve`` does, without its per-call cost)."""
    rows = [[*matrix[i], rhs[i]] for i in range(3)]
    for k in range(3):
        pivot = max(range(k, 3), key=lambda i: abs(rows[i][k]))
        rows[k], rows[pivot] = rows[pivot], rows[k]
        for i in range(k + 1, 3):
            factor = rows[i][k] / rows[k][k]
            for j in range(k, 4):
                rows[i][j] -= factor * rows[k][j]
    x = [0.0, 0.0, 0.0]
    for k in (2, 1, 0):
        x[k] = (rows[k][3] - sum(rows[k][j] * x[j] for j in range(k + 1, 3))) / rows[k][k]
    return x[0], x[1], x[2]


@dataclass(slots=True)
class StepBudget:
    """How long a step shared with decoding requests may take (module docstring). Its state:
    when a step was last priced with decoding requests (``LINGER_S``), and the prompt tokens
    the last bounded step granted and when (``GROWTH``; None after a step that was not
    bounded; not held against a step more than ``linger_s`` later)."""

    cost: ForwardCost
    ratio: float  # times the decoding requests' own forward
    min_seconds: float  # the bound is never below this
    min_chunk: int = MIN_PREFILL_CHUNK
    short_prompt: int = SHORT_PROMPT
    max_seconds: float = math.inf  # nor above this (>= min_seconds)
    linger_s: float = LINGER_S
    clock: Callable[[], float] = time.monotonic
    _last_decoding: float = -math.inf
    last_granted: int | None = None
    _granted_at: float = -math.inf  # when the last bounded step that granted was sized
    _sized_at: float = -math.inf  # when the step now sized was

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ratio) and self.ratio >= 1):
            raise ValueError(f"ratio: expected a number >= 1, got {self.ratio!r}")
        if not (math.isfinite(self.min_seconds) and self.min_seconds >= 0):
            raise ValueError(f"min_seconds: expected a number >= 0, got {self.min_seconds!r}")
        if not (self.max_seconds >= self.min_seconds):  # inf allowed; NaN is not
            raise ValueError(
                f"max_seconds: expected a number >= min_seconds ({self.min_seconds!r}), "
                f"got {self.max_seconds!r}"
            )
        if self.min_chunk < 1:
            raise ValueError(f"min_chunk: expected an integer >= 1, got {self.min_chunk!r}")
        if self.short_prompt < 0:
            raise ValueError(f"short_prompt: expected an integer >= 0, got {self.short_prompt!r}")

    def starts(self, cached: int, pending: int) -> bool:
        """Whether a request with ``cached`` tokens cached and ``pending`` prompt tokens left
        feeds them all this step (module docstring): the scheduler passes it to ``start`` among
        ``starting``."""
        return pending <= self.short_prompt and cached <= START_DEPTH

    def start(
        self,
        decoding: list[tuple[int, int]],
        max_tokens: int,
        starting: list[tuple[int, int]] | None = None,
    ) -> StepChunks | None:
        """The step's chunk sizer, given each decoding request's (cached tokens, rows it is
        expected to feed) and each starting one's (a rest that ``starts``: its rows and first
        drafts), granting at most ``max_tokens`` in all besides the starting rests
        (``prefill_chunk_size``: a shared step never prefills much more than one alone), nor
        more than ``GROWTH`` times what the last bounded step (within ``linger_s``) granted, plus
        ``min_chunk``; None when nothing decodes or starts (nor did within ``linger_s``) or the
        cost model cannot tell yet.

        Only the decoding requests set the bound: a starting rest is priced within it, never
        raises it, since what a prompt costs is no measure of how long the streams beside it
        may wait."""
        starting = starting or []
        now = self.clock()
        if decoding or starting:
            self._last_decoding = now
        elif now - self._last_decoding > self.linger_s:
            self.last_granted = None
            return None
        spans = decoding + starting
        decode_s = self._seconds(decoding) if decoding else 0.0
        if decode_s is None or self._seconds(spans) is None:
            self.last_granted = None
            return None
        share = min(FAIR_SHARE, self.ratio) * decode_s if decode_s > self.max_seconds else 0.0
        ceiling = max(self.max_seconds, share)
        bound = max(min(self.ratio * decode_s, ceiling), self.min_seconds)
        recent = now - self._granted_at <= self.linger_s  # else no prompt was fed for a while
        if self.last_granted is not None and recent:  # near what the last one fed (GROWTH)
            max_tokens = min(max_tokens, int(GROWTH * self.last_granted) + self.min_chunk)
        self._sized_at = now
        num_rows = sum(rows for _, rows in spans)
        num_scores = sum(attention_scores(cached, rows) for cached, rows in spans)
        return StepChunks(self, bound, max_tokens, num_rows, num_scores, progressed=bool(starting))

    def granted(self, tokens: int) -> None:
        """The step now sized has granted ``tokens`` prompt tokens so far (``StepChunks``): what
        the next one's ``GROWTH`` counts from. A step that fed only starting rests grants none
        and leaves it as it was."""
        self.last_granted, self._granted_at = tokens, self._sized_at

    def _seconds(self, spans: list[tuple[int, int]]) -> float | None:
        """The cost model's estimate of a forward over ``spans`` (cached tokens, rows)."""
        num_rows = sum(rows for _, rows in spans)
        return self.cost.seconds(num_rows, sum(attention_scores(c, r) for c, r in spans))


@dataclass(slots=True)
class StepChunks:
    """One step's prefill grants within ``bound`` seconds; ``num_rows`` and ``num_scores`` are
    the step's so far (its decoding requests', then each grant's)."""

    budget: StepBudget
    bound: float
    max_tokens: int
    num_rows: int
    num_scores: int
    granted: int = 0  # prompt tokens granted so far this step
    progressed: bool = False  # a prompt is fed this step (a starting rest, or a grant)

    def grant(self, cached: int, pending: int) -> int:
        """Prompt tokens (at most ``pending``, and what is left of ``max_tokens``) that a
        request with ``cached`` tokens feeds: all of a prompt that ``starts`` (priced with the
        decoding requests), else the most that keep the step's estimate within the bound
        (found by bisection, the cost rising with the tokens), at least ``min_chunk`` where no
        prompt is fed yet this step (every step feeds one: prompts always progress)."""
        if self.budget.starts(cached, pending):
            return pending
        most = min(pending, self.max_tokens - self.granted)
        low, high = 0, most  # fits(low) holds; find the largest n that fits
        while low < high:
            mid = (low + high + 1) // 2
            if self._fits(cached, mid):
                low = mid
            else:
                high = mid - 1
        if not self.progressed:
            low = max(low, min(self.budget.min_chunk, most))
        self.progressed = self.progressed or low > 0
        self.num_rows += low
        self.num_scores += attention_scores(cached, low)
        self.granted += low
        if low > 0:
            self.budget.granted(self.granted)
        return low

    def _fits(self, cached: int, num_rows: int) -> bool:
        """Whether the step with ``num_rows`` more after ``cached`` is priced within the bound
        (unpriced: no)."""
        seconds = self.budget.cost.seconds(
            self.num_rows + num_rows, self.num_scores + attention_scores(cached, num_rows)
        )
        return seconds is not None and seconds <= self.bound
