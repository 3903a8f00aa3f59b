"""Busy processes beside a benchmark: ``hybridspec bench --busy N`` measures decoding on a
machine that is doing other work (a build, a browser), where OpenMP barriers wait for a
descheduled worker.

Each busy process is a plain CPU spin in a fresh interpreter (started with ``subprocess``, not
forked, so it shares nothing with torch's thread pools). It checks now and then that the process
that started it is still its parent and exits when it is not, so that none outlives a bench that
was killed without running its ``finally``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

MAX_BUSY = 256
# A spin of about 10-50 ms between checks of the parent: short enough that an orphan exits at
# once, long enough that the check costs nothing beside the spin.
_SPIN = "while os.getppid() == {parent}:\n    for _ in range(1_000_000):\n        pass\n"
_STOP_TIMEOUT_S = 5.0


def _spin_code(parent: int) -> str:
    return "import os\n" + _SPIN.format(parent=parent)


@contextmanager
def busy_processes(num_busy: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run ``num_busy`` CPU-spinning processes for the block; they stop when it ends, also on an
    exception or Ctrl-C."""
    if isinstance(num_busy, bool) or not isinstance(num_busy, int) or not 0 <= num_busy <= MAX_BUSY:
        raise ValueError(f"busy: expected an integer in [0, {MAX_BUSY}], got {num_busy!r}")
    code = _spin_code(os.getpid())
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(num_busy):
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield processes
    finally:
        _stop(processes)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every process, then kill those that did not exit in time."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
