"""``--threads auto``: the usable cores, and the controller driven by injected step times."""

from __future__ import annotations

import pytest

from hybridspec.model import thread_policy
from hybridspec.model.thread_policy import (
    CoreRoom,
    ThreadController,
    available_cores,
    packed_cpus,
)


def test_available_cores_is_the_affinity_capped_by_the_cgroup_quota() -> None:
    assert available_cores({0, 1, 2, 3}, "max 100000", omp_num_threads="") == 4
    assert available_cores({0, 1, 2, 3}, "200000 100000", omp_num_threads="") == 2
    assert available_cores({0, 1, 2, 3}, "150000 100000", omp_num_threads="") == 2  # rounded up
    assert available_cores({0, 1}, "800000 100000", omp_num_threads="") == 2
    assert available_cores({0, 1, 2}, "", omp_num_threads="") == 3  # no cgroup v2 file
    assert available_cores({0}, "50000 100000", omp_num_threads="") == 1
    assert available_cores(set(), "garbage", cpu_count=6, omp_num_threads="") == 6


def test_available_cores_keep_to_omp_num_threads_where_set() -> None:
    assert available_cores({0, 1, 2, 3}, "max 100000", omp_num_threads="2") == 2
    assert available_cores({0, 1}, "max 100000", omp_num_threads="8") == 2
    assert available_cores({0, 1}, "max 100000", omp_num_threads="0") == 2  # ignored
    assert available_cores({0, 1}, "max 100000", omp_num_threads="x") == 2


def test_a_packed_team_takes_the_lowest_cores_two_threads_a_core() -> None:
    assert packed_cpus(2, {0, 1}) == {0}
    assert packed_cpus(3, {2, 5, 7}) == {2, 5}
    assert packed_cpus(4, set(range(8))) == {0, 1}
    assert packed_cpus(1, {3, 4}) == {3}
    assert packed_cpus(8, {0, 1}) == {0, 1}  # never more than it may use
    assert packed_cpus(2, set()) == set()


def test_while_packed_the_usable_cores_are_those_the_thread_had_before() -> None:
    now = available_cores(cpu_max="max 100000", omp_num_threads="")
    before = set(range(now + 3))  # more CPUs than the thread has now
    thread_policy.unpacked.cpus = before
    try:
        assert available_cores(cpu_max="max 100000", omp_num_threads="") == len(before)
    finally:
        thread_policy.unpacked.cpus = None


class Machine:
    """Step times by thread count: what a step costs at each count under the current load."""

    def __init__(self, seconds_by_threads: dict[int, float]) -> None:
        self.seconds_by_threads = seconds_by_threads
        self.applied: list[int] = []

    def run(self, controller: ThreadController, steps: int) -> list[int]:
        counts = []
        for _ in range(steps):
            counts.append(controller.threads)
            controller.observe(self.seconds_by_threads[controller.threads])
        return counts


def test_alone_the_controller_stays_at_every_core_and_probes_ever_less_often() -> None:
    machine = Machine({1: 0.010, 2: 0.006})
    controller = ThreadController(2, machine.applied.append)
    counts = machine.run(controller, 2000)
    assert counts[-1] == 2
    # probes back off: few steps spent at 1 thread, almost none late in the run
    # a clearly slower probe ends after 3 steps (and the skipped one)
    assert counts.count(1) <= 0.01 * len(counts)
    assert counts[1000:].count(1) <= 2 * 4
    assert machine.applied[0] == 2


def test_under_load_the_controller_moves_to_the_faster_count_within_a_few_windows() -> None:
    machine = Machine({1: 0.010, 2: 0.030})  # 2 threads wait at barriers for a busy core
    controller = ThreadController(2, machine.applied.append)
    counts = machine.run(controller, 500)
    assert counts.index(1) <= 8 + 1
    assert counts[40:].count(2) <= 0.05 * len(counts)


