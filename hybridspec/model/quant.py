"""Group-quantized weight matrices: a GGUF file's own blocks, or a checkpoint quantized at load.

A ``QuantizedWeight`` is a matrix ``W [N, K]`` stored as integer codes in groups of ``group``
(32, or 16 for the K-quants with sub-blocks of 16) consecutive columns of a row, each group
with a float32 scale ``d`` and, for asymmetric schemes, an offset ``m``:
``W[n, group g + j] = d[n, g] * c[n, group g + j] + m[n, g]``. Codes are 4 bits (0..15, two a
byte in column order: byte ``i`` of a row holds columns ``2 i`` and ``2 i + 1``, low nibble
first) or 8 bits (int8, -128..127).

Every GGUF type that ``model.gguf_blocks`` decodes is exactly this arithmetic (its table lists
each type's codes, groups and bytes): the float32 products that ``gguf.quants`` computes
(``d * sc`` for a K-quant's sub-block) are the scales and offsets here, so ``dequantize()``
reproduces the file's dequantized values bit for bit.

``quantize(w, bits)`` builds two schemes from a dense matrix, in groups of 32: 4 bits
asymmetric (Q4_1's, min and max of each group mapped to codes 0 and 15), 8 bits symmetric
(Q8_0's).

Matrices of several schemes stack into one (``cat_rows``, q/k/v and gate/up) by widening each
to the common one (``widen``): 4-bit codes held as 8-bit ones, groups of 32 split in two of
16, a zero offset for a symmetric part. Each value is unchanged; the fused matrix costs the
bits of its widest part, and the matmul stays one call.

Dimensions: ``N`` rows (output features), ``K`` columns (input features, a multiple of 32),
``G = K / group`` groups per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32  # the activations' group: every K is a multiple of it
GROUPS = (16, 32)
BITS = (4, 8)
ROWS = 16  # rows of a ``PackedWeight`` tile (csrc/matmul.h)


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """``W [N, K]`` as codes, scales and offsets in groups of ``group`` columns (module
    docstring)."""

    codes: torch.Tensor  # bits 4: [N, K / 2] uint8, two codes 0..15 a byte; bits 8: [N, K] int8
    scales: torch.Tensor  # [N, G] float32
    offsets: torch.Tensor | None  # [N, G] float32; None: zero
    bits: int
    group: int = GROUP_SIZE

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if self.bits not in BITS:
            raise ValueError(f"bits: expected one of {BITS}, got {self.bits!r}")
        if self.group not in GROUPS:
            raise ValueError(f"group: expected one of {GROUPS}, got {self.group!r}")
        expected = torch.uint8 if self.bits == 4 else torch.int8
        if self.codes.dtype != expected:
            raise ValueError(
                f"codes: expected {expected} for {self.bits} bits, got {self.codes.dtype}"
            )
        if cols % GROUP_SIZE:
            raise ValueError(f"codes: {cols} columns is not a multiple of {GROUP_SIZE}")
        for name, part in (("scales", self.scales), ("offsets", self.offsets)):
            if part is not None and tuple(part.shape) != (rows, cols // self.group):
                raise ValueError(
                    f"{name}: expected shape {(rows, cols // self.group)}, got {tuple(part.shape)}"
                )

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return rows, cols * 2 if self.bits == 4 else cols

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and offsets."""
        parts = (self.codes, self.scales, self.offsets)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

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
        groups = self.unpacked_codes().view(rows, cols // self.group, self.group).float()
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
        return QuantizedWeight(
            self.codes[index], self.scales[index], offsets, self.bits, self.group
        )

    def to(self, device: torch.device | str) -> QuantizedWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return QuantizedWeight(
            self.codes.to(device), self.scales.to(device), offsets, self.bits, self.group
        )


SUPER = 8  # groups of 32 per super-block of a ``PackedWeight``'s factored scales (256 columns)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A ``QuantizedWeight`` in the block kernel's tiles of ``ROWS`` = 16 rows (``model.qgemm``,
    csrc/matmul.c): the form the runtime multiplies, the weight cache stores and the model holds
    when the kernel builds, so each matrix is resident once.

    Codes ``[N / 16, G32, 16 * 32 * bits / 8]`` (``G32 = K / 32``): per tile and group of 32
    columns, 8 quads of 4 columns, each as 16 rows x 4 bytes; a 4-bit tile holds quads ``u``
    and ``u + 4`` in the low and high nibbles of one quad's bytes, an 8-bit one ``c + 128``
    (uint8), a 6-bit one (``bits`` 6: 8-bit codes within -32..31, as Q6_K's and the 5-bit
    types' are) ``c + 32``: its low 4 bits as a 4-bit tile, then its high 2 bits, quad
    ``4 v + i`` at bits ``2 i`` of 2 more quads' bytes ``v``. Scales and offsets
    ``[N / 16, G32, S * 16]`` (``S = 32 / group`` sub-groups): float32, float16 (where every
    one is a float16 value), or (``scale_super`` given) int8 steps whose factor is
    ``step * super`` with
    ``super [N / 16, ceil(G32 / 8), 16]`` float32 per row and 256 columns: a K-quant's
    ``d * sc``, held in the bytes the file spends on it (``factor_steps``). Offsets are
    factored when the scales are. Rows past ``N`` are zero.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    scale_super: torch.Tensor | None
    offset_super: torch.Tensor | None
    bits: int
    group: int
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and offsets (with their super-block factors)."""
        parts = (self.codes, self.scales, self.offsets, self.scale_super, self.offset_super)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    def unpack(self) -> QuantizedWeight:
        """The ``QuantizedWeight`` this was packed from, exactly (a permutation of bytes)."""
        tiles, groups = self.codes.shape[:2]
        if self.bits == 8:  # [tiles, G32, u, r, e] -> [tiles, r, G32, u, e]
            quads = (self.codes.view(tiles, groups, 8, ROWS, 4) ^ 0x80).view(torch.int8)
        else:
            low = self.codes[..., : 4 * ROWS * 4].reshape(tiles, groups, 4, ROWS, 4)
            quads = torch.cat((low & 0x0F, low >> 4), dim=2)
        if self.bits == 6:  # high 2 bits of quad 4 v + i at bits 2 i of vector v; c + 32
            high = self.codes[..., 4 * ROWS * 4 :].reshape(tiles, groups, 2, 1, ROWS, 4)
            shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1, 1)
            high = ((high >> shifts) & 3).reshape(tiles, groups, 8, ROWS, 4)
            quads = ((quads | (high << 4)).to(torch.int16) - 32).to(torch.int8)
        codes = quads.permute(0, 3, 1, 2, 4).reshape(tiles * ROWS, self.cols)[: self.rows]
        if self.bits == 4:
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales = _per_row(self.scales, self.scale_super, self.rows)
        offsets = None
        if self.offsets is not None:
            offsets = _per_row(self.offsets, self.offset_super, self.rows)
        bits = 8 if self.bits == 6 else self.bits
        return QuantizedWeight(codes.contiguous(), scales, offsets, bits, self.group)

    def to(self, device: torch.device | str) -> PackedWeight:
        def move(part: torch.Tensor | None) -> torch.Tensor | None:
            return None if part is None else part.to(device)

        return PackedWeight(
            self.codes.to(device),
            self.scales.to(device),
            move(self.offsets),
            move(self.scale_super),
            move(self.offset_super),
            self.bits,
            self.group,
            self.rows,
            self.cols,
        )


def held_bytes(matrix: torch.Tensor | QuantizedWeight | PackedWeight) -> int:
    """Bytes a matrix holds: a forward reads them once."""
    if isinstance(matrix, torch.Tensor):
        return matrix.numel() * matrix.element_size()
    return matrix.nbytes


def tiled(part: torch.Tensor) -> torch.Tensor:
    """Per-row factors ``[N, X]`` in tiles of ``ROWS`` rows, ``[ceil(N / 16), X, 16]`` (rows
    past ``N`` zero)."""
    rows, width = part.shape
    tiles = -(-rows // ROWS)
    padded = part.new_zeros((tiles * ROWS, width))
    padded[:rows] = part
    return padded.view(tiles, ROWS, width).transpose(1, 2).contiguous()


def _per_row(part: torch.Tensor, sup: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``tiled``'s inverse for a ``PackedWeight``'s scales or offsets: float32 ``[N, G32 S]``."""
    tiles, groups = part.shape[:2]
    flat = part.reshape(tiles, -1, ROWS).transpose(1, 2).reshape(tiles * ROWS, -1)[:rows]
    if sup is None:
        return flat.contiguous()
    per_super = flat.shape[1] // groups * SUPER
    factor = sup.transpose(1, 2).reshape(tiles * ROWS, -1)[:rows]
    factor = factor.repeat_interleave(per_super, dim=1)[:, : flat.shape[1]]
    return (flat.float() * factor).contiguous()


def factor_steps(values: torch.Tensor, per: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float32 ``values [N, X]`` as int8 steps ``[N, X]`` times a float32 factor per row and run
    of ``per`` columns ``[N, ceil(X / per)]``, the products exactly ``values``; None where some
    run has no such form.

    The factor is the greatest common divisor of the run's values (as integers at the run's
    least exponent): a K-quant's ``d * sc_j`` gives ``d * gcd(sc)`` and steps
    ``sc_j / gcd(sc)`` (within 6 bits, or Q6_K's int8, negated with the factor where d < 0
    and a step would be +128). For example ``0.75, 1.25, 0`` is ``0.25 * (3, 5, 0)``.
    """
    rows, width = values.shape
    runs = -(-width // per)
    padded = torch.zeros((rows, runs * per), dtype=torch.float32)
    padded[:, :width] = values
    if not bool(torch.isfinite(padded).all()):
        return None
    mantissa, exponent = np.frexp(padded.numpy().astype(np.float64).reshape(rows, runs, per))
    integers = np.rint(np.ldexp(mantissa, 24)).astype(np.int64)  # exact: 24-bit significands
    exponent = exponent.astype(np.int64) - 24
    nonzero = integers != 0
    least = np.where(nonzero, exponent, np.iinfo(np.int64).max).min(axis=-1, keepdims=True)
    least = np.where(nonzero.any(axis=-1, keepdims=True), least, 0)
    shift = np.where(nonzero, exponent - least, 0)
    if shift.max(initial=0) > 38:  # 24 + 38 bits: still within int64
        return None
    aligned = integers << shift
    divisor = np.gcd.reduce(aligned, axis=-1, keepdims=True)
    divisor = np.where(divisor == 0, 1, divisor)
    divisor = np.where((aligned // divisor).max(axis=-1, keepdims=True) > 127, -divisor, divisor)
    steps = aligned // divisor  # a negative factor where a step would be +128 (d < 0, sc -128)
    if steps.min(initial=0) < -128 or steps.max(initial=0) > 127:
        return None
    factor = np.ldexp(divisor.astype(np.float64), least).astype(np.float32)[..., 0]
    steps_t = torch.from_numpy(steps.astype(np.int8).reshape(rows, runs * per)[:, :width])
    factor_t = torch.from_numpy(np.ascontiguousarray(factor))
    rebuilt = steps_t.float() * factor_t.repeat_interleave(per, dim=1)[:, :width]
    if not torch.equal(rebuilt, values.float()):
        return None
    return steps_t.contiguous(), factor_t


def widen(weight: QuantizedWeight, bits: int, group: int, offsets: bool) -> QuantizedWeight:
    """``weight`` in a scheme at least as wide, with the same values: 8-bit codes for 4-bit
    ones (0..15 as int8), groups of 16 for groups of 32 (each scale twice), a zero offset for a
    symmetric weight. Raises ValueError for a narrower scheme."""
    if bits < weight.bits or group > weight.group or (weight.offsets is not None and not offsets):
        raise ValueError(
            f"widen: cannot hold {weight.bits}-bit codes in groups of {weight.group} as "
            f"{bits}-bit codes in groups of {group}{'' if offsets else ' without offsets'}"
        )
    codes = weight.codes if bits == weight.bits else weight.unpacked_codes().to(torch.int8)
    repeat = weight.group // group
    scales = weight.scales.repeat_interleave(repeat, dim=1)
    held = weight.offsets
    if held is None and offsets:
        held = torch.zeros_like(weight.scales)
    if held is not None:
        held = held.repeat_interleave(repeat, dim=1)
    return QuantizedWeight(codes, scales.contiguous(), held, bits, group)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack matrices along their rows (q/k/v into one projection), each widened to the
    common scheme first (``widen``) where their schemes differ."""
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    asymmetric = any(p.offsets is not None for p in parts)
    parts = [widen(p, bits, group, asymmetric) for p in parts]
    offsets = None
    if asymmetric:
        offsets = torch.cat([p.offsets for p in parts if p.offsets is not None])
    return QuantizedWeight(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        offsets,
        bits,
        group,
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
