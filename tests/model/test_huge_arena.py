"""The packed codes' arena (model.huge_arena): tensors handed out from its start, page-aligned
and apart, until it is used up; faulted in on its own thread; its unused part given back."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from hybridspec.model import huge_arena

MB = 1 << 20


def resident(tensor_or_address: torch.Tensor | int, nbytes: int) -> int:
    """Pages of ``nbytes`` from the address that are resident (mincore)."""
    address = (
        tensor_or_address.data_ptr()
        if isinstance(tensor_or_address, torch.Tensor)
        else tensor_or_address
    )
    pages = -(-nbytes // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None)
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vector) == 0
    return sum(v & 1 for v in vector)


def test_take_hands_out_aligned_tensors_apart_until_used_up() -> None:
    arena = huge_arena.Arena(3 * MB)
    arena.stop_faulting()
    first = arena.take((1000, 1000), torch.uint8)
    second = arena.take((256, 1024), torch.float16)
    assert first is not None and second is not None
    assert first.shape == (1000, 1000) and second.dtype is torch.float16
    assert first.data_ptr() % 4096 == 0 and second.data_ptr() % 4096 == 0
    assert second.data_ptr() >= first.data_ptr() + first.numel()
    first.fill_(1)
    second.fill_(2)
    assert int(first.sum()) == 1000 * 1000  # writing one never touches the other
    assert arena.take((2 * MB,), torch.uint8) is None  # no room left: the caller maps its own
    assert arena.take((0,), torch.uint8) is None
    arena.finish()


def test_the_arena_is_faulted_in_on_its_own_thread() -> None:
    arena = huge_arena.Arena(24 * MB)
    arena._thread.join(timeout=60)
    if arena.faulted == 0:
        pytest.skip("no MADV_POPULATE_WRITE on this kernel")
    assert arena.faulted == 24 * MB
    taken = arena.take((24 * MB,), torch.uint8)
    assert taken is not None and resident(taken, 24 * MB) == 24 * MB // mmap.PAGESIZE
    arena.finish()


def test_finish_gives_back_the_part_never_taken() -> None:
    arena = huge_arena.Arena(16 * MB)
    arena._thread.join(timeout=60)
    taken = arena.take((4 * MB,), torch.uint8)
    assert taken is not None
    arena.finish()
    rest = taken.data_ptr() + 4 * MB
    assert resident(rest, 12 * MB) == 0
    taken.fill_(3)  # what was taken stays usable
    assert int(taken[-1]) == 3


def test_take_outside_a_load_gives_nothing() -> None:
    assert huge_arena.take((4 * MB,), torch.uint8) is None
    with huge_arena.prefaulted(8 * MB):
        inside = huge_arena.take((4 * MB,), torch.uint8)
    assert inside is not None
    assert huge_arena.take((4 * MB,), torch.uint8) is None
