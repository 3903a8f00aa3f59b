"""Imported first by ``tests/conftest.py``: under ``pytest -n N`` (``make test``'s first pass),
each worker keeps to a core of its own.

Every thread team in a test (torch's, numba's, the kernel library's) sizes itself from the
process's affinity when it starts, so the affinity is set here, before any of them is imported.
Two workers then never wait on each other's spinning threads. Tests that time something or
need every core are marked ``serial`` and run in a second pass, alone, with every core.
"""

from __future__ import annotations

import os


def pin_worker() -> None:
    """Pin this xdist worker (``gw0``, ``gw1``, ...) to one core, where there is one for each."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= len(cores):
        os.sched_setaffinity(0, {cores[int(worker[2:])]})  # gw0 .. gw(N-1): N <= cores


pin_worker()
