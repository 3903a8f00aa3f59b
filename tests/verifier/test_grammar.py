"""Grammars as position-aware masks: the matcher's lookahead, and exact losslessness.

The exact-enumeration machinery of ``test_controls_losslessness`` is reused with a grammar as
the constraint of every history: the law of 4 tokens generated through ``verify()`` with
drafts of length 3 (sampled q under the same mask, one-hot drafts that the grammar may
forbid, keyed uniforms) must equal the target's law under the grammar, built position by
position. The grammar over the 4 raw tokens ``a b c d`` makes what may follow depend on the
text so far (``b`` must be followed by ``c``; ``c`` by ``b b``; ``d`` by ``a``).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import xgrammar as xgr

import tests.verifier.test_controls_losslessness as exact
from hybridspec.errors import InvalidRequestError
from hybridspec.types import GrammarSpec, SamplingParams, TokenHistory
from hybridspec.verifier import DraftLayout, apply_controls, logits_to_probs
from hybridspec.verifier.grammar import Grammars, GrammarState, allowed_tokens, bitmask_of
from tests.conftest import TINY_EOS, tiny_tokenizer

RAW_GRAMMAR = 'root ::= ("a" | "b" "c" | "c" "b" "b" | "d" "a")*'
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "cow"]}, "n": {"type": "integer"}},
    "required": ["kind", "n"],
    "additionalProperties": False,
}


@functools.cache
def raw_grammar() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(["a", "b", "c", "d"], vocab_type=xgr.VocabType.RAW, stop_token_ids=[])
    return xgr.GrammarCompiler(info).compile_grammar(RAW_GRAMMAR)


def raw_state(generated: tuple[int, ...], lenient: bool = False) -> GrammarState:
    """The matcher after ``generated``; ``lenient``: after its longest allowed start (the
    exact tests also build rows after text the grammar forbids, which weigh 0)."""
    state = GrammarState(raw_grammar(), None, exact.VOCAB)  # type: ignore[arg-type]  # no text
    state.commit(generated[: state.num_allowed(generated)] if lenient else generated)
    return state


@pytest.fixture
def grammar_histories(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every history of the exact tests carries the grammar at its committed position."""

    def history(tokens: tuple[int, ...]) -> TokenHistory:
        constraint = raw_state(tokens[len(exact.PROMPT) :], lenient=True)
        return TokenHistory(tokens, len(exact.PROMPT), exact.STOPS, constraint)

    monkeypatch.setattr(exact, "history", history)
    monkeypatch.setattr(exact, "next_probs", functools.cache(exact.next_probs.__wrapped__))


@pytest.mark.parametrize(
    ("sampled", "keyed"),
    [(True, False), (False, False), (False, True)],
    ids=["q", "one-hot", "keyed"],
)
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), exact.CONTROLS["all"]],
    ids=["grammar", "grammar-and-controls"],
)
def test_a_grammar_is_exact_with_three_drafts(
    monkeypatch: pytest.MonkeyPatch,
    grammar_histories: None,
    params: SamplingParams,
    sampled: bool,
    keyed: bool,
) -> None:
    law = exact.target_law(params)
    assert all(raw_state(()).num_allowed(tokens) == exact.LENGTH for tokens in law)
    exact.assert_same_law(exact.speculative_law(monkeypatch, params, sampled, keyed), law)


