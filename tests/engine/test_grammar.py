"""Structured output through the engine: every proposer gives the text of plain decoding.

A tiny random target over the suite's byte-level tokenizer writes JSON under a schema, a regex
or an EBNF grammar: greedy texts are identical across ``none``, ``ngram``, ``draft`` and their
compositions with ``grammar`` (which drafts the grammar's forced text), seeded sampled texts
across the proposers with deterministic drafts, and every finished output parses and matches.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from hybridspec import Engine, GenerationParams, InvalidRequestError
from hybridspec.config import EagleConfig
from hybridspec.model.loader import LoadedModel
from hybridspec.proposers.grammar import GrammarProposer
from hybridspec.types import GrammarSpec
from tests.conftest import tiny_tokenizer
from tests.engine.tiny import make_engine, tiny_loaded
from tests.proposers.eagle_helpers import random_head, use_head

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["invoice", "receipt", "quote"]},
        "paid": {"type": "boolean"},
        "total": {"type": "integer", "minimum": 0, "maximum": 99},
        "currency": {"enum": ["EUR", "USD"]},
        "lines": {
            "type": "array",
            "items": {"enum": ["rent", "power", "water"]},
            "maxItems": 1,
        },
    },
    "required": ["kind", "paid", "total", "currency", "lines"],
    "additionalProperties": False,
}
GRAMMARS = {
    "schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", r"(yes|no), [0-9]{2}, (red|green|blue)!"),
    "ebnf": GrammarSpec("grammar", 'root ::= "<" ("ab" | "cd") ("ab" | "cd" | "") ">"'),
}
PROMPTS = ["Extract the invoice as JSON: paid 120 EUR for rent.", "x"]
DETERMINISTIC = [("none", None), ("ngram", 4), ("grammar", 8), ("grammar+ngram", 8)]
# The model proposers are the slow ones on CPU: they run on the schema only.
MODELS = [("draft", 3), ("grammar+draft", 5), ("eagle", 4), ("grammar+eagle", 4), ("hybrid", 4)]
PROPOSERS = {
    "schema": [*DETERMINISTIC, *MODELS, ("grammar+hybrid", 6)],
    "regex": DETERMINISTIC,
    "ebnf": DETERMINISTIC,
}


@pytest.fixture(scope="module")
def text_target() -> LoadedModel:
    return tiny_loaded(0, tokenizer=tiny_tokenizer())


@pytest.fixture(scope="module")
def text_engine(text_target: LoadedModel) -> Engine:
    draft = tiny_loaded(1, noise_from=text_target, tokenizer=tiny_tokenizer())
    engine = make_engine(text_target, draft, eagle=EagleConfig(cost_per_token=0.0))
    head = random_head(text_target, 48)
    use_head(engine, head)
    return engine


def texts(engine: Engine, proposer: str, k: int | None, grammar: str, **options: Any) -> list:
    return [
        engine.generate(
            prompt,
            proposer=proposer,
            num_speculative_tokens=k,
            max_new_tokens=96,
            grammar=GRAMMARS[grammar],
            **options,
        )
        for prompt in PROMPTS
    ]


def matches(grammar: str, text: str) -> bool:
    if grammar == "schema":
        value = json.loads(text)
        return set(value) == set(SCHEMA["required"]) and value["currency"] in ("EUR", "USD")
    if grammar == "regex":
        return re.fullmatch(GRAMMARS["regex"].source, text) is not None
    return re.fullmatch("<(ab|cd){1,2}>", text) is not None


@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_greedy_text_under_a_grammar_is_the_same_with_every_proposer(
    text_engine: Engine, grammar: str
) -> None:
    expected = texts(text_engine, "none", None, grammar)
    for result in expected:
        if result.finish_reason.value == "stop":
            assert matches(grammar, result.text), result.text
    assert any(r.finish_reason.value == "stop" for r in expected)
    for proposer, k in PROPOSERS[grammar][1:]:
        got = texts(text_engine, proposer, k, grammar)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected], (proposer, k)


@pytest.mark.parametrize("grammar", ["schema", "regex"])
def test_seeded_text_under_a_grammar_is_the_same_with_deterministic_drafts(
    text_engine: Engine, grammar: str
) -> None:
    options = {"temperature": 0.8, "seed": 5, "presence_penalty": 0.5}
    expected = [r.token_ids for r in texts(text_engine, "none", None, grammar, **options)]
    for proposer, k in DETERMINISTIC[1:]:
        got = texts(text_engine, proposer, k, grammar, **options)
        assert [r.token_ids for r in got] == expected, (proposer, k)


def test_sampled_drafts_under_a_grammar_give_matching_output(text_engine: Engine) -> None:
    """The draft model's q is under the grammar too: its sampled drafts are allowed text, and
    the output parses."""
    for seed in range(2):
        result = text_engine.generate(
            "x",
            proposer="grammar+draft",
            num_speculative_tokens=6,
            max_new_tokens=80,
            grammar=GRAMMARS["schema"],
            temperature=1.0,
            seed=seed,
        )
        if result.finish_reason.value == "stop":
            assert matches("schema", result.text), result.text
        assert result.stats.draft_tokens_accepted > 0


def test_forced_text_is_drafted_for_free(text_engine: Engine) -> None:
    """The schema's punctuation, keys and enum tails are drafted and accepted: grammar+ngram
    commits more tokens per forward than ngram alone."""
    alone, composed = (
        text_engine.generate(
            PROMPTS[0],
            proposer=proposer,
            num_speculative_tokens=8,
            max_new_tokens=96,
            grammar=GRAMMARS["schema"],
        )
        for proposer in ("ngram", "grammar+ngram")
    )
    assert composed.token_ids == alone.token_ids
    assert composed.stats.target_forwards < 0.7 * alone.stats.target_forwards
    assert composed.stats.acceptance_rate > 0.5


def test_composed_names_resolve_to_one_shared_instance(text_engine: Engine) -> None:
    composed = text_engine.resolve_proposer("grammar+ngram")
    assert isinstance(composed, GrammarProposer)
    assert composed.inner is text_engine.resolve_proposer("ngram")
    assert text_engine.resolve_proposer("grammar+ngram") is composed
    with pytest.raises(InvalidRequestError, match="does not compose"):
        text_engine.resolve_proposer("ngram+grammar")
    with pytest.raises(InvalidRequestError, match="unknown proposer"):
        text_engine.resolve_proposer("grammar+nope")
    plain = text_engine.generate("abc", proposer="grammar+ngram", max_new_tokens=12)
    assert plain.token_ids == text_engine.generate("abc", max_new_tokens=12).token_ids


def test_max_tokens_cuts_the_output_with_finish_reason_length(text_engine: Engine) -> None:
    result = text_engine.generate(
        PROMPTS[0], proposer="grammar+ngram", max_new_tokens=9, grammar=GRAMMARS["schema"]
    )
    assert result.finish_reason.value == "length" and result.text == '{"kind": '
    assert len(result.token_ids) == 9


def test_a_grammar_needs_a_tokenizer(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.generate(prompt_token_ids=[1, 2], grammar=GrammarSpec("json_object"))


def test_generation_params_take_only_grammar_specs() -> None:
    with pytest.raises(InvalidRequestError, match="grammar"):
        GenerationParams(grammar="json")  # type: ignore[arg-type]