def test_when_the_load_arrives_later_the_slowdown_starts_a_probe_at_once() -> None:
    machine = Machine({1: 0.010, 2: 0.006})
    controller = ThreadController(2, machine.applied.append)
    machine.run(controller, 3000)  # probes backed off to their longest period
    assert controller.threads == 2
    machine.seconds_by_threads[2] = 0.030
    counts = machine.run(controller, 60)
    assert counts.index(1) <= 8 + 2
    assert counts[10:].count(1) >= 0.8 * 50  # back at 2 threads only for short probes


def test_noise_within_the_margin_does_not_switch() -> None:
    machine = Machine({1: 0.0097, 2: 0.0100})  # 1 thread 3% faster: inside the 10% margin
    controller = ThreadController(2, machine.applied.append)
    counts = machine.run(controller, 1000)
    assert counts[-1] == 2
    assert counts.count(1) < 0.05 * len(counts)


def test_with_more_cores_the_controller_walks_down_to_the_fastest_count() -> None:
    machine = Machine({1: 0.020, 2: 0.008, 3: 0.012, 4: 0.025})
    controller = ThreadController(4, machine.applied.append)
    counts = machine.run(controller, 400)
    assert counts[200:].count(2) >= 0.9 * 200


def test_a_rare_long_stall_counts_in_the_mean() -> None:
    # 2 threads: fast steps, but every 4th waits 20x for a descheduled worker (mean 0.0175);
    # 1 thread: a steady 0.010. Medians would keep 2 threads; the rate says 1.
    controller = ThreadController(2, lambda n: None)
    counts = []
    for step in range(1, 401):
        counts.append(controller.threads)
        stalled = controller.threads == 2 and step % 4 == 0
        controller.observe(0.050 if stalled else (0.0075 if controller.threads == 2 else 0.010))
    assert counts[100:].count(1) >= 0.85 * 300


def test_stray_stalls_alone_do_not_move_the_controller_off_every_core() -> None:
    """A stall that has nothing to do with the count (a collection, another process's burst)
    now and then, alone: a probe at 1 thread must not win because its baseline held the stall,
    nor the way back to 2 threads lose because its window did."""
    controller = ThreadController(2, lambda n: None)
    counts = []
    for step in range(3000):
        counts.append(controller.threads)
        stall = 0.050 if step % 117 == 58 else 0.0
        controller.observe((0.008 if controller.threads == 1 else 0.0055) + stall)
    assert counts.count(1) <= 0.015 * len(counts)  # the probes' steps, about 1%
    assert counts[-1] == 2


def test_one_stall_in_a_probe_at_fewer_threads_does_not_end_it() -> None:
    """Loaded from the start: 1 thread is 3x faster, but the probe's second counted step
    stalls (a stray one): the probe runs on and 1 thread is kept."""
    controller = ThreadController(2, lambda n: None)
    at_one, counts = 0, []
    for _ in range(60):
        counts.append(controller.threads)
        at_one = at_one + 1 if controller.threads == 1 else 0
        stall = 0.080 if at_one == 3 else 0.0  # (the step after a switch is not counted)
        controller.observe((0.010 if controller.threads == 1 else 0.030) + stall)
    assert counts[8:20] == [1] * 12
    assert counts[-1] == 1


def test_one_core_never_probes() -> None:
    machine = Machine({1: 0.01})
    controller = ThreadController(1, machine.applied.append)
    assert set(machine.run(controller, 100)) == {1}
    assert machine.applied == [1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_threads": 0},
        {"window": 0},
        {"min_probe": 9},
        {"first_period": 2},
        {"prompt_threads": 1},
    ],
)
def test_bad_settings_are_a_value_error(kwargs: dict[str, int]) -> None:
    settings = {"max_threads": 2, "window": 8, "min_probe": 3, "first_period": 16, **kwargs}
    max_threads = settings.pop("max_threads")
    with pytest.raises(ValueError, match="thread controller"):
        ThreadController(max_threads, lambda n: None, **settings)  # type: ignore[arg-type]


