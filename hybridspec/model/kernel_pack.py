"""A ``QuantizedWeight`` packed into the block kernel's tiles (``csrc/tiles.c``), at load.

The codes go into tiles of ``ROWS`` = 16 rows per group of 32 columns (8-bit codes within
-32..31 in 6 bits); the scales and offsets are held in the narrowest form that keeps their
values: int8 steps times a float32 factor per 256 columns where they have that form exactly
(``quant.factor_steps``), else float16 where every one is a float16 value (a Q8_0 or Q4_1
block's d and m), else float32.
"""

from __future__ import annotations

import ctypes

import torch

from hybridspec.model.quant import (
    GROUP_SIZE,
    ROWS,
    SUPER,
    PackedWeight,
    QuantizedWeight,
    factor_steps,
    tiled,
)


def pack_weight(lib: ctypes.CDLL, weight: QuantizedWeight, narrow: bool = True) -> PackedWeight:
    """``weight`` in the kernel's tiled layout (module docstring), packed by ``lib``'s
    ``hs_pack``. ``narrow`` False: codes and factors as ``weight`` holds them (the same
    products, more bytes)."""
    if weight.device.type != "cpu":
        raise ValueError(f"weight: the block kernel runs on CPU, not {weight.device.type}")
    rows, cols = weight.shape
    tiles, groups = -(-rows // ROWS), cols // GROUP_SIZE
    bits = weight.bits
    if (
        narrow
        and bits == 8
        and rows
        and -32 <= int(weight.codes.min()) <= int(weight.codes.max()) < 32
    ):
        bits = 6  # Q6_K, Q5_K, Q5_0, Q5_1, widened 4-bit codes: 6 bits (+ 32) hold them
    codes = weight.codes.contiguous()
    packed = torch.empty((tiles, groups, ROWS * GROUP_SIZE * bits // 8), dtype=torch.uint8)
    lib.hs_pack(codes.data_ptr(), bits, rows, cols, packed.data_ptr())
    scales, offsets, scale_super, offset_super = _factors(weight, narrow)
    shape = (tiles, groups, GROUP_SIZE // weight.group * ROWS)
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


def _factors(
    weight: QuantizedWeight, narrow: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Scales and offsets in their narrowest exact form (module docstring), and the tiled
    float32 super-block factors of those held as int8 steps (None where not)."""
    subs = GROUP_SIZE // weight.group  # scales per group of 32
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
    if offsets is not None and offset_super is None:
        offsets = offsets.float()
    if narrow and scale_super is None and _is_half(scales) and _is_half(offsets):
        scales = scales.half()  # a block's float16 d (and m): half the bytes, same values
        offsets = None if offsets is None else offsets.half()
    return scales, offsets, scale_super, offset_super


def _is_half(part: torch.Tensor | None) -> bool:
    """Whether every value of ``part`` (float32) is a float16 value (None: trivially)."""
    return part is None or bool(torch.equal(part.half().float(), part))
