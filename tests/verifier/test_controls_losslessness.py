"""Exact losslessness of every sampling control through ``verify()``, with drafts of length 3.

The law of a 4-token continuation under speculative decoding is computed exactly, not sampled.
Target and draft are Markov chains over 4 tokens (the next token's logits depend on the previous
token), made history-dependent by the controls. Every round enumerates its drafts (all draft
sequences, weighted by q, for a sampling draft; the draft chain's argmax for a deterministic
one), and ``verify()`` itself decides each: its random draws are replaced by the test
(``Forced``), which reads the acceptance probabilities and the final token's distribution that
verify() computed, and makes it return each possible number of accepted drafts in turn. The
result must equal the target's law built position by position from the true history (no
drafts): a verifier that counted the drafted prefix wrongly at any row would not match.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from hybridspec.types import SamplingParams, TokenHistory
from hybridspec.verifier import DraftLayout, VerifyInput, apply_controls, logits_to_probs, verify
from hybridspec.verifier.acceptance import accept_probability
from hybridspec.verifier.uniforms import KeyedUniforms

verify_module = importlib.import_module("hybridspec.verifier.verify")

VOCAB = 4
LENGTH = 4
MAX_DRAFTS = 3
PROMPT = (0, 1)
EOS = 3
STOPS = frozenset({EOS})
TOLERANCE = 1e-6
TARGET_LOGITS = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(21)) * 1.5
DRAFT_LOGITS = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(22)) * 1.5

CONTROLS = {
    "presence": SamplingParams(temperature=1.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=1.0, frequency_penalty=1.2),
    "negative-frequency": SamplingParams(temperature=1.0, frequency_penalty=-0.8),
    "repetition": SamplingParams(temperature=1.0, repetition_penalty=1.8),
    "logit-bias": SamplingParams(temperature=1.0, logit_bias=((0, -2.0), (2, 1.5))),
    "min-p": SamplingParams(temperature=0.8, min_p=0.2),
    "min-tokens": SamplingParams(temperature=1.0, min_tokens=2),
    "all": SamplingParams(
        temperature=0.8,
        top_k=3,
        top_p=0.95,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
        logit_bias=((1, 0.5),),
        min_p=0.05,
        min_tokens=3,
    ),
}


def history(tokens: tuple[int, ...]) -> TokenHistory:
    return TokenHistory(tokens, len(PROMPT), STOPS)


@functools.cache
def next_probs(chain: str, params: SamplingParams, context: tuple[int, ...]) -> torch.Tensor:
    """[VOCAB] float64: the ``chain``'s (target or draft) next-token distribution after
    ``context`` (prompt and generated), under the controls counted on ``context`` itself."""
    table = TARGET_LOGITS if chain == "target" else DRAFT_LOGITS
    logits = apply_controls(table[context[-1]].unsqueeze(0), [params], [history(context)], [[]])
    return logits_to_probs(logits, params)[0].double()


def target_law(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The exact law of the first LENGTH generated tokens, one position at a time."""
    law: dict[tuple[int, ...], float] = {}
    for tokens in itertools.product(range(VOCAB), repeat=LENGTH):
        weight = 1.0
        for i, token in enumerate(tokens):
            weight *= float(next_probs("target", params, PROMPT + tokens[:i])[token])
        if weight > 0:
            law[tokens] = weight
    return law


@dataclass
class Forced:
    """Stands in for verify()'s random draws: returns ``num_accepted`` (sampled sequences) or
    ``tokens`` (keyed ones), and records what verify() would have drawn from."""

    num_accepted: int = 0
    tokens: list[int] = field(default_factory=list)
    accept: torch.Tensor | None = None  # [k] acceptance probability of each draft
    final: list[torch.Tensor] = field(default_factory=list)  # each distribution sampled

    def rejection_accept(
        self, p_at: torch.Tensor, q_at: torch.Tensor | None, uniforms: object, layout: object
    ) -> torch.Tensor:
        self.accept = accept_probability(p_at, q_at).double()
        return torch.tensor([self.num_accepted])

    def sample_from_probs(self, probs: torch.Tensor, uniforms: object) -> torch.Tensor:
        row = probs[0].double()
        self.final.append(row / row.sum())
        return torch.tensor([self.tokens[len(self.final) - 1] if self.tokens else 0])


def draft_choices(
    params: SamplingParams, context: tuple[int, ...], k: int, sampled: bool
) -> Iterator[tuple[tuple[int, ...], float, torch.Tensor | None]]:
    """(drafts, their probability, q [k, VOCAB] or None) of one round after ``context``.

    A sampling draft's q at draft j is its chain under the controls counted on the context and
    d_1 .. d_{j-1}, as ``proposers.draft`` computes it; a deterministic draft follows the draft
    chain's raw argmax."""
    if not sampled:
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(int(DRAFT_LOGITS[(context + tuple(drafts))[-1]].argmax()))
        yield tuple(drafts), 1.0, None
        return
    for drafts in itertools.product(range(VOCAB), repeat=k):
        rows = [next_probs("draft", params, context + drafts[:j]) for j in range(k)]
        weight = 1.0
        for q, d in zip(rows, drafts, strict=True):
            weight *= float(q[d])
        if weight > 0:
            yield drafts, weight, torch.stack(rows).float() if k else None


