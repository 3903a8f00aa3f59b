"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Three metric kinds cover what the server reports: counters (``*_total``), gauges and
histograms (``*_bucket`` with cumulative ``le`` bounds, ``*_sum``, ``*_count``). Every metric
is updated and rendered on the event loop thread only, so no lock is needed.

Worked example of a histogram with bounds (0.1, 1.0) after observing 0.05 and 0.5::

    x_bucket{le="0.1"} 1
    x_bucket{le="1.0"} 2
    x_bucket{le="+Inf"} 2
    x_sum 0.55
    x_count 2
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from hybridspec.types import GenerationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format_labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}"


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass(slots=True)
class _Metric:
    name: str
    help: str
    label_names: tuple[str, ...] = ()

    def _key(self, labels: Sequence[str]) -> Labels:
        assert len(labels) == len(self.label_names), (self.name, labels)
        return tuple(labels)

    def header(self, kind: str) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {kind}"]


@dataclass(slots=True)
class Counter(_Metric):
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        assert amount >= 0, f"counter {self.name} cannot decrease"
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def render(self) -> Iterator[str]:
        yield from self.header("counter")
        for key, value in sorted(self.values.items()):
            yield f"{self.name}{_format_labels(self.label_names, key)} {_format_value(value)}"


@dataclass(slots=True)
class Gauge(_Metric):
    values: dict[Labels, float] = field(default_factory=dict)

    def set(self, value: float, *labels: str) -> None:
        self.values[self._key(labels)] = value

    def render(self) -> Iterator[str]:
        yield from self.header("gauge")
        for key, value in sorted(self.values.items()):
            yield f"{self.name}{_format_labels(self.label_names, key)} {_format_value(value)}"


@dataclass(slots=True)
class Histogram(_Metric):
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: dict[Labels, list[int]] = field(default_factory=dict)  # per bucket, not cumulative
    sums: dict[Labels, float] = field(default_factory=dict)

    def observe(self, value: float, *labels: str) -> None:
        key = self._key(labels)
        counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1  # le is inclusive
        self.sums[key] = self.sums.get(key, 0.0) + value

    def count(self, *labels: str) -> int:
        return sum(self.counts.get(self._key(labels), ()))

    def render(self) -> Iterator[str]:
        yield from self.header("histogram")
        names = (*self.label_names, "le")
        for key, counts in sorted(self.counts.items()):
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += n
                labels = _format_labels(names, (*key, _format_value(bound)))
                yield f"{self.name}_bucket{labels} {cumulative}"
            plain = _format_labels(self.label_names, key)
            yield f"{self.name}_sum{plain} {_format_value(self.sums[key])}"
            yield f"{self.name}_count{plain} {cumulative}"


class ServerMetrics:
    """What the server counts; ``render()`` gives the exposition text for ``GET /metrics``."""

    def __init__(self) -> None:
        self.http_requests = Counter(
            "hybridspec_http_requests_total",
            "HTTP requests answered, by method, route and status code "
            "(499: the client went away before the response began).",
            ("method", "path", "status"),
        )
        self.finished = Counter(
            "hybridspec_requests_finished_total",
            "Generation requests ended, by proposer and finish reason (abort: client gone).",
            ("proposer", "finish_reason"),
        )
        self.prompt_tokens = Counter(
            "hybridspec_prompt_tokens_total",
            "Prompt tokens of requests that began generating.",
            ("proposer",),
        )
        self.generated_tokens = Counter(
            "hybridspec_generated_tokens_total",
            "Completion tokens sent to clients (including those of cancelled requests).",
            ("proposer",),
        )
        self.draft_proposed = Counter(
            "hybridspec_draft_tokens_proposed_total",
            "Draft tokens proposed, over requests that ran to completion.",
            ("proposer",),
        )
        self.draft_accepted = Counter(
            "hybridspec_draft_tokens_accepted_total",
            "Draft tokens accepted by the target, over requests that ran to completion.",
            ("proposer",),
        )
        self.target_forwards = Counter(
            "hybridspec_target_forwards_total",
            "Verification forwards of the target, over requests that ran to completion.",
            ("proposer",),
        )
        self._committed: dict[str, int] = {}  # stats.generated_tokens summed, per proposer
        self.mean_accepted_length = Gauge(
            "hybridspec_mean_accepted_length",
            "Tokens committed per target forward (accepted drafts plus the bonus token).",
            ("proposer",),
        )
        self.latency = Histogram(
            "hybridspec_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            ("proposer",),
            LATENCY_BUCKETS_S,
        )
        self.ttft = Histogram(
            "hybridspec_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            ("proposer",),
            TTFT_BUCKETS_S,
        )
        self.running = Gauge("hybridspec_num_running_requests", "Requests in the running batch.")
        self.waiting = Gauge("hybridspec_num_waiting_requests", "Requests waiting for a slot.")
        self.running.set(0)
        self.waiting.set(0)

    def observe_result(self, proposer: str, stats: GenerationStats, latency_s: float) -> None:
        """Count the speculation statistics of a request that ran to completion."""
        self.draft_proposed.inc(proposer, amount=stats.draft_tokens_proposed)
        self.draft_accepted.inc(proposer, amount=stats.draft_tokens_accepted)
        self.target_forwards.inc(proposer, amount=stats.target_forwards)
        self._committed[proposer] = self._committed.get(proposer, 0) + stats.generated_tokens
        forwards = self.target_forwards.get(proposer)
        if forwards > 0:
            self.mean_accepted_length.set(self._committed[proposer] / forwards, proposer)
        self.latency.observe(latency_s, proposer)

    def set_engine_state(self, num_running: int, num_waiting: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)

    def render(self) -> str:
        metrics: list[Counter | Gauge | Histogram] = [
            self.http_requests,
            self.finished,
            self.prompt_tokens,
            self.generated_tokens,
            self.draft_proposed,
            self.draft_accepted,
            self.target_forwards,
            self.mean_accepted_length,
            self.latency,
            self.ttft,
            self.running,
            self.waiting,
        ]
        return "\n".join(line for metric in metrics for line in metric.render()) + "\n"
