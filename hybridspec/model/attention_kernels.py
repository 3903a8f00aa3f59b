"""A row-invariant attention kernel for CPU decoding (numba nopython, disk-cached).

Why it exists: greedy speculative decoding is lossless only if the target computes each token
the same way whether it is verified alone (plain decoding) or among K drafts. PyTorch's CPU
``scaled_dot_product_attention`` does not: its result for a query row depends on how many rows
share the call, by enough to change a greedy argmax. The matmuls of the runtime (oneDNN,
``linear.PackedLinear``) and its element-wise ops are row-invariant already, so this kernel is
the missing piece.

What it computes, for every query row: softmax attention over the keys at positions ``0 ..
position`` of its sequence (with a sliding ``window`` > 0: only the last ``window`` of them,
positions ``position - window + 1 .. position``, as Gemma's local layers attend), in float32,
with a fixed order of operations that depends only on the row itself (its query, its keys and
values, its length ``L = position + 1``):

- score ``j`` is ``(q[d] * scale) * k[d, j]`` summed over ``d`` in order by fused multiply-adds
  (``fma``: one rounding per step), from 0;
- with ``softcap`` > 0 (Gemma 2), each score becomes ``softcap * tanh(score / softcap)``, the
  tanh by ``fast_exp`` too (``soft_cap``);
- ``m`` is the maximum score over the positions attended (exact in any order); ``e_j =
  exp(score_j - m)`` by ``fast_exp``, and ``e_j = 0`` for a position before the window;
- ``sum``: ``LANES`` = 16 partial sums, lane ``l`` taking ``e_j`` for ``j % 16 == l`` over the
  full blocks of 16 from position 0, folded in a fixed tree (lane ``l += l + w`` for ``w`` = 8,
  4, 2, 1), plus the last ``L % 16`` values summed in order;
- the output is ``(sum over j of e_j * v[j]) * (1 / sum)``, the sum over positions in order by
  fused multiply-adds, from 0 (a position before the window adds ``0 * v``, which leaves the
  zero sum as it is: skipping it gives the same bits).

Nothing depends on the other rows of the call, on the batch, or on how the rows are split
between threads, so a token's attention output is bit-identical in any forward that contains
it. No fast-math flag is used (it would let the compiler reorder sums or fuse multiply-adds
differently in a loop's vector body and its remainder); every sum is one chain of explicit
fused multiply-adds, vectorised across positions (scores) or dims (values), never within a sum.
The block kernel's library has the same computation in C (``csrc/attention.c``), which the
runtime calls where the library builds: the two give the same bits (tests), so a machine
without a C compiler computes what one with it does.

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
from numba.extending import intrinsic, overload

from hybridspec.model.attention_items import (
    ITEM_COLUMNS,
    ITEM_HEAD,
    ITEM_NUM_TOKENS,
    ITEM_POSITION,
    ITEM_SLOT,
    ITEM_TOKEN,
)

__all__ = [
    "ITEM_COLUMNS",
    "LANES",
    "attend",
    "fast_exp",
    "fma",
    "soft_cap",
    "widen",
    "widen_row",
]

LANES = 16  # partial sums of the softmax denominator

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


@njit(inline="always", cache=True)
def soft_cap(x, cap):  # numba-typed (float32); no annotations
    """``cap * tanh(x / cap)`` in float32, the tanh as ``(1 - e) / (1 + e)`` with ``e =
    exp(-2 |x / cap|)`` by ``fast_exp`` (one fixed formula: no library call whose vector and
    scalar forms could round differently), the sign put back."""
    z = x / cap
    e = fast_exp(_F32(-2.0) * abs(z))
    t = (_F32(1.0) - e) / (_F32(1.0) + e)
    return cap * (t if z >= _F32(0.0) else -t)


@intrinsic
def _llvm_fma(typingctx, a, b, c):  # numba-typed; no annotations
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


@njit(inline="always", cache=True)
def fma(a, b, c):  # numba-typed; no annotations
    """``a * b + c`` rounded once (LLVM's ``llvm.fma``: the instruction where the machine has
    it, else a correctly rounded library call), for float32 or float64 arguments alike."""
    return _llvm_fma(a, b, c)  # type: ignore[call-arg]  # numba supplies the typing context


@njit(cache=True, boundscheck=False)
def add_scores(qs, keys_t, start, block, scores):  # numba-typed; no annotations
    """``scores[m, j] = fma(qs[m, hd - 1], k[hd - 1, j], ... fma(qs[m, 0], k[0, j], 0))`` with
    ``k[d, j] = keys_t[d, start + j]``, for ``j < scores.shape[1]``.

    ``qs`` ``[rows, hd]`` float32 (queries, already scaled), ``keys_t`` ``[hd, S]`` one head's
    transposed keys, ``block`` ``[width]`` float32 scratch, ``scores`` ``[rows, width]``
    float32 (zeros on entry). Four rows share each widened key row. Kept a separate function
    (not inlined into ``attend``): compiled on its own its loops vectorise, which they do not
    inside the parallel loop.
    """
    rows, hd = qs.shape
    width = scores.shape[1]
    for d in range(hd):
        widen_row(keys_t[d, start : start + width], block)
        m = 0
        while m + 4 <= rows:
            a0, a1, a2, a3 = qs[m, d], qs[m + 1, d], qs[m + 2, d], qs[m + 3, d]
            r0, r1, r2, r3 = scores[m], scores[m + 1], scores[m + 2], scores[m + 3]
            for j in range(width):
                k = block[j]
                r0[j] = fma(a0, k, r0[j])
                r1[j] = fma(a1, k, r1[j])
                r2[j] = fma(a2, k, r2[j])
                r3[j] = fma(a3, k, r3[j])
            m += 4
        while m < rows:
            a0 = qs[m, d]
            row = scores[m]
            for j in range(width):
                row[j] = fma(a0, block[j], row[j])
            m += 1


@njit(cache=True, boundscheck=False)
def softmax_weights(row, first, length, lanes):  # numba-typed; no annotations
    """Replace ``row[:length]`` (float32 scores) by ``exp(score - max)``, zero before position
    ``first`` (the window's first key; 0 without a window); return ``1 / sum``.

    ``lanes`` is ``[LANES]`` float32 scratch. Order of the sum: module docstring.
    """
    blocked = length - length % LANES
    for j in range(first):
        row[j] = -np.inf
    top = row[0]
    for lane in range(LANES):
        lanes[lane] = top
    for j0 in range(0, blocked, LANES):
        for lane in range(LANES):
            lanes[lane] = max(lanes[lane], row[j0 + lane])
    for lane in range(LANES):
        top = max(top, lanes[lane])
    for j in range(blocked, length):
        top = max(top, row[j])
    for j in range(length):
        row[j] = fast_exp(row[j] - top)
    for j in range(first):
        row[j] = 0
    for lane in range(LANES):
        lanes[lane] = 0
    for j0 in range(0, blocked, LANES):
        for lane in range(LANES):
            lanes[lane] += row[j0 + lane]
    tail = _F32(0.0)
    for j in range(blocked, length):
        tail += row[j]
    w = LANES // 2
    while w >= 1:
        for lane in range(w):
            lanes[lane] += lanes[lane + w]
        w //= 2
    return _F32(1.0) / (lanes[0] + tail)


@njit(cache=True, boundscheck=False)
def add_weighted_values(weights, values, start, position0, rep, block, acc):  # numba-typed
    """``acc[m, d] = fma(weights[m, L - 1], v[L - 1, d], ... fma(weights[m, 0], v[0, d], 0))``
    with ``v[j] = values[start + j]`` and ``L`` the row's length past ``start``: each row's
    positions in order (module docstring).

    Row ``m`` belongs to token ``m // rep`` of the item, at position ``start + position0 + m //
    rep``, so its length past ``start`` is ``position0 + m // rep + 1``. ``weights`` ``[rows,
    width]`` float32, ``values`` ``[S, hd]`` one head's values, ``block`` ``[hd]`` float32
    scratch, ``acc`` ``[rows, hd]`` float32 (zeros on entry). A position is widened once for
    every row long enough to hold it.
    """
    rows, hd = acc.shape
    width = weights.shape[1]
    for j in range(width):
        # the first row whose length passes j: token index >= j - position0
        first = max(0, j - position0) * rep
        if first >= rows:
            break
        widen_row(values[start + j], block)
        for m in range(first, rows):
            p = weights[m, j]
            row = acc[m]
            for d in range(hd):
                row[d] = fma(p, block[d], row[d])


@njit(parallel=True, cache=True, boundscheck=False)
def attend(q, keys_t, values, items, scale, softcap, window, out):  # numba-typed
    """Attention of every query row named by ``items`` (module docstring).

    ``scale`` multiplies the queries; ``softcap`` (0: none) caps the scores; ``window`` (0:
    none) is the number of most recent keys a row attends, its own included. With a window, an
    item skips the whole blocks of ``LANES`` positions before its first row's window: their
    weights would be zeros, which leave every sum as it is, so a row's bits do not change.

    ``q`` and ``out`` are ``[T, H, hd]`` float32; ``keys_t`` ``[slots, KV, hd, S]`` and
    ``values`` ``[slots, KV, S, hd]``, uint16 (bfloat16 bits) or float32; ``items`` int32
    ``[num_items, ITEM_COLUMNS]``. Query head ``h * rep + r`` uses key/value head ``h``. Each
    item writes ``out`` for its tokens and its head's ``rep`` query heads only.
    """
    num_heads, hd = q.shape[1], q.shape[2]
    rep = num_heads // keys_t.shape[1]
    for it in prange(items.shape[0]):
        slot, head, token0 = items[it, ITEM_SLOT], items[it, ITEM_HEAD], items[it, ITEM_TOKEN]
        position0, num_tokens = items[it, ITEM_POSITION], items[it, ITEM_NUM_TOKENS]
        rows = num_tokens * rep  # row m: token m // rep, query head head * rep + m % rep
        # positions from ``start`` on (a multiple of LANES, at or before every row's window)
        start = 0
        if window > 0:
            start = max(0, position0 + 1 - window) // LANES * LANES
        width = position0 + num_tokens - start  # keys seen by the item's last token
        qs = np.empty((rows, hd), _F32)
        for m in range(rows):
            for d in range(hd):
                qs[m, d] = q[token0 + m // rep, head * rep + m % rep, d] * scale
        scores = np.zeros((rows, width), _F32)  # column j: position start + j
        add_scores(qs, keys_t[slot, head], start, np.empty(width, _F32), scores)
        lanes = np.empty(LANES, _F32)
        inverse_sum = np.empty(rows, _F32)
        for m in range(rows):
            length = position0 + m // rep + 1
            if softcap > 0:
                row = scores[m]
                for j in range(length - start):
                    row[j] = soft_cap(row[j], softcap)
            first = max(0, length - window) if window > 0 else 0
            inverse_sum[m] = softmax_weights(scores[m], first - start, length - start, lanes)
        acc = np.zeros((rows, hd), _F32)
        add_weighted_values(
            scores,
            values[slot, head],
            start,
            position0 - start,
            rep,
            np.empty(hd, _F32),
            acc,
        )
        for m in range(rows):
            token = token0 + m // rep
            query_head = head * rep + m % rep
            for d in range(hd):
                out[token, query_head, d] = acc[m, d] * inverse_sum[m]
