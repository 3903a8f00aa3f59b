"""Parsing helpers shared by the server tests: server-sent events and Prometheus text."""

from __future__ import annotations

import json
import re
from typing import Any

DONE = "[DONE]"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of an event stream, in order; asserts the framing is SSE."""
    events = [e for e in text.split("\n\n") if e.strip()]
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"not an SSE data event: {event!r}"
        payloads.append(event[len("data: ") :])
    return payloads


def sse_chunks(text: str) -> list[dict[str, Any]]:
    """The JSON chunks of a complete stream; asserts it ends with exactly one ``[DONE]``."""
    payloads = sse_data(text)
    assert payloads and payloads[-1] == DONE, f"stream does not end with [DONE]: {payloads[-1:]}"
    assert DONE not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def chunk_text(chunks: list[dict[str, Any]]) -> str:
    parts = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if "delta" in choice:
                parts.append(choice["delta"].get("content") or "")
            else:
                parts.append(choice["text"])
    return "".join(parts)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Prometheus text exposition -> {(name, labels): value}; asserts every line is well formed."""
    samples: Samples = {}
    declared: dict[str, str] = {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            declared[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        match = _SAMPLE.match(line)
        assert match is not None, f"malformed sample line: {line!r}"
        name, _, labels, value = match.groups()
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in declared or base in declared, f"sample {name} has no # TYPE"
        pairs = frozenset(_LABEL.findall(labels or ""))
        samples[(name, pairs)] = float(value)
    return samples


def metric(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over every sample whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, pairs), v in samples.items() if n == name and want <= pairs)
