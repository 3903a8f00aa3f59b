"""``--threads auto``: the forward's thread count, chosen from the cores the process may use and
adapted to the load from measured step times.

On a machine busy with other work a forward's threads wait for the worker the OS descheduled:
the kernel library's calls wait only for the chunks their workers took (csrc/pool.h), but a
worker descheduled inside one holds the call up, and a spinning waiter keeps its core from the
worker it waits for. No fixed count is right both alone and under load, so ``ThreadController``
starts at every usable core and keeps measuring: now and then it runs a short window of steps
at one thread fewer (or more), compares the window's mean step time with the current count's
last two windows, and keeps the faster count only where it wins by a margin (hysteresis, so
that noise does not flip it). Probes back off exponentially while the count stays, and start
again at once when the current count's step times rise well above what they were (the load
changed: then at fewer threads, or passive waits), or, on a busy machine, fall well below (the
load may have gone: then at more threads, or spinning waits).

The wait mode is chosen the same way. Alone, waits spin (a sleeping worker's wake-up at each of
a forward's hundreds of regions would cost). Once fewer threads have won (the sign of a busy
machine), a probe at more threads runs with passive waits (``wait``), where a spinning probe
would cost several rounds' time for each of its steps. A passive team of two or more is packed
(``packed_cpus``, ``threads.wait_mode``): two threads a core, which wait by yielding it to each
other. The OS gives each runnable thread its share, so the team's share is the same packed or
not; spread out, each of its threads shares a core with another process and each of a forward's
calls waits for the one descheduled inside a chunk, while packed the two take turns and the
other processes share the other cores. A passive mode is kept
only where its window wins, like a count. On a busy machine a probe at more threads, or at
spinning waits from passive ones, ends as soon as it is slower at all (after 3 steps; a
spinning one after its first). At every core, the same count spinning is probed in turn, and
below every core a spinning probe follows a passive one that lost, so that spinning returns
when the load goes.

Where the system tells (Linux' ``/proc/stat``: ``CoreRoom``), the controller also knows the
cores other processes leave it, and never tries a spinning team larger than that room: beside
two busy processes on 2 cores a spinning probe at 2 threads holds each of a forward's hundreds
of calls for a scheduler slice whenever its worker is descheduled, while a passive probe costs
about one round. The room is what other processes did, not how fast this
one's steps ran, so it does not depend on the mode being judged. When the room shrinks below
the spinning team (the load came), the same count waits passively from the next step on, not as
a probe (the spinning steps before it are no baseline), and one thread fewer is probed a window
later, kept where its window is faster at all (the passive waits are the room's guess, not a
mode that won): which of the two wins depends on the load and the forward. Beside two busy
processes on 2 cores 2 packed threads get a core's share, where 1 thread gets two thirds of one;
beside one busy process both get a whole core. Where the room fits the spinning team
again before a probe has kept another mode, the waits spin again at once: a moment's work by
another process does not leave a quiet machine's forward waiting passively. When the room grows
to fit a spinning team again while fewer threads or passive waits are kept otherwise (the load
went), a spinning probe starts at once.

The mode is chosen on decode rounds; a step that feeds prompt tokens (a chunk, or a short
prompt fed whole in its first round), which takes many decode rounds' time, never runs at a
probe's mode (``for_step``). Alone (the rounds spin at every core) it runs at the rounds' mode.
On a busy machine it runs on the prompt team (``prompt_threads``: ``threads.py`` makes it
twice as many threads as cores) with passive waits, spread over the cores, not packed
(``threads.prompt_step``). Its calls run in long chunks, so a descheduled worker holds up only
the end of each, and the OS gives each runnable thread its share: beside one busy process on 2
cores two threads spread get four thirds of a core, where one thread or a packed team gets one,
and four threads eight fifths; beside two, two threads get one core and four threads four
thirds. It runs there unless its measured prompt steps, per token (``observe_prompt``), are
slower than those at the rounds' mode, which runs one prompt step every few to compare
(``prompt_period``, backing off while the choice holds). Decode rounds never run more threads
than cores: each of their hundreds of calls is short, and a team larger than the cores waits in
each for a thread the OS has descheduled.

The controller sees step times only through ``observe`` and ``observe_prompt``, and the room
only through its ``room`` callback; it reads no clock, so its tests inject both. Greedy texts
do not depend on the count: the kernels' sums run in a fixed order whatever the thread count
(tests/model's invariance tests).
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
PROC_STAT = Path("/proc/stat")
# the cores of spare room a spinning team may lack: the busy-time counts tick at 100 Hz, so a
# quiet machine reads a little busy now and then
SPIN_SLACK = 0.3
# the cores of room beyond a packed team's a passive team is still packed in (``packed_cpus``):
# beside processes that leave more, spreading the team gains from the room they leave
PACK_SLACK = 0.4


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
        affinity = allowed_cpus()
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


# ``cpus``: the calling thread's CPU affinity before ``threads.py`` packed its team, while packed
unpacked = threading.local()


def allowed_cpus() -> set[int]:
    """The CPUs the calling thread may use: its affinity, or while its team is packed onto
    fewer (``packed_cpus``) the affinity it had before."""
    saved = getattr(unpacked, "cpus", None)
    if saved is not None:
        return set(saved)
    getter = getattr(os, "sched_getaffinity", None)
    return set(getter(0)) if getter is not None else set()


def packed_cpus(threads: int, allowed: set[int]) -> set[int]:
    """The CPUs a team of ``threads`` is packed onto on a busy machine: two threads a core,
    the lowest-numbered of ``allowed`` (at least one, at most all of them).

    Beside other busy processes the OS gives each runnable thread its share, so a team of two
    on 2 cores beside two busy processes gets one core's time in all, packed or not. Spread
    over both cores, each of its threads shares its core with a busy process, and each of a
    forward's calls waits for the one descheduled inside a chunk; packed on one core, the two
    take turns on it (yielding waits, csrc/pool.c), nobody else's work between them, while the
    busy processes share the other."""
    cores = sorted(allowed)
    if not cores:
        return set()
    return set(cores[: max(1, min(len(cores), math.ceil(threads / 2)))])


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


class CoreRoom:
    """The cores of this process's CPUs that other processes left it lately: the CPUs' count
    less the busy time of those CPUs (``/proc/stat``: all but idle and iowait, steal included:
    a hypervisor's other guests take the core as a process would) less this process's own CPU
    time, over the last ``span`` seconds or more.

    Called often (once a decode round), it reads the counters at most every ``span`` seconds
    and answers from the last two readings. None where the counters cannot be read (not Linux)
    or before a second reading. The arguments are for tests."""

    def __init__(
        self,
        cpus: set[int] | None = None,
        *,
        read_stat: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
        ticks_per_second: float | None = None,
        span: float = 0.25,
    ) -> None:
        self._cpus = cpus if cpus is not None else allowed_cpus()
        self._read_stat = read_stat if read_stat is not None else lambda: _read(PROC_STAT)
        self._clock, self._cpu_time, self._span = clock, cpu_time, span
        if ticks_per_second is None:
            ticks_per_second = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100
        self._hz = ticks_per_second
        self._last: tuple[float, float, float] | None = None  # clock, busy ticks, own seconds
        self._room: float | None = None

    def __call__(self) -> float | None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self._span:
            return self._room
        busy = self._busy_ticks()
        if busy is None:
            return None
        reading = (now, busy, self._cpu_time())
        if self._last is not None:
            elapsed = reading[0] - self._last[0]
            others = (reading[1] - self._last[1]) / self._hz - (reading[2] - self._last[2])
            self._room = len(self._cpus) - max(0.0, others) / elapsed
        self._last = reading
        return self._room

    def _busy_ticks(self) -> float | None:
        """The busy ticks of this process's CPUs since boot (``cpuN user nice system idle
        iowait irq softirq steal``); None where the file says nothing of them."""
        busy, seen = 0, 0
        for line in self._read_stat().splitlines():
            name, _, rest = line.partition(" ")
            if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self._cpus):
                continue
            fields = [int(field) for field in rest.split()[:8]]
            if len(fields) < 5:
                continue
            busy += sum(fields) - fields[3] - fields[4]
            seen += 1
        return float(busy) if seen else None


Mode = tuple[int, bool]  # (threads, passive waits)

# ``mode``: the mode last applied on the calling thread, by whichever controller. A thread's
# count and wait mode are the thread's, not a controller's: where two engines step on one
# thread (the bench's pairs, each with its own controller), each applies what differs from the
# thread's mode, which the other may have changed since its own last step.
_thread_mode = threading.local()


class ThreadController:
    """Adapts the thread count and the wait mode from the step times it is given (see the
    module docstring).

    ``observe(seconds)`` takes the time of one step run at ``threads`` and returns the count for
    the next; ``apply`` is called with every new count (``model.threads.set_num_threads``) and
    ``wait`` with every new wait mode (``model.threads.wait_mode``: True for passive waits,
    which give the core up at once, in a packed team where it has two threads; False for
    spinning ones). Only comparable steps should be observed
    (decode rounds); a prompt step's time goes to ``observe_prompt``.

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
        wait: Callable[[bool], None] | None = None,
        room: Callable[[], float | None] | None = None,
        window: int = 8,
        min_probe: int = 3,
        first_period: int = 16,
        max_period: int = 1024,
        backoff: int = 4,
        margin: float = 0.1,
        slowdown: float = 1.5,
        prompt_period: int = 4,
        prompt: Callable[[bool], None] | None = None,
        prompt_threads: int | None = None,
    ) -> None:
        if (
            max_threads < 1
            or not 1 <= min_probe <= window
            or first_period < window
            or prompt_period < 2
            or (prompt_threads is not None and prompt_threads < max_threads)
        ):
            raise ValueError(
                f"thread controller: expected max_threads >= 1, 1 <= min_probe <= window <= "
                f"first_period, prompt_period >= 2, prompt_threads >= max_threads, got "
                f"{max_threads}, {min_probe}, {window}, {first_period}, {prompt_period}, "
                f"{prompt_threads}"
            )
        self.max_threads = max_threads
        self.threads = max_threads
        self.passive = False  # the current mode's waits: passive (sleep) or spinning
        self._apply, self._wait, self._room = apply, wait, room
        self._prompt = prompt  # told whether each step feeds prompt tokens (``for_step``)
        # a prompt step's passive team on a busy machine (module docstring)
        self.prompt_threads = max_threads if prompt_threads is None else prompt_threads
        self._fits = (True, True)  # the room fitted (the current count, one more) spinning
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
        self._probe: Mode | None = None  # the mode to return to, while a probe runs
        self._probed: list[float] = []  # the probe's step times
        self._baseline = 0.0  # the current count's mean step time when the probe began
        self._skip = 0  # steps not counted after a switch (the pool wakes up)
        self._upward = False  # the direction of the next probe, alternating
        # fewer threads won, or the room turned the waits passive: the machine is busy, wider
        # probes wait passively
        self._loaded = False
        self._spin_next = False  # the next probe at more threads spins (a passive one lost)
        # the room made the current waits passive and no probe has won since (outside probes
        # the current mode is then the room's, which a probe returns to when it loses)
        self._turned = False
        self._applied: Mode = (self.threads, False)  # the mode this controller last applied
        # prompt steps on a busy machine: seconds per token by the mode they ran at, the
        # prompt steps since the rounds' mode last ran one, and the period of those comparisons
        self._prompt_times: dict[Mode, deque[float]] = {}
        self._prompt_period, self._since_compare = prompt_period, 0
        self._compare_period = prompt_period
        self._prompt_step: tuple[Mode, Mode, bool] | None = None  # the last one's, if timed
        self._apply(self.threads)
        if wait is not None:
            wait(False)
        _thread_mode.mode = self._applied
        if room is not None:
            room()  # the first reading: the room is known from the first rounds on

    def for_step(self, prefill: bool) -> None:
        """Apply the mode of the next step: for a decode round the current one (a probe's while
        one runs); for a step that feeds prompt tokens ``prompt_mode``'s (a probe is a guess,
        and a prompt step weighs many rounds). Nothing is applied where the calling thread runs
        at that mode already (``_thread_mode``). ``prompt``, where given, is told which kind
        of step comes (``threads.prompt_step``: a passive team is not packed for a prompt
        step), before a prompt step's mode is applied and after a round's."""
        if prefill:
            if self._prompt is not None:
                self._prompt(True)
            self._prompt_step = self._next_prompt_step()
            self._set(self._prompt_step[0] if self._prompt_step else self._chosen())
            return
        current = (self.threads, self.passive)
        if current != self._applied:  # back from a prompt step's mode: the pool wakes up
            self._skip = max(self._skip, 1)
        self._set(current)
        if self._prompt is not None:
            self._prompt(False)

    def prompt_mode(self) -> Mode:
        """The mode the next prompt step runs at (module docstring)."""
        step = self._next_prompt_step()
        return step[0] if step is not None else self._chosen()

    def _chosen(self) -> Mode:
        """The rounds' chosen mode: the current one, or while a probe runs the one it left."""
        return self._probe if self._probe is not None else (self.threads, self.passive)

    def _next_prompt_step(self) -> tuple[Mode, Mode, bool] | None:
        """(the mode, the rounds' chosen one, whether it runs to compare) for the next prompt
        step on a busy machine; None where it runs at the rounds' mode untimed: alone (at every
        core spinning), at the prompt team's mode already, or with no wait mode."""
        chosen, wide = self._chosen(), self._prompt_team
        if chosen in (wide, (self.max_threads, False)) or self._wait is None:
            return None
        if not self._prompt_times.get(wide):
            return wide, chosen, False
        preferred = self._preferred(chosen)
        if self._since_compare >= self._compare_period:
            return (chosen if preferred == wide else wide), chosen, True
        return preferred, chosen, False

    @property
    def _prompt_team(self) -> Mode:
        """The mode of a prompt step on a busy machine: the prompt team, waiting passively."""
        return (self.prompt_threads, True)

    def _preferred(self, chosen: Mode) -> Mode:
        """The prompt team with passive waits, unless the rounds' mode ran prompt steps faster
        per token by the margin."""
        wide = self._prompt_team
        ours, theirs = self._prompt_times.get(chosen), self._prompt_times.get(wide)
        if (
            ours
            and theirs
            and statistics.fmean(ours) < statistics.fmean(theirs) * (1 - self._margin)
        ):
            return chosen
        return wide

    def observe_prompt(self, seconds: float, tokens: int) -> None:
        """Record the time of the prompt step ``for_step`` last set up, which fed ``tokens``
        tokens in all (decode rows included), per token by its mode. A comparison that did not
        change the preferred mode comes back less often, one that did at the shortest period."""
        step, self._prompt_step = self._prompt_step, None
        if step is None or tokens < 1:
            return
        mode, chosen, compare = step
        before = self._preferred(chosen)
        self._prompt_times.setdefault(mode, deque(maxlen=3)).append(seconds / tokens)
        if not compare:
            self._since_compare += 1
            return
        self._since_compare = 0
        if self._preferred(chosen) == before:
            self._compare_period = min(self._compare_period * 2, self._max_period)
        else:
            self._compare_period = self._prompt_period

    def _set(self, mode: Mode) -> None:
        threads, passive = mode
        here: Mode = getattr(_thread_mode, "mode", self._applied)
        if threads != here[0]:
            self._apply(threads)
        if passive != here[1] and self._wait is not None:
            self._wait(passive)
        self._applied = _thread_mode.mode = mode

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
        if self._room_changed():
            return self.threads
        if len(self._recent) == self._window:
            median = statistics.median(self._recent)
            if self._reference is None:
                self._reference = median
            # slower: the load came; faster, where fewer threads won: it may have gone
            slowed = median > self._reference * self._slowdown
            sped = self._loaded and median * self._slowdown < self._reference
            if slowed or sped or self._since_probe >= self._period:
                # a probe the load's change set off looks the way the load went: slower, at a
                # narrower mode (a spinning probe under more load costs the most); faster, at
                # a wider one
                upward = None if slowed == sped else sped
                self._start_probe(statistics.fmean(self._history), upward)
        return self.threads

    def _spin_fits(self, threads: int, known: bool = False) -> bool:
        """Whether a spinning team of ``threads`` fits in the room other processes leave;
        where the room is not known, ``not known`` (by default True: the step times alone
        decide then)."""
        room = self._room() if self._room is not None else None
        return not known if room is None else threads <= room + SPIN_SLACK

    def _room_changed(self) -> bool:
        """Start a probe at once where the room changed across a spinning team's size: the
        current spinning count no longer fits (another process came: passive waits at once,
        ``_turn``, or without a wait mode a probe at one thread fewer); it fits again while
        the waits are still the ones it made passive (spinning again at once, ``_turn``); or,
        with fewer threads kept, one more spinning thread (or the same count where the waits
        are passive) fits again (it went). True where a probe started or the waits turned."""
        if self._room is None:
            return False
        wider = self.threads + 1 if self.threads < self.max_threads else self.threads
        fits = (self._spin_fits(self.threads), self._spin_fits(wider))
        before, self._fits = self._fits, fits
        if before[0] and not fits[0] and not self.passive and self.threads > 1:
            if self._wait is not None:
                self._turn(passive=True)
                return True
            self._start_probe(statistics.fmean(self._history), upward=False)
        elif not before[0] and fits[0] and self._turned:
            self._turn(passive=False)
            return True
        elif (
            not before[1]
            and fits[1]
            and self._loaded
            and (self.threads < self.max_threads or self.passive)
        ):
            self._start_probe(statistics.fmean(self._history), upward=True)
        return self._probe is not None

    def _judge_probe(self) -> None:
        """Keep the probed count once a full window beats the baseline by the margin (by any
        margin, probing from the waits the room made passive); go back at once where the first
        steps are clearly slower, or where the window does not win.

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
        if self.threads < self._probe[0] and len(steps) > 1:
            robust = (sum(steps) - max(steps)) / (len(steps) - 1)
        wins = robust if len(steps) == 2 * self._window else mean
        lost = len(steps) == 2 * self._window or (
            len(steps) == self._window and robust >= baseline * (1 - margin)
        )
        # on a busy machine a probe at more threads, or at spinning waits where they were
        # passive, ends once it is slower at all (a spinning one after its first step: there
        # each of its steps costs several rounds' time)
        # where the room fits the spinning team the probe left (nothing else busy), a probe at
        # fewer threads ends after its first step if that is clearly slower: alone step times
        # hold steady, and each of its steps costs a thread's share of a round
        threads, passive = self._probe
        spinning = self.threads == threads and passive and not self.passive
        up = self._loaded and (self.threads > threads or spinning)
        alone = self.threads < threads and not passive and self._spin_fits(threads, known=True)
        early = 1 if (up and not self.passive) or alone else self._min_probe
        slower = baseline * (1 if up else 1 + 2 * margin)
        # a probe from the waits the room made passive weighs two guesses, not a mode that won
        # its window: the faster window wins by any margin (beside one busy process 1 thread
        # beats 2 passive ones by less than the margin)
        keep = 0.0 if self._turned else margin
        if len(steps) % self._window == 0 and wins < baseline * (1 - keep):
            self._keep_probe()
        elif (len(steps) >= early and robust > slower) or lost:
            self._end_probe()

    def _turn(self, passive: bool) -> None:
        """The room's own decision, not a probe, at the current count: wait passively from
        the next step on where it no longer fits the team spinning (module docstring), or spin
        again where it fits again before a probe won.

        Turning passive, a spinning team the room does not fit is not what the step times
        should be compared with, and a busy machine says nothing of which count suits it, so
        one thread fewer is probed after one window. Turning back, what the room decided alone
        it undoes alone, where a spinning probe would have to beat the passive steps by the
        margin."""
        self._loaded = self._turned = passive
        if not passive:
            self._prompt_times.clear()  # timed under a load that went
        self._since_probe = 0
        self._period = self._window if passive else self._first_period
        self._reference = None
        self._history.clear()
        self._switch((self.threads, passive))

    def _start_probe(self, baseline: float, upward: bool | None = None) -> None:
        """Probe a neighbouring mode: the wider one where ``upward``, the narrower where not,
        in turn where None."""
        candidates = self._neighbours()
        if not candidates:
            self._since_probe = 0
            return
        self._upward = not self._upward if upward is None else upward
        probe = candidates[-1] if self._upward else candidates[0]
        self._baseline = baseline
        self._probe = (self.threads, self.passive)
        self._switch(probe)

    def _neighbours(self) -> list[Mode]:
        """The modes a probe may try, narrower first: one thread fewer, and one more (with
        passive waits once fewer threads won: on a busy machine a spinning wait keeps its core
        from the descheduled worker it waits for, which makes a spinning probe there cost
        several rounds' time; spinning again after a passive one lost, since alone passive
        waits may not win by the margin where spinning ones would); at every core with passive
        waits, the same count spinning (the load may have gone). Without a ``wait`` callback,
        spinning counts only. Where the room is known (``room``), a spinning mode is tried only
        where its team fits in it, else its passive twin (or at every core, nothing): a wider
        probe then spins exactly where the room fits it."""
        threads, passive, can_wait = self.threads, self.passive, self._wait is not None
        modes: list[Mode] = []
        if threads > 1:
            fewer = threads - 1
            modes.append(
                (fewer, fewer > 1 and can_wait and (passive or not self._spin_fits(fewer)))
            )
        if threads < self.max_threads:
            if self._room is not None and self._room() is not None:
                wider = not self._spin_fits(threads + 1)
            else:
                wider = (passive or self._loaded) and not self._spin_next
            modes.append((threads + 1, wider and can_wait))
        elif passive and self._spin_fits(threads):
            modes.append((threads, False))
        return modes

    def _keep_probe(self) -> None:
        """The probed mode won: stay, and look again soon (the load changed). Fewer threads
        winning is the sign of a busy machine; spinning waits winning, of a quiet one."""
        assert self._probe is not None
        if self.threads < self._probe[0]:
            self._loaded = True
        elif not self.passive:
            self._loaded = False
            self._prompt_times.clear()  # timed under a load that went
        self._probe = None
        self._spin_next = False
        self._turned = False  # a mode that won its window, not the room's turn
        self._since_probe = 0
        self._period = self._first_period
        self._reference = statistics.median(self._probed)
        self._history.clear()
        self._history.extend(self._probed)
        self._recent.clear()
        self._recent.extend(self._probed)
        self._probed = []

    def _end_probe(self) -> None:
        """The probed mode lost: return, and probe less often."""
        previous = self._probe
        assert previous is not None
        if self.threads > previous[0]:
            self._spin_next = self.passive
        self._probe = None
        self._probed = []
        self._since_probe = 0
        self._period = min(self._period * self._backoff, self._max_period)
        self._reference = None
        self._switch(previous)

    def _switch(self, mode: Mode) -> None:
        self.threads, self.passive = mode
        self._recent.clear()
        self._skip = 1
        self._set(mode)
