"""The kernel library's C interface as ctypes sees it: its structs, its functions' argument
types, and a packed matrix as the ``qweight_t`` each matmul call takes.

The structs mirror ``csrc/matmul.h`` (``qweight_t``, ``factors_t``), ``csrc/cache_layout.h``
and ``csrc/scratch.h``; ``SIGNATURES`` gives every entry point's argument types, in the C
order, for ``qgemm.Kernel`` to set once.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from hybridspec.model.quant import PackedWeight

PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_SILU_MUL = 0, 1, 2
_ptr, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class QWeight(ctypes.Structure):
    """csrc/matmul.h's ``qweight_t``: one packed matrix's pointers, bits, group and shape, built
    once per matrix (``BlockLinear``) so that each call passes one pointer for all of them."""

    _fields_ = [
        ("packed", _ptr),
        *((name, _ptr) for name in ("scales", "scales_f16", "scale_steps", "scale_super")),
        *((name, _ptr) for name in ("offsets", "offsets_f16", "offset_steps", "offset_super")),
        ("bits", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("N", _i64),
        ("K", _i64),
    ]


_QW = ctypes.POINTER(QWeight)


class CacheLayout(ctypes.Structure):
    """csrc/cache_layout.h's ``cache_layout_t``: one layer's keys ``[slots, KV, hd, S]`` and values
    ``[slots, KV, S, hd]``, pointers and element strides (``cache_layout``)."""

    _fields_ = [
        ("keys", _ptr),
        *((name, _i64) for name in ("ks_slot", "ks_head", "ks_dim")),
        ("values", _ptr),
        *((name, _i64) for name in ("vs_slot", "vs_head", "vs_pos")),
    ]


_CACHE = ctypes.POINTER(CacheLayout)


class StackLayer(ctypes.Structure):
    """csrc/stack.c's ``stack_layer_t``: one decoder layer as ``hs_layers`` runs it (its
    matrices, norms, rope table, cache, eps and window), built once per layer."""

    _fields_ = [
        *((name, _QW) for name in ("wqkv", "wo", "w_gate_up", "w_down")),
        ("attn_norm", _ptr),
        ("mlp_norm", _ptr),
        ("rope", _ptr),
        ("cache", _CACHE),
        ("eps", ctypes.c_float),
        ("window", _i64),
    ]


class StackPass(ctypes.Structure):
    """csrc/stack.c's ``stack_pass_t``: what every layer of one ``hs_layers`` forward reads."""

    _fields_ = [
        *((name, _i64) for name in ("T", "H", "KV", "hd")),
        ("slots", _ptr),
        ("positions", _ptr),
        ("items", _ptr),
        ("num_items", _i64),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("f32", _int),
        ("q", _ptr),
        ("attn", _ptr),
    ]


class Scratch(ctypes.Structure):
    """csrc/scratch.h's ``hs_scratch_t``: a buffer and its size, and what a call that found it
    short needs (``Kernel._call`` grows it and calls again)."""

    _fields_ = [("data", _ptr), ("bytes", _i64), ("need", _i64)]


_SCRATCH = ctypes.POINTER(Scratch)


