"""Size bounds on a grammar's source, checked before it is compiled.

xgrammar's compile cannot be interrupted, and its time grows fast with some features of the
source (about quadratically with a JSON schema's properties; with nesting depth, alternatives
and large repetition counts), so a request's grammar is bounded before it is compiled: a
source within these bounds compiles in well under a second on a CPU core, one beyond them is
refused at once with a ``GrammarError`` naming the field the client sent. So is a schema that
no finite JSON satisfies (``schema_finite``).

======================  ==========================================================  =====
bound                   counts                                                      limit
======================  ==========================================================  =====
``MAX_SOURCE_BYTES``    the source's UTF-8 bytes (schema JSON, regex or EBNF)       128 Ki
``MAX_PROPERTIES``      a schema's ``properties`` entries, all objects together     1000
``MAX_OPTIONAL``        one object's properties that ``required`` does not name     256
``MAX_DEPTH``           a schema's JSON nesting (objects and arrays of the schema)  64
``MAX_ALTERNATIVES``    ``enum``/``anyOf``/``oneOf``/``allOf``/type-list entries;   1000
                        in a regex or EBNF, its ``|`` characters
``MAX_REPEAT``          ``minItems``/``maxItems``/``minLength``/``maxLength``/      1000
                        ``minProperties``/``maxProperties``; a regex's or EBNF's
                        ``{m,n}`` counts
======================  ==========================================================  =====
"""

from __future__ import annotations

import json
import re
from typing import Any

from hybridspec.errors import GrammarError
from hybridspec.types import GrammarSpec
from hybridspec.verifier.schema_finite import has_finite_instance

MAX_SOURCE_BYTES = 128 * 1024
MAX_PROPERTIES = 1000
MAX_OPTIONAL = 256
MAX_DEPTH = 64
MAX_ALTERNATIVES = 1000
MAX_REPEAT = 1000

_ALTERNATIVE_KEYS = ("enum", "anyOf", "oneOf", "allOf")
_REPEAT_KEYS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
)
_COUNTS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def check_bounds(spec: GrammarSpec, param: str) -> Any:
    """Raise GrammarError (``param``) for a source beyond the bounds; returns the parsed
    schema of a ``json_schema`` (None for other kinds)."""
    size = len(spec.source.encode("utf-8", "surrogatepass"))
    _limit(size, MAX_SOURCE_BYTES, param, "bytes of source")
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except (json.JSONDecodeError, RecursionError):
            raise GrammarError(f"{param}: the schema is not JSON", param) from None
        if not isinstance(schema, dict):
            raise GrammarError(
                f"{param}: a JSON schema is an object, got {type(schema).__name__}", param
            )
        counts = _SchemaCounts()
        counts.walk(schema, 1, param)
        _limit(counts.properties, MAX_PROPERTIES, param, "properties")
        _limit(counts.alternatives, MAX_ALTERNATIVES, param, "alternatives (enum/anyOf/...)")
        if not has_finite_instance(schema):
            raise GrammarError(
                f"{param}: no finite JSON satisfies the schema (a $ref cycle through required "
                "properties, items or alternatives)",
                param,
            )
        return schema
    if spec.kind in ("regex", "grammar"):
        _limit(spec.source.count("|"), MAX_ALTERNATIVES, param, "alternatives ('|')")
        for match in _COUNTS.finditer(spec.source):
            for count in match.groups():
                if count:
                    _limit(int(count), MAX_REPEAT, param, "repetitions in a {m,n} count")
    return None


def _limit(value: int, limit: int, param: str, what: str) -> None:
    if value > limit:
        raise GrammarError(
            f"{param}: the grammar has {value} {what}, over this server's limit of {limit}",
            param,
        )


class _SchemaCounts:
    """Walks a schema document once, counting what ``check_bounds`` limits."""

    __slots__ = ("alternatives", "properties")

    def __init__(self) -> None:
        self.properties = 0
        self.alternatives = 0

    def walk(self, node: Any, depth: int, param: str) -> None:
        _limit(depth, MAX_DEPTH, param, "levels of nesting")
        if isinstance(node, list):
            for item in node:
                self.walk(item, depth + 1, param)
            return
        if not isinstance(node, dict):
            return
        properties = node.get("properties")
        if isinstance(properties, dict):
            self.properties += len(properties)
            required = node.get("required")
            named = set(required) & set(properties) if isinstance(required, list) else set()
            _limit(len(properties) - len(named), MAX_OPTIONAL, param, "optional properties")
        for key in _ALTERNATIVE_KEYS:
            if isinstance(node.get(key), list):
                self.alternatives += len(node[key])
        if isinstance(node.get("type"), list):
            self.alternatives += len(node["type"])
        for key in _REPEAT_KEYS:
            value = node.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_REPEAT:
                raise GrammarError(
                    f"{param}: {key} {value} is over this server's limit of {MAX_REPEAT}", param
                )
        for value in node.values():
            if isinstance(value, (dict, list)):
                self.walk(value, depth + 1, param)
