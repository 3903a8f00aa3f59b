"""The verify step on batches: greedy scenarios, mixed batches, seeded determinism, bad inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from hybridspec.errors import InvalidRequestError
from hybridspec.types import Proposal, SamplingParams
from hybridspec.verifier import DraftLayout, VerifyInput, VerifyOutput, logits_to_probs, verify
from hybridspec.verifier.acceptance import sample_from_probs

VOCAB_SIZE = 50
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)


def target_logits_with_argmax(argmax: list[list[int]], seed: int = 0) -> torch.Tensor:
    """Random logits [sum(len(a)), VOCAB_SIZE] whose row argmaxes are the given tokens."""
    rows = [t for tokens in argmax for t in tokens]
    logits = torch.randn(len(rows), VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
    return logits


def greedy_case(
    k: int, batch: int, first_mismatch: int | None, seed: int = 0
) -> tuple[VerifyInput, list[list[int]]]:
    """Each sequence's drafts copy its target argmaxes up to ``first_mismatch`` (None: all)."""
    gen = torch.Generator().manual_seed(seed)
    argmax = [torch.randint(VOCAB_SIZE, (k + 1,), generator=gen).tolist() for _ in range(batch)]
    proposals = []
    for tokens in argmax:
        drafts = tokens[:k]
        if first_mismatch is not None:
            drafts[first_mismatch] = (drafts[first_mismatch] + 1) % VOCAB_SIZE
            # later drafts that happen to match must not count
            drafts[first_mismatch + 1 :] = tokens[first_mismatch + 1 : k]
        proposals.append(Proposal(drafts))
    logits = target_logits_with_argmax(argmax, seed)
    inp = VerifyInput.from_proposals(proposals, logits, [GREEDY] * batch)
    return inp, argmax


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("batch", [1, 4])
def test_all_drafts_accepted_gives_bonus(k: int, batch: int) -> None:
    inp, argmax = greedy_case(k, batch, first_mismatch=None)
    out = verify(inp)
    assert out.num_accepted.tolist() == [k] * batch
    assert out.output_token_ids == argmax  # k drafts, then the bonus argmax of row k + 1


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("batch", [1, 4])
def test_first_draft_rejected(k: int, batch: int) -> None:
    inp, argmax = greedy_case(k, batch, first_mismatch=0)
    out = verify(inp)
    assert out.num_accepted.tolist() == [0] * batch
    assert out.output_token_ids == [[tokens[0]] for tokens in argmax]


