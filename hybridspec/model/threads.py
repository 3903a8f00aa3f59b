"""The forward's CPU threads: torch's intra-op threads, which the block kernel and its attention
follow (they run on torch's OpenMP runtime, ``qgemm``), and numba's, which the numba attention
(where the library has no vector path) runs on.

Both settings hold for the thread that makes them: torch applies its number to each new thread
on that thread's first parallel work, while numba's is the calling thread's alone. So they are
set on the thread that runs the forwards (``Engine`` sets ``EngineConfig.num_threads`` where it
is built, which the server does on its engine thread).

numba is imported only by a run that uses it (about 100 MB of resident libraries, llvmlite's
among them): ``set_num_threads`` sets numba's count only once numba is imported, and remembers
the calling thread's count, which ``numba_follows`` gives numba before a parallel numba kernel
runs on that thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, Literal

import torch

from hybridspec.model import thread_policy
from hybridspec.model.thread_policy import (
    PACK_SLACK,
    CoreRoom,
    ThreadController,
    available_cores,
    packed_cpus,
)

# ``wanted``: the thread's count; ``numba``: what numba was given; ``passive``: its wait mode
# (``wait_mode``); ``packed``: the CPUs its team is packed onto, None where it is not
_local = threading.local()


def set_num_threads(num_threads: int) -> None:
    """Run the forward on ``num_threads`` threads (numba's at most ``NUMBA_NUM_THREADS``)."""
    _local.wanted = num_threads
    if "numba" in sys.modules:
        _set_numba_threads(num_threads)
    torch.set_num_threads(num_threads)
    if getattr(_local, "passive", False) or getattr(_local, "packed", None) is not None:
        _place()


def numba_follows() -> None:
    """Give numba the calling thread's count (``set_num_threads``) if it does not have it yet:
    called before a parallel numba kernel runs, so that numba imported after the count was set
    runs on the same threads as torch."""
    wanted = getattr(_local, "wanted", None)
    if wanted is not None and getattr(_local, "numba", None) != wanted:
        _set_numba_threads(wanted)
        torch.set_num_threads(wanted)


def _set_numba_threads(num_threads: int) -> None:
    # numba first (callers set torch's after): launching its OpenMP pool (on its first call)
    # resets the calling thread's OpenMP thread count, which torch's is, to numba's pool size.
    import numba

    # numba's config module sets its names at import from the environment: mypy sees none
    numba_threads = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    numba.set_num_threads(min(num_threads, numba_threads))
    _local.numba = num_threads


def num_threads() -> int:
    """The threads of the calling thread's forwards (torch's and the block kernel's)."""
    return int(torch.get_num_threads())


def thread_controller(num_threads: int | Literal["auto"] | None) -> ThreadController | None:
    """Set the calling thread's forward threads as ``EngineConfig.num_threads`` says; for
    ``"auto"``, every usable core, and the controller that adapts the count and the wait mode
    (``passive_waits``) from step times and from the cores other processes leave it
    (``CoreRoom``); on a busy machine its prompt steps run twice as many threads as cores
    (``ThreadController.prompt_threads``). A fixed count spins at its waits."""
    if num_threads == "auto":
        room = CoreRoom()

        def wait(passive: bool) -> None:
            wait_mode(passive, room())

        cores = available_cores()
        return ThreadController(
            cores,
            set_num_threads,
            wait=wait,
            room=room,
            prompt=prompt_step,
            prompt_threads=2 * cores,
        )
    if num_threads is not None:
        set_num_threads(num_threads)
    return None


def wait_mode(passive: bool, room: float | None = None) -> None:
    """Passive waits (``True``: the forward on a busy machine), or spinning waits (``False``,
    the default: alone, a wake-up at each of a forward's calls would cost), for torch's OpenMP
    threads and the kernel library's own (csrc/pool.c). Torch's stay passive once the kernel
    library runs a forward's matmuls (``kernel_forward``).

    Passive, a team of two or more that runs its forward in the kernel library is packed where
    the ``room`` other processes leave it (``CoreRoom``; None: not known) is no more than the
    packed cores and ``PACK_SLACK``, but for a prompt step (``prompt_step``): the calling
    thread and its workers are pinned to ``packed_cpus`` (two threads a core) and wait by
    yielding the core to each other. Unpacked, a passive thread sleeps almost at once, so that
    its core goes to the thread it waits for. Spinning again, the team gets back the affinity
    it had."""
    passive_waits(passive or _kernel_forward.is_set())
    _local.passive, _local.room = passive, room
    _place()


def prompt_step(prompt: bool) -> None:
    """Whether the calling thread's next forward feeds prompt tokens: a passive team is then
    not packed (``wait_mode``). A prompt step's calls run in long chunks, so a worker the OS
    deschedules holds up only the end of each, and spread over the cores the team gets its
    share of every one: beside one busy process on 2 cores, two threads get four thirds of a
    core spread and one core packed."""
    if getattr(_local, "prompt", False) != prompt:
        _local.prompt = prompt
        _place()


def _loaded_kernel() -> Any:
    qgemm = sys.modules.get("hybridspec.model.qgemm")
    if qgemm is not None and qgemm.kernel.cache_info().currsize:  # loaded: never built here
        return qgemm.kernel()
    return None


def _place() -> None:
    """Apply the calling thread's wait mode and its team's CPUs for its count (``wait_mode``).
    Packing needs the kernel library's forward: torch's own threads are not packed."""
    kernel = _loaded_kernel()
    passive = getattr(_local, "passive", False)
    threads = torch.get_num_threads()
    pack = (
        passive
        and threads > 1
        and kernel is not None
        and _kernel_forward.is_set()
        and hasattr(os, "sched_setaffinity")
    )
    packed: set[int] | None = getattr(_local, "packed", None)
    allowed = thread_policy.allowed_cpus()  # the CPUs it had before, where packed
    cpus = packed_cpus(threads, allowed)
    room = getattr(_local, "room", None)
    pack = pack and (room is None or room <= len(cpus) + PACK_SLACK)
    pack = pack and not getattr(_local, "prompt", False)
    if kernel is not None:
        kernel.lib.hs_set_passive(2 if pack else int(passive))
    if pack:
        if cpus in (packed, allowed):
            return
        thread_policy.unpacked.cpus = allowed
        _local.packed = cpus
        _pin(kernel, cpus)
    elif packed is not None:
        _local.packed = None
        thread_policy.unpacked.cpus = None
        _pin(kernel, allowed)


def _pin(kernel: Any, cpus: set[int]) -> None:
    """Set the CPU affinity of the calling thread and of its kernel workers (those started so
    far: a later one inherits the calling thread's)."""
    tids = [threading.get_native_id()]
    if kernel is not None:
        tids += kernel.team_tids()
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that ended, or CPUs the system took
            os.sched_setaffinity(tid, cpus)


_kernel_forward = threading.Event()  # set once a forward runs its matmuls in the kernel library


def kernel_forward() -> None:
    """Note that a forward's matmuls run in the kernel library, on its own threads: from then
    on torch's OpenMP threads, which run only the small ops between its calls, wait passively
    whatever the wait mode. A torch worker spinning after such an op would take the core that a
    kernel worker spins or works on (alone on 2 cores, a 1B model decoded about 13% slower with
    torch's waits spinning)."""
    _kernel_forward.set()
    passive_waits(True)


@contextlib.contextmanager
def openmp_defaults() -> Iterator[None]:
    """GNU OpenMP's own waits (spinning) for the block inside, whatever the forward's wait mode,
    restored after: for code that shares the runtime but should run as in a process of its own
    (the bench's llama.cpp baseline, whose ggml runs on the same ``libgomp``)."""
    held = _holder is not None
    passive_waits(False)
    try:
        yield
    finally:
        if held:
            passive_waits(True)


_holder: threading.Event | None = None  # set to end the thread that holds passive waits


def passive_waits(passive: bool) -> None:
    """Make the OpenMP runtime's waits passive (``True``) or spinning again (``False``).

    GNU OpenMP (torch's, which the kernel library shares) spins about 300000 times at a barrier
    before it sleeps, and only about 100 times while it manages more threads than there are
    cores (its CPU affinity). A thread that runs one parallel region of one thread more than
    those cores and then blocks keeps its workers (asleep) in its team, so that while it lives
    the runtime counts more threads than cores and every wait sleeps almost at once; ending it
    frees its team and spinning returns. The region runs ``free(NULL)``, which does nothing.
    Nothing happens where the runtime is not found."""
    global _holder
    if passive == (_holder is not None):
        return
    if not passive:
        assert _holder is not None
        _holder.set()
        _holder = None
        return
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
        region = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return
    gomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    release = threading.Event()
    cores = len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else 2

    def hold() -> None:
        gomp.GOMP_parallel(region, None, cores, 0)
        release.wait()

    threading.Thread(target=hold, name="hybridspec-passive-waits", daemon=True).start()
    _holder = release
