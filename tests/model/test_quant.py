"""Group-quantized weights: GGUF blocks decoded exactly, quantization at load, row operations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from hybridspec.model.gguf import permute_qk, unpermute_qk, unpermute_qk_rows
from hybridspec.model.loader import embedded_model_path
from hybridspec.model.quant import QuantizedWeight, cat_rows, from_gguf_blocks, quantize


def gguf_reference(raw: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int]):
    return torch.from_numpy(np.array(dequantize(raw, kind), dtype=np.float32).reshape(shape))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
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
    with pytest.raises(ValueError, match="one quantization scheme"):
        cat_rows([a, quantize(torch.randn(8, 32), 8)])


def test_bad_input_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(4, 32), 3)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), 4)
    with pytest.raises(ValueError, match="type_name"):
        from_gguf_blocks(np.zeros((1, 18), np.uint8), "Q5_K", (1, 32))
    with pytest.raises(ValueError, match="codes"):
        QuantizedWeight(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 1), None, 4)
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2), None, 4)
