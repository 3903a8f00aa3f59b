"""A GGUF file's quantized blocks decoded, exactly, into a ``QuantizedWeight`` (``model.quant``).

Each type is read the way ``gguf.quants`` dequantizes it, stopping before the last product:
the codes become ``QuantizedWeight`` codes and the float32 factors (``d``, ``d * sc``,
``dmin * m``) its scales and offsets, so ``dequantize()`` computes the very same float32
operations and values.

| type | block | bytes | kept as | group | value |
| --- | --- | --- | --- | --- | --- |
| Q4_0 | 32 | 18 | 4-bit | 32 | ``d c - 8 d`` |
| Q4_1 | 32 | 20 | 4-bit | 32 | ``d c + m`` |
| Q5_0 | 32 | 22 | 8-bit | 32 | ``d (c - 16)`` |
| Q5_1 | 32 | 24 | 8-bit | 32 | ``d c + m`` |
| Q8_0 | 32 | 34 | 8-bit | 32 | ``d c`` |
| Q2_K | 256 | 84 | 4-bit | 16 | ``(d sc) c - dmin m`` |
| Q3_K | 256 | 110 | 4-bit | 16 | ``(d (sc - 32)) (c - 4)``: codes ``c`` 0..7, offset ``-4 d sc'`` |
| Q4_K | 256 | 144 | 4-bit | 32 | ``(d sc) c - dmin m`` |
| Q5_K | 256 | 176 | 8-bit | 32 | ``(d sc) c - dmin m`` |
| Q6_K | 256 | 210 | 8-bit | 16 | ``(d sc) (c - 32)`` |
| IQ4_NL | 32 | 18 | 8-bit | 32 | ``d kv[c]`` (``kv`` a fixed table of 16 int8) |
| IQ4_XS | 256 | 136 | 8-bit | 32 | ``(d (sc - 32)) kv[c]`` |

Q3_K's ``s (c + 4) - 4 s`` equals ``s c`` exactly: ``s = d (sc - 32)`` has at most 17
significant bits, so both terms and their sum are exact in float32.

Dimensions: ``M`` blocks, ``B`` values per block (32 or 256).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hybridspec.model.quant import GROUP_SIZE, QuantizedWeight, cat_rows

QK_K = 256
IQ4_VALUES = np.array(
    (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=np.int8
)
# codes [M, B], scales [M, B / group] float32, offsets (or None) alike
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 ``[M, 1]``."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Low nibbles of each run of ``width`` bytes, then their high nibbles: ``[M, 2 * bytes]``."""
    runs = qs.reshape(qs.shape[0], -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(qs.shape[0], -1)


def _bits(raw: np.ndarray, width: int, step: int, count: int) -> np.ndarray:
    """Fields of ``step`` bits (``count`` shifts) of each run of ``width`` bytes."""
    shifts = np.arange(0, step * count, step, dtype=raw.dtype).reshape(1, 1, count, 1)
    runs = raw.reshape(raw.shape[0], -1, 1, width) >> shifts
    return (runs & ((1 << step) - 1)).reshape(raw.shape[0], -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-block scales and mins: two ``[M, 8]``."""
    d, m, m_d = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8).astype(np.float32), mins.reshape(-1, 8).astype(np.float32)


def _q4_0(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:], 16), d, d * np.float32(-8.0)


def _q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:], 16), _f16(b, 0), _f16(b, 2)


def _q5_high(qh: np.ndarray) -> np.ndarray:
    bits = qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q5_0(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 6:], 16) | _q5_high(b[:, 2:6])
    return q.astype(np.int8) - np.int8(16), _f16(b, 0), None


def _q5_1(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 8:], 16) | _q5_high(b[:, 4:8])
    return q.astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Decoded:
    return b[:, 2:].copy().view(np.int8), _f16(b, 0), None


def _q2_k(b: np.ndarray) -> Decoded:
    scales = b[:, :16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    codes = _bits(b[:, 16:80], 32, 2, 4)
    return codes, d * (scales & 0x0F).astype(np.float32), -(dmin * (scales >> 4).astype(np.float32))


def _q3_k(b: np.ndarray) -> Decoded:
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = _bits(packed[:, :8], 8, 4, 2)  # [M, 16]
    high = _bits(packed[:, 8:], 4, 2, 4)
    sc = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    s = _f16(b, 108) * sc  # [M, 16]
    ql = _bits(qs, 32, 2, 4)
    qh = _bits(hmask, 32, 1, 8)
    codes = ql | (qh << 2)  # ql - 4 (1 - qh) + 4
    return codes, s, s * np.float32(-4.0)


def _q4_k(b: np.ndarray) -> Decoded:
    sc, mins = _k_scale_min(b[:, 4:16])
    return _nibbles(b[:, 16:], 32), _f16(b, 0) * sc, -(_f16(b, 2) * mins)


def _q5_k(b: np.ndarray) -> Decoded:
    sc, mins = _k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 32, 1, 8) << 4)
    return q.astype(np.int8), _f16(b, 0) * sc, -(_f16(b, 2) * mins)


def _q6_k(b: np.ndarray) -> Decoded:
    ql = _nibbles(b[:, :128], 64)
    qh = _bits(b[:, 128:192], 32, 2, 4)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    scales = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q, _f16(b, 208) * scales, None


def _iq4_nl(b: np.ndarray) -> Decoded:
    return IQ4_VALUES[_nibbles(b[:, 2:], 16)], _f16(b, 0), None


def _iq4_xs(b: np.ndarray) -> Decoded:
    packed = b[:, 2:4].copy().view(np.uint16)
    high = (packed >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)) & 0x03
    low = (b[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)) & 0x0F
    sc = (low.reshape(-1, 8) | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    return IQ4_VALUES[_nibbles(b[:, 8:], 16)], _f16(b, 0) * sc.astype(np.float32), None


# type name -> (values per block, bytes per block, bits kept, group, decoder)
GGUF_TYPES: dict[str, tuple[int, int, int, int, Callable[[np.ndarray], Decoded]]] = {
    "Q4_0": (32, 18, 4, 32, _q4_0),
    "Q4_1": (32, 20, 4, 32, _q4_1),
    "Q5_0": (32, 22, 8, 32, _q5_0),
    "Q5_1": (32, 24, 8, 32, _q5_1),
    "Q8_0": (32, 34, 8, 32, _q8_0),
    "Q2_K": (QK_K, 84, 4, 16, _q2_k),
    "Q3_K": (QK_K, 110, 4, 16, _q3_k),
    "Q4_K": (QK_K, 144, 4, 32, _q4_k),
    "Q5_K": (QK_K, 176, 8, 32, _q5_k),
    "Q6_K": (QK_K, 210, 8, 16, _q6_k),
    "IQ4_NL": (32, 18, 8, 32, _iq4_nl),
    "IQ4_XS": (QK_K, 136, 8, 32, _iq4_xs),
}
DENSE_TYPES = ("F32", "F16", "BF16")


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Decode the blocks ``raw`` (uint8, ``N * K / B`` blocks in row order) of ``type_name``
    into a matrix ``shape = (N, K)``, exactly (module docstring's table)."""
    if type_name not in GGUF_TYPES:
        raise ValueError(f"type_name: expected one of {sorted(GGUF_TYPES)}, got {type_name!r}")
    per_block, block_bytes, bits, group, decode = GGUF_TYPES[type_name]
    rows, cols = shape
    if cols % per_block or cols % GROUP_SIZE:
        raise ValueError(
            f"shape: {cols} columns is not a multiple of {type_name}'s block of {per_block}"
        )
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    if blocks.shape[0] != rows * cols // per_block:
        raise ValueError(f"raw: expected {rows * cols // per_block} blocks, got {blocks.shape[0]}")
    codes, scales, offsets = decode(blocks)
    groups = cols // group
    scales_t = torch.from_numpy(np.ascontiguousarray(scales, np.float32).reshape(rows, groups))
    offsets_t = None
    if offsets is not None:
        offsets = np.ascontiguousarray(offsets, np.float32).reshape(rows, groups)
        offsets_t = torch.from_numpy(offsets)
    codes = codes.reshape(rows, cols)
    if bits == 8:
        return QuantizedWeight(
            torch.from_numpy(np.ascontiguousarray(codes, np.int8)), scales_t, offsets_t, 8, group
        )
    codes = codes.astype(np.uint8)
    packed = np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))
    return QuantizedWeight(torch.from_numpy(packed), scales_t, offsets_t, 4, group)


