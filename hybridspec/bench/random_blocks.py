"""Random GGUF blocks written directly, and llama.cpp's choice of type for each tensor of a mix.

``random_blocks`` makes a ``[rows, cols]`` matrix's blocks of one GGML type from random codes
and float16 scales chosen so that the values have a given standard deviation and mean about 0,
without ever making the dense matrix (a tensor of an 8B model is written in the time its bytes
take). The value of each code, as ``gguf.quants`` decodes it (``model.gguf_blocks`` has the
table), and the scales chosen here (``s`` the wanted std; a K-quant's sub-block scale ``sc``
random in ``[32, 63]``, its min ``m = sc``):

| type | value | chosen |
| --- | --- | --- |
| Q4_0 | ``d (c - 8)``, c 0..15 | ``d = s / 4.61`` |
| Q4_1 | ``d c + m`` | ``m = -7.5 d`` |
| Q5_0 | ``d (c - 16)``, c 0..31 | ``d = s / 9.23`` |
| Q5_1 | ``d c + m`` | ``m = -15.5 d`` |
| Q8_0 | ``d c``, c -128..127 | ``d = s / 73.9`` |
| Q4_K | ``d sc c - dmin m`` | ``dmin = 7.5 d``: ``d sc (c - 7.5)`` |
| Q5_K | ``d sc c - dmin m``, c 0..31 | ``dmin = 15.5 d`` |
| Q6_K | ``d sc (c - 32)``, c 0..63 | ``sc`` int8 in ``[32, 63]`` |

``tensor_type`` is llama.cpp's ``llama_tensor_get_type`` (src/llama-quant.cpp) for the dense
families' tensors and the mixes named in ``MIXES``: Q4_K_M and Q5_K_M give ``attn_v`` and
``ffn_down`` Q6_K on the layers ``use_more_bits`` picks (the first and last eighth, every third
between), the output (or the tied embedding) Q6_K (Q8_0 stays Q8_0), and a 256-block type whose
row length is not a multiple of 256 falls back to a 32-block one (Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0), as in SmolLM2-135M's 576-wide matrices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256
# type: (values per block, bytes per block)
BLOCKS = {
    T.Q4_0: (32, 18),
    T.Q4_1: (32, 20),
    T.Q5_0: (32, 22),
    T.Q5_1: (32, 24),
    T.Q8_0: (32, 34),
    T.Q4_K: (QK_K, 144),
    T.Q5_K: (QK_K, 176),
    T.Q6_K: (QK_K, 210),
    T.F16: (1, 2),
    T.F32: (1, 4),
}
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
_SC_LOW, _SC_HIGH = 32, 63  # a K-quant's random sub-block scales
_SC_RMS = float(np.sqrt(np.mean(np.arange(_SC_LOW, _SC_HIGH + 1, dtype=np.float64) ** 2)))
_UNIFORM_STD = {16: 4.610, 32: 9.233, 64: 18.47, 256: 73.90}  # std of c uniform over n codes


@dataclass(frozen=True, slots=True)
class Mix:
    """One of llama.cpp's file types: its base type, ``general.file_type`` and bumps."""

    name: str
    base: T
    file_type: int  # llama_ftype
    more_bits: T | None = None  # attn_v and ffn_down on use_more_bits layers (the _M mixes)


