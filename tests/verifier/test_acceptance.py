"""Acceptance rules: exact losslessness computed from the real functions, and their bookkeeping.

The emitted distribution is computed exactly (not sampled) from the acceptance rule:
``P(x) = q(x) a(x) + (1 - sum_y q(y) a(y)) r(x)`` with ``a = accept_probability`` and ``r`` the
residual distribution, and must equal the target's p (after its sampling transforms).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.types import SamplingParams
from hybridspec.verifier import DraftLayout
from hybridspec.verifier.acceptance import (
    accept_probability,
    count_accepted,
    greedy_accept,
    one_hot_residual_probs,
    rejection_accept,
    residual_probs,
    sample_from_probs,
)
from hybridspec.verifier.sampling import logits_to_probs

TOLERANCE = 1e-6

# Logits on a grid of eighths in [-6, 6] (ties included); -49 stands for -inf, a masked token.
logit = st.integers(-49, 48).map(lambda n: -math.inf if n == -49 else n / 8)
transforms = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.4, 1.0, 1.6]),
    top_k=st.one_of(st.none(), st.integers(1, 8)),
    top_p=st.one_of(st.just(1.0), st.floats(0.1, 0.95)),
)


@st.composite
def distributions(draw: st.DrawFn, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft probs [rows, vocab_size] under one hypothesis-drawn sampling transform."""
    vocab_size = draw(st.integers(2, 8))
    params = draw(transforms)

    def probs() -> torch.Tensor:
        rows_of_logits = []
        for _ in range(rows):
            row = draw(st.lists(logit, min_size=vocab_size, max_size=vocab_size))
            if max(row) == -math.inf:
                row[0] = 0.0  # a row needs one finite logit
            rows_of_logits.append(row)
        return logits_to_probs(torch.tensor(rows_of_logits), params)

    return probs(), probs()