def test_a_prompt_step_runs_at_the_chosen_count_never_a_probes() -> None:
    applied: list[int] = []
    controller = ThreadController(2, applied.append, window=4, min_probe=2, first_period=4)
    for _ in range(4):  # the first window at 2 threads; the probe at 1 starts
        controller.observe(1.0)
    assert controller.threads == 1 and applied == [2, 1]
    controller.for_step(prefill=True)  # a prompt arrives during the probe: the chosen 2
    assert applied[-1] == 2
    controller.for_step(prefill=False)  # the probe's rounds go on at 1
    assert applied[-1] == 1 and len(applied) == 4
    for _ in range(5):  # 1 thread's rounds twice as fast: the probe wins
        controller.observe(0.5)
    assert controller.threads == 1
    controller.for_step(prefill=True)  # chosen now: the prompt step runs at 1 too
    controller.for_step(prefill=False)
    assert applied[-1] == 1 and len(applied) == 4  # already so: nothing applied


def test_the_prompt_callback_hears_of_a_prompt_step_before_its_mode_and_of_a_round_after() -> None:
    log: list[tuple[str, object]] = []
    controller = ThreadController(
        2,
        lambda n: log.append(("count", n)),
        wait=lambda passive: log.append(("passive", passive)),
        room=lambda: 0.5,  # another process takes most of the machine
        prompt=lambda prompt: log.append(("prompt", prompt)),
        window=4,
        min_probe=2,
        first_period=4,
    )
    for _ in range(4):  # the first window at 2 threads; the probe at 1 starts
        controller.observe(1.0)
    for _ in range(3):  # 1 thread's rounds twice as fast: the probe wins, the machine is busy
        controller.observe(0.5)
    assert controller.threads == 1
    log.clear()
    controller.for_step(prefill=True)  # every core, passive: told first that it is a prompt's
    assert log[0] == ("prompt", True) and ("count", 2) in log and ("passive", True) in log
    log.clear()
    controller.for_step(prefill=False)  # back at 1 thread, then told a round comes
    assert log[-1] == ("prompt", False) and ("count", 1) in log


class Modes:
    """Step times by mode (threads, passive waits), with what the controller applied."""

    def __init__(
        self,
        seconds: dict[tuple[int, bool], float],
        room: Room | None = None,
        prompt_threads: int | None = None,
    ) -> None:
        self.seconds = seconds
        self.counts: list[int] = []
        self.waits: list[bool] = []
        self.controller = ThreadController(
            2,
            self.counts.append,
            wait=self.waits.append,
            room=room,
            prompt_threads=prompt_threads,
        )

    def run(self, steps: int) -> list[tuple[int, bool]]:
        modes = []
        for _ in range(steps):
            mode = (self.controller.threads, self.controller.passive)
            modes.append(mode)
            self.controller.for_step(prefill=False)
            self.controller.observe(self.seconds[mode])
        return modes


class Room:
    """The cores other processes leave, as ``CoreRoom`` would tell them."""

    def __init__(self, cores: float) -> None:
        self.cores = cores

    def __call__(self) -> float | None:
        return self.cores


def test_alone_the_waits_spin_and_the_counts_are_those_without_a_wait_mode() -> None:
    times = {(1, False): 0.010, (2, False): 0.006, (2, True): 0.007}
    machine = Modes(times)
    plain = Machine({1: 0.010, 2: 0.006})
    assert [n for n, _ in machine.run(3000)] == plain.run(
        ThreadController(2, plain.applied.append), 3000
    )
    assert machine.waits == [False]  # spinning from the start, never changed


