"""numba is imported only by a run that uses it: a count set before its import reaches numba
when the numba attention first runs, on the thread that set it, and torch's count stays."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    out = subprocess.run(
        [sys.executable, "-c", SET_BEFORE_IMPORT],
        cwd=Path(__file__).parents[2],
        env={**os.environ, "NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.split() == ["1", "1", "2", "2", "2"]
