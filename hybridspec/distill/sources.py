"""Training text made offline from what the machine has: local documents, and chat prompts
built from them for the target to answer.

Sources: the docstrings of the Python standard library's modules (read with ``ast``, nothing
imported), its source code, and the licence and copyright texts under ``/usr/share``. Prompts
mix open-ended requests (explain, write a story or poem, give tips, arithmetic word problems
with random numbers) and input-grounded ones (summarise, answer from, rewrite, comment on a
snippet). None of them is a benchmark prompt (``tests/distill`` checks it against the bench
workload).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MIN_SNIPPET_CHARS = 200
MAX_SNIPPET_CHARS = 1500
SHARE_DIRS = (Path("/usr/share/common-licenses"), Path("/usr/share/doc"))
MAX_SHARE_FILES = 400


@dataclass(frozen=True, slots=True)
class Snippet:
    """A piece of local text, and a short name for what it is about."""

    topic: str
    text: str
    is_code: bool = False


def stdlib_snippets(limit: int, rng: random.Random) -> list[Snippet]:
    """Docstrings and function bodies from the standard library's ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(files)
    out: list[Snippet] = []
    for path in files:
        if len(out) >= limit:
            break
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        out.extend(_module_snippets(path.stem, source, tree))
    rng.shuffle(out)
    return out[:limit]


def _module_snippets(module: str, source: str, tree: ast.Module) -> Iterator[Snippet]:
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= MIN_SNIPPET_CHARS:
        yield Snippet(f"the {module} module", doc[:MAX_SNIPPET_CHARS])
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        text = ast.get_source_segment(source, node) or ""
        if MIN_SNIPPET_CHARS <= len(text) <= MAX_SNIPPET_CHARS:
            yield Snippet(f"{module}.{node.name}", text, is_code=True)


def share_snippets(limit: int, rng: random.Random) -> list[Snippet]:
    """Paragraphs of licence and copyright files under /usr/share."""
    files: list[Path] = []
    for directory in SHARE_DIRS:
        if directory.is_dir():
            files += sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix != ".gz")
    rng.shuffle(files)
    out: list[Snippet] = []
    for path in files[:MAX_SHARE_FILES]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for paragraph in text.split("\n\n"):
            paragraph = paragraph.strip()
            if MIN_SNIPPET_CHARS <= len(paragraph) <= MAX_SNIPPET_CHARS:
                topic = path.parent.name if path.name == "copyright" else path.name
                out.append(Snippet(f"the {topic} licence", paragraph))
    rng.shuffle(out)
    return out[:limit]


GROUNDED = (
    "Summarize the following text in a few sentences.\n\n{text}",
    "Read this and answer: what is it about, and who would need it?\n\n{text}",
    "Rewrite the following in plain, simple English.\n\n{text}",
    "List the key points of this text as bullet points.\n\n{text}",
)
CODE = (
    "Explain what this Python code does, step by step.\n\n```python\n{text}\n```",
    "Add comments to this Python code and return the whole code.\n\n```python\n{text}\n```",
    "Suggest improvements to this Python code.\n\n```python\n{text}\n```",
)
OPEN = (
    "Explain {topic} to a beginner.",
    "Write a short poem about {topic}.",
    "Write a short story in which {topic} plays a part.",
    "Give me three practical tips related to {topic}.",
    "What are common mistakes people make with {topic}?",
    "Write a friendly email to a colleague about {topic}.",
)
ARITHMETIC = (
    "A box holds {a} apples and {b} more are added each day for {c} days. How many apples "
    "are there at the end? Show your reasoning.",
    "Compute {a} * {b} - {c} and explain each step.",
    "If a train travels {a} km in {b} hours, what is its average speed? Think step by step.",
)


def chat_prompts(snippets: list[Snippet], count: int, rng: random.Random) -> list[str]:
    """``count`` user messages built from ``snippets`` (one template each, at random)."""
    prompts = []
    for i in range(count):
        snippet = snippets[i % len(snippets)]
        roll = rng.random()
        if roll < 0.1:
            a, b, c = rng.randint(2, 99), rng.randint(2, 30), rng.randint(2, 20)
            prompts.append(rng.choice(ARITHMETIC).format(a=a, b=b, c=c))
        elif roll < 0.55:
            prompts.append(rng.choice(OPEN).format(topic=snippet.topic))
        else:
            templates = CODE if snippet.is_code else GROUNDED
            prompts.append(rng.choice(templates).format(text=snippet.text))
    return prompts
