"""Group-quantized weights: GGUF blocks decoded exactly, quantization at load, row operations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from hybridspec.model.gguf import permute_qk, unpermute_qk, unpermute_qk_rows
from hybridspec.model.gguf_blocks import GGUF_TYPES, from_gguf_blocks
from hybridspec.model.loader import embedded_model_path
from hybridspec.model.quant import QuantizedWeight, cat_rows, quantize, widen


def gguf_reference(raw: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int]):
    return torch.from_numpy(np.array(dequantize(raw, kind), dtype=np.float32).reshape(shape))


# the byte offsets of each type's float16 fields (d, dmin or m), kept finite in random blocks
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_raw(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Blocks of random bytes (every code, scale and min pattern is a valid block) with finite
    float16 factors, ``[rows, bytes per row]``."""
    per_block, block_bytes = GGUF_TYPES[kind][:2]
    count = rows * cols // per_block
    gen = np.random.default_rng(seed)
    raw = gen.integers(0, 256, (count, block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        factor = (gen.standard_normal(count) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = factor.view(np.uint8).reshape(count, 2)
    return raw.reshape(rows, -1)


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> QuantizedWeight:
    return from_gguf_blocks(random_raw(kind, rows, cols, seed), kind, (rows, cols))


@pytest.mark.parametrize("kind", sorted(GGUF_TYPES))
def test_every_types_random_blocks_decode_as_gguf_dequantizes_them(kind: str) -> None:
    raw = random_raw(kind, 6, 512, seed=len(kind))
    weight = from_gguf_blocks(raw, kind, (6, 512))
    reference = gguf_reference(raw, GGMLQuantizationType[kind], (6, 512))
    assert torch.equal(weight.dequantize(), reference)
    assert weight.nbytes < 6 * 512 * 2  # never as large as bfloat16


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_decode_to_the_values_gguf_dequantizes_bit_for_bit(kind: str) -> None:
    gen = np.random.default_rng(0)
    dense = gen.standard_normal((48, 96)).astype(np.float32) * 0.05
    dense[3, :32] = 0.0  # a group of zeros: scale 0
    dense[5, 32:64] += 4.0  # an offset group
    qtype = GGMLQuantizationType[kind]
    raw = gguf_quantize(dense, qtype)
    weight = from_gguf_blocks(raw, kind, (48, 96))
    reference = gguf_reference(raw, qtype, (48, 96))
    assert torch.equal(weight.dequantize(), reference)
    index = torch.tensor([5, 0, 47])
    assert torch.equal(weight.dequantize_rows(index, torch.float32), reference[index])


def test_every_quantized_tensor_of_the_embedded_file_decodes_block_exactly() -> None:
    reader = GGUFReader(embedded_model_path())
    checked = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0") or not tensor.name.startswith(
            ("token_embd", "blk.0.", "blk.29.")
        ):
            continue
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))
        weight = from_gguf_blocks(tensor.data, kind, shape)
        reference = gguf_reference(tensor.data, tensor.tensor_type, shape)
        assert torch.equal(weight.dequantize(), reference), tensor.name
        checked.add(kind)
    assert checked == {"Q4_1", "Q8_0"}  # the embedded file's two quantized types


def test_rope_row_order_is_undone_on_codes_as_on_dense_rows() -> None:
    dense = torch.randn(64, 32)
    weight = quantize(permute_qk(dense, 4), 4)
    assert torch.equal(
        unpermute_qk_rows(weight, 4).dequantize(), unpermute_qk(weight.dequantize(), 4)
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_keeps_each_group_within_half_a_step(bits: int) -> None:
    dense = torch.randn(20, 64) * torch.linspace(0.01, 3, 20)[:, None]
    weight = quantize(dense, bits)
    assert weight.bits == bits and weight.shape == (20, 64)
    step = weight.scales.repeat_interleave(32, dim=1)
    error = (weight.dequantize() - dense).abs()
    # half a step of rounding, plus the float16 rounding of the scale (and offset) times codes
    slack = 1e-3 * dense.abs().amax(dim=1, keepdim=True)
    assert (error <= step / 2 + slack).all()


def test_four_bit_codes_are_kept_two_to_a_byte_in_column_order() -> None:
    values = torch.arange(16.0).repeat(3, 4)  # each group of 32: 0..15 twice, scale 1, offset 0
    weight = quantize(values, 4)
    assert weight.codes.shape == (3, 32) and weight.shape == (3, 64)
    assert weight.codes[0, :2].tolist() == [0 | 1 << 4, 2 | 3 << 4]  # columns 0, 1 and 2, 3
    assert torch.equal(weight.unpacked_codes(), values.to(torch.uint8))


def test_cat_rows_stacks_codes_scales_and_offsets() -> None:
    a, b = quantize(torch.randn(16, 32), 4), quantize(torch.randn(8, 32), 4)
    both = cat_rows([a, b])
    assert torch.equal(both.dequantize(), torch.cat((a.dequantize(), b.dequantize())))


def test_parts_of_different_types_stack_into_the_widest_scheme_value_for_value() -> None:
    """q and k as Q4_K, v as Q6_K (as a Q4_K_M file mixes them): one matrix of 8-bit codes in
    groups of 16 with offsets, every value unchanged."""
    q, k, v = (
        random_blocks(kind, rows, 256, seed)
        for kind, rows, seed in (("Q4_K", 32, 1), ("Q4_K", 16, 2), ("Q6_K", 16, 3))
    )
    both = cat_rows([q, k, v])
    assert (both.bits, both.group, both.offsets is not None) == (8, 16, True)
    parts = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(both.dequantize(), parts)
    with pytest.raises(ValueError, match="widen"):
        widen(v, 4, 16, True)  # 8-bit codes do not fit in 4 bits


def test_bad_input_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(4, 32), 3)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), 4)
    with pytest.raises(ValueError, match="type_name"):
        from_gguf_blocks(np.zeros((1, 18), np.uint8), "IQ2_XXS", (1, 32))
    with pytest.raises(ValueError, match="block of 256"):
        from_gguf_blocks(np.zeros((1, 144), np.uint8), "Q4_K", (1, 128))
    with pytest.raises(ValueError, match="codes"):
        QuantizedWeight(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 1), None, 4)
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2), None, 4)
