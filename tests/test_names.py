"""One name per idea: names the glossary retired (ARCHITECTURE.md) must not come back into the
package, its docstrings included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hybridspec
from hybridspec.proposers import Proposer

PACKAGE = Path(hybridspec.__file__).parent

# retired name -> the name that replaced it
RETIRED = {
    r"\bcorrection\b": "recovered (the token that replaces the first rejected draft)",
    r"\bQuantizedLinear\b": "Int8DraftLinear (the eagle head's 8-bit drafting matmul)",
    r"(proposer|self|inner|model)\.hidden_layers\b": "Proposer.feature_layers",
    r"\bconstraint_of\b|\bconstraint fields\b": "grammar_source; a grammar is what a request "
    "states, a constraint is that grammar at its committed position (the glossary)",
    r"\bgrammar_of\b": "grammar_source (the grammar and the field it comes from)",
    r"\bproposer_options\b": "ProposerContext (each proposer reads its own part of the config)",
}


def test_no_retired_name_in_the_package() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {pattern} (use {replacement})"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for pattern, replacement in RETIRED.items()
        if re.search(pattern, line, re.IGNORECASE)
    ]
    assert not found, "\n".join(found)


def test_the_check_finds_a_retired_name() -> None:
    assert re.search(next(iter(RETIRED)), "the Correction token", re.IGNORECASE)


def test_a_proposer_naming_the_old_attribute_is_refused() -> None:
    with pytest.raises(TypeError, match="feature_layers"):

        class Old(Proposer):
            hidden_layers = (-1,)

            def propose(self, requests):  # type: ignore[no-untyped-def]
                return []
