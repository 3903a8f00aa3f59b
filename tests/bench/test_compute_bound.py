"""The int8 peak's wrapper and the compute bound's arithmetic (no timing asserted)."""

from __future__ import annotations

import pytest
import torch

from hybridspec.bench.compute_bound import ComputeBound, macs_per_row, peak_rate
from hybridspec.bench.oracle_table import best_ideal
from hybridspec.model import LlamaWeights, block_kernel
from tests.engine.tiny import tiny_loaded


@pytest.mark.skipif(block_kernel() is None, reason="no kernel library")
def test_peak_rate_is_positive_on_one_and_two_threads() -> None:
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rate = peak_rate(repeats=1)
            assert rate is not None and rate > 0
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="repeats"):
        peak_rate(repeats=0)


def test_macs_per_row_counts_every_matrix_once() -> None:
    weights = tiny_loaded(0).weights
    assert isinstance(weights, LlamaWeights)
    expected = weights.lm_head.shape[0] * weights.lm_head.shape[1]
    for layer in weights.layers:
        for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
            expected += m.shape[0] * m.shape[1]
    assert macs_per_row(weights) == expected


def test_bound_arithmetic_on_given_numbers() -> None:
    # 1 GMAC a row; a 50 ms decode; one more row 10 ms (100 GMAC/s) of a 200 GMAC/s peak
    bound = ComputeBound(10**9, 0.05, 0.01, 2e11, 2)
    assert bound.row_rate == pytest.approx(1e11)
    assert bound.peak_row_cost == pytest.approx(0.1)  # 5 ms of a 50 ms decode
    assert bound.verify_cost([1, 2, 3, 4]) == pytest.approx({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3})
    # alpha 0.7: E(3) = 1 + .7 + .49 + .343 = 2.533 over 1.3 = 1.949, the best of K = 1..3
    k, speedup = best_ideal(0.7, (1, 2, 3), bound.verify_cost(range(1, 5)))
    assert k == 3 and speedup == pytest.approx(2.533 / 1.3)
    line = bound.line({0.7: (k, speedup)})
    assert "1.00 GMAC per row" in line and "10.0 ms of a 50.0 ms decode" in line
    assert "100 GMAC/s, of an int8 peak of 200 GMAC/s (2 threads): 50%" in line
    assert "costs 0.100 of a decode" in line and "alpha 0.70 1.95x (K=3)" in line
    assert bound.to_dict()["peak_macs_per_s"] == 2e11
    assert "disturbed" not in line and "disturbed" in ComputeBound(1, 0.05, -0.001, 1.0, 1).line({})
