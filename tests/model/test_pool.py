"""The kernel library's own threads (csrc/pool.c): each calling thread's team of workers, the
chunks that any member may take with the same results, and the workers' lifetime (they end
with their calling thread; a forked child starts its own)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
import torch

from hybridspec.model import kernel_build, qgemm
from hybridspec.model.qgemm import BlockLinear, Kernel
from tests.model.test_qgemm import activations, weight
from tests.model.test_threads import run_script

pytestmark = pytest.mark.skipif(qgemm.kernel() is None, reason="no C compiler")


def test_callers_on_threads_of_their_own_share_out_their_chunks_alike(kernel: Kernel) -> None:
    # 300 rows x 256 columns: the activation rows are chunks too (more than a thread's few)
    linear = BlockLinear(kernel.pack(weight("4K", 333, 256, 0)), kernel)
    shapes = [activations(1, 256, 1), activations(300, 256, 2), activations(9, 256, 3)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [linear(x) for x in shapes]
    finally:
        torch.set_num_threads(threads)
    failures: list[str] = []

    def caller(teams: tuple[int, ...]) -> None:
        for turn in range(40):
            team = teams[turn % len(teams)]  # a smaller team leaves spare workers asleep
            torch.set_num_threads(team)
            kernel.lib.hs_set_passive(turn % 3)  # spinning, passive and yielding waits
            for x, expected in zip(shapes, want, strict=True):
                if not torch.equal(linear(x), expected):
                    failures.append(f"team {team}, turn {turn}, rows {x.shape[0]}")

    teams = [(2,), (3,), (4, 2, 3, 1), (2, 4)]
    callers = [threading.Thread(target=caller, args=(team,)) for team in teams]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    kernel.lib.hs_set_passive(0)
    assert not failures


LIFETIME = """
import os
import threading
import time

import torch

from hybridspec.model import kernel_build, qgemm
from hybridspec.model.qgemm import BlockLinear
from tests.model.test_qgemm import activations, weight


def tasks():
    return len(os.listdir("/proc/self/task"))


def settle(count):  # a joined Python thread's OS thread may still be ending
    for _ in range(500):
        if tasks() == count:
            break
        time.sleep(0.01)
    return tasks()


kernel = qgemm.kernel()
linear = BlockLinear(kernel.pack(weight("8", 512, 256, 0)), kernel)
x = activations(2, 256, 1)
torch.set_num_threads(1)
want = linear(x)
before = tasks()
during = []


def caller():
    torch.set_num_threads(3)
    assert torch.equal(linear(x), want)
    during.append(tasks())


thread = threading.Thread(target=caller)
thread.start()
thread.join()
after = settle(before)
torch.set_num_threads(2)
assert torch.equal(linear(x), want)  # this thread's own workers
pid = os.fork()
if pid == 0:  # the child: the parent's workers are not here; it starts its own (1 of 2)
    same = torch.equal(linear(x), want) and torch.equal(linear(x), want)
    os._exit(1 if not same else 0 if tasks() == 2 else 2)
for _ in range(600):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    status = -1
print(during[0] - before, after - before, status)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc to count threads")
def test_workers_end_with_their_calling_thread_and_a_forked_child_starts_its_own() -> None:
    out = run_script(LIFETIME, OMP_NUM_THREADS="4")
    during, after, child = map(int, out.split())
    assert during >= 3  # the calling thread and its 2 workers
    assert after == 0  # all three ended
    assert child == 0  # the child computed the same, on a worker of its own


SLOW_WORKER = r"""
#include <omp.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "pool.h"

static int runs[32];
static long by_workers;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void chunk(void *ctx, int64_t c, int64_t member) {
    (void)ctx;
    for (double start = now(); now() - start < 150e-6;) {
    } /* a tile's time: longer than the slowed worker's claim, which then takes chunks */
    __atomic_add_fetch(&runs[c], 1, __ATOMIC_SEQ_CST);
    if (member) __atomic_add_fetch(&by_workers, 1, __ATOMIC_SEQ_CST);
}

int main(void) {
    omp_set_num_threads(2); /* the caller and one worker */
    for (int call = 0; call < 1000; call++) {
        int64_t chunks = call % 2 ? 32 : 2; /* the next call has more chunks than the last */
        memset(runs, 0, sizeof runs);
        pool_run(chunk, NULL, chunks);
        for (int64_t c = 0; c < 32; c++) {
            if (runs[c] != (c < chunks)) {
                printf("call %d: chunk %ld ran %d times\n", call, (long)c, runs[c]);
                return 1;
            }
        }
    }
    printf("%ld\n", by_workers);
    return 0;
}
"""


def test_a_worker_slow_between_reading_a_claim_and_taking_it_takes_nothing_of_the_next_call(
    tmp_path: Path,
) -> None:
    # Built with pool.c's test delays: the worker sleeps after each read of the claim word, and
    # the caller after writing a call's job, before it opens the claims. The worker then often
    # reads the next call's job (more chunks) with the last call's claim word (every chunk
    # taken). It must not take a chunk with it: that chunk would be the next call's, run before
    # the caller opened the call and again after (the driver counts each chunk's runs), or
    # counted with its chunks so that the caller waits for ever (the timeout fails the test).
    cc = kernel_build.compiler()
    assert cc is not None  # the module's tests run where the library was built
    csrc = Path(qgemm.__file__).parent / "csrc"
    (tmp_path / "driver.c").write_text(SLOW_WORKER)
    program = tmp_path / "driver"
    build = [cc, "-O2", "-fopenmp", "-DHS_POOL_DELAY_NS=30000", f"-I{csrc}", "-o", str(program)]
    subprocess.run([*build, str(tmp_path / "driver.c"), str(csrc / "pool.c")], check=True)
    done = subprocess.run([program], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout
    assert int(done.stdout) > 0  # the worker took chunks: the calls ran on the pool