@pytest.mark.parametrize("k", [2, 3, 8])
@pytest.mark.parametrize("batch", [1, 4])
def test_mismatch_midway(k: int, batch: int) -> None:
    j = k // 2
    inp, argmax = greedy_case(k, batch, first_mismatch=j)
    out = verify(inp)
    assert out.num_accepted.tolist() == [j] * batch
    assert out.output_token_ids == [tokens[: j + 1] for tokens in argmax]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_zero_drafts_is_plain_decoding(batch: int, params: SamplingParams) -> None:
    logits = torch.randn(batch, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    out = verify(VerifyInput.from_proposals([Proposal(())] * batch, logits, [params] * batch, gens))
    assert out.num_accepted.tolist() == [0] * batch
    if params.is_greedy:
        expected = logits.argmax(dim=-1).tolist()
    else:  # one uniform from each sequence's own generator, inverse-CDF into p
        u = torch.cat(
            [
                torch.rand(1, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                for i in range(batch)
            ]
        )
        expected = sample_from_probs(logits_to_probs(logits, params), u).tolist()
    assert out.output_token_ids == [[t] for t in expected]


def test_mixed_batch_lengths_keep_the_ragged_layout() -> None:
    argmax = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]  # k = 2, 0, 1, 3
    drafts = [[1, 2], [], [0], [7, 8, 0]]
    logits = target_logits_with_argmax(argmax)
    inp = VerifyInput.from_proposals([Proposal(d) for d in drafts], logits, [GREEDY] * 4)
    out = verify(inp)
    assert out.num_accepted.tolist() == [2, 0, 0, 2]
    assert out.output_token_ids == [[1, 2, 3], [4], [5], [7, 8, 9]]


@pytest.mark.parametrize("probabilistic", [False, True])
def test_top_k_1_sampling_matches_greedy(probabilistic: bool) -> None:
    """A one-hot p accepts exactly the argmax-matching drafts, whatever the uniforms."""
    for k, mismatch in [(4, None), (4, 0), (4, 2)]:
        greedy_inp, _ = greedy_case(k, 3, mismatch, seed=k + (mismatch or 0))
        params = SamplingParams(temperature=0.7, top_k=1)
        q: list[torch.Tensor | None] = [None] * 3
        if probabilistic:  # any q that gives each draft positive probability
            q = [logits_to_probs(torch.zeros(k, VOCAB_SIZE), SamplingParams(temperature=1.0))] * 3
        sampled = VerifyInput(
            greedy_inp.draft_token_ids,
            greedy_inp.layout,
            q,
            greedy_inp.target_logits,
            [params] * 3,
            [torch.Generator().manual_seed(i) for i in range(3)],
        )
        assert verify(sampled).output_token_ids == verify(greedy_inp).output_token_ids


def test_draft_equal_to_target_is_always_accepted() -> None:
    k, batch = 5, 6
    logits = torch.randn(batch * (k + 1), VOCAB_SIZE, generator=torch.Generator().manual_seed(4))
    p = logits_to_probs(logits, SAMPLED).view(batch, k + 1, VOCAB_SIZE)
    gen = torch.Generator().manual_seed(5)
    proposals = [
        Proposal(torch.multinomial(p[i, :k], 1, generator=gen).squeeze(1).tolist(), p[i, :k])
        for i in range(batch)
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    out = verify(VerifyInput.from_proposals(proposals, logits, [SAMPLED] * batch, gens))
    assert out.num_accepted.tolist() == [k] * batch
    for proposal, tokens in zip(proposals, out.output_token_ids, strict=True):
        assert tokens[:k] == list(proposal.token_ids)


def mixed_inputs(seed: int) -> VerifyInput:
    """Greedy and sampled sequences, one-hot and probabilistic drafts, k from 0 to 6."""
    return VerifyInput.dummy(
        num_drafts=[3, 0, 5, 2, 6, 1],
        vocab_size=VOCAB_SIZE,
        sampling=[GREEDY, SAMPLED, SAMPLED, GREEDY, SamplingParams(temperature=1.3), SAMPLED],
        probabilistic=[False, False, True, True, False, True],
        seed=seed,
    )


def alone(inp: VerifyInput, i: int, seed: int) -> VerifyOutput:
    """Sequence i of ``inp`` verified in a batch of its own, with a fresh generator."""
    offsets = inp.cu_num_drafts.tolist()
    return verify(
        VerifyInput(
            inp.draft_token_ids[offsets[i] : offsets[i + 1]],
            DraftLayout.from_counts([inp.num_drafts[i]]),
            [inp.draft_probs[i]],
            inp.target_logits[offsets[i] + i : offsets[i + 1] + i + 1],
            [inp.sampling[i]],
            [torch.Generator().manual_seed(seed)],
        )
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_equals_each_sequence_alone(seed: int) -> None:
    inp = mixed_inputs(seed)
    out = verify(inp)
    offsets = inp.cu_num_drafts.tolist()
    for i in range(inp.num_seqs):
        single = alone(inp, i, seed + i)  # dummy seeds sequence i's generator with seed + i
        assert out.output_token_ids[i] == single.output_token_ids[0]
        n = int(out.num_accepted[i])
        assert n == int(single.num_accepted[0])
        drafts = inp.draft_token_ids[offsets[i] : offsets[i + 1]].tolist()
        assert out.output_token_ids[i][:n] == drafts[:n]
        assert len(out.output_token_ids[i]) == n + 1


def test_same_seed_same_output_and_a_fixed_draw_count() -> None:
    first, second = verify(mixed_inputs(7)), verify(mixed_inputs(7))
    assert first.output_token_ids == second.output_token_ids
    assert torch.equal(first.num_accepted, second.num_accepted)
    inp = mixed_inputs(8)
    verify(inp)
    for i, (k, params) in enumerate(zip(inp.num_drafts, inp.sampling, strict=True)):
        reference = torch.Generator().manual_seed(8 + i)
        if not params.is_greedy:  # k + 1 uniforms, whatever was accepted; greedy draws none
            torch.rand(k + 1, generator=reference, dtype=torch.float64)
        gen = inp.generators[i]
        assert gen is not None
        assert torch.equal(gen.get_state(), reference.get_state())


def test_sampled_outputs_depend_on_the_generator_only() -> None:
    inp = mixed_inputs(0)
    outputs = []
    for seed in range(8):  # same inputs, other generators
        gens = [torch.Generator().manual_seed(100 * seed + i) for i in range(inp.num_seqs)]
        outputs.append(verify(dataclasses.replace(inp, generators=gens)).output_token_ids)
    for i, params in enumerate(inp.sampling):
        distinct = {str(out[i]) for out in outputs}
        assert len(distinct) == 1 if params.is_greedy else len(distinct) > 1


def test_from_proposals_flattens_in_order() -> None:
    logits = torch.zeros(6, 4)
    q = torch.full((2, 4), 0.25)
    inp = VerifyInput.from_proposals(
        [Proposal([1, 2], q), Proposal(()), Proposal([3])], logits, [SAMPLED] * 3
    )
    assert inp.draft_token_ids.tolist() == [1, 2, 3]
    assert inp.cu_num_drafts.tolist() == [0, 2, 2, 3]
    assert inp.num_drafts == (2, 0, 1)
    assert inp.draft_probs[0] is q and inp.draft_probs[2] is None
    assert list(inp.generators) == [None, None, None]


def make(
    draft_token_ids: Sequence[int] | torch.Tensor = (1, 2),
    cu: Sequence[int] | torch.Tensor = (0, 2),
    rows: int = 3,
    probs: list[torch.Tensor | None] | None = None,
    sampling: list[SamplingParams] | None = None,
) -> VerifyInput:
    """A one- or two-sequence input with one field broken by the caller."""
    num_seqs = len(cu) - 1
    return VerifyInput(
        torch.as_tensor(draft_token_ids, dtype=torch.long)
        if not isinstance(draft_token_ids, torch.Tensor)
        else draft_token_ids,
        DraftLayout.from_cu_num_drafts(
            torch.as_tensor(cu, dtype=torch.long) if not isinstance(cu, torch.Tensor) else cu
        ),
        probs if probs is not None else [None] * num_seqs,
        torch.randn(rows, 8),
        sampling if sampling is not None else [SAMPLED] * num_seqs,
        [None] * num_seqs,
    )


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"cu": torch.tensor([0, 2], dtype=torch.int32)}, "cu_num_drafts", "expected int64"),
        ({"cu": [1, 2]}, "cu_num_drafts", "starting at 0"),
        ({"cu": [0, 2, 1], "rows": 4}, "cu_num_drafts", "non-decreasing"),
        (
            {"cu": [0, 3], "rows": 4},
            "draft_token_ids",
            r"cu_num_drafts\[-1\] = 3 tokens, got 2",
        ),
        ({"rows": 4}, "target_logits", "2 \\+ 1 rows, got 4"),
        (
            {"draft_token_ids": [1, 8]},
            "draft_token_ids",
            r"token ids in \[0, 8\), got values in \[1, 8\]",
        ),
        ({"draft_token_ids": [-1, 0]}, "draft_token_ids", r"in \[0, 8\)"),
        ({"draft_token_ids": torch.tensor([1.0, 2.0])}, "draft_token_ids", "expected int64"),
        (
            {"probs": [torch.full((2, 7), 1 / 7)]},
            "draft_probs",
            r"sequence 0: expected a float tensor \[2, 8\]",
        ),
        ({"probs": [None, None]}, "draft_probs", r"one entry per sequence \(1\), got 2"),
        ({"sampling": [GREEDY, GREEDY]}, "sampling", r"one entry per sequence \(1\), got 2"),
        ({"sampling": ["greedy"]}, "sampling", "sequence 0: expected SamplingParams, got 'greedy'"),
    ],
)
def test_bad_inputs_raise(kwargs: dict[str, object], param: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        make(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            [0.5, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            "position 1: expected a row summing to 1 within",
        ),
        ([1.5, 0.1, -0.6, 0.0, 0.0, 0.0, 0.0, 0.0], "position 1: expected probabilities >= 0"),
        ([float("nan")] + [0.0] * 7, "position 1: expected a row summing to 1"),
        ([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], "position 1: the draft token has probability 0"),
    ],
)
def test_bad_draft_probs_raise_when_sampled(row: list[float], message: str) -> None:
    good = torch.full((8,), 1 / 8)
    probs = torch.stack([good, torch.tensor(row)])
    inp = make(probs=[probs])
    with pytest.raises(InvalidRequestError, match=f"draft_probs: sequence 0 {message}"):
        verify(inp)


def test_bad_draft_probs_name_their_sequence_and_position() -> None:
    good = torch.full((1, 8), 1 / 8)
    bad = torch.cat([good, torch.full((1, 8), 0.5)])
    inp = VerifyInput(
        torch.tensor([1, 2, 3]),
        DraftLayout.from_counts([1, 0, 2]),
        [good, good[:0], bad],
        torch.randn(6, 8),
        [SAMPLED] * 3,
        [None] * 3,
    )
    with pytest.raises(InvalidRequestError, match="sequence 2 position 1: expected a row summing"):
        verify(inp)


def test_bad_generator_raises() -> None:
    with pytest.raises(InvalidRequestError, match="sequence 0: expected a Generator, got 7"):
        generators: list[object] = [7]
        args = (
            torch.tensor([1]),
            DraftLayout.from_counts([1]),
            [None],
            torch.randn(2, 8),
            [SAMPLED],
        )
        VerifyInput(*args, generators)  # type: ignore[arg-type]
