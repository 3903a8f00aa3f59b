"""Every ```python block of README.md and docs/*.md parses, its ``hybridspec`` imports name
what the package exports, and what it calls on an ``engine`` or ``result`` exists there.

Running the blocks needs a server or the embedded model for each, which CI's budget does not
hold; these checks catch what goes stale when code moves or is renamed."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from hybridspec.engine import Engine, GenerationResult

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
OWNERS = {"engine": Engine, "result": GenerationResult}


def snippets() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for number, match in enumerate(BLOCK.finditer(page.read_text()), 1):
            found.append((f"{page.relative_to(ROOT)}#{number}", match.group(1)))
    return found


SNIPPETS = snippets()


def test_the_pages_have_snippets() -> None:
    assert len(SNIPPETS) >= 5, [name for name, _ in SNIPPETS]


@pytest.mark.parametrize(("name", "code"), SNIPPETS, ids=[name for name, _ in SNIPPETS])
def test_a_snippet_parses_and_names_what_exists(name: str, code: str) -> None:
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridspec"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{name}: {node.module}.{alias.name}"
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in OWNERS
        ):
            owner = OWNERS[node.value.id]
            fields = getattr(owner, "__dataclass_fields__", {})
            assert hasattr(owner, node.attr) or node.attr in fields, (
                f"{name}: {node.value.id}.{node.attr}"
            )
