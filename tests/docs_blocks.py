"""The fenced blocks of README.md and docs/*.md, and the commands of their shell blocks, as
``tests/test_docs_snippets.py`` runs them.

A block is named ``page#n``: the ``n``-th fenced block of the page, whatever its language. A
shell block holds commands (a backslash continues a line; a quote left open continues it too,
as a shell reads it) and ``#`` comments; a comment that starts with ``{`` right after a command
is the output that command prints, as the page shows it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL = ("bash", "sh", "shell")
# A placeholder where a page shows printed output: `"max_model_len":N` (any number there).
PLACEHOLDER = re.compile(r"(?<=:)\s*[A-Z]\b")
# The address the pages give the server (`make serve`'s), which a test replaces by its own.
SERVER_URL = re.compile(r"(?:https?://)?(?:127\.0\.0\.1|localhost):8000")


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced block: its page (relative to the repository), its number on the page (from
    1, counting every fenced block), the line its fence opens on, its language and text."""

    page: str
    number: int
    line: int
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}#{self.number}"

    @property
    def where(self) -> str:
        return f"{self.name} (line {self.line})"


@dataclass(frozen=True, slots=True)
class Command:
    """One command of a shell block: its text (continuations joined, comments dropped), its
    words as the shell splits them, and the output the page shows for it ('' for none)."""

    text: str
    words: tuple[str, ...]
    shown_output: str

    @property
    def program(self) -> str:
        """The program, without a path (``.venv/bin/hybridspec`` is ``hybridspec``)."""
        return self._words()[0].rsplit("/", 1)[-1]

    @property
    def arguments(self) -> list[str]:
        return self._words()[1:]

    def _words(self) -> list[str]:
        """The words after the environment assignments (``HF_HUB_OFFLINE=1 lm_eval``), and
        before a trailing ``&`` (run in the background)."""
        words = list(self.words[:-1] if self.words[-1] == "&" else self.words)
        while len(words) > 1 and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words.pop(0)
        return words


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    found = []
    for page in pages:
        text = page.read_text()
        for number, match in enumerate(FENCE.finditer(text), 1):
            line = text.count("\n", 0, match.start()) + 1
            name = str(page.relative_to(ROOT))
            found.append(Block(name, number, line, match.group(1), match.group(2)))
    return found


def commands(code: str) -> list[Command]:
    """The commands of a shell block, in order: ``a 'x<newline>y' \\<newline> b  # note``
    is one command of the words ``a``, ``x<newline>y`` and ``b``."""
    found: list[Command] = []
    pending = ""
    for line in code.splitlines():
        if not pending and line.lstrip().startswith("#"):
            comment = line.lstrip()[1:].strip()
            if found and comment.startswith("{") and not found[-1].shown_output:
                last = found[-1]
                found[-1] = Command(last.text, last.words, comment)
            continue
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if words:
            found.append(Command(pending.strip(), tuple(words), ""))
        pending = ""
    assert not pending, f"a command never ends: {pending!r}"
    return found


def with_server(text: str, base_url: str) -> str:
    """``text`` with the pages' server address replaced by ``base_url``."""
    return SERVER_URL.sub(base_url, text)


def shown_json(shown_output: str) -> str:
    """The output a page shows, as JSON: placeholders become 0 and a trailing note, after the
    JSON's last brace, is dropped."""
    return PLACEHOLDER.sub("0", shown_output[: shown_output.rindex("}") + 1])


def same_shape(value: object, shown: object) -> bool:
    """Whether ``value`` has the keys and value types that ``shown`` has (recursively; a list
    by its first item)."""
    if isinstance(shown, dict):
        return (
            isinstance(value, dict)
            and value.keys() == shown.keys()
            and all(same_shape(value[k], shown[k]) for k in shown)
        )
    if isinstance(shown, list):
        return isinstance(value, list) and (
            not shown or not value or same_shape(value[0], shown[0])
        )
    if isinstance(shown, bool) or shown is None:
        return type(value) is type(shown)
    if isinstance(shown, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return type(value) is type(shown)
