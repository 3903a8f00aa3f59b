"""JSON extraction under a schema: ``grammar+ngram`` against ``none`` and ``ngram``.

The workload (``json_extraction.json`` beside this file): 25 short texts written for this benchmark
(invented invoices, shipments, appointments, support tickets and reviews: in no training
data), each with the JSON schema of what to extract (keys, enums, numbers, booleans). Every
answer is generated under its schema (``response_format`` json_schema strict, through
``GenerationParams.grammar``) by the embedded SmolLM2-135M-Instruct, greedy, with each method;
the texts must be identical across methods (the engine's promise), and every finished answer
must parse and validate against its schema. Then each prompt runs once more with
``grammar+ngram`` at T = 0.8 (seeded): 100 answers in all, each validated.

Reported, from one run (the machine may be shared: compare the ratios, taken in the same run):

- tokens per second of each method over the whole workload, and the speed-up over ``none``;
- target forwards per generated token;
- the grammar's cost per generated token (every mask, lookahead, forced-text and commit call
  of ``verifier.grammar.GrammarState``, timed in place) as a share of a one-token target
  forward (``Engine.target_forward_s``).

Run from the repository root, after ``make install`` (a few minutes)::

    python benchmarks/experiments/grammar/json_extraction.py [--k 8] [--max-new-tokens 160] \
        [--prompts 25]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridspec import Engine, EngineConfig, GenerationParams, ModelConfig
from hybridspec.types import GrammarSpec
from hybridspec.verifier import GrammarState

WORKLOAD = Path(__file__).with_name("json_extraction.json")
METHODS = ("none", "ngram", "grammar+ngram")


class GrammarClock:
    """Accumulates the seconds spent in ``GrammarState``'s methods while installed."""

    NAMES = ("mask_", "num_allowed", "forced", "commit")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in self.NAMES:
            original = getattr(GrammarState, name)
            self._saved[name] = original
            setattr(GrammarState, name, self._timed(original))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def remove(self) -> None:
        for name, fn in self._saved.items():
            setattr(GrammarState, name, fn)


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """The schema's violations by ``value`` (the subset of JSON Schema the workload uses)."""
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    kind = schema.get("type")
    types = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": (int, float),
    }
    if kind is not None and (
        not isinstance(value, types[kind]) or (kind in ("integer", "number") and value is True)
    ):
        return [*errors, f"{path}: expected {kind}, got {value!r}"]
    if kind in ("integer", "number"):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > {schema['maximum']}")
    if kind == "object":
        properties = schema.get("properties", {})
        errors += [f"{path}: missing {k}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{path}: extra {k}" for k in value if k not in properties]
        for key, sub in properties.items():
            if key in value:
                errors += validate(value[key], sub, f"{path}.{key}")
    if kind == "array":
        for i, item in enumerate(value):
            errors += validate(item, schema.get("items", {}), f"{path}[{i}]")
    return errors


def messages(prompt: dict[str, Any]) -> list[dict[str, str]]:
    keys = ", ".join(prompt["schema"]["properties"])
    return [
        {"role": "system", "content": "You extract facts from texts as JSON."},
        {
            "role": "user",
            "content": f"Text:\n{prompt['text']}\n\nExtract these fields as JSON: {keys}.",
        },
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = json.loads(WORKLOAD.read_text())
    chosen = workload["prompts"]
    step = max(1, len(chosen) // args.prompts)
    workload["prompts"] = chosen[::step][: args.prompts]  # spread over the five schemas
    engine = Engine(EngineConfig(target=ModelConfig(max_num_seqs=1), adaptive_speculation=False))
    prompts = [
        (p["id"], engine.encode(messages=messages(p)), p["schema"]) for p in workload["prompts"]
    ]
    forward_s = engine.target_forward_s()
    clock = GrammarClock()
    clock.install()

    def generate(pid: str, ids: list[int], schema: dict, method: str, **sampling: Any):
        params = GenerationParams.create(
            max_new_tokens=args.max_new_tokens,
            proposer=method,
            num_speculative_tokens=args.k,
            grammar=GrammarSpec("json_schema", json.dumps(schema)),
            **sampling,
        )
        return engine.generate(prompt_token_ids=ids, params=params)

    generate(*prompts[0], "grammar+ngram")  # compiles the tokenizer's grammar tables
    rows, texts, answers = {}, {}, []
    for method in METHODS:
        clock.seconds, tokens, forwards, start = 0.0, 0, 0, time.perf_counter()
        texts[method] = []
        for pid, ids, schema in prompts:
            result = generate(pid, ids, schema, method)
            tokens += len(result.token_ids)
            forwards += result.stats.target_forwards
            texts[method].append(result.token_ids)
            answers.append((pid, method, result.text, result.finish_reason.value, schema))
        elapsed = time.perf_counter() - start
        print(f"{method}: {tokens} tokens in {elapsed:.1f} s", flush=True)
        rows[method] = {
            "tokens": tokens,
            "seconds": elapsed,
            "tokens_per_second": tokens / elapsed,
            "forwards_per_token": forwards / tokens,
            "grammar_s_per_token": clock.seconds / tokens,
            "grammar_share_of_forward": clock.seconds / tokens / forward_s,
        }
    for i, (pid, ids, schema) in enumerate(prompts):
        result = generate(pid, ids, schema, "grammar+ngram", temperature=0.8, seed=i)
        answers.append(
            (pid, "grammar+ngram T=0.8", result.text, result.finish_reason.value, schema)
        )
    clock.remove()
    checked = [_check(*answer) for answer in answers]
    return {
        "target_forward_s": forward_s,
        "methods": rows,
        "speedup_over_none": {
            m: rows[m]["tokens_per_second"] / rows["none"]["tokens_per_second"] for m in METHODS
        },
        "same_greedy_texts": all(texts[m] == texts["none"] for m in METHODS),
        "answers": len(answers),
        "valid_answers": sum(ok for ok, _ in checked),
        "invalid": [why for ok, why in checked if not ok],
    }


def _check(pid: str, method: str, text: str, reason: str, schema: dict) -> tuple[bool, str]:
    if reason != "stop":
        return False, f"{pid} {method}: finished by {reason}: {text!r}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return False, f"{pid} {method}: not JSON ({exc}): {text!r}"
    errors = validate(value, schema)
    return not errors, f"{pid} {method}: {errors}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=25, help="how many (spread evenly)")
    args = parser.parse_args()
    report = run(args)
    print(f"one-token target forward: {report['target_forward_s'] * 1e3:.1f} ms")
    print(
        f"{'method':<16}{'tok/s':>8}{'x none':>8}{'fwd/tok':>9}{'grammar us/tok':>16}{'share':>8}"
    )
    for name, row in report["methods"].items():
        print(
            f"{name:<16}{row['tokens_per_second']:>8.1f}{report['speedup_over_none'][name]:>8.2f}"
            f"{row['forwards_per_token']:>9.3f}{row['grammar_s_per_token'] * 1e6:>16.1f}"
            f"{row['grammar_share_of_forward']:>8.2%}"
        )
    print(f"greedy texts identical across methods: {report['same_greedy_texts']}")
    print(f"answers valid against their schema: {report['valid_answers']} of {report['answers']}")
    for why in report["invalid"]:
        print("  invalid:", why)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