def test_once_fewer_threads_win_the_wider_probes_wait_passively() -> None:
    # beside one busy process: 2 spinning threads 3x slower, 2 passive about 1 thread's speed
    machine = Modes({(1, False): 0.010, (2, False): 0.030, (2, True): 0.0105})
    modes = machine.run(600)
    assert modes.index((1, False)) <= 8 + 1
    # the probes at 2 threads wait passively, but for one in two after a passive one lost
    # (it ends after its first 3 steps and the skipped one)
    assert modes[20:].count((2, False)) <= 4
    assert modes[20:].count((2, True)) >= 2 * 4  # each ends after 3 steps (and the skipped one)
    assert modes[-1] == (1, False)  # not faster by the margin: 1 thread stays
    assert machine.waits[0] is False and True in machine.waits


def prompt_steps(machine: Modes, per_token: dict[tuple[int, bool], float], steps: int) -> list:
    """``steps`` prompt steps of 100 tokens, each followed by a decode round: the modes they ran
    at (what was applied), each timed at ``per_token`` of its mode."""
    modes = []
    for _ in range(steps):
        machine.controller.for_step(prefill=True)
        mode = (machine.counts[-1], machine.waits[-1])
        modes.append(mode)
        machine.controller.observe_prompt(100 * per_token[mode], 100)
        machine.controller.for_step(prefill=False)
    return modes


def test_on_a_busy_machine_a_prompt_step_runs_at_every_core_with_passive_waits() -> None:
    machine = Modes({(1, False): 0.010, (2, False): 0.030, (2, True): 0.0105})
    machine.run(600)
    controller = machine.controller
    assert (controller.threads, controller.passive) == (1, False)
    assert controller.prompt_mode() == (2, True)
    per_token = {(1, False): 0.004, (2, True): 0.003}  # every core wins in long regions
    modes = prompt_steps(machine, per_token, 40)
    assert modes[:4] == [(2, True)] * 4  # the rounds' mode runs the 5th, to compare
    assert modes.count((1, False)) <= 4  # every 4th, then 8th, 16th ... prompt step
    assert modes[-8:] == [(2, True)] * 8
    assert machine.counts[-1] == 1 and machine.waits[-1] is False  # the rounds' mode again


def test_prompt_steps_at_every_core_that_lose_go_back_to_the_rounds_mode() -> None:
    machine = Modes({(1, False): 0.010, (2, False): 0.030, (2, True): 0.0105})
    machine.run(600)
    per_token = {(1, False): 0.003, (2, True): 0.004}
    modes = prompt_steps(machine, per_token, 40)
    assert modes[:5] == [(2, True)] * 4 + [(1, False)]
    wide = [i for i, mode in enumerate(modes) if mode == (2, True)]
    assert wide == [0, 1, 2, 3, 9, 18, 35]  # compared again ever less often
    per_token[(2, True)] = 0.002  # the load changed: every core wins again
    modes = prompt_steps(machine, per_token, 200)
    assert modes[-8:] == [(2, True)] * 8


def test_on_a_busy_machine_prompt_steps_run_the_prompt_team_and_rounds_every_core_at_most() -> None:
    # beside one busy process the rounds keep 1 thread; the prompt team is 4 threads passive
    machine = Modes({(1, False): 0.010, (2, False): 0.030, (2, True): 0.0105}, prompt_threads=4)
    machine.run(600)
    assert (machine.controller.threads, machine.controller.passive) == (1, False)
    assert machine.controller.prompt_mode() == (4, True)
    per_token = {(1, False): 0.004, (4, True): 0.0025}
    modes = prompt_steps(machine, per_token, 40)
    assert modes[:4] == [(4, True)] * 4 and modes.count((1, False)) <= 4
    assert modes[-8:] == [(4, True)] * 8
    rounds = machine.run(600)
    assert max(count for count, _ in rounds) <= 2  # decode rounds: every core at most
    assert machine.counts[-1] <= 2


