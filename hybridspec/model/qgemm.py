"""The block-quantized matmul kernel (``csrc/``): built once per machine, called by ctypes.

``BlockLinear`` computes ``y = x @ W.T`` straight from a ``QuantizedWeight``'s codes, scales
and offsets (repacked once into tiles of 16 rows), with activations quantized to 8 bits per row
and group of 32 as llama.cpp does (Q8_1), so each group's dot product is an integer one
(AVX512-VNNI, AVX2, or portable C: the same integers and float operations, hence the same
results). It reads each weight block once for up to 8 rows of ``x``, where torch's int4 kernel
dequantizes the weights again for every 4 rows. Its fused forms take a layer's RMSNorm, or the
MLP's ``silu(gate) * up``, as the prologue and the residual add as the epilogue, and
``Kernel.rope_store`` rotates q and k and writes k and v into the KV cache in one call: a layer
is three matmul calls, that one and the attention.

(One module over 400 lines, on purpose: the ctypes signatures and the Python checks of one C
library's entry points sit beside each other.)

Each output row is computed alike whatever rows share the call (one fixed order of summation,
in one thread), so a token's logits do not depend on how many drafts it is verified with.

The C library, by concern: ``matmul.c`` (the matmul, its tiles per instruction set in
``matmul_tiles.h``), ``tiles.c`` (packing into tiles, rows read back), ``layer.c`` (a layer's
fused calls: ``hs_attn_in`` with rope and the cache stores, ``hs_mlp_block``), ``attention.c``
(with ``attention_tiles.h``), ``pack.c`` (a GGUF file's blocks into tiles), and the headers
``isa.h`` (the one set of instruction-set macros), ``fastmath.h`` (conversions, the one exp),
``scratch.h``, ``matmul.h``, ``cache_layout.h``, ``gguf_decode.h``. No call allocates: each
takes the calling thread's scratch buffer (``Scratch``), which grows when a call reports it
short and is then reused.

Building: the C sources are compiled with the system's C compiler (``$CC``, else ``cc``) with
``-O3 -march=native -fopenmp`` into ``default_cache_dir()/kernels``, keyed by the sources, the
flags and the compiler, the first time it is needed (a few seconds). The library links the
OpenMP runtime that torch has loaded (same soname), so it runs on torch's threads and follows
``torch.set_num_threads``. Where no compiler works, ``kernel()`` is None and quantized weights
fall back to torch's int4 kernel (``quant_linear``); ``HYBRIDSPEC_QGEMM=0`` forces that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hybridspec.model.gguf import default_cache_dir
from hybridspec.model.quant import (
    GROUP_SIZE,
    ROWS,
    SUPER,
    PackedWeight,
    QuantizedWeight,
    factor_steps,
    tiled,
)

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(_CSRC.glob("*.c")))  # compiled together into one library
HEADERS = tuple(sorted(_CSRC.glob("*.h")))  # in the build's key with the sources
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_SILU_MUL = 0, 1, 2
_X_DTYPES = (torch.bfloat16, torch.float32)
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
    ``[slots, KV, S, hd]``, pointers and element strides (``Kernel.cache_struct``)."""

    _fields_ = [
        ("keys", _ptr),
        *((name, _i64) for name in ("ks_slot", "ks_head", "ks_dim")),
        ("values", _ptr),
        *((name, _i64) for name in ("vs_slot", "vs_head", "vs_pos")),
    ]


_CACHE = ctypes.POINTER(CacheLayout)


class Scratch(ctypes.Structure):
    """csrc/scratch.h's ``hs_scratch_t``: a buffer and its size, and what a call that found it
    short needs (``Kernel._call`` grows it and calls again)."""

    _fields_ = [("data", _ptr), ("bytes", _i64), ("need", _i64)]


_SCRATCH = ctypes.POINTER(Scratch)


class _ThreadScratch(threading.local):
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