def test_the_grammar_changes_the_law(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = exact.target_law(SamplingParams(temperature=1.0))
    monkeypatch.setattr(exact, "next_probs", functools.cache(exact.next_probs.__wrapped__))
    monkeypatch.setattr(
        exact,
        "history",
        lambda tokens: TokenHistory(
            tokens,
            len(exact.PROMPT),
            exact.STOPS,
            raw_state(tokens[len(exact.PROMPT) :], lenient=True),
        ),
    )
    constrained = exact.target_law(SamplingParams(temperature=1.0))
    assert (1, 0, 0, 0) in plain and (1, 0, 0, 0) not in constrained  # b then a: forbidden
    assert len(constrained) < len(plain) / 2


# --- the matcher's lookahead ---------------------------------------------------------------


def test_mask_rows_follow_the_drafts_and_leave_the_matcher_where_it_was() -> None:
    state = raw_state((0,))
    logits = torch.zeros(4, exact.VOCAB)
    state.mask_(logits, [1, 2, 3])  # after "a": rows after "", "b", "bc", "bcd"
    allowed = (logits > float("-inf")).tolist()
    assert allowed == [
        [True, True, True, True],
        [False, False, True, False],  # b -> c
        [True, True, True, True],
        [True, False, False, False],  # d -> a
    ]
    assert state.num_allowed([1, 1]) == 1 and state.num_allowed([2, 1, 1, 3, 0]) == 5
    logits = torch.zeros(1, exact.VOCAB)
    state.mask_(logits, [2])  # one row, after "c": only b
    assert (logits > float("-inf")).tolist() == [[False, True, False, False]]


def test_rows_after_a_forbidden_draft_are_left_alone() -> None:
    logits = torch.zeros(4, exact.VOCAB)
    raw_state(()).mask_(logits, [1, 0, 3])  # "b a" is forbidden
    assert torch.isinf(logits[1]).tolist() == [True, True, False, True]
    assert not torch.isinf(logits[2:]).any()


def test_committing_a_forbidden_token_raises() -> None:
    with pytest.raises(RuntimeError, match="not allowed"):
        raw_state((1, 0))


def test_allowed_tokens_unpacks_xgrammar_bitmasks() -> None:
    bitmask = torch.tensor([[0b1010, -1]], dtype=torch.int32)
    allowed = allowed_tokens(bitmask, 40)
    assert allowed[0, :4].tolist() == [False, True, False, True]
    assert not allowed[0, 4:32].any() and allowed[0, 32:].all()
    row = bitmask_of([3, 31, 33], 40)
    assert allowed_tokens(row.unsqueeze(0), 40)[0].nonzero().flatten().tolist() == [3, 31, 33]


def test_past_the_end_only_stop_tokens_follow() -> None:
    """A request that ignores EOS goes on after the grammar's end: with stop tokens only."""
    tokenizer = grammars().tokenizer
    state = grammars().state(GrammarSpec("regex", "ab"))
    done = [*tokenizer.encode("ab", add_special_tokens=False), TINY_EOS]
    state.commit(done)
    logits = torch.zeros(3, len(tokenizer))
    state.mask_(logits, [TINY_EOS, TINY_EOS])
    assert (torch.isfinite(logits).nonzero()[:, 1] == TINY_EOS).all()
    assert torch.isfinite(logits).sum() == 3
    assert state.num_allowed([TINY_EOS, 97]) == 1
    state.commit([TINY_EOS])
    with pytest.raises(RuntimeError):
        state.commit([97])


def test_min_tokens_yields_where_the_grammar_allows_only_eos() -> None:
    state = grammars().state(GrammarSpec("regex", "a"))
    vocab = len(grammars().tokenizer)
    history = TokenHistory((1, 97), 1, frozenset({TINY_EOS}), state)
    params = SamplingParams(min_tokens=5)
    out = apply_controls(
        torch.zeros(2, vocab), [params], [history], [[97]], DraftLayout.from_counts([1])
    )
    assert out[0].argmax().item() == 97 and torch.isinf(out[0, TINY_EOS])  # EOS held back
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [TINY_EOS]  # only EOS: kept


# --- JSON with the suite's byte-level tokenizer ---------------------------------------------


@functools.cache
def grammars() -> Grammars:
    tokenizer = tiny_tokenizer()
    return Grammars(tokenizer, len(tokenizer), [TINY_EOS])


def test_forced_text_is_drafted_as_its_tokens() -> None:
    tokenizer = grammars().tokenizer
    state = grammars().state(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert tokenizer.decode(state.forced([], 64)) == '{"kind": "c'
    assert state.forced([], 3) == tokenizer.encode('{"k', add_special_tokens=False)
    after_cow = tokenizer.encode('{"kind": "co', add_special_tokens=False)
    assert tokenizer.decode(state.forced(after_cow, 64)) == 'w", "n": '
    state.commit(after_cow)
    assert tokenizer.decode(state.forced([], 64)) == 'w", "n": '
    assert state.forced(tokenizer.encode("x", add_special_tokens=False), 8) == []


def test_eos_is_allowed_once_the_json_is_whole() -> None:
    tokenizer = grammars().tokenizer
    state = grammars().state(GrammarSpec("json_object"))
    text = tokenizer.encode('{"a": [1, "x"]}', add_special_tokens=False)
    assert state.num_allowed(text) == len(text)
    logits = torch.zeros(1, len(tokenizer))
    state.mask_(logits, text)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [TINY_EOS]
    assert not state.is_complete
    state.commit(text)
    assert state.is_complete


@pytest.mark.parametrize(
    ("spec", "allowed", "forbidden"),
    [
        (GrammarSpec("regex", "[0-9]{3}-[a-z]+"), "123-abc", "12a"),
        (GrammarSpec("grammar", 'root ::= "yes" | "no"'), "no", "maybe"),
        (GrammarSpec("json_object"), '{"k": null}', "[1]"),
    ],
)
def test_every_kind_compiles_and_constrains(spec: GrammarSpec, allowed: str, forbidden: str):
    encode = functools.partial(grammars().tokenizer.encode, add_special_tokens=False)
    state = grammars().state(spec)
    assert state.num_allowed(encode(allowed)) == len(encode(allowed))
    assert state.num_allowed(encode(forbidden)) < len(encode(forbidden))


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("json_schema", "[1, 2]"),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("grammar", "root ::= undefined_rule"),
    ],
)
def test_an_invalid_grammar_is_a_400_naming_the_field(spec: GrammarSpec) -> None:
    with pytest.raises(InvalidRequestError, match="grammar") as info:
        grammars().compile(spec)
    assert info.value.param == "grammar"