def round_law(
    monkeypatch: pytest.MonkeyPatch,
    params: SamplingParams,
    context: tuple[int, ...],
    drafts: tuple[int, ...],
    q: torch.Tensor | None,
    keyed: bool,
) -> dict[tuple[int, ...], float]:
    """The exact law of the tokens one verify() round commits after ``context``."""
    k = len(drafts)
    forced = Forced()
    monkeypatch.setattr(verify_module, "rejection_accept", forced.rejection_accept)
    monkeypatch.setattr(verify_module, "sample_from_probs", forced.sample_from_probs)

    def run() -> None:
        verify(
            VerifyInput(
                draft_token_ids=torch.tensor(drafts, dtype=torch.long),
                layout=DraftLayout.from_counts([k]),
                draft_probs=[q],
                target_logits=TARGET_LOGITS[torch.tensor((context[-1], *drafts))],
                sampling=[params],
                generators=[torch.Generator()],
                keyed=[KeyedUniforms(0, len(context)) if keyed else None],
                histories=[history(context)],
            )
        )

    law: dict[tuple[int, ...], float] = defaultdict(float)
    if keyed:  # every draft accepted records p at every row; any other path stops earlier
        forced.tokens = [*drafts, 0]
        run()
        prefix = 1.0
        for n, p in enumerate(forced.final):
            for x in range(VOCAB):
                if n == k or x != drafts[n]:
                    law[(*drafts[:n], x)] += prefix * float(p[x])
            prefix *= float(p[drafts[n]]) if n < k else 0.0
        return law
    for n in range(k + 1):
        forced.num_accepted, forced.final = n, []
        run()
        assert forced.accept is not None
        reached = float(forced.accept[:n].prod()) * (1 - float(forced.accept[n]) if n < k else 1)
        for x in range(VOCAB):
            law[(*drafts[:n], x)] += reached * float(forced.final[0][x])
    return law


def speculative_law(
    monkeypatch: pytest.MonkeyPatch, params: SamplingParams, sampled: bool, keyed: bool
) -> dict[tuple[int, ...], float]:
    """The exact law of the first LENGTH tokens generated round by round through verify().

    What follows a generated prefix depends on that prefix alone, so the law of its rest is
    computed once per prefix (at most 85) and shared by every path of rounds that commits it:
    verify() decides each round of each prefix once, instead of once per path reaching it."""

    @functools.cache
    def rest_law(generated: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        """The law of the tokens after ``generated`` up to LENGTH, by the rounds that follow."""
        if len(generated) == LENGTH:
            return {(): 1.0}
        law: dict[tuple[int, ...], float] = defaultdict(float)
        k = min(MAX_DRAFTS, LENGTH - len(generated) - 1)
        context = PROMPT + generated
        for drafts, q_weight, q in draft_choices(params, context, k, sampled):
            for tokens, p in round_law(monkeypatch, params, context, drafts, q, keyed).items():
                if p > 0:
                    for rest, r in rest_law(generated + tokens).items():
                        law[tokens + rest] += q_weight * p * r
        return law

    return rest_law(())


def assert_same_law(got: dict[tuple[int, ...], float], expected: dict[tuple[int, ...], float]):
    for tokens in set(got) | set(expected):
        assert got.get(tokens, 0.0) == pytest.approx(expected.get(tokens, 0.0), abs=TOLERANCE), (
            tokens
        )


@pytest.mark.parametrize(
    ("sampled", "keyed"),
    [(True, False), (False, False), (False, True)],
    ids=["q", "one-hot", "keyed"],
)
@pytest.mark.parametrize("control", list(CONTROLS))
def test_each_control_is_exact_with_three_drafts(
    monkeypatch: pytest.MonkeyPatch, control: str, sampled: bool, keyed: bool
) -> None:
    params = CONTROLS[control]
    assert_same_law(speculative_law(monkeypatch, params, sampled, keyed), target_law(params))


def test_the_controls_change_the_law() -> None:
    """The cases above are not vacuous: each control moves the target's law."""
    plain = target_law(SamplingParams(temperature=1.0))
    for name, params in CONTROLS.items():
        if name in ("min-p", "all"):
            continue  # another temperature: compared with its own plain law below
        law = target_law(params)
        assert max(abs(law.get(t, 0.0) - plain.get(t, 0.0)) for t in plain) > 0.01, name
    cooler = target_law(SamplingParams(temperature=0.8))
    assert max(abs(target_law(CONTROLS["min-p"]).get(t, 0.0) - p) for t, p in cooler.items()) > 0.01
