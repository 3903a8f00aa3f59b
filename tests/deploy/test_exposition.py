"""Many replicas' metrics as one exposition, each series labelled with its replica."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from hybridspec.deploy.exposition import merge_expositions
from hybridspec.engine.stats import GenerationStats
from hybridspec.server.metrics import ServerMetrics


def _metrics(finished: int, running: int) -> bytes:
    metrics = ServerMetrics()
    for _ in range(finished):
        metrics.observe_finished("ngram", "stop")
    metrics.observe_http("POST", "/v1/chat/completions", 200)
    metrics.observe_result("ngram", GenerationStats(generated_tokens=8, target_forwards=4), 0.3)
    metrics.set_engine_state(running, 0)
    return metrics.render()


def test_every_sample_carries_its_replica_and_families_are_written_once() -> None:
    text = merge_expositions({"b": _metrics(2, 1), "a": _metrics(3, 0)}).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    finished = families["hybridspec_requests_finished"]
    values = {s.labels["replica"]: s.value for s in finished.samples}
    assert values == {"a": 3.0, "b": 2.0}
    assert finished.samples[0].labels == {
        "replica": "a",
        "proposer": "ngram",
        "finish_reason": "stop",
    }
    running = {
        s.labels["replica"]: s.value for s in families["hybridspec_num_running_requests"].samples
    }
    assert running == {"a": 0.0, "b": 1.0}
    buckets = [
        s
        for s in families["hybridspec_request_latency_seconds"].samples
        if s.labels["replica"] == "b"
    ]
    assert buckets and all(s.labels["proposer"] == "ngram" for s in buckets)
    assert text.count("# TYPE hybridspec_requests_finished_total counter") == 1
    assert "_created" not in text


def _samples(text: bytes) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    ]


def test_one_replica_is_its_own_exposition_labelled() -> None:
    own = _metrics(1, 0)
    merged = _samples(merge_expositions({"only": own}))
    assert all(labels.pop("replica") == "only" for _, labels, _ in merged)
    assert merged == _samples(own)
