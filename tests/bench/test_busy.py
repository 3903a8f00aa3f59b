"""The busy processes of ``hybridspec bench --busy N``: started for the block, stopped after."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hybridspec.bench.busy import _spin_code, busy_processes


def test_busy_processes_run_during_the_block_and_stop_after() -> None:
    with busy_processes(2) as processes:
        assert len(processes) == 2
        time.sleep(0.2)
        assert all(p.poll() is None for p in processes)
    assert all(p.poll() is not None for p in processes)


def test_busy_processes_stop_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), busy_processes(1) as processes:
        raise RuntimeError("bench failed")
    assert processes[0].poll() is not None


def test_zero_busy_processes_start_nothing() -> None:
    with busy_processes(0) as processes:
        assert processes == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", 10_000])
def test_busy_count_out_of_range_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="busy"), busy_processes(bad):  # type: ignore[arg-type]
        pass


def test_a_busy_process_exits_when_its_parent_is_not_the_one_that_started_it() -> None:
    # parent id that is not this test's process: the spin's first check fails and it exits
    code = _spin_code(os.getpid() + 1_000_000)
    done = subprocess.run([sys.executable, "-c", code], timeout=30, check=False)
    assert done.returncode == 0
