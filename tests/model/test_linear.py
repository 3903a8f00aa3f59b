"""``PackedLinear`` against ``F.linear``, prepacked and plain."""

from __future__ import annotations

import pytest
import torch

from hybridspec.model.linear import PackedLinear


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a CPU weight of ``dtype``: bfloat16 needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, which an AVX2 CPU lacks."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 9, 70])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    packed = PackedLinear(weight, prepack=True)
    if onednn_packs(dtype):
        assert packed.packed is not None and packed.weight is None
    else:  # plain F.linear, the weight kept as it is
        assert packed.packed is None and packed.weight is weight
    expected = torch.nn.functional.linear(x.float(), weight.float())
    tolerance = 1e-5 if dtype == torch.float32 else 0.05  # bfloat16 output rounding, |y| ~ 8
    torch.testing.assert_close(packed(x).float(), expected, atol=tolerance, rtol=0.01)
    plain = PackedLinear(weight, prepack=False)
    assert plain.packed is None
    torch.testing.assert_close(plain(x).float(), expected, atol=tolerance, rtol=0.01)


@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="needs oneDNN's bfloat16 path")
def test_packed_linear_two_rows_padded_to_three_give_the_same_rows() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    x = torch.randn(2, 64, generator=generator).bfloat16()
    packed = PackedLinear(weight, prepack=True)
    assert torch.equal(packed(x), packed._packed(x))
