"""``--threads auto``: the forward's thread count, chosen from the cores the process may use and
adapted to the load from measured step times.

On a machine busy with other work a forward's parallel regions wait at every barrier for the
worker the OS descheduled: on 2 cores with one other busy process, 2 threads decode at a third
of 1 thread's rate. No fixed count is right both alone and under load, so ``ThreadController``
starts at every usable core and keeps measuring: now and then it runs a short window of steps
at one thread fewer (or more), compares the window's mean step time with the current count's
last two windows, and keeps the faster count only where it wins by a margin (hysteresis, so
that noise does not flip it). Probes back off exponentially while the count stays, and start
again at once when the current count's step times rise well above what they were (the load
changed).
The count is chosen on decode rounds; a step that feeds prompt tokens (a chunk, or a short
prompt fed whole in its first round), which takes many decode rounds' time, runs at the chosen
count, never a probe's (``for_step``), and is not observed.

The controller sees step times only through ``observe``; it reads no clock, so its tests inject
the times. Greedy texts do not depend on the count: the kernels' sums run in a fixed order
whatever the thread count (tests/model's invariance tests).
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores(
    affinity: set[int] | None = None,
    cpu_max: str | None = None,
    cpu_count: int | None = None,
    omp_num_threads: str | None = None,
) -> int:
    """The cores this process may use: its CPU affinity, capped by the cgroup v2 ``cpu.max``
    quota (``"200000 100000"``: 2 cores; ``"max 100000"``: no cap) and by ``OMP_NUM_THREADS``
    where set (replicas share a machine's cores that way: ``deploy``), at least 1.

    Read from the system where not given (the arguments are for tests)."""
    if affinity is None:
        affinity = _affinity()
    cores = len(affinity) if affinity else (cpu_count or os.cpu_count() or 1)
    if cpu_max is None:
        cpu_max = _read(CGROUP_CPU_MAX)
    quota = _quota_cores(cpu_max)
    if quota is not None:
        cores = min(cores, quota)
    if omp_num_threads is None:
        omp_num_threads = os.environ.get("OMP_NUM_THREADS", "")
    if omp_num_threads.strip().isdigit() and int(omp_num_threads) > 0:
        cores = min(cores, int(omp_num_threads))
    return max(1, cores)


def _affinity() -> set[int]:
    getter = getattr(os, "sched_getaffinity", None)
    return set(getter(0)) if getter is not None else set()


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii")
    except OSError:
        return ""


def _quota_cores(cpu_max: str) -> int | None:
    """Whole cores of a cgroup ``cpu.max`` line (rounded up), None where it sets no quota."""
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


class ThreadController:
    """Adapts the thread count from the step times it is given (see the module docstring).

    ``observe(seconds)`` takes the time of one step run at ``threads`` and returns the count for
    the next; ``apply`` is called with every new count (``model.threads.set_num_threads``).
    Only comparable steps should be observed (decode rounds, not prompt chunks).

    Counts are compared by their windows' mean step time, which is what the rate depends on:
    under load a step time is heavy-tailed (most steps fast, a few waiting hundreds of times
    longer for a descheduled worker), which a median would hide. A probe that is clearly slower
    after ``min_probe`` steps ends early, so that probing costs little where the count is right.
    The load's changes are watched with the median, which a single stall does not move.
    """

    def __init__(
        self,
        max_threads: int,
        apply: Callable[[int], None],
        *,
        window: int = 8,
        min_probe: int = 3,
        first_period: int = 16,
        max_period: int = 1024,
        backoff: int = 4,
        margin: float = 0.1,
        slowdown: float = 1.5,
    ) -> None:
        if max_threads < 1 or not 1 <= min_probe <= window or first_period < window:
            raise ValueError(
                f"thread controller: expected max_threads >= 1, 1 <= min_probe <= window <= "
                f"first_period, got {max_threads}, {min_probe}, {window}, {first_period}"
            )
        self.max_threads = max_threads
        self.threads = max_threads
        self._apply = apply
        self._window, self._min_probe = window, min_probe
        self._first_period, self._max_period, self._backoff = first_period, max_period, backoff
        self._margin, self._slowdown = margin, slowdown
        self._period = window  # the first probe at once: a busy start costs most
        self._since_probe = 0
        self._recent: deque[float] = deque(maxlen=window)  # the last steps at this count
        # the current count's last steps outside probes: a probe's baseline, two windows long
        # so that one stray stall (a collection, another process's burst) cannot fake a win
        self._history: deque[float] = deque(maxlen=2 * window)
        self._reference: float | None = None  # the current count's median after a decision
        self._probe: int | None = None  # the count to return to, while a probe runs
        self._probed: list[float] = []  # the probe's step times
        self._baseline = 0.0  # the current count's mean step time when the probe began
        self._skip = 0  # steps not counted after a switch (the pool wakes up)
        self._upward = False  # the direction of the next probe, alternating
        self._applied = self.threads  # the count last applied (a probe's, or the chosen one)
        self._apply(self.threads)

    def for_step(self, prefill: bool) -> None:
        """Apply the count of the next step: for a decode round the current count (a probe's
        while one runs); for a step that feeds prompt tokens the count the rounds chose, never
        a probe's (a probe is a guess, and a prompt step weighs many rounds). Under load a
        prompt step's parallel regions wait for a descheduled worker as a round's do, so it
        does not take every core. Nothing is applied where the count is already so."""
        chosen = self._probe if self._probe is not None else self.threads
        wanted = chosen if prefill else self.threads
        if wanted != self._applied:
            self._applied = wanted
            self._apply(wanted)

    def observe(self, seconds: float) -> int:
        """Record one step's time at the current count; return the count of the next step."""
        if self._skip:
            self._skip -= 1
            return self.threads
        if self._probe is not None:
            self._probed.append(seconds)
            self._judge_probe()
            return self.threads
        self._recent.append(seconds)
        self._history.append(seconds)
        self._since_probe += 1
        if len(self._recent) == self._window:
            median = statistics.median(self._recent)
            if self._reference is None:
                self._reference = median
            slowed = median > self._reference * self._slowdown
            if slowed or self._since_probe >= self._period:
                self._start_probe(statistics.fmean(self._history))
        return self.threads

    def _judge_probe(self) -> None:
        """Keep the probed count once a full window beats the baseline by the margin; go back
        at once where the first steps are clearly slower, or where the window does not win.

        A probe at fewer threads discounts its slowest step: a stall there is a stray one (a
        collection, another process's burst), not the barrier waits that fewer threads avoid,
        so it must not end the probe alone. Its early return needs the steps but the slowest
        clearly slower, and a window that loses only by its slowest step runs on for a second
        window, which must win without its slowest step too. A probe at more threads is judged
        by its mean: there a stall is what too many threads under load look like."""
        steps, margin, baseline = self._probed, self._margin, self._baseline
        assert self._probe is not None
        mean = statistics.fmean(steps)
        robust = mean
        if self.threads < self._probe and len(steps) > 1:
            robust = (sum(steps) - max(steps)) / (len(steps) - 1)
        wins = robust if len(steps) == 2 * self._window else mean
        lost = len(steps) == 2 * self._window or (
            len(steps) == self._window and robust >= baseline * (1 - margin)
        )
        if len(steps) % self._window == 0 and wins < baseline * (1 - margin):
            self._keep_probe()
        elif (len(steps) >= self._min_probe and robust > baseline * (1 + 2 * margin)) or lost:
            self._end_probe()

    def _start_probe(self, baseline: float) -> None:
        candidates = [n for n in (self.threads - 1, self.threads + 1) if 1 <= n <= self.max_threads]
        if not candidates:
            self._since_probe = 0
            return
        self._upward = not self._upward
        probe = candidates[-1] if self._upward else candidates[0]
        self._baseline = baseline
        self._probe = self.threads
        self._switch(probe)

    def _keep_probe(self) -> None:
        """The probed count won: stay, and look again soon (the load changed)."""
        self._probe = None
        self._since_probe = 0
        self._period = self._first_period
        self._reference = statistics.median(self._probed)
        self._history.clear()
        self._history.extend(self._probed)
        self._recent.clear()
        self._recent.extend(self._probed)
        self._probed = []

    def _end_probe(self) -> None:
        """The probed count lost: return, and probe less often."""
        previous = self._probe
        assert previous is not None
        self._probe = None
        self._probed = []
        self._since_probe = 0
        self._period = min(self._period * self._backoff, self._max_period)
        self._reference = None
        self._switch(previous)

    def _switch(self, threads: int) -> None:
        self.threads = threads
        self._recent.clear()
        self._skip = 1
        self._applied = threads
        self._apply(threads)