def test_with_every_core_passive_the_prompt_team_is_compared_and_dropped_where_it_loses() -> None:
    # beside two busy processes the rounds keep 2 passive threads
    machine = Modes({(1, False): 0.015, (2, False): 0.040, (2, True): 0.010}, prompt_threads=4)
    machine.run(600)
    assert (machine.controller.threads, machine.controller.passive) == (2, True)
    per_token = {(2, True): 0.003, (4, True): 0.004}  # the larger team loses here
    modes = prompt_steps(machine, per_token, 40)
    assert modes[:5] == [(4, True)] * 4 + [(2, True)]
    wide = [i for i, mode in enumerate(modes) if mode == (4, True)]
    assert wide == [0, 1, 2, 3, 9, 18, 35]  # compared again ever less often
    # alone the rounds spin at every core and so does every prompt step
    alone = Modes({(1, False): 0.010, (2, False): 0.006, (2, True): 0.007}, prompt_threads=4)
    alone.run(600)
    assert set(prompt_steps(alone, {(2, False): 0.002}, 20)) == {(2, False)}
    assert max(alone.counts) == 2


def test_a_prompt_step_never_runs_at_a_probes_mode() -> None:
    machine = Modes({(1, False): 0.010, (2, False): 0.030, (2, True): 0.0105})
    modes = machine.run(600)
    # stop during a probe at 2 passive threads from 1: the prompt step runs at the mode the
    # rounds chose, or at every core passive where that is not a probe's guess but the rule
    while (machine.controller.threads, machine.controller.passive) != (2, True):
        modes += machine.run(1)
    assert machine.controller.prompt_mode() == (2, True)
    alone = Modes({(1, False): 0.010, (2, False): 0.006, (2, True): 0.007})
    alone.run(3000)
    while alone.controller.threads != 1:  # a probe at 1 thread, alone
        alone.run(1)
    assert alone.controller.prompt_mode() == (2, False)
    alone.controller.for_step(prefill=True)
    assert alone.counts[-1] == 2 and alone.waits == [False]  # untimed, at the rounds' mode
    alone.controller.observe_prompt(1.0, 100)
    assert alone.controller.prompt_mode() == (2, False)


def test_a_spinning_probe_from_passive_waits_under_load_ends_after_its_first_step() -> None:
    # beside two busy processes: 2 passive threads kept, 2 spinning ones 4x slower
    machine = Modes({(1, False): 0.015, (2, False): 0.040, (2, True): 0.010})
    modes = machine.run(2000)[99:]
    spinning, fewer = probe_lengths(modes, (2, False)), probe_lengths(modes, (1, False))
    assert spinning and max(spinning) == 2  # the skipped step, the one that lost
    # a probe at fewer threads still runs its 3 steps (and the skipped one)
    assert fewer and min(fewer) == 4


def test_under_heavier_load_the_passive_count_is_kept() -> None:
    # beside two busy processes: 2 passive threads take a larger share of the cores
    machine = Modes({(1, False): 0.015, (2, False): 0.040, (2, True): 0.010})
    modes = machine.run(600)
    assert modes[100:].count((2, True)) >= 0.9 * 500
    assert machine.waits[-1] is True


def test_when_the_load_goes_the_waits_spin_again() -> None:
    machine = Modes({(1, False): 0.030, (2, False): 0.080, (2, True): 0.020})
    machine.run(2000)  # probes backed off to their longest period
    assert machine.controller.passive
    machine.seconds = {(1, False): 0.010, (2, False): 0.006, (2, True): 0.008}
    modes = machine.run(1000)
    assert modes[-1] == (2, False) and machine.waits[-1] is False
    assert modes.index((2, False)) <= 2 * 8 + 2  # the faster steps start a probe at once
    assert modes[100:].count((2, False)) >= 0.97 * 900


