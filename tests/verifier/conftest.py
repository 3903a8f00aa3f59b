"""Shared settings of the verifier tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run each verifier test on one intra-op thread, then restore the setting.

    These tests run thousands of operations on tiny tensors, where intra-op parallelism only
    adds synchronisation; on a shared, busy CPU it turns microsecond operations into
    milliseconds while a worker thread waits for a core.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
