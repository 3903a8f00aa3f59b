"""``KVCache.resident_bytes``: what a slot adds to resident memory, against the kernel's count."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest
import torch

from hybridspec.model.kv_cache import KVCache
from tests.model.test_gguf_pack import vm_flags

PAGE = mmap.PAGESIZE


def resident_pages(tensor: torch.Tensor) -> int:
    """Pages of ``tensor``'s memory resident now (Linux ``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = tensor.data_ptr() // PAGE * PAGE
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    num_pages = -(-(end - start) // PAGE)
    vec = (ctypes.c_ubyte * num_pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))


def slot_resident_pages(cache: KVCache, slot: int) -> int:
    """Resident pages of ``slot``'s memory in every layer, keys and values."""
    return sum(resident_pages(layer[slot]) for layer in (*cache.layer_keys, *cache.layer_values))


def big_cache(transposed: bool) -> KVCache:
    # 2 x 4 x 2 x 64 x 16384 bfloat16 = 32 MiB each for keys and values, each in a mapping of
    # its own: none of it resident before a write.
    return KVCache(
        num_layers=2,
        max_num_seqs=4,
        num_kv_heads=2,
        max_seq_len=16384,
        head_dim=64,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        transposed_keys=transposed,
    )


def write(cache: KVCache, slot: int, start: int, num: int) -> None:
    k = torch.ones(num, 2, 64, dtype=torch.bfloat16)
    for layer in range(2):
        cache.write(layer, slot, start, k, k)
    cache.commit([slot], [start + num])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is Linux's")
@pytest.mark.parametrize("transposed", [True, False])
def test_resident_bytes_match_the_pages_the_kernel_holds(transposed: bool) -> None:
    cache = big_cache(transposed)
    cache.slots.allocate()
    slot = cache.slots.allocate()
    assert cache.resident_bytes(slot) == 0 == slot_resident_pages(cache, slot)
    write(cache, slot, 0, 10)
    # Transposed: one page per key row (2 layers x 2 heads x 64 dims) and per value run (4).
    expected = (2 * 2 * 64 + 4) * PAGE if transposed else (4 + 4) * PAGE
    assert cache.resident_bytes(slot) == expected
    assert slot_resident_pages(cache, slot) * PAGE == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is Linux's")
def test_written_pages_stay_counted_after_truncate_and_free() -> None:
    cache = big_cache(True)
    slot = cache.slots.allocate()
    write(cache, slot, 0, 3000)  # 6000 bytes a key row: 2 pages each
    held = cache.resident_bytes(slot)
    assert held == (2 * 2 * 64 * 2 + 4 * -(-3000 * 128 // PAGE)) * PAGE
    cache.slots.truncate(slot, 5)
    cache.slots.free(slot)
    assert cache.resident_bytes(slot) == held  # the pages stay resident
    assert resident_pages(cache.keys) * PAGE >= 2 * 2 * 64 * 2 * PAGE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is Linux's")
@pytest.mark.parametrize("transposed", [True, False])
def test_released_pages_go_back_and_read_as_zeros(transposed: bool) -> None:
    cache = big_cache(transposed)
    kept, slot = cache.slots.allocate(), cache.slots.allocate()
    write(cache, kept, 0, 100)
    write(cache, slot, 0, 3000)
    with pytest.raises(ValueError, match="slot"):
        cache.release_pages(slot)  # still allocated
    cache.slots.free(slot)
    cache.release_pages(slot)
    assert cache.resident_bytes(slot) == 0 == slot_resident_pages(cache, slot)
    held = cache.resident_bytes(kept)  # a neighbour keeps its pages and its values
    assert held > 0 and slot_resident_pages(cache, kept) * PAGE == held
    assert bool((cache.values[:, kept, :, :100] == 1).all())
    # Written again, the slot counts its new pages only.
    slot = cache.slots.allocate()
    write(cache, slot, 0, 10)
    assert cache.resident_bytes(slot) == slot_resident_pages(cache, slot) * PAGE
    # (Reading maps the system's zero page, which mincore counts: last.)
    keys = cache.keys[:, slot, ..., 10:] if transposed else cache.keys[:, slot, :, 10:]
    assert not keys.any() and not cache.values[:, slot, :, 10:].any()


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="no transparent huge pages")
def test_the_cache_is_never_held_in_huge_pages() -> None:
    """A token touches one page per key row: a 2 MB page each would hold 512x what it counts."""
    cache = big_cache(transposed=True)
    for tensor in (cache.keys, cache.values):
        flags = vm_flags(tensor.data_ptr())
        if flags is None:
            pytest.skip("no /proc/self/smaps")
        assert "nh" in flags and "hg" not in flags
