"""Group-quantized weight matrices: the GGUF's own blocks, or a checkpoint quantized at load.

A ``QuantizedWeight`` is a matrix ``W [N, K]`` stored as integer codes in groups of
``GROUP_SIZE`` = 32 consecutive columns of a row, each group with a float scale ``d`` and, for
asymmetric schemes, an offset ``m``: ``W[n, 32 g + j] = d[n, g] * c[n, 32 g + j] + m[n, g]``.
That is exactly llama.cpp's arithmetic for the types kept here:

| GGUF type | bytes per block of 32 | codes | value |
| --- | --- | --- | --- |
| Q4_0 | 18: ``d`` f16, 16 bytes of nibbles | 0..15 | ``d * (c - 8)``: offset ``-8 d`` |
| Q4_1 | 20: ``d``, ``m`` f16, 16 bytes of nibbles | 0..15 | ``d * c + m`` |
| Q8_0 | 34: ``d`` f16, 32 signed bytes | -128..127 | ``d * c`` |

In a Q4 block, byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its
high nibble. Here 4-bit codes are kept two to a byte in column order (byte ``i`` of a row holds
columns ``2 i`` and ``2 i + 1``, low nibble first): half a byte per weight, as in the file.
Scales and offsets are kept as float32 (float16 values widen exactly), so
``dequantize()`` reproduces the GGUF's dequantized values bit for bit (``gguf.quants``
computes them in float32 the same way).

``quantize(w, bits)`` builds the same two schemes from a dense matrix: 4 bits asymmetric (the
Q4_1 scheme, min and max of each group mapped to codes 0 and 15), 8 bits symmetric (Q8_0).

Dimensions: ``N`` rows (output features), ``K`` columns (input features), ``G = K / 32`` groups
per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
BITS = (4, 8)
# GGUF type name -> (bytes per block, whether the block carries an offset ``m``, bits)
GGUF_BLOCKS = {"Q4_0": (18, False, 4), "Q4_1": (20, True, 4), "Q8_0": (34, False, 8)}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """``W [N, K]`` as codes, scales and offsets in groups of 32 columns (module docstring)."""

    codes: torch.Tensor  # bits 4: [N, K / 2] uint8, two codes 0..15 a byte; bits 8: [N, K] int8
    scales: torch.Tensor  # [N, G] float32
    offsets: torch.Tensor | None  # [N, G] float32; None: zero
    bits: int

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if self.bits not in BITS:
            raise ValueError(f"bits: expected one of {BITS}, got {self.bits!r}")
        expected = torch.uint8 if self.bits == 4 else torch.int8
        if self.codes.dtype != expected:
            raise ValueError(
                f"codes: expected {expected} for {self.bits} bits, got {self.codes.dtype}"
            )
        if cols % GROUP_SIZE:
            raise ValueError(f"codes: {cols} columns is not a multiple of {GROUP_SIZE}")
        for name, part in (("scales", self.scales), ("offsets", self.offsets)):
            if part is not None and tuple(part.shape) != (rows, cols // GROUP_SIZE):
                raise ValueError(
                    f"{name}: expected shape {(rows, cols // GROUP_SIZE)}, got {tuple(part.shape)}"
                )

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return rows, cols * 2 if self.bits == 4 else cols

    def unpacked_codes(self) -> torch.Tensor:
        """The codes one per column, ``[N, K]``: uint8 0..15 (bits 4) or int8 (bits 8)."""
        if self.bits == 8:
            return self.codes
        return torch.stack((self.codes & 0x0F, self.codes >> 4), dim=-1).view(self.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W [N, K]``: computed in float32 as llama.cpp does, then cast to ``dtype``."""
        rows, cols = self.shape
        groups = self.unpacked_codes().view(rows, cols // GROUP_SIZE, GROUP_SIZE).float()
        values = groups * self.scales[..., None]
        if self.offsets is not None:
            values = values + self.offsets[..., None]
        return values.view(rows, cols).to(dtype)

    def dequantize_rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``W[index]`` ``[len(index), K]`` in ``dtype`` (an embedding lookup)."""
        return self.select_rows(index).dequantize(dtype)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (a permutation, a subset), codes and scales unchanged."""
        offsets = None if self.offsets is None else self.offsets[index]
        return QuantizedWeight(self.codes[index], self.scales[index], offsets, self.bits)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return QuantizedWeight(self.codes.to(device), self.scales.to(device), offsets, self.bits)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack matrices of one scheme along their rows (q/k/v into one projection)."""
    bits = {p.bits for p in parts}
    symmetric = {p.offsets is None for p in parts}
    if len(bits) != 1 or len(symmetric) != 1:
        raise ValueError("cat_rows: expected parts of one quantization scheme")
    offsets = None
    if not symmetric.pop():
        offsets = torch.cat([p.offsets for p in parts if p.offsets is not None])
    return QuantizedWeight(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        offsets,
        bits.pop(),
    )


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Decode GGUF blocks ``raw`` (uint8, ``[N, G * block_bytes]``) of ``type_name`` into codes,
    scales and offsets, exactly (module docstring's table)."""
    if type_name not in GGUF_BLOCKS:
        raise ValueError(f"type_name: expected one of {sorted(GGUF_BLOCKS)}, got {type_name!r}")
    block_bytes, has_offset, bits = GGUF_BLOCKS[type_name]
    rows, cols = shape
    if cols % GROUP_SIZE:
        raise ValueError(f"shape: {cols} columns is not a multiple of {GROUP_SIZE}")
    groups = cols // GROUP_SIZE
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, groups, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if bits == 8:
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return QuantizedWeight(torch.from_numpy(codes), torch.from_numpy(scales), None, 8)
    start = 4 if has_offset else 2
    nibbles = blocks[..., start:]  # [N, G, 16]
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if has_offset:
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:  # Q4_0: d * (c - 8)
        offsets = scales * np.float32(-8.0)
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(packed)),
        torch.from_numpy(scales),
        torch.from_numpy(offsets),
        4,
    )


def quantize(weight: torch.Tensor, bits: int) -> QuantizedWeight:
    """Quantize a dense ``[N, K]`` matrix in groups of 32: 4 bits asymmetric (Q4_1's scheme),
    8 bits symmetric (Q8_0's). Scales are rounded to float16 first, as GGUF stores them."""
    if bits not in BITS:
        raise ValueError(f"bits: expected one of {BITS}, got {bits!r}")
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(
            f"weight: expected a matrix whose columns are a multiple of {GROUP_SIZE}, "
            f"got shape {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    groups = weight.detach().float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    if bits == 8:
        amax = groups.abs().amax(-1)
        scales = (amax / 127).half().float()
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (groups / safe[..., None]).round().clamp(-128, 127).to(torch.int8)
        return QuantizedWeight(codes.reshape(rows, cols), scales, None, 8)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).half().float()
    offsets = low.half().float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = ((groups - offsets[..., None]) / safe[..., None]).round().clamp(0, 15)
    codes = codes.to(torch.uint8).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return QuantizedWeight(packed.contiguous(), scales, offsets, 4)
