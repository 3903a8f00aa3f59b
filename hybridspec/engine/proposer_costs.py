"""What each proposer's drafting measurably costs, for adaptive speculation's price of a round.

A proposer's ``cost_per_token`` is one number fixed when it is built (timed alone, or
configured); what its drafting costs inside the engine differs with the batch (the eagle head
and the draft model step all their sequences together), the threads, the load, and the parts
of a round outside one token's step (feeding the features or tokens the proposer has not seen,
sampling its drafts). ``ProposerCosts`` times every ``propose`` call of each proposer that was
asked for drafts (``ProposerPool.propose``) and fits ``seconds = f R + p D``: ``R`` the requests
that asked for drafts in the call, ``D`` the drafts it returned, by least squares over the
calls, each weighted ``DECAY ** age`` so that the fit follows the machine, and each counted at
most ``OUTLIER`` times what the fit predicts for it. ``price`` gives
``(p, f)`` over the seconds of a target forward's fixed part: adaptive speculation's
``proposer_cost_per_token`` and ``proposer_cost_per_round`` (``engine.speculation``).

Worked example: calls of one request with 1 draft took 2 ms and with 3 drafts 4 ms: p = 1 ms,
f = 1 ms; over a 10 ms forward, 0.1 per draft and 0.1 per round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridspec.proposers import Proposer

DECAY = 0.95  # weight of a timed call after each later one of the same proposer
MIN_CALLS = 4  # calls timed before the fit prices anything
OUTLIER = 4.0  # a call counts at most this many times the fit's time for it
EIGEN_RCOND = 1e-12  # eigenvalues below this share of the largest count as 0 (``least_norm_2x2``)


@dataclass(slots=True)
class _Fit:
    """Decayed normal equations of ``seconds = f R + p D`` over one proposer's calls: the
    symmetric 2 x 2 ``[[rr, rd], [rd, dd]]`` and the moments ``rs``, ``ds``, in floats (solved
    once a round per proposer: numpy's calls on 2 x 2 arrays cost more than the arithmetic)."""

    rr: float = 0.0
    rd: float = 0.0
    dd: float = 0.0
    rs: float = 0.0
    ds: float = 0.0
    calls: int = 0
    solved: tuple[float, float] | None = None  # ``solve``'s answer since the last call

    def observe(self, num_requests: int, num_drafts: int, seconds: float) -> None:
        """Add a call, its time at most ``OUTLIER`` times what the fit predicts for it (a
        call that compiled a kernel, or met a page fault, is no round's price)."""
        r, d = float(num_requests), float(num_drafts)
        if self.calls >= MIN_CALLS:
            f, p = self.solve()
            seconds = min(seconds, OUTLIER * (f * r + p * d))
        self.rr = DECAY * self.rr + r * r
        self.rd = DECAY * self.rd + r * d
        self.dd = DECAY * self.dd + d * d
        self.rs = DECAY * self.rs + r * seconds
        self.ds = DECAY * self.ds + d * seconds
        self.calls += 1
        self.solved = None

    def solve(self) -> tuple[float, float]:
        """``(f, p)`` in seconds, both at least 0: where the joint fit makes one negative, the
        other is fitted alone. Calls whose drafts are always the same multiple of their
        requests cannot split the two; the least-norm split prices such calls alike."""
        if self.solved is None:  # asked once per request a round, learned once per call
            self.solved = self._solve()
        return self.solved

    def _solve(self) -> tuple[float, float]:
        f, p = least_norm_2x2(self.rr, self.rd, self.dd, self.rs, self.ds)
        if f >= 0 and p >= 0:
            return f, p
        if f < 0:
            return 0.0, (max(0.0, self.ds / self.dd) if self.dd > 0 else 0.0)
        return (max(0.0, self.rs / self.rr) if self.rr > 0 else 0.0), 0.0


def least_norm_2x2(a: float, b: float, d: float, u: float, v: float) -> tuple[float, float]:
    """The least-norm least-squares solution of ``[[a, b], [b, d]] x = [u, v]`` (symmetric,
    positive semi-definite), as ``numpy.linalg.lstsq`` gives it: through the eigenvalues,
    those below ``EIGEN_RCOND`` of the largest taken as 0. Example: ``[[1, 1], [1, 1]] x =
    [2, 2]`` gives ``(1, 1)``; ``[[2, 0], [0, 4]] x = [2, 2]`` gives ``(1, 0.5)``."""
    mean, half = (a + d) / 2.0, math.hypot((a - d) / 2.0, b)
    big, small = mean + half, mean - half
    if big <= 0:
        return 0.0, 0.0
    # the largest eigenvalue's unit eigenvector; the other is perpendicular to it
    if half == 0.0:
        e1 = (1.0, 0.0)
    else:
        x, y = (b, big - a) if abs(big - a) >= abs(big - d) else (big - d, b)
        norm = math.hypot(x, y)
        e1 = (x / norm, y / norm)
    e2 = (-e1[1], e1[0])
    f, p = 0.0, 0.0
    for value, (x, y) in ((big, e1), (small, e2)):
        if value > EIGEN_RCOND * big:
            along = (x * u + y * v) / value
            f, p = f + along * x, p + along * y
    return f, p


class ProposerCosts:
    """Each proposer's measured drafting time (module docstring), kept across engine resets:
    it is the machine's, not a request's."""

    def __init__(self) -> None:
        self._fits: dict[int, _Fit] = {}  # by the proposer's identity

    def observe(
        self, proposer: Proposer, num_requests: int, num_drafts: int, seconds: float
    ) -> None:
        """Learn from a ``propose`` call in which ``num_requests`` requests asked for drafts
        and ``num_drafts`` came back, taking ``seconds``; calls that asked for none carry no
        evidence (the proposer does no work in them)."""
        if num_requests <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        self._fits.setdefault(id(proposer), _Fit()).observe(num_requests, num_drafts, seconds)

    def price(self, proposer: Proposer, forward_s: float | None) -> tuple[float, float] | None:
        """``(per draft, per round)``: the proposer's time over ``forward_s``, the fixed part of
        a target forward; None until ``MIN_CALLS`` calls are timed or without a forward's
        time."""
        fit = self._fits.get(id(proposer))
        if fit is None or fit.calls < MIN_CALLS or forward_s is None or forward_s <= 0:
            return None
        per_round, per_draft = fit.solve()
        return per_draft / forward_s, per_round / forward_s

    def clear(self) -> None:
        """Forget every timing (``Engine.reset``: the warm-up's calls, of tiny requests and
        first compilations, are no measure of the requests' rounds)."""
        self._fits.clear()

    def forget(self, proposer: Proposer) -> None:
        """Drop a proposer's timings (it was replaced)."""
        self._fits.pop(id(proposer), None)
