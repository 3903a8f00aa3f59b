"""KernelAttention's split of a batch's rows into items: even work for the threads, the same
bits whatever the split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridspec.model import attention, qgemm
from hybridspec.model.attention import KernelAttention, Spans
from hybridspec.model.attention_items import ITEM_NUM_TOKENS
from hybridspec.model.kv_cache import KVCache


def cache_of(kv: int, hd: int, max_len: int) -> KVCache:
    """A one-layer, two-slot bfloat16 cache of random keys and values, as the kernel reads it."""
    cache = KVCache(
        num_layers=1,
        max_num_seqs=2,
        num_kv_heads=kv,
        max_seq_len=max_len,
        head_dim=hd,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        transposed_keys=True,
    )
    gen = torch.Generator().manual_seed(0)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    return cache


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_kv", [1, 2, 3, 8])
def test_a_prompt_spans_items_are_a_multiple_of_the_threads_where_twice_the_blocks_allow(
    threads: int, num_kv: int
) -> None:
    for n in (17, 30, 40, 57, 100, 333, 512):
        least = -(-n // KernelAttention.LONG_ITEM_TOKENS)
        size = KernelAttention.item_tokens(n, num_kv, threads)
        blocks = -(-n // size)
        assert size <= KernelAttention.LONG_ITEM_TOKENS
        assert least <= blocks <= 2 * least
        if threads in (1, 2, 4):
            assert blocks * num_kv % threads == 0, (n, size)
        elif blocks * num_kv % threads:  # then no block count up to twice the least gives one
            assert size == -(-n // least)
            assert all(-(-n // -(-n // b)) * num_kv % threads for b in range(least, 2 * least + 1))


def test_a_40_token_chunk_on_2_threads_gives_4_items_per_head_not_3() -> None:
    assert KernelAttention.item_tokens(40, 3, 2) == 10
    assert KernelAttention.item_tokens(40, 3, 1) == 14  # one thread: the fewest items
    assert KernelAttention.item_tokens(512, 3, 2) == 16  # 96 items: already even


def test_decode_and_verify_spans_keep_their_short_items() -> None:
    for threads in (1, 2, 3):
        assert KernelAttention.item_tokens(1, 3, threads) == 1
        assert KernelAttention.item_tokens(9, 3, threads) == 3
        assert KernelAttention.item_tokens(16, 3, threads) == 4


@pytest.mark.parametrize("use_c", [True, False])
def test_the_output_has_the_same_bits_whatever_the_thread_count_splits(
    monkeypatch: pytest.MonkeyPatch, use_c: bool
) -> None:
    kernel = qgemm.kernel() if use_c else None
    if use_c and kernel is None:
        pytest.skip("no C compiler")
    kv, rep, hd = 3, 3, 64
    cache = cache_of(kv, hd, 256)
    spans = Spans(cache, slots=[1, 0], starts=[150, 60], num_new=[1, 40], rep=rep)
    q = torch.randn(41, kv * rep, hd, generator=torch.Generator().manual_seed(1))
    outputs, counts = [], []
    for threads in (1, 2, 4):
        monkeypatch.setattr(attention, "num_threads", lambda threads=threads: threads)
        kernel_attention = KernelAttention(spans, kernel)
        counts.append(len(kernel_attention.items))
        assert kernel_attention.items[:, ITEM_NUM_TOKENS].sum() == 41 * kv
        outputs.append(kernel_attention.attend_stored(0, q).numpy().view(np.uint32))
    assert counts == [3 + 9, 3 + 12, 3 + 12]  # the decode's 3 items, then the chunk's
    for out in outputs[1:]:
        assert np.array_equal(out, outputs[0])
