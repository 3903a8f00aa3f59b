"""Whether a JSON schema admits a finite document at all.

A schema whose every instance must contain another instance of itself, such as an object that
requires a property ``"next"`` of its own type (``{"properties": {"next": {"$ref": "#"}},
"required": ["next"]}``), compiles to a grammar that allows no complete output: a constrained
request would only ever stop at its length limit. ``has_finite_instance`` finds such schemas,
so that they are refused like any other grammar that allows nothing.

A schema node has a finite instance when (least fixpoint over the ``$ref`` targets, which
start as having none and gain one as the iteration shows it):

- it is a ``$ref`` whose target has one (a target this module cannot resolve counts as yes);
- ``anyOf``/``oneOf``: one alternative has one; ``allOf``: every part has one;
- an object: every property that ``required`` names and ``properties`` defines has one;
- an array: ``minItems`` 0, or its ``items`` (and the ``prefixItems`` that ``minItems``
  needs) have one;
- a type list: one of its types gives one; anything else (scalars, ``enum``, ``const``, ``{}``)
  has one. Keywords this ignores only narrow a schema, which xgrammar checks itself.

Worked example: ``{"$defs": {"A": {"type": "object", "properties": {"b": {"$ref":
"#/$defs/B"}}, "required": ["b"]}, "B": {"anyOf": [{"$ref": "#/$defs/A"}, {"type":
"null"}]}}, "$ref": "#/$defs/A"}``: round 1 finds B (its ``null``), round 2 then A. Without the
``null`` branch neither ever does, and the schema is refused.
"""

from __future__ import annotations

from typing import Any

MAX_ROUNDS = 64  # fixpoint rounds; a schema still changing after them is taken as fine


def has_finite_instance(schema: dict[str, Any]) -> bool:
    """False only when no finite JSON document satisfies ``schema`` (module docstring)."""
    targets = {ref: _resolve(schema, ref) for ref in _refs(schema)}
    known: dict[str, bool] = dict.fromkeys(targets, False)
    for ref, target in targets.items():
        if target is None:
            known[ref] = True  # unresolvable (external, or not a JSON pointer): not judged
    for _ in range(MAX_ROUNDS):
        changed = False
        for ref, target in targets.items():
            if not known[ref] and _finite(target, known):
                known[ref] = changed = True
        if not changed:
            return _finite(schema, known)
    return True


def _finite(node: Any, known: dict[str, bool]) -> bool:
    """One round's verdict on ``node``, reading ``known`` for ``$ref`` targets."""
    if not isinstance(node, dict):
        return node is not False  # ``false`` is the schema that nothing satisfies
    ref = node.get("$ref")
    if isinstance(ref, str) and not known.get(ref, True):
        return False
    if isinstance(node.get("allOf"), list) and not all(_finite(p, known) for p in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        options = node.get(key)
        if isinstance(options, list) and options and not any(_finite(o, known) for o in options):
            return False
    kinds = node.get("type")
    if isinstance(kinds, list) and kinds:
        return any(_finite_as(node, kind, known) for kind in kinds)
    return _finite_as(node, kinds, known)


def _finite_as(node: dict[str, Any], kind: Any, known: dict[str, bool]) -> bool:
    """Whether ``node`` read as a value of type ``kind`` (None: as its keywords say) has a
    finite instance, by its object or array keywords."""
    if kind in (None, "object"):
        properties = node.get("properties")
        required = node.get("required")
        if isinstance(properties, dict) and isinstance(required, list):
            named = [properties[name] for name in required if name in properties]
            if not all(_finite(p, known) for p in named):
                return False
    if kind in (None, "array"):
        least = node.get("minItems", 0)
        if isinstance(least, int) and least > 0:
            prefix = node.get("prefixItems")
            needed = prefix[:least] if isinstance(prefix, list) else []
            rest = least > len(needed)
            if not all(_finite(p, known) for p in needed):
                return False
            if rest and "items" in node and not _finite(node["items"], known):
                return False
    return True


def _refs(node: Any) -> set[str]:
    """Every ``$ref`` string in the document."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                found.add(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    """The node a local JSON pointer (``#``, ``#/$defs/A``) names; None for anything else."""
    if not ref.startswith("#"):
        return None
    node: Any = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
