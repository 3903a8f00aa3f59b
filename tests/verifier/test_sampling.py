"""Sampling transforms: temperature, top-k and top-p against a plain sort-based reference."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hybridspec.errors import InvalidRequestError
from hybridspec.types import SamplingParams
from hybridspec.verifier import sampling
from hybridspec.verifier.sampling import (
    greedy_token_ids,
    logits_to_logprobs,
    logits_to_probs,
    logits_to_probs_by_row,
)

VOCAB_SIZE = 49152


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """The documented semantics, one row, in float64 Python with a full sort."""
    scaled = [z / params.temperature for z in logits]
    if params.top_k is not None and params.top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[params.top_k - 1]
        scaled = [s if s >= kth else -math.inf for s in scaled]
    if params.min_p > 0:
        floor = max(scaled) + math.log(params.min_p)
        scaled = [s if s >= floor else -math.inf for s in scaled]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    probs = [w / sum(weights) for w in weights]
    if params.top_p < 1.0:
        running, threshold = 0.0, 0.0
        for value in sorted(probs, reverse=True):
            running += value
            threshold = value
            if running >= params.top_p:
                break
        probs = [p if p >= threshold else 0.0 for p in probs]
        probs = [p / sum(probs) for p in probs]
    return probs


def top_p_margin(logits: list[float], params: SamplingParams) -> float:
    """Distance from top_p to the nearest running mass (tiny margins flip by rounding)."""
    probs = reference_probs(
        logits, SamplingParams(temperature=params.temperature, top_k=params.top_k)
    )
    running, margin = 0.0, math.inf
    for value in sorted(probs, reverse=True):
        running += value
        margin = min(margin, abs(running - params.top_p))
    return margin


def sort_based_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by a full sort of float32 probabilities, as the docstring defines it."""
    ordered = probs.sort(dim=-1, descending=True).values
    last = (ordered.to(torch.float64).cumsum(dim=-1) < top_p).sum(dim=-1, keepdim=True)
    threshold = ordered.gather(1, last.clamp(max=probs.shape[1] - 1))
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


# Logits on a grid of quarters: exact ties happen (the tie rules get exercised), and distinct
# values stay distinct after any temperature in float32 as in float64.
grid_logits = st.lists(st.integers(-24, 24).map(lambda n: n / 4), min_size=2, max_size=12)
sampled_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.8]),
    top_k=st.one_of(st.none(), st.integers(1, 14)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 0.99)),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
)


def min_p_margin(logits: list[float], params: SamplingParams) -> float:
    """Distance from the min-p floor to the nearest scaled logit (ties flip by rounding)."""
    if params.min_p == 0:
        return math.inf
    scaled = [z / params.temperature for z in logits]
    floor = max(scaled) + math.log(params.min_p)
    return min(abs(s - floor) for s in scaled)


@pytest.mark.parametrize("prefix_size", [1, 64])  # 1 forces the bucketed path on most rows
@settings(deadline=None, max_examples=150)
@given(logits=grid_logits, params=sampled_params)
def test_matches_reference(prefix_size: int, logits: list[float], params: SamplingParams) -> None:
    assume(params.top_p == 1.0 or top_p_margin(logits, params) > 1e-6)
    assume(min_p_margin(logits, params) > 1e-5)
    expected = reference_probs(logits, params)
    with mock.patch.object(sampling, "_PREFIX_SIZE", prefix_size):
        got = logits_to_probs(torch.tensor([logits]), params)[0]
    assert got.dtype == torch.float32
    assert [p == 0 for p in got.tolist()] == [p == 0 for p in expected]
    torch.testing.assert_close(
        got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_min_p_drops_tokens_below_min_p_times_the_largest() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.25))[0]
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    only_max = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))[0]
    assert only_max.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=1))[0]
    assert probs.tolist() == [0.0, 0.5, 0.5, 0.0, 0.0]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))[0]
    assert (probs > 0).tolist() == [False, True, True, True, False]


def test_top_k_at_least_vocab_size_keeps_everything() -> None:
    logits = torch.randn(3, 6)
    plain = logits_to_probs(logits, SamplingParams(temperature=0.9))
    assert torch.equal(logits_to_probs(logits, SamplingParams(temperature=0.9, top_k=6)), plain)
    assert torch.equal(logits_to_probs(logits, SamplingParams(temperature=0.9, top_k=99)), plain)


