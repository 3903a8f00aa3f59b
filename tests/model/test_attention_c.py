"""The attention kernel in C (csrc/attention.c) against the numba kernel it stands in for.

The runtime calls the C form where the kernel library has its vector path, and the numba form
(``attention_kernels.attend``) elsewhere; both must give the same bits, so that a machine
without a compiler, or without AVX-512, computes what this one does, and every row-invariance
and reference test of the numba kernel holds for the C one. Checked for each instruction-set
path (AVX-512, AVX2, portable C), bfloat16 and float32 caches, head sizes that are and are not
multiples of 16, windows and soft-capping, and items of every length.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridspec.model import qgemm
from hybridspec.model.attention_kernels import ITEM_COLUMNS, attend
from hybridspec.model.kernel_abi import cache_layout
from hybridspec.model.qgemm import Kernel

pytestmark = pytest.mark.skipif(qgemm.kernel() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def variants(kernel_variants: dict[str, Kernel]) -> dict[str, Kernel]:
    """The library as the runtime builds it, its AVX2 path, and its portable C."""
    return {name: kernel_variants[name] for name in ("native", "avx2", "portable")}


def random_cache(
    gen: torch.Generator, kv: int, hd: int, max_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[2, kv, hd, S]`` and values ``[2, kv, S, hd]``, NaN in slot 1 past position 60
    (memory no row may read)."""
    keys = torch.randn(2, kv, hd, max_len, generator=gen).to(dtype)
    values = torch.randn(2, kv, max_len, hd, generator=gen).to(dtype)
    keys[1, :, :, 60:] = float("nan")
    values[1, :, 60:] = float("nan")
    return keys, values


def items_of(spans: list[tuple[int, int, int]], kv: int) -> np.ndarray:
    """Items for spans ``(slot, first position, tokens)``, one per key/value head, tokens in
    the order of the spans."""
    rows, token = [], 0
    for slot, position, count in spans:
        rows += [(slot, head, token, position, count) for head in range(kv)]
        token += count
    return np.array(rows, dtype=np.int32).reshape(-1, ITEM_COLUMNS)


def numba_attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    items: np.ndarray,
    scale: float,
    softcap: float,
    window: int,
) -> np.ndarray:
    """The numba kernel's output (bfloat16 caches passed as their bits, as the runtime does)."""
    bits = keys.dtype == torch.bfloat16
    k = keys.view(torch.uint16).numpy() if bits else keys.numpy()
    v = values.view(torch.uint16).numpy() if bits else values.numpy()
    out = np.full(q.shape, np.nan, dtype=np.float32)
    attend(q.numpy(), k, v, items, np.float32(scale), np.float32(softcap), np.int64(window), out)
    return out


SPANS = [
    [(0, 0, 1)],  # the first token
    [(0, 100, 1), (1, 59, 1)],  # decodes, one at the NaN boundary
    [(0, 37, 9), (1, 3, 4)],  # verify spans
    [(0, 0, 40), (1, 20, 40)],  # prompt chunks (slot 1 up to position 59)
    [(0, 250, 17), (0, 267, 3)],  # one sequence over two items
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv", "hd"), [(9, 3, 64), (4, 1, 96), (2, 2, 80), (4, 2, 16)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (8, 0.0), (0, 30.0), (33, 50.0)])
def test_the_c_kernel_gives_the_numba_kernels_bits(
    variants: dict[str, Kernel],
    dtype: torch.dtype,
    heads: int,
    kv: int,
    hd: int,
    window: int,
    softcap: float,
) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + hd + window)
    keys, values = random_cache(gen, kv, hd, 300, dtype)
    layout = cache_layout(keys, values)
    scale = hd**-0.5
    for spans in SPANS:
        items = items_of(spans, kv)
        q = torch.randn(sum(n for _, _, n in spans), heads, hd, generator=gen)
        expected = numba_attend(q, keys, values, items, scale, softcap, window)
        assert np.isfinite(expected).all()
        for (name, kernel), pooled in itertools.product(variants.items(), (False, True)):
            got = kernel.attend_unchecked(
                q, kv, layout, dtype == torch.float32, items, scale, softcap, window, pooled
            )
            assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32)), (
                name,
                spans,
                pooled,
            )


def test_the_paths_are_the_ones_named(variants: dict[str, Kernel]) -> None:
    assert not variants["portable"].attention_vectorized
    assert variants["avx2"].attention_vectorized
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the instruction sets from")
    flags = set(cpuinfo.read_text().split())
    expected = {"avx2", "fma"} <= flags
    assert variants["native"].attention_vectorized == expected
