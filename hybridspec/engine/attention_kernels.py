"""A row-invariant attention kernel for CPU decoding (numba nopython, disk-cached).

Why it exists: greedy speculative decoding is lossless only if the target computes each token
the same way whether it is verified alone (plain decoding) or among K drafts. PyTorch's CPU
``scaled_dot_product_attention`` does not: its result for a query row depends on how many rows
share the call (measured in bfloat16: differences up to 2.4e-4, enough to flip the argmax of a
135M model within tens of tokens). The matmuls of the runtime (oneDNN, ``llama.PackedLinear``)
and its element-wise ops are row-invariant already, so this kernel is the missing piece.

What it computes, for every query row: softmax attention over the keys at positions ``0 ..
position`` of its sequence, in float32, with a fixed order of operations that depends only on
the row itself (its query, its keys and values, its position):

- score ``j`` is ``sum over d of (q[d] * scale) * k[d, j]``, summed in order ``d = 0 .. hd - 1``;
- ``m`` is the running maximum over ``j = 0 .. L - 1``; ``e_j = exp(score_j - m)`` by ``fast_exp``;
- ``sum`` is ``e_0 + e_1 + ...`` in order; the output is ``(sum over j of e_j * v[j]) * (1 /
  sum)``, accumulated in order ``j = 0 .. L - 1``.

Nothing depends on the other rows of the call, on the batch, or on how the rows are split
between threads, so a token's attention output is bit-identical in any forward that contains
it. No fast-math flag is used (it would let the compiler reorder sums).

Layout: keys are read transposed, ``[slots, KV, hd, S]``, so that scores vectorise over
positions; values are ``[slots, KV, S, hd]``. bfloat16 tensors are passed as their uint16 bits
and widened exactly to float32; float32 tensors are read as they are. Only positions below a
row's length are read, so stale or never-written cache memory (even NaN) never reaches a row.

Work is split into *items*, each one key/value head of one sequence over a run of consecutive
query tokens (``ITEM_COLUMNS``), and items run in parallel (``prange``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

__all__ = ["ITEM_COLUMNS", "attend", "fast_exp", "widen", "widen_row"]

# Columns of the int32 ``items`` array: cache slot, key/value head, index of the item's first
# query token in ``q``, position of that token in its sequence, number of consecutive tokens.
ITEM_COLUMNS = 5
ITEM_SLOT, ITEM_HEAD, ITEM_TOKEN, ITEM_POSITION, ITEM_NUM_TOKENS = range(ITEM_COLUMNS)

_F32 = np.float32


def widen(x: object) -> float:
    """One cache element as float32: bfloat16 bits (uint16) shifted into place, or a float32."""
    raise NotImplementedError("widen is only defined inside numba-compiled code")


@overload(widen, inline="always")
def _widen_overload(x):  # numba compares parameter lists: no annotations
    if isinstance(x, types.Integer):
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


@njit(inline="always", cache=True)
def widen_row(source, target):  # numba-typed; no annotations
    """``target[i] = widen(source[i])`` for the first ``len(target)`` elements."""
    for i in range(target.shape[0]):
        target[i] = widen(source[i])


@njit(inline="always", cache=True)
def fast_exp(x):  # numba-typed (float32); no annotations
    """``exp(x)`` in float32 for ``x <= 0`` (Cephes ``expf``: range reduction by ln 2 and a
    degree-6 polynomial; relative error about 1e-7). Branch-free, so loops over it vectorise;
    below -87 it returns ``exp(-87)`` (about 1.6e-38), which a softmax sum cannot notice."""
    x = max(x, _F32(-87.0))
    n = np.floor(x * _F32(1.44269504) + _F32(0.5))
    r = x - n * _F32(0.693359375) - n * _F32(-2.12194440e-4)
    p = _F32(1.9875691500e-4) * r + _F32(1.3981999507e-3)
    p = p * r + _F32(8.3334519073e-3)
    p = p * r + _F32(4.1665795894e-2)
    p = p * r + _F32(1.6666665459e-1)
    p = p * r + _F32(5.0000001201e-1)
    p = p * (r * r) + r + _F32(1.0)
    bits = np.int32((np.int32(n) + np.int32(127)) << np.int32(23))  # 2 ** n
    return p * bits.view(np.float32)


@njit(parallel=True, cache=True, boundscheck=False)
def attend(q, keys_t, values, items, scale, out):  # numba-typed; no annotations
    """Attention of every query row named by ``items`` (module docstring).

    ``q`` and ``out`` are ``[T, H, hd]`` float32; ``keys_t`` ``[slots, KV, hd, S]`` and
    ``values`` ``[slots, KV, S, hd]``, uint16 (bfloat16 bits) or float32; ``items`` int32
    ``[num_items, ITEM_COLUMNS]``. Query head ``h * rep + r`` uses key/value head ``h``. Each
    item writes ``out`` for its tokens and its head's ``rep`` query heads only.
    """
    num_heads, hd = q.shape[1], q.shape[2]
    rep = num_heads // keys_t.shape[1]
    for it in prange(items.shape[0]):
        slot, head, token0 = items[it, 0], items[it, 1], items[it, 2]
        position0, num_tokens = items[it, 3], items[it, 4]
        rows = num_tokens * rep  # row m: token m // rep, query head head * rep + m % rep
        width = position0 + num_tokens  # keys seen by the item's last token
        scores = np.empty((rows, width), _F32)
        keys_f = np.empty(width, _F32)
        for d in range(hd):
            widen_row(keys_t[slot, head, d], keys_f)
            for m in range(rows):
                qd = q[token0 + m // rep, head * rep + m % rep, d] * scale
                if d == 0:
                    for j in range(width):
                        scores[m, j] = qd * keys_f[j]
                else:
                    for j in range(width):
                        scores[m, j] += qd * keys_f[j]
        inverse_sum = np.empty(rows, _F32)
        for m in range(rows):
            length = position0 + m // rep + 1
            top = scores[m, 0]
            for j in range(1, length):
                top = max(top, scores[m, j])
            for j in range(length):
                scores[m, j] = fast_exp(scores[m, j] - top)
            total = _F32(0.0)
            for j in range(length):
                total += scores[m, j]
            inverse_sum[m] = _F32(1.0) / total
        acc = np.zeros((rows, hd), _F32)
        value_f = np.empty(hd, _F32)
        for j in range(width):
            widen_row(values[slot, head, j], value_f)
            # rows whose token sees position j: all when j <= position0, else from token j - p0
            first = 0 if j <= position0 else (j - position0) * rep
            for m in range(first, rows):
                p = scores[m, j]
                for d in range(hd):
                    acc[m, d] += p * value_f[d]
        for m in range(rows):
            token = token0 + m // rep
            query_head = head * rep + m % rep
            for d in range(hd):
                out[token, query_head, d] = acc[m, d] * inverse_sum[m]
