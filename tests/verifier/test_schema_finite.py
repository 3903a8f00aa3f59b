"""Schemas that no finite JSON satisfies (``verifier.schema_finite``), and ones that look alike
but do have finite instances."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hybridspec.errors import GrammarError
from hybridspec.types import GrammarSpec
from hybridspec.verifier.grammar_bounds import check_bounds
from hybridspec.verifier.schema_finite import has_finite_instance


def node(required: bool, ref: str = "#") -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"next": {"$ref": ref}, "value": {"type": "integer"}},
        "required": ["next", "value"] if required else ["value"],
    }


LIST_OF = {"$defs": {"Node": node(True, "#/$defs/Node")}, "$ref": "#/$defs/Node"}
INFINITE = [
    node(True),
    LIST_OF,
    {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    {"type": "array", "minItems": 1, "prefixItems": [{"$ref": "#"}]},
    {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}, {"type": "string"}]}]},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
    {"type": ["object", "array"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    | {"minItems": 2, "items": {"$ref": "#"}},
]
FINITE = [
    node(False),  # the link is optional
    {"anyOf": [node(True), {"type": "null"}]},  # a null ends the chain
    {"type": "array", "items": {"$ref": "#"}},  # an empty array
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"A": node(True, "#/$defs/B"), "B": {"anyOf": [{"$ref": "#/$defs/A"}, {}]}}}
    | {"$ref": "#/$defs/A"},
    {"$ref": "https://example.com/schema.json"},  # not this module's to judge
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},
    {"type": "string"},
]


@pytest.mark.parametrize("schema", INFINITE)
def test_a_schema_every_instance_of_which_contains_another_has_none(schema: Any) -> None:
    assert not has_finite_instance(schema)


@pytest.mark.parametrize("schema", FINITE)
def test_a_schema_with_a_way_out_has_finite_instances(schema: Any) -> None:
    assert has_finite_instance(schema)


def test_check_bounds_refuses_it_naming_the_field() -> None:
    spec = GrammarSpec("json_schema", json.dumps(LIST_OF))
    with pytest.raises(GrammarError, match="response_format: no finite JSON") as refused:
        check_bounds(spec, "response_format")
    assert refused.value.param == "response_format"
    assert check_bounds(GrammarSpec("json_schema", json.dumps(node(False))), "x") is not None
