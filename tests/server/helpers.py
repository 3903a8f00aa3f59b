"""Parsing helpers shared by the server tests: server-sent events and Prometheus text."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

DONE = "[DONE]"


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


def parse_metrics(text: str | bytes) -> Samples:
    """Prometheus text exposition -> {(name, labels): value}, read by prometheus_client's parser
    (which raises on a malformed line); asserts no sample repeats."""
    if isinstance(text, bytes):
        text = text.decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = sample.value
    return samples


def metric(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over every sample whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, pairs), v in samples.items() if n == name and want <= pairs)
