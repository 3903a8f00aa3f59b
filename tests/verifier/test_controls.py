"""The sampling controls on hand-built logits: the documented semantics, the position of each
verify row, and what requests without controls cost (nothing)."""

from __future__ import annotations

import pytest
import torch

from hybridspec.errors import InvalidRequestError
from hybridspec.types import SamplingParams, TokenHistory
from hybridspec.verifier import (
    DraftLayout,
    VerifyInput,
    apply_controls,
    check_logit_bias,
    verify,
)

VOCAB = 10
PLAIN = SamplingParams(temperature=1.0)


def test_worked_example_of_the_module_docstring() -> None:
    """Prompt [5, 6], generated [7, 7], drafts [8, 7, 9]: penalties and min_tokens per row."""
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0, min_tokens=4)
    history = TokenHistory([5, 6, 7, 7], 2, frozenset({9}))
    out = apply_controls(
        torch.zeros(4, VOCAB), [params], [history], [[8, 7, 9]], DraftLayout.from_counts([3])
    )
    expected = torch.zeros(4, VOCAB)
    expected[:, 7] = torch.tensor([-2.0, -2.0, -2.5, -2.5])  # 2, 2, 3, 3 times generated
    expected[1:, 8] = -1.5  # after d_1 = 8
    expected[3, 9] = -1.5  # after d_3 = 9
    expected[:2, 9] = float("-inf")  # 2 and 3 generated, fewer than 4: the stop token masked
    assert torch.equal(out, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0.0, 2.0]])
    history = TokenHistory([0, 1, 4], 2, frozenset())  # prompt 0 1, generated 4
    out = apply_controls(logits, [SamplingParams(repetition_penalty=2.0)], [history], [[]])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.0, 2.0]]
    # A draft counts as seen at the rows after it.
    out = apply_controls(
        logits.repeat(2, 1),
        [SamplingParams(repetition_penalty=2.0)],
        [history],
        [[5]],
        DraftLayout.from_counts([1]),
    )
    assert out[:, 5].tolist() == [2.0, 1.0]


def test_presence_and_frequency_count_generated_tokens_only() -> None:
    history = TokenHistory([3, 3, 3, 4], 3, frozenset())  # 3 only in the prompt
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    out = apply_controls(torch.zeros(1, VOCAB), [params], [history], [[]])
    assert out[0, 3] == 0 and out[0, 4] == -2.0


def test_logit_bias_adds_to_the_logits() -> None:
    params = SamplingParams(logit_bias=((1, 2.5), (3, -100.0)))
    out = apply_controls(
        torch.ones(2, 4), [params], [TokenHistory([0], 1)], [[2]], DraftLayout.from_counts([1])
    )
    assert out.tolist() == [[1.0, 3.5, 1.0, -99.0]] * 2


def test_one_row_per_sequence_follows_all_its_drafts() -> None:
    """A proposer's next position (no layout: one row) is the verifier's last row."""
    params = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.5, min_tokens=3)
    history = TokenHistory([1, 2, 2], 2, frozenset({0}))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    rows = apply_controls(logits, [params], [history], [[2, 5, 2]], DraftLayout.from_counts([3]))
    last = apply_controls(logits[3:], [params], [history], [[2, 5, 2]])
    assert torch.equal(rows[3:], last)


def test_requests_without_controls_cost_nothing_and_keep_their_rows() -> None:
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1))
    layout = DraftLayout.from_counts([2, 3])
    assert apply_controls(logits, [PLAIN, PLAIN], [None, None], [[1, 2], [3, 4, 5]]) is logits
    params = SamplingParams(presence_penalty=1.0)
    history = TokenHistory([1, 1], 1)  # generated [1]
    out = apply_controls(logits, [PLAIN, params], [None, history], [[1, 2], [3, 4, 5]], layout)
    assert torch.equal(out[:3], logits[:3])  # the first sequence's rows
    assert out[3, 1] == logits[3, 1] - 1 and out[3, 3] == logits[3, 3]
    assert out[4, 3] == logits[4, 3] - 1  # after its first draft


def test_half_precision_logits_come_back_in_float32() -> None:
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    params = SamplingParams(logit_bias=((0, 1.0),))
    out = apply_controls(
        logits, [params], [TokenHistory([0], 1)], [[1]], DraftLayout.from_counts([1])
    )
    assert out.dtype == torch.float32
    assert torch.equal(out[:, 1:], logits[:, 1:].float())


def test_a_controlled_sequence_needs_its_history() -> None:
    with pytest.raises(InvalidRequestError, match="histories"):
        apply_controls(torch.zeros(1, VOCAB), [SamplingParams(min_tokens=1)], [None], [[]])


def test_logit_bias_ids_must_be_in_the_vocabulary() -> None:
    check_logit_bias(SamplingParams(logit_bias=((VOCAB - 1, 1.0),)), VOCAB)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        check_logit_bias(SamplingParams(logit_bias=((VOCAB, 1.0),)), VOCAB)


def test_greedy_verification_takes_the_argmax_of_the_controlled_logits() -> None:
    """Drafts [4, 4]: the presence penalty makes 4 lose the argmax at the row after the first,
    so the second draft is rejected and replaced by the runner-up."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 4], logits[:, 6] = 2.0, 1.5
    params = SamplingParams(presence_penalty=1.0)
    out = verify(
        VerifyInput(
            draft_token_ids=torch.tensor([4, 4]),
            layout=DraftLayout.from_counts([2]),
            draft_probs=[None],
            target_logits=logits,
            sampling=[params],
            generators=[None],
            histories=[TokenHistory([1, 2], 2)],
        )
    )
    assert out.output_token_ids == [[4, 6]]
    assert out.controlled_logits is not None and out.controlled_logits[1, 4] == 1.0
    plain = verify(
        VerifyInput(
            draft_token_ids=torch.tensor([4, 4]),
            layout=DraftLayout.from_counts([2]),
            draft_probs=[None],
            target_logits=logits,
            sampling=[SamplingParams()],
            generators=[None],
        )
    )
    assert plain.output_token_ids == [[4, 4, 4]] and plain.controlled_logits is None
