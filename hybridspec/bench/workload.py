"""Benchmark workloads: categories of chat prompts, read from a JSON file.

A workload file holds one object::

    {
      "name": "...",
      "temperatures": [0.0, 0.8],          # the variants it is meant to run at
      "categories": {"code_editing": {"input_grounded": true, "description": "..."}, ...},
      "prompts": [
        {"id": "code-1", "category": "code_editing", "source": "def f(x): ...",
         "messages": [{"role": "user", "content": "Add type hints:\\n\\n{source}"}]},
        ...
      ]
    }

*Input-grounded* categories answer from text given in the prompt (their output copies from
it, which is what n-gram speculation exploits); each of their prompts carries that text in
``source``, and its last message says where it goes with the placeholder ``{source}``.
*Open-ended* categories (chat, math, creative writing) do not; their prompts have no source.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridspec.errors import InvalidRequestError, check

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SOURCE_PLACEHOLDER = "{source}"
MIN_SOURCE_CHARS = 100  # a guard against a grounded prompt that has nothing to copy from
DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "workloads" / "specbench_mini.json"


@dataclass(frozen=True, slots=True)
class Category:
    name: str
    input_grounded: bool
    description: str = ""


@dataclass(frozen=True, slots=True)
class WorkloadPrompt:
    """One prompt: chat messages with the source text (if any) already substituted."""

    id: str
    category: str
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    temperatures: tuple[float, ...]
    categories: dict[str, Category]
    prompts: tuple[WorkloadPrompt, ...]

    def select(
        self, categories: Sequence[str] | None = None, prompts_per_category: int | None = None
    ) -> Workload:
        """The workload restricted to ``categories`` (in that order) and the first
        ``prompts_per_category`` prompts of each; None keeps everything."""
        names = list(self.categories) if categories is None else list(categories)
        unknown = [n for n in names if n not in self.categories]
        check(not unknown, "categories", f"unknown {unknown}; known: {sorted(self.categories)}")
        check(
            prompts_per_category is None or prompts_per_category >= 1,
            "prompts_per_category",
            f"expected an integer >= 1, got {prompts_per_category!r}",
        )
        prompts: list[WorkloadPrompt] = []
        for name in names:
            mine = [p for p in self.prompts if p.category == name]
            prompts.extend(mine[:prompts_per_category])
        return Workload(
            self.name, self.temperatures, {n: self.categories[n] for n in names}, tuple(prompts)
        )


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file; raises InvalidRequestError naming the bad field."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(
            f"workload: cannot read {str(path)!r}: {exc}", "workload"
        ) from exc
    return parse_workload(data)


def parse_workload(data: Any) -> Workload:
    check(isinstance(data, dict), "workload", "expected a JSON object")
    raw_categories = data.get("categories")
    check(
        isinstance(raw_categories, dict) and bool(raw_categories),
        "categories",
        "expected a non-empty object of categories",
    )
    categories = {}
    for name, spec in raw_categories.items():
        check(
            isinstance(spec, dict) and isinstance(spec.get("input_grounded"), bool),
            f"categories.{name}",
            "expected an object with a boolean 'input_grounded'",
        )
        categories[name] = Category(name, spec["input_grounded"], str(spec.get("description", "")))
    temperatures = data.get("temperatures", [0.0])
    check(
        isinstance(temperatures, list)
        and bool(temperatures)
        and all(isinstance(t, (int, float)) and t >= 0 for t in temperatures),
        "temperatures",
        f"expected a non-empty list of numbers >= 0, got {temperatures!r}",
    )
    raw_prompts = data.get("prompts")
    check(isinstance(raw_prompts, list) and bool(raw_prompts), "prompts", "expected a list")
    prompts = tuple(_parse_prompt(i, p, categories) for i, p in enumerate(raw_prompts))
    ids = [p.id for p in prompts]
    check(len(set(ids)) == len(ids), "prompts", "prompt ids must be unique")
    return Workload(
        str(data.get("name", "workload")),
        tuple(float(t) for t in temperatures),
        categories,
        prompts,
    )


def _parse_prompt(index: int, raw: Any, categories: dict[str, Category]) -> WorkloadPrompt:
    field = f"prompts[{index}]"
    check(isinstance(raw, dict), field, "expected an object")
    check(isinstance(raw.get("id"), str) and bool(raw["id"]), f"{field}.id", "expected a string")
    category = raw.get("category")
    check(
        category in categories,
        f"{field}.category",
        f"expected one of {sorted(categories)}, got {category!r}",
    )
    messages = raw.get("messages")
    check(
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ),
        f"{field}.messages",
        "expected a non-empty list of {role, content} strings",
    )
    check(
        messages[-1]["role"] == "user", f"{field}.messages", "the last message must be the user's"
    )
    source = raw.get("source")
    last = messages[-1]["content"]
    if categories[category].input_grounded:
        check(
            isinstance(source, str) and len(source) >= MIN_SOURCE_CHARS,
            f"{field}.source",
            f"input-grounded category {category!r} needs the text to answer from "
            f"(at least {MIN_SOURCE_CHARS} characters), got {source!r}",
        )
        check(
            last.count(SOURCE_PLACEHOLDER) == 1,
            f"{field}.messages",
            f"the last message must contain {SOURCE_PLACEHOLDER} exactly once",
        )
        last = last.replace(SOURCE_PLACEHOLDER, source)
    else:
        check(source is None, f"{field}.source", f"open-ended category {category!r} takes none")
    final = {"role": "user", "content": last}
    return WorkloadPrompt(
        raw["id"],
        category,
        (*({"role": m["role"], "content": m["content"]} for m in messages[:-1]), final),
    )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: WorkloadPrompt) -> list[int]:
    """Token ids of the prompt with the chat template applied, exactly as ``Engine.encode``."""
    check(
        tokenizer.chat_template is not None,
        "workload",
        "the target's tokenizer has no chat template; workload prompts are chat messages",
    )
    text = tokenizer.apply_chat_template(
        list(prompt.messages), tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(str(text), add_special_tokens=False))