def test_grammar_spec_checks_its_fields() -> None:
    for kind, source in [("xml", "x"), ("regex", ""), ("json_object", "{}")]:
        with pytest.raises(InvalidRequestError, match="grammar"):
            GrammarSpec(kind, source)  # type: ignore[arg-type]


def test_controls_apply_the_grammar_last() -> None:
    """A logit bias cannot lift a token the grammar forbids."""
    params = SamplingParams(logit_bias=((0, 100.0),))
    history = TokenHistory((0, 1), 2, frozenset(), raw_state((1,)))  # after "b": only c
    out = apply_controls(torch.zeros(1, exact.VOCAB), [params], [history], [[]])
    assert out.argmax().item() == 2 and torch.isinf(out[0, 0])


def test_a_huge_temperature_keeps_the_mask() -> None:
    """1e300 is inf in float32: the masked logits must stay masked, not turn NaN."""
    logits = torch.zeros(1, exact.VOCAB)
    raw_state((1,)).mask_(logits, [])  # after "b": only c
    probs = logits_to_probs(logits, SamplingParams(temperature=1e300))
    assert probs[0].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_a_gguf_tokenizer_masks_as_transformers_conversion() -> None:
    """A GGUF file's own tokenizer (``model.tokenizer.GGUFTokenizer``, built without
    transformers) compiles grammars that force and mask as its transformers conversion's."""
    from hybridspec.model.gguf_tokenizer import convert_gguf_tokenizer, load_gguf_tokenizer
    from hybridspec.model.loader import embedded_model_path
    from hybridspec.model.tokenizer import GGUFTokenizer

    path = embedded_model_path()
    ours, reference = load_gguf_tokenizer(path), convert_gguf_tokenizer(path)
    assert isinstance(ours, GGUFTokenizer)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    states = [Grammars(t, len(t), [2]).state(spec) for t in (ours, reference)]
    prefix = reference.encode('{"kind": "co', add_special_tokens=False)
    assert states[0].forced(prefix, 64) == states[1].forced(prefix, 64)
    masked = []
    for state in states:
        logits = torch.zeros(1, len(reference))
        state.mask_(logits, [])
        masked.append(logits)
    assert torch.equal(masked[0], masked[1])
    assert bool(torch.isinf(masked[0]).any())
