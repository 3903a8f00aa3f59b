"""numba is imported only by a run that uses it: a count set before its import reaches numba
when the numba attention first runs, on the thread that set it, and torch's count stays; passive
OpenMP waits hold a sleeping team while on, and none after, unless the kernel library runs the
forward's matmuls: then they stay passive whatever the wait mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_script(script: str, **env: str) -> str:
    """``script`` run by this Python in a process of its own, from the repository's root, with
    ``env`` added to the environment: its standard output."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parents[2],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout


SET_BEFORE_IMPORT = """
import sys
import threading

import torch

from hybridspec.model.attention import numba_attend
from hybridspec.model.threads import set_num_threads

set_num_threads(1)
assert "numba" not in sys.modules
numba_attend()
import numba

print(numba.get_num_threads(), torch.get_num_threads())
other = []  # a thread that set no count keeps numba's default
thread = threading.Thread(target=lambda: (numba_attend(), other.append(numba.get_num_threads())))
thread.start()
thread.join()
set_num_threads(2)  # numba imported now: both at once
print(other[0], numba.get_num_threads(), torch.get_num_threads())
"""


def test_numba_imported_after_the_count_takes_the_calling_threads_count() -> None:
    out = run_script(SET_BEFORE_IMPORT, NUMBA_NUM_THREADS="2", OMP_NUM_THREADS="2")
    assert out.split() == ["1", "1", "2", "2", "2"]


PASSIVE_WAITS = """
import os
import time

import torch

from hybridspec.model.threads import passive_waits, set_num_threads


def tasks():
    return len(os.listdir("/proc/self/task"))


def settle(check):
    for _ in range(500):
        if check(tasks()):
            return tasks()
        time.sleep(0.01)
    return tasks()


set_num_threads(2)
torch.ones(1 << 22).mul_(2).sum()
alone = tasks()
passive_waits(True)
passive_waits(True)  # once only
held = settle(lambda n: n >= alone + 3)
passive_waits(False)
print(alone, held - alone, settle(lambda n: n == alone) - alone)
"""


@pytest.mark.serial  # counts a team's threads: needs every core
def test_passive_waits_hold_a_sleeping_team_while_on_and_end_it_after() -> None:
    out = run_script(PASSIVE_WAITS, OMP_NUM_THREADS="2")
    # the holding thread and its team of the cores plus one (2 cores given: 3), then none
    _, held, after = map(int, out.split())
    assert held >= 3
    assert after == 0


KERNEL_FORWARD = PASSIVE_WAITS.replace(
    "print(alone, held - alone, settle(lambda n: n == alone) - alone)",
    """from hybridspec.model.threads import kernel_forward, openmp_defaults, wait_mode

kernel_forward()
again = settle(lambda n: n >= alone + 3)
wait_mode(False)
time.sleep(0.2)
spinning = tasks()
with openmp_defaults():
    inside = settle(lambda n: n == alone)
print(again - alone, spinning - alone, inside - alone, settle(lambda n: n >= alone + 3) - alone)""",
)


@pytest.mark.serial  # counts a team's threads: needs every core
def test_once_the_kernel_runs_the_forward_torchs_waits_stay_passive_but_for_llamacpps() -> None:
    out = run_script(KERNEL_FORWARD, OMP_NUM_THREADS="2")
    # held again by kernel_forward, and still held after spinning waits were asked for; let go
    # inside openmp_defaults (the bench's llama.cpp runs), and held again after it
    held, after_spinning, inside, after = map(int, out.split())
    assert held >= 3
    assert after_spinning >= 3
    assert inside == 0
    assert after >= 3


PACKED = """
import json
import os
import threading

import torch

from hybridspec.model import qgemm
from hybridspec.model.qgemm import BlockLinear
from hybridspec.model.thread_policy import available_cores, packed_cpus
from hybridspec.model.threads import kernel_forward, prompt_step, set_num_threads, wait_mode
from tests.model.test_qgemm import activations, weight

kernel = qgemm.kernel()
linear = BlockLinear(kernel.pack(weight("8", 512, 256, 0)), kernel)
x = activations(2, 256, 1)
seen = {}


def team():  # the calling thread's affinity and each of its workers'
    tids = [threading.get_native_id(), *kernel.team_tids()]
    return [sorted(os.sched_getaffinity(tid)) for tid in tids]


def caller():
    allowed = os.sched_getaffinity(0)
    set_num_threads(2)
    want = linear(x)  # starts the worker
    kernel_forward()
    cores = available_cores()
    seen["allowed"] = sorted(allowed)
    seen["packed_cpus"] = sorted(packed_cpus(2, allowed))
    wait_mode(True, room=1.8)  # other processes leave more than the packed core and a half
    seen["roomy"] = team()
    wait_mode(True, room=1.0)
    seen["packed"] = team()
    seen["workers"] = [str(tid) in os.listdir("/proc/self/task") for tid in kernel.team_tids()]
    prompt_step(True)  # a prompt step's team is spread, whatever the room
    seen["prompt"] = team()
    seen["same_prompt"] = torch.equal(linear(x), want)
    prompt_step(False)
    seen["after_prompt"] = team()
    seen["same"] = torch.equal(linear(x), want)
    seen["cores"] = [cores, available_cores()]
    set_num_threads(1)
    seen["one"] = team()
    set_num_threads(2)
    seen["again"] = team()
    wait_mode(False)
    seen["after"] = team()
    seen["same_after"] = torch.equal(linear(x), want)


thread = threading.Thread(target=caller)
thread.start()
thread.join()
print(json.dumps(seen))
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="packing needs 2 CPUs and CPU affinity",
)
def test_passive_waits_pack_a_team_of_two_onto_one_core_spinning_or_prompt_ones_unpack() -> None:
    import json

    from hybridspec.model import qgemm

    if qgemm.kernel() is None:
        pytest.skip("no C compiler")
    seen = json.loads(run_script(PACKED, OMP_NUM_THREADS="2"))
    allowed, packed = seen["allowed"], seen["packed_cpus"]
    assert len(packed) == 1
    assert seen["roomy"] == [allowed, allowed]
    assert seen["workers"] == [True]  # one worker, a thread of this process
    assert seen["packed"] == [packed, packed]  # the calling thread and its worker
    assert seen["prompt"] == [allowed, allowed] and seen["same_prompt"]
    assert seen["after_prompt"] == [packed, packed]
    assert seen["same"] and seen["same_after"]
    assert seen["cores"][0] == seen["cores"][1] == 2  # what it may use, not where it is packed
    assert seen["one"] == [allowed, allowed]  # a team of one is not packed
    assert seen["again"] == [packed, packed]
    assert seen["after"] == [allowed, allowed]