def test_a_busy_spell_that_ends_does_not_keep_one_thread_where_passive_waits_do_not_win() -> None:
    """Alone, 2 passive threads only 5% faster than 1 (inside the margin), 2 spinning ones 60%:
    after a busy spell left the controller at 1 thread, a spinning probe follows the passive one
    that lost, and spinning 2 threads are kept."""
    machine = Modes({(1, False): 0.010, (2, False): 0.030, (2, True): 0.0105})
    machine.run(100)
    assert machine.controller.threads == 1  # 1 thread's rounds take the same time alone
    machine.seconds = {(1, False): 0.010, (2, False): 0.00625, (2, True): 0.0095}
    modes = machine.run(2000)
    assert modes[-1] == (2, False) and machine.waits[-1] is False
    assert modes[1000:].count((2, False)) >= 0.97 * 1000


def test_under_load_a_slowdown_probes_fewer_threads_and_a_speedup_spinning_waits() -> None:
    """A probe that a change of the step times sets off goes the way the load went: a spinning
    probe beside more load would cost the most."""
    machine = Modes({(1, False): 0.015, (2, False): 0.040, (2, True): 0.010})
    machine.run(2000)  # probes backed off to their longest period
    assert (machine.controller.threads, machine.controller.passive) == (2, True)
    machine.seconds = {mode: 2 * seconds for mode, seconds in machine.seconds.items()}
    modes = machine.run(20)
    assert (1, False) in modes and (2, False) not in modes
    machine.run(2000)
    machine.seconds = {(1, False): 0.010, (2, False): 0.006, (2, True): 0.007}  # the load went
    modes = machine.run(20)
    assert modes[modes.index((2, True)) :].index((2, False)) < 10


def test_the_round_after_a_prompt_step_at_another_mode_is_not_counted() -> None:
    machine = Modes({(1, False): 0.010, (2, False): 0.030, (2, True): 0.0105})
    machine.run(600)
    controller = machine.controller
    while controller._probe is not None:  # between probes, at 1 thread
        machine.run(1)
    history = list(controller._history)
    controller.for_step(prefill=True)
    assert (machine.counts[-1], machine.waits[-1]) == (2, True)
    controller.observe_prompt(0.3, 100)
    controller.for_step(prefill=False)
    controller.observe(5.0)  # the pool waking up at 1 thread again
    assert list(controller._history) == history
    controller.observe(0.010)
    assert list(controller._history)[-1] == 0.010


# beside two busy processes on 2 cores: 2 spinning threads stall at every barrier for a
# scheduler slice (a step takes ~70 rounds' time), 2 passive ones about 1 thread's rate
CROWDED = {(1, False): 0.015, (2, False): 1.0, (2, True): 0.016}
ALONE = {(1, False): 0.010, (2, False): 0.006, (2, True): 0.009}


def settle(machine: Modes) -> None:
    """Run until no probe runs."""
    while machine.controller._probe is not None:
        machine.run(1)


def test_a_spinning_team_larger_than_the_room_is_never_tried() -> None:
    machine = Modes(dict(CROWDED), room=Room(2 / 3))
    modes = machine.run(2000)
    assert modes[0] == (2, False)  # where every forward starts
    assert modes.count((2, False)) == 1  # the room decides from the first round on
    assert modes[1] == (2, True)  # the same count with passive waits, not a probe
    assert (1, False) in modes  # then probes at fewer threads, as anywhere
    # without the room, the step times alone decide: spinning probes follow passive ones
    blind = Modes(dict(CROWDED))
    assert blind.run(2000).count((2, False)) > 2


