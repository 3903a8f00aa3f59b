"""The packed codes' arena (model.huge_arena): tensors handed out from its start, page-aligned
and apart, until it is used up; faulted in on its own thread; its unused part given back; a
file packed with its codes in the arena holds the same bytes; the arena's size a lower bound
of the codes."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from hybridspec.model import gguf_pack, huge_arena
from hybridspec.model.gguf import read_gguf
from hybridspec.model.gguf_load import codes_lower_bound, convert_in_place
from hybridspec.model.quant import PackedWeight
from tests.model.test_gguf_pack import (
    _private_cache,  # noqa: F401  # a fixture: the cache dir
    assert_same_bytes,
    kernel,
    mixed_file,  # noqa: F401  # a fixture: the file of every type
)

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


def mapped_bytes(address: int) -> int:
    """Resident bytes of the mapping that holds ``address`` (smaps' Rss: a file mapping's
    pages in the process, where mincore would count the page cache's)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            field = line.split()
            if "-" in field[0] and not field[0].endswith(":"):
                low, high = (int(x, 16) for x in field[0].split("-"))
                inside = low <= address < high
            elif inside and field[0] == "Rss:":
                return int(field[1]) << 10
    raise AssertionError("no mapping holds the address")


def test_a_given_region_is_faulted_in_only_up_to_fault(tmp_path: Path) -> None:
    with open(tmp_path / "region", "w+b") as handle:  # a shared file mapping, as packed_file's
        handle.truncate(16 * MB)
        mapping = mmap.mmap(handle.fileno(), 16 * MB)
        region = (ctypes.c_char * (16 * MB)).from_buffer(mapping)
        arena = huge_arena.Arena(16 * MB, region, fault=4 * MB)
        arena._thread.join(timeout=60)
        if arena.faulted == 0:
            pytest.skip("no MADV_POPULATE_WRITE on this kernel")
        address = ctypes.addressof(region)
        assert arena.faulted == 4 * MB
        assert 4 * MB <= mapped_bytes(address) < 8 * MB  # in the process: not the rest
        taken = arena.take((8 * MB,), torch.uint8)
        assert taken is not None and taken.data_ptr() == address
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


def test_codes_packed_in_the_arena_are_the_same_bytes(
    mixed_file: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gguf_pack, "_HUGE", 4096)  # the small file's matrices held as big ones
    model = read_gguf(mixed_file, keep_quantized=True, lazy=True, stored_config=True)
    bound = codes_lower_bound(model, kernel())
    plain = convert_in_place(mixed_file, torch.bfloat16, kernel()).weights
    with huge_arena.prefaulted(bound) as arena:
        arena.stop_faulting()
        inside = convert_in_place(mixed_file, torch.bfloat16, kernel()).weights
        used = arena._used
    codes = 0
    for ours, theirs in zip(inside.layers, plain.layers, strict=True):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            got, want = getattr(ours, name), getattr(theirs, name)
            if isinstance(want, PackedWeight):
                assert_same_bytes(got, want)
                codes += want.codes.numel()
    assert 0 < bound <= codes  # a lower bound: the arena never holds what the load would not
    assert used > bound // 2  # the codes were taken from it
