"""Matmuls with group-quantized weights on CPU: torch's int4 weight-only kernel, row-invariant.

``aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero)`` computes ``x @ W.T`` with
``W[n, 32 g + j] = (c - 8) * s[g, n] + z[g, n]`` for 4-bit codes ``c``, activations and
scales in bfloat16, accumulating in float32. It reads half a byte per weight where a bfloat16
matmul reads two, and each output row is computed alike whatever rows share the call, so a
token's logits do not depend on how many drafts it is verified with
(``tests/model/test_quant_linear.py``).

- 4 bits (``Int4Linear``): ``d * c + m`` is ``(c - 8) * d + (m + 8 d)``: scale ``d``, zero
  ``m + 8 d``. The kernel takes them in bfloat16, so the weights it computes with are the
  GGUF's codes with their scale and offset rounded to bfloat16 (a relative 2**-9, like every
  weight of the bfloat16 runtime); the codes themselves are the GGUF's.
- 8 bits (``Int8Linear``): a code ``c`` in -128..127 is ``u - 128`` with ``u = 16 h + l`` in
  0..255, so ``d * c = 16 d (h - 8) + d (l - 8) + 8 d``: two 4-bit products over the high and
  low nibbles (scale ``16 d``, zero ``8 d``; scale ``d``, zero 0), summed in float32.

Dimensions: ``T`` rows of ``x``, ``N`` output features, ``K`` input features, ``G = K / 32``.
"""

from __future__ import annotations

import torch

from hybridspec.model.quant import GROUP_SIZE, QuantizedWeight

ROW_MULTIPLE = 16  # the kernel packs output features in blocks of 16; others are padded


def int4_kernel_available() -> bool:
    """Whether this torch has the CPU int4 weight-only kernel."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class _Int4Pack:
    """One 4-bit matrix in the kernel's packed layout with its bfloat16 scale and zero."""

    __slots__ = ("packed", "rows", "scale_zero")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        rows = codes.shape[0]
        pad = -rows % ROW_MULTIPLE
        if pad:  # zero rows (scale and zero 0) whose outputs are sliced off
            codes = torch.cat((codes, codes.new_zeros(pad, codes.shape[1])))
            scales = torch.cat((scales, scales.new_zeros(pad, scales.shape[1])))
            zeros = torch.cat((zeros, zeros.new_zeros(pad, zeros.shape[1])))
        self.rows = rows
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        # [G, N, 2]: the kernel's layout of the per-group scale and zero
        self.scale_zero = torch.stack((scales.T, zeros.T), dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, K] bf16 -> [T, N] bf16
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scale_zero)
        return y if y.shape[1] == self.rows else y[:, : self.rows]


class Int4Linear:
    """``y = x @ W.T`` for a 4-bit ``QuantizedWeight`` (module docstring); bfloat16 in and out."""

    __slots__ = ("_pack",)

    def __init__(self, weight: QuantizedWeight) -> None:
        if weight.bits != 4:
            raise ValueError(f"weight: expected 4-bit codes, got {weight.bits} bits")
        offsets = weight.offsets if weight.offsets is not None else torch.zeros_like(weight.scales)
        codes = weight.unpacked_codes()
        self._pack = _Int4Pack(codes, weight.scales, offsets + 8 * weight.scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._pack(x)


class Int8Linear:
    """``y = x @ W.T`` for an 8-bit ``QuantizedWeight`` as two 4-bit products (module docstring)."""

    __slots__ = ("_high", "_low")

    def __init__(self, weight: QuantizedWeight) -> None:
        if weight.bits != 8 or weight.offsets is not None:
            raise ValueError("weight: expected symmetric 8-bit codes")
        unsigned = (weight.codes.to(torch.int32) + 128).to(torch.uint8)
        d = weight.scales
        self._high = _Int4Pack(unsigned >> 4, 16 * d, 8 * d)
        self._low = _Int4Pack(unsigned & 0x0F, d, torch.zeros_like(d))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self._high(x).float() + self._low(x).float()).to(torch.bfloat16)


def quantized_linear(weight: QuantizedWeight) -> Int4Linear | Int8Linear:
    """The kernel for ``weight``'s scheme."""
    return Int4Linear(weight) if weight.bits == 4 else Int8Linear(weight)
