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

import sys
import threading
from typing import Literal

import torch

from hybridspec.model.thread_policy import ThreadController, available_cores

_local = threading.local()  # ``wanted``: the thread's count; ``numba``: what numba was given


def set_num_threads(num_threads: int) -> None:
    """Run the forward on ``num_threads`` threads (numba's at most ``NUMBA_NUM_THREADS``)."""
    _local.wanted = num_threads
    if "numba" in sys.modules:
        _set_numba_threads(num_threads)
    torch.set_num_threads(num_threads)


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
    ``"auto"``, every usable core, and the controller that adapts the count from step times."""
    if num_threads == "auto":
        return ThreadController(available_cores(), set_num_threads)
    if num_threads is not None:
        set_num_threads(num_threads)
    return None