def test_top_p_keeps_the_smallest_prefix_reaching_top_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for top_p, kept in [(0.45, 1), (0.55, 2), (0.79, 2), (0.81, 3), (0.96, 4)]:
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))[0]
        assert int((probs > 0).sum()) == kept, top_p
        assert abs(float(probs.sum()) - 1.0) < 1e-6


def test_top_p_keeps_ties_with_its_last_member_and_at_least_one_token() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))[0]
    assert (probs > 0).tolist() == [True, True, True, False]
    tiny = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))[0]
    assert tiny.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_p_applies_to_the_top_k_survivors() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # After top-k 2 the survivors are 4/7 and 3/7; top_p 0.5 keeps only the first.
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))[0]
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("scale", "temperature", "top_k", "top_p"),
    [
        (4.0, 0.8, None, 0.9),  # small nuclei: the top-64 prefix
        (1.0, 1.0, None, 0.9),  # nuclei of ~30000 tokens: the bucketed path
        (2.0, 0.2, None, 0.95),  # many probabilities underflow to exactly 0
        (1.0, 1.0, 2000, 0.5),  # top-k zeros and a nucleus beyond the prefix
        (3.0, 1.0, 50, 0.999999),  # top_p close to 1 after top-k
    ],
)
def test_large_vocabulary_matches_a_full_sort(
    scale: float, temperature: float, top_k: int | None, top_p: float
) -> None:
    logits = torch.randn(5, VOCAB_SIZE, generator=torch.Generator().manual_seed(7)) * scale
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    unfiltered = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k))
    expected = sort_based_top_p(unfiltered, top_p)
    got = logits_to_probs(logits, params)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, atol=1e-7, rtol=1e-6)


def test_by_row_equals_each_row_alone() -> None:
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(1)) * 3
    row_params = [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=100, top_p=0.3),
        SamplingParams(temperature=0.9, top_k=100, top_p=0.3, seed=4),  # same transform
        SamplingParams(temperature=2.0, top_k=1000),
        SamplingParams(temperature=0.7, min_p=0.1, top_p=0.9),
    ]
    got = logits_to_probs_by_row(logits, row_params)
    for i, params in enumerate(row_params):
        torch.testing.assert_close(got[i], logits_to_probs(logits[i : i + 1], params)[0])


def test_half_precision_logits_give_float32_probs() -> None:
    logits = torch.randn(2, 100).to(torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7, top_p=0.9))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2))


def test_greedy_is_the_argmax_with_ties_to_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 5.0]])
    assert greedy_token_ids(logits).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_greedy_over_any_float_dtype_is_torch_s_argmax(dtype: torch.dtype) -> None:
    """The CPU path (numpy over rows widened to float32) picks torch's index: ties (rounded
    logits, many equal) to the lowest id, values past float16's range, a NaN row to its first
    NaN, a strided view too."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 300, generator=generator) * 3).round()
    logits[32:] *= 30_000  # bfloat16 keeps them apart; a widening through float16 would not
    logits = logits.to(dtype)
    logits[3, 7] = logits[5, 0] = logits[5, 9] = float("nan")
    for view in (logits, logits[:, ::3]):
        got = greedy_token_ids(view)
        assert got.dtype == torch.int64
        assert torch.equal(got, view.argmax(dim=-1))


def test_logprobs_are_the_sampled_distribution_or_for_greedy_the_plain_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0], [0.0, 0.0, 1.0, 2.0, -3.0]])
    sampled = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    expected = torch.tensor([reference_probs(row, sampled) for row in logits.tolist()]).log()
    torch.testing.assert_close(logits_to_logprobs(logits, sampled), expected.float())
    assert logits_to_logprobs(logits, sampled)[0, 3].item() == -math.inf  # filtered by top-k
    for greedy in (SamplingParams(), SamplingParams(temperature=0.0, top_k=1, top_p=0.1)):
        torch.testing.assert_close(
            logits_to_logprobs(logits, greedy), torch.log_softmax(logits, dim=-1)
        )
    assert logits_to_logprobs(logits.half(), SamplingParams()).dtype == torch.float32


def test_bad_inputs_raise() -> None:
    with pytest.raises(InvalidRequestError, match="temperature 0 is greedy"):
        logits_to_probs(torch.zeros(1, 4), SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"logits: expected a float tensor \[num_rows"):
        logits_to_probs(torch.zeros(4), SamplingParams(temperature=1.0))
    with pytest.raises(InvalidRequestError, match="expected one SamplingParams per row"):
        logits_to_probs_by_row(torch.zeros(2, 4), [SamplingParams(temperature=1.0)])