_SIGNATURES = {
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
    "hs_pack": [_ptr, _int, _i64, _i64, _ptr],
    # parts, nparts, N, K, bits, group, mode, t0, t1, out, scratch (csrc/pack.c)
    "hs_pack_gguf": [_ptr, _int, _i64, _i64, _int, _int, _int, _i64, _i64, _ptr, _ptr],
    "hs_pack_scratch": [_i64, _int],
    "hs_pack_type_known": [_int],
    "hs_dequant_rows": [*(_ptr,) * 9, _int, _int, _i64, _ptr, _i64, _ptr],
    # q, H, KV, hd, cache, f32, items, num_items, scale, softcap, window, out, scratch
    "hs_attend": [
        *(_ptr, *(_i64,) * 3, _CACHE, _int, _ptr, _i64, *(ctypes.c_float,) * 2, _i64, _ptr),
        _SCRATCH,
    ],
    # qkv, T, H, KV, hd, rope, slots, positions, cache, q_out
    "hs_rope_store": [*(_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr), _CACHE, _ptr],
}


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` / ``gcc`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def build(extra_flags: tuple[str, ...] = (), cache_dir: Path | None = None) -> Path:
    """Compile the kernel (or find it compiled) and return the shared library's path.

    ``extra_flags`` are appended to ``FLAGS`` (the tests build each instruction-set path, e.g.
    ``("-mno-avx512vnni",)``). Raises RuntimeError when there is no compiler or it fails.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    flags = (*FLAGS, *extra_flags)
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join((shutil.which(cc) or cc, *flags)).encode())
    folder = (cache_dir or default_cache_dir()) / "kernels"
    target = folder / f"qgemm-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", scratch, *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build the kernel: {done.stderr.strip()}")
        os.replace(scratch, target)  # atomic: a concurrent build finds a whole library
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


class Kernel:
    """The loaded library and what it was compiled for (``isa``)."""

    def __init__(self, path: Path) -> None:
        torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so it is shared
        self._lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            getattr(self._lib, name).argtypes = argtypes
        for name in ("hs_matmul", "hs_mlp_block", "hs_attn_in", "hs_attend"):
            getattr(self._lib, name).restype = ctypes.c_int
        self._lib.hs_isa.restype = ctypes.c_char_p
        self._lib.hs_pack_scratch.restype = _i64
        self.path = path
        self.isa: str = self._lib.hs_isa().decode()
        # The attention's vector path (AVX-512); without it the portable C is slower than the
        # numba kernel of the same bits, which ``attention.KernelAttention`` then runs instead.
        self.attention_vectorized = bool(self._lib.hs_attend_vectorized())
        self._scratch = _ThreadScratch()

    @property
    def lib(self) -> ctypes.CDLL:
        """The library, for the modules that call its other functions (``gguf_pack``)."""
        return self._lib

    def max_threads(self) -> int:
        return int(self._lib.hs_max_threads())

    def _call(self, function: Callable[..., int], *args: object) -> None:
        """``function(*args, scratch)`` with the calling thread's scratch, grown and called
        again where the call found it short (it then did nothing)."""
        scratch = self._scratch
        if function(*args, scratch.pointer):
            scratch.grow()
            if function(*args, scratch.pointer):
                raise RuntimeError(
                    f"{getattr(function, '__name__', function)}: scratch short after growing it"
                )

    def pack(self, weight: QuantizedWeight, narrow: bool = True) -> PackedWeight:
        """``weight`` in the kernel's tiled layout (csrc/matmul.c): 8-bit codes within -32..31
        in 6 bits; its scales and offsets as int8 steps times a float32 factor per 256 columns
        where they have that form exactly (``quant.factor_steps``), else float16 where every
        one is a float16 value (a Q8_0 or Q4_1 block's d and m), else float32. ``narrow``
        False: codes and factors as ``weight`` holds them (the same products, more bytes)."""
        if weight.device.type != "cpu":
            raise ValueError(f"weight: the block kernel runs on CPU, not {weight.device.type}")
        rows, cols = weight.shape
        tiles, groups = -(-rows // ROWS), cols // GROUP_SIZE
        bits = weight.bits
        if (
            narrow
            and bits == 8
            and rows
            and int(weight.codes.min()) >= -32
            and int(weight.codes.max()) < 32
        ):
            bits = 6  # Q6_K, Q5_K, Q5_0, Q5_1, widened 4-bit codes: 6 bits (+ 32) hold them
        subs = GROUP_SIZE // weight.group  # scales per group of 32
        codes = weight.codes.contiguous()
        packed = torch.empty((tiles, groups, ROWS * GROUP_SIZE * bits // 8), dtype=torch.uint8)
        self._lib.hs_pack(codes.data_ptr(), bits, rows, cols, packed.data_ptr())
        scales, offsets = weight.scales.float(), weight.offsets
        factored = factor_steps(scales, SUPER * subs) if narrow else None
        offset_factored = None
        if narrow and offsets is not None:
            offset_factored = factor_steps(offsets.float(), SUPER * subs)
        scale_super = offset_super = None
        if factored is not None and (offsets is None or offset_factored is not None):
            scales, scale_super = factored[0], tiled(factored[1])
            if offset_factored is not None:
                offsets, offset_super = offset_factored[0], tiled(offset_factored[1])
        shape = (tiles, groups, subs * ROWS)
        if offsets is not None and offset_super is None:
            offsets = offsets.float()
        if narrow and scale_super is None and _is_half(scales) and _is_half(offsets):
            scales = scales.half()  # a block's float16 d (and m): half the bytes, same values
            offsets = None if offsets is None else offsets.half()
        return PackedWeight(
            packed,
            tiled(scales).view(shape),
            None if offsets is None else tiled(offsets).view(shape),
            scale_super,
            offset_super,
            bits,
            weight.group,
            rows,
            cols,
        )

    def qgemm(
        self,
        x: torch.Tensor,  # [T, K] bfloat16 or float32 ([T, 2 K] bfloat16 for PROLOGUE_SILU_MUL)
        weight: PackedWeight,
        prologue: int = PROLOGUE_NONE,
        norm: torch.Tensor | None = None,  # [K] bfloat16, for PROLOGUE_RMSNORM
        eps: float = 0.0,
        residual: torch.Tensor | None = None,  # [T, N] bfloat16
    ) -> torch.Tensor:
        """``prologue(x) @ W.T (+ residual)`` in bfloat16, ``[T, N]`` (module docstring); the
        checks are ``BlockLinear``'s."""
        return BlockLinear(weight, self).apply(x, prologue, norm, eps, residual)

    def qgemm_unchecked(
        self,
        x: torch.Tensor,
        weight: ctypes._Pointer[QWeight],  # pointer(qweight(the PackedWeight))
        rows: int,
        prologue: int,
        norm: int | None,  # the norm's data_ptr(), for PROLOGUE_RMSNORM
        eps: float,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """``qgemm`` for callers that hold what it checks true (``BlockLinear``): contiguous
        ``x`` and ``residual`` of the shapes and dtypes ``qgemm`` names. No checks, the least
        work per call: the runtime makes about four calls per layer and token."""
        tokens = x.shape[0]
        y = torch.empty((tokens, rows), dtype=torch.bfloat16)
        if tokens == 0:
            return y
        self._call(
            self._lib.hs_matmul,
            weight,
            x.data_ptr(),
            x.dtype is torch.float32,
            tokens,
            prologue,
            norm,
            eps,
            None if residual is None else residual.data_ptr(),
            y.data_ptr(),
        )
        return y

    def mlp_block(
        self,
        wo: BlockLinear,
        w_gate_up: BlockLinear,
        w_down: BlockLinear,
        attn: torch.Tensor,  # [T, wo's K] bfloat16 or float32
        x: torch.Tensor,  # [T, D] bfloat16, the layer's input
        mlp_norm: torch.Tensor,  # [D] bfloat16
        eps: float,
    ) -> torch.Tensor:
        """A decoder layer after its attention in one call (csrc/layer.c, ``hs_mlp_block``):
        ``h = wo(attn, residual=x)``, then ``w_down.after_silu_mul(w_gate_up.after_norm(h,
        mlp_norm, eps), residual=h)``, equal to those three calls to the bit."""
        dims = wo.weight.rows
        if (
            attn.dim() != 2
            or attn.shape[1] != wo.weight.cols
            or attn.dtype not in _X_DTYPES
            or x.shape != (attn.shape[0], dims)
            or x.dtype is not torch.bfloat16
            or w_gate_up.weight.cols != dims
            or w_down.weight.cols * 2 != w_gate_up.weight.rows
            or w_down.weight.rows != dims
            or mlp_norm.shape != (dims,)
            or mlp_norm.dtype is not torch.bfloat16
        ):
            raise ValueError("mlp_block: tensors or matrices of unexpected shapes or dtypes")
        attn, x, mlp_norm = attn.contiguous(), x.contiguous(), mlp_norm.contiguous()
        y = torch.empty((attn.shape[0], dims), dtype=torch.bfloat16)
        if attn.shape[0] == 0:
            return y
        self._call(
            self._lib.hs_mlp_block,
            wo.pointer,
            w_gate_up.pointer,
            w_down.pointer,
            attn.data_ptr(),
            attn.dtype is torch.float32,
            attn.shape[0],
            x.data_ptr(),
            mlp_norm.data_ptr(),
            eps,
            y.data_ptr(),
        )
        return y

    def rope_store(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 KV) hd] bfloat16
        num_heads: int,
        rope: torch.Tensor,  # [S, hd / 2, 2] float32: cos, sin
        slots: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, each below S
        keys: torch.Tensor,  # [slots, KV, hd, S] bfloat16 (one layer, transposed)
        values: torch.Tensor,  # [slots, KV, S, hd] bfloat16
    ) -> torch.Tensor:
        """q and k rotated by rope, k and v stored at each token's slot and position, q
        returned ``[T, H, hd]`` float32 (csrc/layer.c, ``hs_rope_store``)."""
        _, num_kv, head_dim, seq_len = keys.shape
        tokens = qkv.shape[0]
        if (
            qkv.dtype != torch.bfloat16
            or tuple(qkv.shape) != (tokens, (num_heads + 2 * num_kv) * head_dim)
            or keys.dtype != torch.bfloat16
            or values.dtype != torch.bfloat16
            or keys.stride(3) != 1
            or values.stride(3) != 1
            or tuple(rope.shape) != (seq_len, head_dim // 2, 2)
            or rope.dtype != torch.float32
            or slots.shape != (tokens,)
            or positions.shape != (tokens,)
        ):
            raise ValueError("rope_store: tensors of unexpected shapes or dtypes")
        slots, positions = slots.to(torch.int64), positions.to(torch.int64)
        return self.rope_store_unchecked(
            qkv.contiguous(),
            num_heads,
            num_kv,
            head_dim,
            rope.contiguous(),
            slots.contiguous(),
            positions.contiguous(),
            self.cache_struct(keys, values),
        )

    def attend_unchecked(
        self,
        q: torch.Tensor,  # [T, H, hd] float32, contiguous
        num_kv: int,
        cache: ctypes._Pointer[CacheLayout],  # the layer's keys and values, this batch's stored
        cache_f32: bool,  # the cache holds float32 (else bfloat16)
        items: np.ndarray,  # int32 [n, 5], attention_kernels.ITEM_COLUMNS
        scale: float,
        softcap: float,
        window: int,
    ) -> torch.Tensor:
        """``attention_kernels.attend`` in C (csrc/attention.c, the same bits), for the runtime,
        which builds every argument to fit: ``[T, H, hd]`` float32."""
        _, num_heads, head_dim = q.shape
        out = torch.empty_like(q)
        self._call(
            self._lib.hs_attend,
            q.data_ptr(),
            num_heads,
            num_kv,
            head_dim,
            cache,
            cache_f32,
            items.ctypes.data,
            items.shape[0],
            scale,
            softcap,
            window,
            out.data_ptr(),
        )
        return out

    @staticmethod
    def cache_struct(keys: torch.Tensor, values: torch.Tensor) -> ctypes._Pointer[CacheLayout]:
        """One layer's cache as ``rope_store_unchecked`` and ``attn_in`` take it: pointers and
        element strides (keys ``[slots, KV, hd, S]``, values ``[slots, KV, S, hd]``, the last
        stride 1), which the caller keeps alive."""
        layout = (keys.data_ptr(), *keys.stride()[:3], values.data_ptr(), *values.stride()[:3])
        return ctypes.pointer(CacheLayout(*layout))

    def rope_store_unchecked(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv: int,
        head_dim: int,
        rope: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        cache: ctypes._Pointer[CacheLayout],
    ) -> torch.Tensor:
        """``rope_store`` for the runtime, which builds every argument to fit (contiguous
        bfloat16 ``qkv``, contiguous int64 ``slots`` and ``positions`` within the cache,
        ``cache`` from ``cache_struct``): no checks, the least work per layer."""
        q = torch.empty((qkv.shape[0], num_heads, head_dim), dtype=torch.float32)
        self._lib.hs_rope_store(
            qkv.data_ptr(),
            qkv.shape[0],
            num_heads,
            num_kv,
            head_dim,
            rope.data_ptr(),
            slots.data_ptr(),
            positions.data_ptr(),
            cache,
            q.data_ptr(),
        )
        return q

    def attn_in(
        self,
        wqkv: BlockLinear,
        x: torch.Tensor,  # [T, D] bfloat16, contiguous
        attn_norm: torch.Tensor,  # [D] bfloat16, contiguous
        eps: float,
        num_heads: int,
        num_kv: int,
        head_dim: int,
        rope: torch.Tensor,  # as rope_store_unchecked takes them
        slots: torch.Tensor,
        positions: torch.Tensor,
        cache: ctypes._Pointer[CacheLayout],  # cache_struct(keys, values)
    ) -> torch.Tensor:
        """``rope_store_unchecked(wqkv.after_norm(x, attn_norm, eps), ...)`` in one call
        (csrc/layer.c, ``hs_attn_in``), equal to it; for the runtime, which builds every
        argument to fit (no checks). q ``[T, H, hd]`` float32."""
        q = torch.empty((x.shape[0], num_heads, head_dim), dtype=torch.float32)
        if x.shape[0] == 0:
            return q
        self._call(
            self._lib.hs_attn_in,
            wqkv.pointer,
            x.data_ptr(),
            x.shape[0],
            attn_norm.data_ptr(),
            eps,
            num_heads,
            num_kv,
            head_dim,
            rope.data_ptr(),
            slots.data_ptr(),
            positions.data_ptr(),
            cache,
            q.data_ptr(),
        )
        return q

    def dequantize_rows(self, weight: PackedWeight, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the matrix in bfloat16, ``[len(index), K]`` (an embedding lookup)."""
        index = index.to(torch.int64).contiguous()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= weight.rows):
            raise IndexError(f"index out of range for {weight.rows} rows")
        out = torch.empty((index.numel(), weight.cols), dtype=torch.bfloat16)
        self._lib.hs_dequant_rows(
            weight.codes.data_ptr(),
            *_factors(weight),
            weight.bits,
            weight.group,
            weight.cols,
            index.data_ptr(),
            index.numel(),
            out.data_ptr(),
        )
        return out


def _is_half(part: torch.Tensor | None) -> bool:
    """Whether every value of ``part`` (float32) is a float16 value (None: trivially)."""
    return part is None or bool(torch.equal(part.half().float(), part))


def qweight(weight: PackedWeight) -> QWeight:
    """``weight`` as the kernel's ``qweight_t``: pointers into its tensors, which must outlive
    it (``BlockLinear`` holds both)."""
    return QWeight(
        weight.codes.data_ptr(),
        *_factors(weight),
        weight.bits,
        weight.group,
        weight.rows,
        weight.cols,
    )


def _factors(weight: PackedWeight) -> tuple[int | None, ...]:
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


def load(extra_flags: tuple[str, ...] = (), cache_dir: Path | None = None) -> Kernel:
    """Build (if needed) and load the kernel; raises RuntimeError where it cannot be built."""
    return Kernel(build(extra_flags, cache_dir))


@functools.cache
def kernel() -> Kernel | None:
    """The kernel for this machine, or None where it cannot be built or is turned off."""
    if os.environ.get("HYBRIDSPEC_QGEMM", "1") == "0":
        return None
    try:
        return load()
    except (RuntimeError, OSError) as exc:
        logger.warning("quantized matmul kernel unavailable, using torch's int4 kernel: %s", exc)
        return None


block_kernel = kernel  # the name ``hybridspec.model`` exports


class BlockLinear:
    """``y = x @ W.T`` for a ``QuantizedWeight`` through the block kernel; bfloat16 in and out.

    Holds the weight only in the kernel's tiled layout: a ``PackedWeight`` as it is (no copy),
    or a ``QuantizedWeight`` packed here.
    """

    __slots__ = ("_kernel", "pointer", "weight")

    def __init__(self, weight: QuantizedWeight | PackedWeight, kernel: Kernel) -> None:
        self.weight = weight if isinstance(weight, PackedWeight) else kernel.pack(weight)
        self._kernel = kernel
        # the weight's tensors are never changed in place: one qweight_t serves every call
        self.pointer = ctypes.pointer(qweight(self.weight))

    @property
    def kernel(self) -> Kernel:
        return self._kernel

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ residual)``: x bfloat16 or float32, the result bfloat16."""
        return self.apply(x, PROLOGUE_NONE, None, 0.0, residual)

    def after_norm(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        """``(rms_norm(x) * norm) @ W.T``, the norm computed in float32 inside the kernel."""
        return self.apply(x, PROLOGUE_RMSNORM, norm, eps, None)

    def after_silu_mul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """``(silu(x[:, :K]) * x[:, K:]) @ W.T (+ residual)``: the MLP's down projection."""
        return self.apply(x, PROLOGUE_SILU_MUL, None, 0.0, residual)

    def apply(
        self,
        x: torch.Tensor,  # [T, K] bfloat16 or float32 ([T, 2 K] bfloat16 for PROLOGUE_SILU_MUL)
        prologue: int,
        norm: torch.Tensor | None,  # [K] bfloat16, for PROLOGUE_RMSNORM
        eps: float,
        residual: torch.Tensor | None,  # [T, N] bfloat16
    ) -> torch.Tensor:
        """``prologue(x) @ W.T (+ residual)``: what the kernel reads checked in the fewest
        steps, then ``Kernel.qgemm_unchecked``."""
        cols, rows = self.weight.cols, self.weight.rows
        width = 2 * cols if prologue == PROLOGUE_SILU_MUL else cols
        if (
            x.dim() != 2
            or x.shape[1] != width
            or not (x.dtype is torch.bfloat16 or (x.dtype is torch.float32 and width == cols))
        ):
            raise ValueError(f"x: expected bfloat16 [T, {width}], got {x.dtype} {tuple(x.shape)}")
        norm_data = None
        if prologue == PROLOGUE_RMSNORM:
            if norm is None or norm.shape != (cols,) or norm.dtype is not torch.bfloat16:
                raise ValueError(f"norm: expected bfloat16 [{cols}] for the RMSNorm prologue")
            norm = norm.contiguous()  # held here while the kernel reads it
            norm_data = norm.data_ptr()
        if residual is not None and (
            residual.dtype is not torch.bfloat16 or residual.shape != (x.shape[0], rows)
        ):
            raise ValueError(f"residual: expected bfloat16 [{x.shape[0]}, {rows}]")
        return self._kernel.qgemm_unchecked(
            x.contiguous(),
            self.pointer,
            rows,
            prologue,
            norm_data,
            eps,
            None if residual is None else residual.contiguous(),
        )

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """``W[index]`` in bfloat16: the embedding lookup of a tied matrix."""
        return self._kernel.dequantize_rows(self.weight, index)


assert GROUP_SIZE == 32  # csrc/matmul.h's GS
