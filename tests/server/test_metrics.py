"""The Prometheus text exposition, on hand-built values."""

from __future__ import annotations

import math

import pytest

from hybridspec.server.metrics import Counter, Gauge, Histogram, ServerMetrics
from hybridspec.types import GenerationStats
from tests.server.helpers import metric, parse_metrics


def test_histogram_buckets_are_cumulative_with_inclusive_bounds() -> None:
    histogram = Histogram("x", "help", (), (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 7.0):
        histogram.observe(value)
    assert list(histogram.render()) == [
        "# HELP x help",
        "# TYPE x histogram",
        'x_bucket{le="0.1"} 2',
        'x_bucket{le="1"} 3',
        'x_bucket{le="+Inf"} 4',
        "x_sum 7.65",
        "x_count 4",
    ]


def test_counter_labels_are_escaped_and_sorted() -> None:
    counter = Counter("c_total", "help", ("path",))
    counter.inc('/b"\\\n')
    counter.inc("/a", amount=2.5)
    lines = list(counter.render())
    assert lines[2:] == ['c_total{path="/a"} 2.5', 'c_total{path="/b\\"\\\\\\n"} 1']


def test_counter_refuses_to_decrease() -> None:
    with pytest.raises(AssertionError):
        Counter("c_total", "help").inc(amount=-1)


def test_gauge_renders_special_values() -> None:
    gauge = Gauge("g", "help", ("k",))
    gauge.set(math.inf, "a")
    gauge.set(math.nan, "b")
    assert list(gauge.render())[2:] == ['g{k="a"} +Inf', 'g{k="b"} NaN']


def test_mean_accepted_length_pools_tokens_over_forwards() -> None:
    metrics = ServerMetrics()
    # 10 tokens in 4 forwards, then 2 tokens in 2 forwards: (10 + 2) / (4 + 2) = 2.
    metrics.observe_result(
        "ngram",
        GenerationStats(
            generated_tokens=10,
            target_forwards=4,
            draft_tokens_proposed=12,
            draft_tokens_accepted=6,
        ),
        0.3,
    )
    metrics.observe_result("ngram", GenerationStats(generated_tokens=2, target_forwards=2), 0.2)
    samples = parse_metrics(metrics.render())
    assert metric(samples, "hybridspec_mean_accepted_length", proposer="ngram") == 2.0
    assert metric(samples, "hybridspec_draft_tokens_proposed_total", proposer="ngram") == 12
    assert metric(samples, "hybridspec_draft_tokens_accepted_total", proposer="ngram") == 6
    assert metric(samples, "hybridspec_request_latency_seconds_count", proposer="ngram") == 2
    assert metric(samples, "hybridspec_request_latency_seconds_sum", proposer="ngram") == 0.5
    assert metric(samples, "hybridspec_num_running_requests") == 0