@dataclass(frozen=True, slots=True)
class GGUFPart:
    """One GGUF tensor still in the file: its blocks (a view of the mapped file, untouched until
    read) and, for llama.cpp's permuted q/k, the row order that undoes the permutation."""

    name: str  # the tensor's GGUF name, for errors
    type_name: str  # a key of ``GGUF_TYPES``
    blocks: np.ndarray  # uint8, the tensor's bytes (``N * K / B`` blocks in row order)
    shape: tuple[int, int]  # (N, K)
    order: np.ndarray | None = None  # int64 [N]: row i of the matrix is row order[i]; None: i


@dataclass(frozen=True, slots=True)
class GGUFMatrix:
    """A matrix read from a GGUF file on demand: its parts stacked along the rows (q, k, v into
    one projection), each of its own type."""

    parts: tuple[GGUFPart, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @staticmethod
    def stack(matrices: list[GGUFMatrix]) -> GGUFMatrix:
        """The matrices' rows one after the other; raises ValueError where columns differ."""
        parts = tuple(p for m in matrices for p in m.parts)
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"stack: parts of different widths {[p.shape for p in parts]}")
        return GGUFMatrix(parts)

    def decode(self) -> QuantizedWeight:
        """The matrix decoded in numpy (``from_gguf_blocks``, rows reordered, ``cat_rows``):
        the reference the packing in C (``gguf_pack``) is equal to."""
        decoded = []
        for part in self.parts:
            weight = from_gguf_blocks(part.blocks, part.type_name, part.shape)
            if part.order is not None:
                weight = weight.select_rows(torch.from_numpy(part.order))
            decoded.append(weight)
        return decoded[0] if len(decoded) == 1 else cat_rows(decoded)