class ThreadScratch(threading.local):
    """One thread's scratch: the kernels' calls from one thread run one at a time, so one
    buffer serves them all; each thread that calls has its own."""

    def __init__(self) -> None:
        self.struct = Scratch(None, 0, 0)
        self.pointer = ctypes.pointer(self.struct)
        self.buffer: torch.Tensor | None = None  # owns the memory ``struct.data`` points at

    def grow(self) -> None:
        """Room for what the last call needed, and half again as much as before (so that a
        context growing by a token at a time regrows it rarely)."""
        size = max(int(self.struct.need), int(self.struct.bytes) * 3 // 2)
        self.buffer = torch.empty(size, dtype=torch.uint8)
        self.struct.data = self.buffer.data_ptr()
        self.struct.bytes = size


SIGNATURES = {
    # weight, x, x_f32, T, prologue, norm, eps, residual, y, scratch
    "hs_matmul": [_QW, _ptr, _int, _i64, _int, _ptr, ctypes.c_float, _ptr, _ptr, _SCRATCH],
    # wo, w_gate_up, w_down, attn, attn_f32, T, x, mlp_norm, eps, y, scratch
    "hs_mlp_block": [
        *(_QW, _QW, _QW, _ptr, _int, _i64, _ptr, _ptr, ctypes.c_float, _ptr, _SCRATCH)
    ],
    # wqkv, x, T, attn_norm, eps, H, KV, hd, rope, slots, positions, cache, q_out, scratch
    "hs_attn_in": [
        *(_QW, _ptr, _i64, _ptr, ctypes.c_float, _i64, _i64, _i64, _ptr, _ptr, _ptr),
        *(_CACHE, _ptr, _SCRATCH),
    ],
    "hs_set_passive": [_int],
    "hs_team_tids": [_ptr, _i64],  # out (int32), max
    "hs_pack": [_ptr, _int, _i64, _i64, _ptr],
    # parts, nparts, N, K, bits, group, mode, t0, t1, out, scratch (csrc/pack.c)
    "hs_pack_gguf": [_ptr, _int, _i64, _i64, _int, _int, _int, _i64, _i64, _ptr, _ptr],
    "hs_pack_scratch": [_i64, _int],
    "hs_pack_type_known": [_int],
    # blocks, type, K, index, count, out, scratch (csrc/pack.c)
    "hs_gguf_rows": [_ptr, _int, _i64, _ptr, _i64, _ptr, _ptr],
    "hs_dequant_rows": [*(_ptr,) * 9, _int, _int, _i64, _ptr, _i64, _ptr],
    # q, H, KV, hd, cache, f32, items, num_items, scale, softcap, window, out, pooled, scratch
    "hs_attend": [
        *(_ptr, *(_i64,) * 3, _CACHE, _int, _ptr, _i64, *(ctypes.c_float,) * 2, _i64, _ptr),
        *(_int, _SCRATCH),
    ],
    # layers, first, end, pass, x, y, scratch (csrc/stack.c)
    "hs_layers": [
        *(ctypes.POINTER(StackLayer), _i64, _i64, ctypes.POINTER(StackPass), _ptr, _ptr),
        _SCRATCH,
    ],
    # qkv, T, H, KV, hd, rope, slots, positions, cache, q_out
    "hs_rope_store": [*(_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr), _CACHE, _ptr],
}


def qweight(weight: PackedWeight) -> QWeight:
    """``weight`` as the kernel's ``qweight_t``: pointers into its tensors, which must outlive
    it (``BlockLinear`` holds both)."""
    return QWeight(
        weight.codes.data_ptr(),
        *factors(weight),
        weight.bits,
        weight.group,
        weight.rows,
        weight.cols,
    )


def factors(weight: PackedWeight) -> tuple[int | None, ...]:
    """The kernel's eight pointers to the scales and offsets: float32, float16, or int8 steps
    and float32 super-block factors (csrc/matmul.h, ``factors_t``)."""
    parts: list[int | None] = []
    for part, sup in ((weight.scales, weight.scale_super), (weight.offsets, weight.offset_super)):
        if part is None:
            parts += [None, None, None, None]
        elif sup is not None:
            parts += [None, None, part.data_ptr(), sup.data_ptr()]
        elif part.dtype == torch.float16:
            parts += [None, part.data_ptr(), None, None]
        else:
            parts += [part.data_ptr(), None, None, None]
    return tuple(parts)


def cache_layout(keys: torch.Tensor, values: torch.Tensor) -> ctypes._Pointer[CacheLayout]:
    """One layer's cache as ``Kernel.rope_store`` and ``Kernel.attn_in`` take it: pointers and
    element strides (keys ``[slots, KV, hd, S]``, values ``[slots, KV, S, hd]``, the last
    stride 1), which the caller keeps alive."""
    layout = (keys.data_ptr(), *keys.stride()[:3], values.data_ptr(), *values.stride()[:3])
    return ctypes.pointer(CacheLayout(*layout))