def test_without_room_for_spinning_the_waits_turn_passive_then_one_fewer_is_probed() -> None:
    # a 1B-sized forward beside two busy processes: its long regions get a core's share in all
    # at 2 threads with passive waits, where 1 thread gets two thirds of one
    two_busy = {(1, False): 0.015, (2, False): 1.0, (2, True): 0.010}
    machine = Modes(two_busy, room=Room(2 / 3))
    modes = machine.run(1000)
    # passive from the second round on, not a probe judged against the spinning round
    assert modes[1:10] == [(2, True)] * 9
    assert modes[10] == (1, False)  # one thread fewer, a window later: it loses
    assert modes[1:].count((2, True)) >= 0.95 * 999
    assert machine.controller._loaded  # the room says the machine is busy
    assert machine.waits[:2] == [False, True]
    # beside one busy process 1 thread gets a whole core: its probe a window later wins
    one_busy = {(1, False): 0.008, (2, False): 0.05, (2, True): 0.010}
    modes = Modes(one_busy, room=Room(1.0)).run(1000)
    assert modes[1:10] == [(2, True)] * 9
    assert modes[10:20] == [(1, False)] * 10
    assert modes[10:].count((1, False)) >= 0.95 * 990
    # the room's passive waits are a guess, not a mode that won: 1 thread faster by less than
    # the margin is kept too, where a probe from a mode that won would need the margin
    near = {(1, False): 0.0095, (2, False): 0.05, (2, True): 0.010}
    modes = Modes(near, room=Room(1.0)).run(1000)
    assert modes[10:20] == [(1, False)] * 10
    assert modes[10:].count((1, False)) >= 0.95 * 990


def test_a_moments_dip_in_the_room_alone_turns_the_waits_passive_only_while_it_lasts() -> None:
    # alone, a 1B-sized forward: 2 passive threads close to 2 spinning ones, here a little
    # faster, so that a spinning probe from passive waits would lose its first round and end;
    # alone the waits spin, as before any load, and what the room turned it turns back
    close = {(1, False): 0.070, (2, False): 0.042, (2, True): 0.040}
    room = Room(2.0)
    machine = Modes(close, room=room)
    machine.run(3000)
    settle(machine)
    assert (machine.controller.threads, machine.controller.passive) == (2, False)
    room.cores = 1.0  # another process's moment of work
    assert machine.run(2) == [(2, False), (2, True)]
    room.cores = 2.0
    modes = machine.run(200)
    assert modes[0] == (2, True) and modes[1] == (2, False)  # back at once, not probed
    assert modes[1:].count((2, True)) == 0
    assert not machine.controller._loaded


def test_when_the_room_fits_a_spinning_team_again_a_spinning_probe_starts_at_once() -> None:
    room = Room(2 / 3)
    machine = Modes(dict(CROWDED), room=room)
    machine.run(3000)  # probes backed off to their longest period
    settle(machine)
    assert (machine.controller.threads, machine.controller.passive) != (2, False)
    machine.seconds, room.cores = dict(ALONE), 2.0  # the busy processes end
    modes = machine.run(40)
    assert modes.index((2, False)) <= 1
    assert modes[-1] == (2, False) and machine.waits[-1] is False


def test_when_the_room_shrinks_below_the_spinning_team_the_waits_turn_passive_at_once() -> None:
    room = Room(2.0)
    machine = Modes(dict(ALONE), room=room)
    machine.run(3000)
    settle(machine)
    assert (machine.controller.threads, machine.controller.passive) == (2, False)
    machine.seconds, room.cores = dict(CROWDED), 2 / 3  # two busy processes start
    modes = machine.run(60)
    # one round at 2 spinning threads, not a window; then the same count with passive waits
    assert modes[:2] == [(2, False), (2, True)]
    assert modes[10:].count((2, False)) == 0


def proc_stat(busy: list[int], idle: list[int]) -> str:
    """``/proc/stat``'s CPU lines: each busy count split over user and system, idle over idle
    and iowait."""
    lines = [f"cpu  {sum(busy)} 0 0 {sum(idle)} 0 0 0 0 0 0"]
    for cpu, (b, i) in enumerate(zip(busy, idle, strict=True)):
        lines.append(f"cpu{cpu} {b - b // 2} 0 {b // 2} {i - i // 4} {i // 4} 0 0 0 0 0")
    return "\n".join([*lines, "intr 12345 0 0", "ctxt 999"])