MIXES = {
    mix.name: mix
    for mix in (
        Mix("F32", T.F32, 0),
        Mix("F16", T.F16, 1),
        Mix("Q4_0", T.Q4_0, 2),
        Mix("Q4_1", T.Q4_1, 3),
        Mix("Q8_0", T.Q8_0, 7),
        Mix("Q5_0", T.Q5_0, 8),
        Mix("Q5_1", T.Q5_1, 9),
        Mix("Q4_K_M", T.Q4_K, 15, more_bits=T.Q6_K),
        Mix("Q5_K_M", T.Q5_K, 17, more_bits=T.Q6_K),
        Mix("Q6_K", T.Q6_K, 18),
    )
}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's layers that get more bits in the _M mixes: 16 layers -> 0, 1, 4, 7, 10,
    13, 14, 15."""
    return (
        layer < num_layers // 8
        or layer >= 7 * num_layers // 8
        or (layer - num_layers // 8) % 3 == 2
    )


def tensor_type(mix: Mix, role: str, layer: int, num_layers: int, cols: int) -> T:
    """The type llama.cpp's quantizer gives a matrix of ``cols`` columns: ``role`` is its GGUF
    name without ``blk.N.`` and ``.weight`` ("output" also for a tied ``token_embd``)."""
    chosen = mix.base
    if mix.base in (T.F16, T.F32):
        return chosen
    if role == "output":
        if cols % BLOCKS[mix.base][0] != 0:
            return _fit(T.Q8_0, cols)
        chosen = mix.base if mix.base == T.Q8_0 else T.Q6_K
    elif role in ("attn_v", "ffn_down") and mix.more_bits and use_more_bits(layer, num_layers):
        chosen = mix.more_bits
    return _fit(chosen, cols)


def _fit(chosen: T, cols: int) -> T:
    """llama.cpp's fallback for a row length the type's block does not divide."""
    if cols % BLOCKS[chosen][0] == 0:
        return chosen
    fallback = _FALLBACK.get(chosen, chosen)
    return fallback if cols % BLOCKS[fallback][0] == 0 else T.F16


def tensor_nbytes(qtype: T, rows: int, cols: int) -> int:
    size, nbytes = BLOCKS[qtype]
    return rows * (cols // size) * nbytes


def random_blocks(
    qtype: T, rows: int, cols: int, std: float, rng: np.random.Generator
) -> np.ndarray:
    """A ``[rows, cols]`` matrix of ``qtype`` with values of standard deviation about ``std``:
    float16/float32 values, or ``uint8 [rows, cols / block * bytes]`` blocks (module table)."""
    if qtype in (T.F16, T.F32):
        dtype = np.float16 if qtype == T.F16 else np.float32
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(dtype)
    size, nbytes = BLOCKS[qtype]
    if cols % size:
        raise ValueError(f"cols: {qtype.name} needs a multiple of {size}, got {cols}")
    blocks = random_bytes(rows * (cols // size) * nbytes, rng).reshape(-1, nbytes)
    _SET_SCALES[qtype](blocks, std, rng)
    return blocks.reshape(rows, -1)


def random_bytes(count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` uniform random bytes: the bit generator's raw 64-bit words, the fastest numpy
    source (about 1 GB/s here, against 0.15 GB/s for ``integers`` over uint8)."""
    words = rng.bit_generator.random_raw((count + 7) // 8)
    return words.view(np.uint8)[:count]


def _put_f16(blocks: np.ndarray, start: int, value: float | np.floating) -> None:
    column = np.broadcast_to(np.asarray(value, np.float16), (blocks.shape[0],))
    blocks[:, start : start + 2] = column.reshape(-1, 1).view(np.uint8)


def _legacy(zero: float, codes: int, offset: bool) -> Callable[..., None]:
    """Q4_0/Q5_0/Q8_0 (``d (c - zero)``) and Q4_1/Q5_1 (``d c + m``, ``m = -zero d``)."""

    def set_scales(blocks: np.ndarray, std: float, rng: np.random.Generator) -> None:
        d = np.float16(std / _UNIFORM_STD[codes])
        _put_f16(blocks, 0, d)
        if offset:
            _put_f16(blocks, 2, -zero * float(d))

    return set_scales


def _k_scales(blocks: np.ndarray, rng: np.random.Generator) -> None:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales ``sc`` and mins ``m`` (bytes 4..15), with
    ``m = sc``: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (sc) and 4-7 (m), sub-blocks 4-7's
    low nibbles in bytes 8-11 and their top 2 bits in the top bits of bytes 0-7."""
    sc = rng.integers(_SC_LOW, _SC_HIGH + 1, (blocks.shape[0], 8), dtype=np.uint8)
    low, high = sc[:, :4], sc[:, 4:]
    first = low | ((high >> 4) << 6)
    blocks[:, 4:8] = first
    blocks[:, 8:12] = first
    blocks[:, 12:16] = (high & 0x0F) | ((high & 0x0F) << 4)


def _q4_k(blocks: np.ndarray, std: float, rng: np.random.Generator) -> None:
    d = np.float16(std / (_UNIFORM_STD[16] * _SC_RMS))
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, 7.5 * float(d))
    _k_scales(blocks, rng)


def _q5_k(blocks: np.ndarray, std: float, rng: np.random.Generator) -> None:
    d = np.float16(std / (_UNIFORM_STD[32] * _SC_RMS))
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, 15.5 * float(d))
    _k_scales(blocks, rng)


def _q6_k(blocks: np.ndarray, std: float, rng: np.random.Generator) -> None:
    """ql[128], qh[64], then 16 int8 scales and d at byte 208."""
    blocks[:, 192:208] = rng.integers(_SC_LOW, _SC_HIGH + 1, (blocks.shape[0], 16), np.uint8)
    _put_f16(blocks, 208, std / (_UNIFORM_STD[64] * _SC_RMS))


_SET_SCALES = {
    T.Q4_0: _legacy(8.0, 16, offset=False),
    T.Q4_1: _legacy(7.5, 16, offset=True),
    T.Q5_0: _legacy(16.0, 32, offset=False),
    T.Q5_1: _legacy(15.5, 32, offset=True),
    T.Q8_0: _legacy(0.0, 256, offset=False),
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
