"""The block-quantized matmul kernel (``csrc/``): loaded once per process, called by ctypes.

``BlockLinear`` computes ``y = x @ W.T`` straight from a
``QuantizedWeight``'s codes, scales and offsets (repacked once into tiles of 16 rows,
``kernel_pack``), with activations quantized to 8 bits per row and group of 32 as llama.cpp
does (Q8_1), so each group's dot product is an integer one (AVX512-VNNI, AVX2, or portable C:
the same integers and float operations, hence the same results). It reads each weight block
once for up to 16 rows of ``x`` (AVX512-VNNI; 4 with AVX2), where torch's int4 kernel
dequantizes the weights again for every 4 rows. Its fused forms take a layer's RMSNorm, or the
MLP's ``silu(gate) * up``, as the prologue and the residual add as the epilogue;
``Kernel.attn_in`` adds rope and the KV-cache stores to the q/k/v projection, and
``Kernel.mlp_block`` runs a layer after its attention in one call.

Each output row is computed alike whatever rows share the call (one fixed order of summation,
in one thread), so a token's logits do not depend on how many drafts it is verified with.

The C library, by concern: ``matmul.c`` (the matmul, its tiles per instruction set in
``matmul_tiles.h``), ``tiles.c`` (packing into tiles, rows read back), ``layer.c`` (a layer's
fused calls: ``hs_attn_in`` with rope and the cache stores, ``hs_mlp_block``), ``attention.c``
(with ``attention_tiles.h``), ``pool.c`` (the threads the calls above share their work on),
``pack.c`` (a GGUF file's blocks into tiles), ``peak.c`` (the int8 peak
``bench.compute_bound`` measures), and the headers ``isa.h`` (the one set of instruction-set
macros), ``fastmath.h`` (conversions, the one exp), ``scratch.h``, ``matmul.h``, ``pool.h``,
``cache_layout.h``, ``gguf_decode.h``. No call allocates (but a thread's first parallel call
starts its workers): each takes the calling thread's scratch buffer
(``kernel_abi.ThreadScratch``), which grows when a call reports it short and is then reused.
Its ctypes interface is ``kernel_abi``.

Threads: a forward's calls (the matmuls, rope and the cache stores, the attention) share
their work on the library's own threads (``pool.c``): each calling thread has a team of
workers, as many in all as ``torch.set_num_threads`` gives that thread, which claim the call's
chunks one at a time, and a call waits only for the chunks that were claimed, so that on a
busy machine a worker the OS descheduled with nothing in hand holds nobody up (OpenMP's
regions end at a barrier every thread must reach). Packing a file's blocks runs on torch's
OpenMP runtime, which the library links (the same soname).

Loading: ``kernel_build`` compiles the library the first time it is needed. Where no compiler
works, ``kernel()`` is None and quantized weights fall back to torch's int4 kernel
(``quant_linear``); ``HYBRIDSPEC_QGEMM=0`` forces that.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hybridspec.model.kernel_abi import (
    PROLOGUE_NONE,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    SIGNATURES,
    CacheLayout,
    QWeight,
    StackLayer,
    StackPass,
    ThreadScratch,
    factors,
    qweight,
)
from hybridspec.model.kernel_build import build
from hybridspec.model.kernel_pack import pack_weight
from hybridspec.model.quant import GROUP_SIZE, PackedWeight, QuantizedWeight

logger = logging.getLogger(__name__)

_X_DTYPES = (torch.bfloat16, torch.float32)


class Kernel:
    """The loaded library and what it was compiled for (``isa``)."""

    def __init__(self, path: Path) -> None:
        torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so it is shared
        self._lib = ctypes.CDLL(str(path))
        for name, argtypes in SIGNATURES.items():
            getattr(self._lib, name).argtypes = argtypes
        for name in ("hs_matmul", "hs_mlp_block", "hs_attn_in", "hs_attend"):
            getattr(self._lib, name).restype = ctypes.c_int
        self._lib.hs_isa.restype = ctypes.c_char_p
        self._lib.hs_pack_scratch.restype = ctypes.c_int64
        self._lib.hs_team_tids.restype = ctypes.c_int64
        self._lib.hs_layers.restype = ctypes.c_int64
        self.path = path
        self.isa: str = self._lib.hs_isa().decode()
        # The attention's vector path (AVX-512); without it the portable C is slower than the
        # numba kernel of the same bits, which ``attention.KernelAttention`` then runs instead.
        self.attention_vectorized = bool(self._lib.hs_attend_vectorized())
        self._scratch = ThreadScratch()

    @property
    def lib(self) -> ctypes.CDLL:
        """The library, for the modules that call its other functions (``gguf_pack``)."""
        return self._lib

    def max_threads(self) -> int:
        return int(self._lib.hs_max_threads())

    def team_tids(self) -> list[int]:
        """The thread ids of the calling thread's workers (csrc/pool.c), those started so far."""
        out = (ctypes.c_int32 * 255)()
        count = int(self._lib.hs_team_tids(out, len(out)))
        return [int(tid) for tid in out[:count] if tid > 0]

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

    def layers(
        self,
        table: ctypes.Array[StackLayer],
        first: int,
        end: int,
        stack_pass: StackPass,
        x: torch.Tensor,  # [T, D] bfloat16, contiguous: layer i's input where i is even
        y: torch.Tensor,  # the same: where i is odd
    ) -> None:
        """Layers ``first`` up to ``end`` of ``table`` in one call (csrc/stack.c,
        ``hs_layers``), the scratch grown where a layer found it short (the call then goes on
        from that layer). The last layer's output is in ``y`` where ``end`` is odd, else
        ``x``. For ``decoder.KernelStack``, which builds every argument to fit: no checks."""
        scratch, layers = self._scratch, self._lib.hs_layers
        pointers = (ctypes.byref(stack_pass), x.data_ptr(), y.data_ptr(), scratch.pointer)
        while first < end:
            first = int(layers(table, first, end, *pointers))
            if first < end:  # each growth covers what a call of that layer asked for
                scratch.grow()

    def pack(self, weight: QuantizedWeight, narrow: bool = True) -> PackedWeight:
        """``weight`` in the kernel's tiled layout (``kernel_pack.pack_weight``)."""
        return pack_weight(self._lib, weight, narrow)

    def qgemm_unchecked(
        self,
        x: torch.Tensor,  # [T, K] bfloat16 or float32 ([T, 2 K] bfloat16 for PROLOGUE_SILU_MUL)
        weight: ctypes._Pointer[QWeight],  # pointer(qweight(the PackedWeight)), N rows
        rows: int,
        prologue: int,
        norm: int | None,  # the norm's data_ptr(), for PROLOGUE_RMSNORM
        eps: float,
        residual: torch.Tensor | None,  # [T, N] bfloat16
    ) -> torch.Tensor:
        """``prologue(x) @ W.T (+ residual)`` in bfloat16, ``[T, N]``, for ``BlockLinear``,
        which checks its arguments: contiguous ``x`` and ``residual`` of the shapes and dtypes
        named above. No checks here, the least work per call."""
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
        pooled: bool,
    ) -> torch.Tensor:
        """``attention_kernels.attend`` in C (csrc/attention.c, the same bits), for the runtime,
        which builds every argument to fit: ``[T, H, hd]`` float32. ``pooled``: on the kernel's
        own threads, where the forward's matmuls are the kernel's too (else torch's threads)."""
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
            int(pooled),
        )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv: int,
        head_dim: int,
        rope: torch.Tensor,  # [S, hd / 2, 2] float32: cos, sin
        slots: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, each below S
        cache: ctypes._Pointer[CacheLayout],
    ) -> torch.Tensor:
        """q and k of ``qkv [T, (H + 2 KV) hd]`` rotated by rope, k and v stored at each
        token's slot and position, q returned ``[T, H, hd]`` float32 (csrc/layer.c,
        ``hs_rope_store``). For the runtime, which builds every argument to fit (contiguous
        bfloat16 ``qkv``, contiguous ``slots`` and ``positions`` within the cache, ``cache``
        from ``kernel_abi.cache_layout``): no checks, the least work per layer."""
        q = torch.empty((qkv.shape[0], num_heads, head_dim), dtype=torch.float32)
        tail = _rope_tail(q, num_kv, rope, slots, positions, cache)
        self._lib.hs_rope_store(qkv.data_ptr(), qkv.shape[0], *tail)
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
        rope: torch.Tensor,  # as rope_store takes them
        slots: torch.Tensor,
        positions: torch.Tensor,
        cache: ctypes._Pointer[CacheLayout],  # kernel_abi.cache_layout(keys, values)
    ) -> torch.Tensor:
        """``rope_store(wqkv.after_norm(x, attn_norm, eps), ...)`` in one call
        (csrc/layer.c, ``hs_attn_in``), equal to it; for the runtime, which builds every
        argument to fit (no checks). q ``[T, H, hd]`` float32."""
        q = torch.empty((x.shape[0], num_heads, head_dim), dtype=torch.float32)
        if x.shape[0] == 0:
            return q
        tail = _rope_tail(q, num_kv, rope, slots, positions, cache)
        head = (wqkv.pointer, x.data_ptr(), x.shape[0], attn_norm.data_ptr(), eps)
        self._call(self._lib.hs_attn_in, *head, *tail)
        return q

    def dequantize_rows(self, weight: PackedWeight, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the matrix in bfloat16, ``[len(index), K]`` (an embedding lookup)."""
        index = index.to(torch.int64).contiguous()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= weight.rows):
            raise IndexError(f"index out of range for {weight.rows} rows")
        out = torch.empty((index.numel(), weight.cols), dtype=torch.bfloat16)
        self._lib.hs_dequant_rows(
            weight.codes.data_ptr(),
            *factors(weight),
            weight.bits,
            weight.group,
            weight.cols,
            index.data_ptr(),
            index.numel(),
            out.data_ptr(),
        )
        return out


def _rope_tail(
    q: torch.Tensor,  # [T, H, hd] float32, written by the call
    num_kv: int,
    rope: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cache: ctypes._Pointer[CacheLayout],
) -> tuple[object, ...]:
    """The arguments ``hs_rope_store`` and ``hs_attn_in`` end with, in their C order: H, KV,
    hd, rope, slots, positions, the cache and q's data."""
    _, num_heads, head_dim = q.shape
    pointers = (rope.data_ptr(), slots.data_ptr(), positions.data_ptr())
    return (num_heads, num_kv, head_dim, *pointers, cache, q.data_ptr())


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