def test_core_room_is_its_cpus_less_the_busy_time_not_its_own() -> None:
    stat = [proc_stat([1000, 1000, 1000], [500, 500, 500])]
    clock, cpu_time = [10.0], [3.0]
    room = CoreRoom(
        {0, 1},  # cpu2 is not this process's
        read_stat=lambda: stat[0],
        clock=lambda: clock[0],
        cpu_time=lambda: cpu_time[0],
        ticks_per_second=100,
        span=0.25,
    )
    assert room() is None  # one reading tells nothing yet
    # a second later: the two CPUs were busy 1.8 s, 0.8 s of it this process's own
    stat[0] = proc_stat([1080, 1100, 1100], [520, 500, 400])
    clock[0], cpu_time[0] = 11.0, 3.8
    assert room() == pytest.approx(2 - 1.0)
    stat[0] = proc_stat([1180, 1200, 1200], [520, 500, 300])  # busy, all this process's own
    clock[0] = 11.2  # within the span: the last answer, the counters not read
    assert room() == pytest.approx(1.0)
    clock[0], cpu_time[0] = 12.0, 5.8
    assert room() == pytest.approx(2.0)


def test_core_room_is_none_where_the_counters_say_nothing_of_its_cpus() -> None:
    text = proc_stat([1000, 1000], [500, 500])
    assert CoreRoom({5}, read_stat=lambda: text, clock=iter([0.0, 1.0]).__next__)() is None
    assert CoreRoom({0}, read_stat=lambda: "", clock=iter([0.0, 1.0]).__next__)() is None
    room = CoreRoom({0}, read_stat=lambda: "", clock=iter([0.0, 1.0]).__next__)
    room()
    assert room() is None


def probe_lengths(modes: list[tuple[int, bool]], probed: tuple[int, bool]) -> list[int]:
    """The lengths of the runs of ``probed`` in ``modes``, the first step's run excluded."""
    lengths, length = [], 0
    for mode in modes[1:]:
        if mode == probed:
            length += 1
        elif length:
            lengths.append(length)
            length = 0
    return lengths


def test_alone_a_probe_at_fewer_threads_ends_after_its_first_slower_step() -> None:
    machine = Modes(dict(ALONE), room=Room(2.0))
    modes = machine.run(3000)
    assert modes[-1] == (2, False)
    assert set(probe_lengths(modes, (1, False))) == {2}  # the skipped step, the one that lost
    # where the room is not known, 3 steps (and the skipped one)
    assert set(probe_lengths(Modes(dict(ALONE)).run(3000), (1, False))) == {4}
    # under load (the room fits no spinning team of 2) a probe at 1 thread runs its window
    # (and the skipped step): here one a little slower than 2 passive threads
    crowded = Modes({**CROWDED, (1, False): 0.0165}, room=Room(2 / 3))
    lengths = probe_lengths(crowded.run(200), (1, False))
    assert lengths and set(lengths) == {8 + 1}


def test_two_controllers_stepping_on_one_thread_each_run_their_steps_at_their_own_mode() -> None:
    """The bench's pairs: two engines on one thread, one alone-like and one crowded, so that
    their modes differ; the thread's count and waits are the last either applied."""
    thread: dict[str, int | bool] = {}

    def controller(room: float) -> ThreadController:
        return ThreadController(
            2,
            lambda n: thread.update(threads=n),
            wait=lambda p: thread.update(passive=p),
            room=Room(room),
        )

    pair = [(controller(2.0), ALONE), (controller(2 / 3), CROWDED)]
    differed = 0
    for _ in range(300):
        for c, seconds in pair:
            c.for_step(prefill=False)
            mode = (c.threads, c.passive)
            assert (thread["threads"], thread["passive"]) == mode
            c.observe(seconds[mode])
        differed += (pair[0][0].threads, pair[0][0].passive) != (
            pair[1][0].threads,
            pair[1][0].passive,
        )
    assert differed > 200
