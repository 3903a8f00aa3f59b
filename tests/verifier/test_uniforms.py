"""Position-keyed uniforms and the keyed verification of sampled sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.types import Proposal, SamplingParams
from hybridspec.verifier import VerifyInput, logits_to_probs, verify
from hybridspec.verifier.acceptance import sample_from_probs
from hybridspec.verifier.uniforms import KeyedUniforms, key_of, position_uniform, splitmix64

VOCAB_SIZE = 40
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)


def test_splitmix64_matches_the_reference_stream() -> None:
    # Vigna's splitmix64.c seeded with 0: its first three outputs.
    assert [splitmix64(0, i) for i in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]


def test_uniforms_are_in_range_and_look_uniform() -> None:
    u = torch.tensor([position_uniform(12345, p) for p in range(20000)], dtype=torch.float64)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    chi_square = float(((counts - 2000) ** 2 / 2000).sum())
    assert chi_square < 27.9  # 9 degrees of freedom, p = 0.001
    assert key_of(7) == key_of(7) != key_of(8)
    keyed = KeyedUniforms(5, 10)
    assert [keyed.uniform(o) for o in (2, 3, 4)] == [position_uniform(5, p) for p in (12, 13, 14)]


def expected_tokens(logits: torch.Tensor, params: SamplingParams, keyed: KeyedUniforms) -> list:
    """Each row's token: the inverse-CDF sample of p at its position's uniform."""
    probs = logits_to_probs(logits, params)
    u = torch.tensor([keyed.uniform(j) for j in range(logits.shape[0])], dtype=torch.float64)
    return sample_from_probs(probs, u).tolist()


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(0, 6),
    seed=st.integers(0, 10_000),
    key=st.integers(0, 2**64 - 1),
    position=st.integers(0, 5000),
    copied=st.integers(0, 6),
)
def test_keyed_tokens_are_the_position_samples_whatever_the_drafts(
    k: int, seed: int, key: int, position: int, copied: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, VOCAB_SIZE, generator=gen) * 2
    keyed = KeyedUniforms(key, position)
    tokens = expected_tokens(logits, SAMPLED, keyed)
    drafts = torch.randint(VOCAB_SIZE, (k,), generator=gen).tolist()
    drafts[: min(copied, k)] = tokens[: min(copied, k)]  # a prefix the target agrees with
    out = verify(VerifyInput.from_proposals([Proposal(drafts)], logits, [SAMPLED], keyed=[keyed]))
    n = int(out.num_accepted[0])
    assert out.output_token_ids[0] == tokens[: n + 1]
    assert drafts[:n] == tokens[:n]
    assert n == k or drafts[n] != tokens[n]


def test_a_draft_is_accepted_with_exactly_its_target_probability() -> None:
    """Over a grid of 2^16 uniforms, the draft is the sampled token on a share p(d)."""
    logits = torch.randn(1, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    probs = logits_to_probs(logits, SAMPLED)[0]
    grid = (torch.arange(2**16, dtype=torch.float64) + 0.5) / 2**16
    tokens = sample_from_probs(probs.expand(len(grid), -1), grid)
    for d in range(VOCAB_SIZE):
        share = float((tokens == d).double().mean())
        assert share == pytest.approx(float(probs[d]), abs=2 / 2**16)


@pytest.mark.parametrize("seed", [0, 1])
def test_keyed_greedy_and_generator_sequences_batched_equal_each_alone(seed: int) -> None:
    inp = VerifyInput.dummy(
        num_drafts=(3, 0, 5, 2, 4),
        vocab_size=VOCAB_SIZE,
        sampling=[SAMPLED, SAMPLED, SamplingParams(), SAMPLED, SAMPLED],
        probabilistic=[False, False, False, True, False],
        seed=seed,
    )
    keyed = [KeyedUniforms(key_of(seed + i), 7 * i) for i in range(inp.num_seqs)]
    keyed[4] = None  # a deterministic sequence without keys: the generator path
    batch = VerifyInput.from_proposals(
        [
            Proposal(inp.draft_token_ids[a:b].tolist(), inp.draft_probs[i])
            for i, (a, b) in enumerate(zip(*_bounds(inp), strict=True))
        ],
        inp.target_logits,
        inp.sampling,
        [torch.Generator().manual_seed(seed + i) for i in range(inp.num_seqs)],
        keyed,
    )
    out = verify(batch)
    starts, ends = _bounds(inp)
    for i in range(inp.num_seqs):
        rows = slice(starts[i] + i, ends[i] + i + 1)
        single = verify(
            VerifyInput.from_proposals(
                [Proposal(inp.draft_token_ids[starts[i] : ends[i]].tolist(), inp.draft_probs[i])],
                inp.target_logits[rows],
                [inp.sampling[i]],
                [torch.Generator().manual_seed(seed + i)],
                [keyed[i]],
            )
        )
        assert out.output_token_ids[i] == single.output_token_ids[0]
    # The keyed sequences' tokens are their position samples.
    for i in (0, 1):
        rows = slice(starts[i] + i, ends[i] + i + 1)
        tokens = expected_tokens(inp.target_logits[rows], SAMPLED, keyed[i])  # type: ignore[arg-type]
        assert out.output_token_ids[i] == tokens[: len(out.output_token_ids[i])]


def _bounds(inp: VerifyInput) -> tuple[list[int], list[int]]:
    cu = inp.cu_num_drafts.tolist()
    return cu[:-1], cu[1:]