def emitted(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the first emitted token for a draft drawn from q; [V] float64."""
    kept = (q * accept_probability(p, q)).double()  # P(draft is x and is accepted)
    recovered = residual_probs(p.unsqueeze(0), q.unsqueeze(0))[0].double()
    return kept + (1 - kept.sum()) * recovered


def emitted_one_hot(p: torch.Tensor, draft: int) -> torch.Tensor:
    """Exact distribution of the first emitted token for the deterministic draft ``draft``."""
    accept = float(accept_probability(p[draft : draft + 1], None)[0])
    recovered = one_hot_residual_probs(p.unsqueeze(0), torch.tensor([draft]))[0].double()
    kept = torch.zeros_like(recovered)
    kept[draft] = accept
    return kept + (1 - accept) * recovered


@settings(deadline=None, max_examples=200)
@given(pq=distributions())
def test_probabilistic_draft_emits_the_target_distribution(
    pq: tuple[torch.Tensor, torch.Tensor],
) -> None:
    p, q = pq[0][0], pq[1][0]
    torch.testing.assert_close(emitted(p, q), p.double(), atol=TOLERANCE, rtol=0)


@settings(deadline=None, max_examples=200)
@given(pq=distributions())
def test_deterministic_draft_emits_the_target_distribution(
    pq: tuple[torch.Tensor, torch.Tensor],
) -> None:
    p = pq[0][0]
    for draft in range(p.shape[0]):  # whatever the draft, including tokens p gives 0
        torch.testing.assert_close(emitted_one_hot(p, draft), p.double(), atol=TOLERANCE, rtol=0)


@settings(deadline=None, max_examples=100)
@given(pq=distributions())
def test_one_hot_residual_equals_the_residual_of_a_one_hot_q(
    pq: tuple[torch.Tensor, torch.Tensor],
) -> None:
    p = pq[0]
    for draft in range(p.shape[1]):
        one_hot = torch.nn.functional.one_hot(torch.tensor([draft]), p.shape[1]).float()
        torch.testing.assert_close(
            one_hot_residual_probs(p, torch.tensor([draft])), residual_probs(p, one_hot)
        )


@st.composite
def two_step_case(draw: st.DrawFn) -> dict[str, object]:
    """A target and a draft over two steps: p1, q1 [V]; p2, q2 [V, V] (row x: after token x)."""
    p, q = draw(distributions(rows=1 + 8))
    vocab_size = p.shape[1]
    return {
        "p1": p[0],
        "p2": p[1 : 1 + vocab_size],
        "q1": q[0],
        "q2": q[1 : 1 + vocab_size],
        "num_drafts": draw(st.sampled_from([1, 2])),
        "first_draft": draw(st.integers(0, vocab_size - 1)),
        "second_drafts": draw(st.lists(st.integers(0, vocab_size - 1), min_size=8, max_size=8)),
    }


@settings(deadline=None, max_examples=150)
@given(case=two_step_case(), probabilistic=st.booleans())
def test_first_two_emitted_tokens_follow_the_target(
    case: dict[str, object], probabilistic: bool
) -> None:
    """Joint law of the first two committed tokens == p1(x) p2(y | x), computed exactly.

    Round 1 proposes d1 (and d2 after it when K = 2). If d1 is accepted, x = d1 and y comes
    from the same round: the verdict on d2 (K = 2) or the bonus token, drawn from p2(. | x)
    (K = 1). If d1 is rejected, x is the recovered token, the round ends, and y is the first
    token of the next round, proposed after x.
    """
    p1, p2, q1, q2 = (case[key] for key in ("p1", "p2", "q1", "q2"))
    assert isinstance(p1, torch.Tensor) and isinstance(p2, torch.Tensor)
    assert isinstance(q1, torch.Tensor) and isinstance(q2, torch.Tensor)
    second_drafts = case["second_drafts"]
    assert isinstance(second_drafts, list)
    vocab_size = p1.shape[0]

    # next_round[x]: the law of the first token emitted by a round proposed after x
    next_round = torch.stack(
        [
            emitted(p2[x], q2[x]) if probabilistic else emitted_one_hot(p2[x], second_drafts[x])
            for x in range(vocab_size)
        ]
    )
    if probabilistic:  # d1 ~ q1; the residual does not depend on d1
        first_drafts = [(d, float(q1[d])) for d in range(vocab_size) if q1[d] > 0]
        recovered = residual_probs(p1.unsqueeze(0), q1.unsqueeze(0))[0].double()
        accept = accept_probability(p1, q1).double()
    else:
        d = case["first_draft"]
        assert isinstance(d, int)
        first_drafts = [(d, 1.0)]
        recovered = one_hot_residual_probs(p1.unsqueeze(0), torch.tensor([d]))[0].double()
        accept = accept_probability(p1, None).double()  # [V]: p1(d) for a one-hot q
    joint = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for d1, weight in first_drafts:
        same_round = next_round[d1] if case["num_drafts"] == 2 else p2[d1].double()
        joint[d1] += weight * accept[d1] * same_round
        joint += weight * (1 - accept[d1]) * recovered.unsqueeze(1) * next_round
    expected = p1.double().unsqueeze(1) * p2.double()
    torch.testing.assert_close(joint, expected, atol=TOLERANCE, rtol=0)


def test_residual_when_p_equals_q_falls_back_to_p() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(residual_probs(p, p), p)
    got = one_hot_residual_probs(p[1:], torch.tensor([0]))
    assert torch.equal(got, p[1:])  # p(d) = 1: never rejected, and no NaN either way


def test_accept_probability_edges() -> None:
    p = torch.tensor([0.2, 0.0, 0.3, 0.6, 0.0])
    q = torch.tensor([0.4, 0.5, 0.0, 0.3, 0.0])
    assert accept_probability(p, q).tolist() == [0.5, 0.0, 1.0, 1.0, 1.0]
    assert torch.equal(accept_probability(p, None), p)


def test_sample_from_probs_gives_each_token_an_interval_of_its_mass() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0], [3.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    grid = 1 << 14
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    edges = torch.tensor([0.0, 1 - 2.0**-53], dtype=torch.float64)  # the extreme uniforms
    for row, expected in zip(
        probs, ([0, 0.25, 0, 0.5, 0.25, 0], [0.75, 0, 0.25, 0, 0, 0]), strict=True
    ):
        tokens = sample_from_probs(row.expand(grid, -1), u)
        share = torch.bincount(tokens, minlength=6).double() / grid
        assert share.tolist() == expected
        assert (row[sample_from_probs(row.expand(2, -1), edges)] > 0).all()


def test_layout_worked_example() -> None:
    layout = DraftLayout.from_counts([2, 0, 3], torch.device("cpu"))
    assert layout.seq_ids.tolist() == [0, 0, 2, 2, 2]
    assert layout.positions.tolist() == [0, 1, 0, 1, 2]
    assert layout.draft_rows.tolist() == [0, 1, 4, 5, 6]
    assert layout.first_rows.tolist() == [0, 3, 4]
    assert layout.bonus_rows.tolist() == [2, 3, 7]
    assert layout.offsets == (0, 2, 2, 5) and layout.row_offsets == (0, 3, 4, 8)
    assert layout.split([10, 11, 12, 13, 14]) == [[10, 11], [], [12, 13, 14]]
    sub, draft_index, row_index = layout.select([2, 1])
    assert sub.num_drafts == (3, 0) and draft_index == [2, 3, 4] and row_index == [4, 5, 6, 7, 3]
    assert sub.row_offsets == (0, 4, 5)


def test_count_accepted_stops_at_the_first_rejection() -> None:
    layout = DraftLayout.from_counts([3, 0, 2, 4], torch.device("cpu"))
    accepted = torch.tensor([True, False, True, True, True, False, True, True, True])
    assert count_accepted(accepted, layout).tolist() == [1, 0, 2, 0]
    empty = DraftLayout.from_counts([0, 0], torch.device("cpu"))
    assert count_accepted(torch.zeros(0, dtype=torch.bool), empty).tolist() == [0, 0]


def test_greedy_accept_recovers_or_adds_the_bonus() -> None:
    layout = DraftLayout.from_counts([2, 2, 0], torch.device("cpu"))
    target = torch.tensor([5, 6, 7, 5, 9, 4, 8])  # argmax per row: seq 0 rows 0-2, 1 rows 3-5
    drafts = torch.tensor([5, 6, 5, 6])
    num_accepted, final = greedy_accept(target, drafts, layout)
    assert num_accepted.tolist() == [2, 1, 0]
    assert final.tolist() == [7, 9, 8]  # bonus, recovered, plain decoding


def test_rejection_accept_compares_uniforms_with_the_ratio() -> None:
    layout = DraftLayout.from_counts([3], torch.device("cpu"))
    p, q = torch.tensor([0.3, 0.2, 0.9]), torch.tensor([0.6, 0.1, 0.9])  # ratios 0.5, 1, 1
    assert rejection_accept(p, q, torch.tensor([0.49, 0.99, 0.0], dtype=torch.float64), layout) == 3
    assert rejection_accept(p, q, torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64), layout) == 0
    assert (
        rejection_accept(p, None, torch.tensor([0.29, 0.21, 0.0], dtype=torch.float64), layout) == 1
    )
