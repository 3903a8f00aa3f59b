"""Server metrics, kept with ``prometheus_client`` in one registry per app.

Each app owns a ``CollectorRegistry`` (not the process-wide default), so that several apps in
one process (the tests) count apart. Every label value is bounded by something the server
defines, never by what a client sends:

==================  ================================================================
label               values
==================  ================================================================
method              GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS, or ``other``
path                a route template of the app (``/v1/models/{model:path}``), or
                    ``unmatched``
status              a status code the server sent
proposer            a proposer name the engine resolved (refused names never count)
finish_reason       a ``FinishReason`` value
tenant              a tenant of the API key file (``server.tenants``), or empty for the
                    anonymous one (``--api-key``); only requests with a known key count
engine              ``main``, or ``twin`` (``serve --bench-twin``: ``engine.loop``)
==================  ================================================================

``GET /metrics`` answers the Prometheus text format 0.0.4. ``prometheus_client`` adds a
``*_created`` series (the time each labelled child was first touched) to every counter and
histogram; ``render`` leaves them out, as the hand-written exposition before it did: they
double the series of every counter and Prometheus reads creation times only from OpenMetrics
or protobuf scrapes. ``prometheus_client.disable_created_metrics()`` would do the same for the
whole process, other libraries' registries included, so it is not called.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from hybridspec.engine.prefix_cache import PrefixCacheStats
from hybridspec.engine.stats import GenerationStats

# What ``generate_latest`` writes; prometheus_client>=0.22 names it CONTENT_TYPE_PLAIN_0_0_4
# (its CONTENT_TYPE_LATEST became the 1.0.0 format then).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
OTHER_METHOD = "other"
ENGINES = ("main", "twin")  # the ``engine`` label of the loop's engines, in its order
UNMATCHED_PATH = "unmatched"


def method_label(method: str) -> str:
    """``method`` if it is a standard one (methods are case-sensitive), else ``other``."""
    return method if method in HTTP_METHODS else OTHER_METHOD


class _WithoutCreated:
    """A view of a registry that leaves out the ``*_created`` samples (see the module doc)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            created = family.name + "_created"
            kept.samples = [s for s in family.samples if s.name != created]
            yield kept


class ServerMetrics:
    """What the server counts; ``render()`` gives the exposition for ``GET /metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.http_requests = Counter(
            "hybridspec_http_requests_total",
            "HTTP requests answered, by method, route and status code "
            "(499: the client went away before the response began).",
            ("method", "path", "status"),
            registry=registry,
        )
        self.tenant_requests = Counter(
            "hybridspec_tenant_http_requests_total",
            "HTTP requests with a known API key answered, by tenant and status code.",
            ("tenant", "status"),
            registry=registry,
        )
        self.tenant_tokens = Counter(
            "hybridspec_tenant_generated_tokens_total",
            "Completion tokens sent to clients, by tenant.",
            ("tenant",),
            registry=registry,
        )
        self.finished = Counter(
            "hybridspec_requests_finished_total",
            "Generation requests ended, by proposer and finish reason (abort: client gone).",
            ("proposer", "finish_reason"),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "hybridspec_prompt_tokens_total",
            "Prompt tokens of requests that began generating.",
            ("proposer",),
            registry=registry,
        )
        self.generated_tokens = Counter(
            "hybridspec_generated_tokens_total",
            "Completion tokens sent to clients (including those of cancelled requests).",
            ("proposer",),
            registry=registry,
        )
        self.draft_proposed = Counter(
            "hybridspec_draft_tokens_proposed_total",
            "Draft tokens proposed, over requests that ran to completion.",
            ("proposer",),
            registry=registry,
        )
        self.draft_accepted = Counter(
            "hybridspec_draft_tokens_accepted_total",
            "Draft tokens accepted by the target, over requests that ran to completion.",
            ("proposer",),
            registry=registry,
        )
        self.target_forwards = Counter(
            "hybridspec_target_forwards_total",
            "Verification forwards of the target, over requests that ran to completion.",
            ("proposer",),
            registry=registry,
        )
        self.mean_accepted_length = Gauge(
            "hybridspec_mean_accepted_length",
            "Tokens committed per target forward (accepted drafts plus the bonus token).",
            ("proposer",),
            registry=registry,
        )
        self.latency = Histogram(
            "hybridspec_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            ("proposer",),
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.ttft = Histogram(
            "hybridspec_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            ("proposer",),
            registry=registry,
            buckets=TTFT_BUCKETS_S,
        )
        self.running = Gauge(
            "hybridspec_num_running_requests", "Requests in the running batch.", registry=registry
        )
        self.waiting = Gauge(
            "hybridspec_num_waiting_requests", "Requests waiting for a slot.", registry=registry
        )
        self.prefix_hit_tokens = Counter(
            "hybridspec_prefix_cache_hit_tokens_total",
            "Prompt tokens read from the prefix cache instead of prefilled.",
            registry=registry,
        )
        self.prefix_evicted_tokens = Counter(
            "hybridspec_prefix_cache_evicted_tokens_total",
            "Tokens evicted from the prefix cache (least recently used first).",
            registry=registry,
        )
        self.prefix_cached_tokens = Gauge(
            "hybridspec_prefix_cache_tokens",
            "Tokens the prefix cache holds.",
            registry=registry,
        )
        self.step_seconds = Counter(
            "hybridspec_engine_step_seconds_total",
            "Seconds the engine thread spent in engine steps, by engine (main; twin: serve "
            "--bench-twin).",
            ("engine",),
            registry=registry,
        )
        self._step_seen = [0.0] * len(ENGINES)  # each engine's step seconds already counted
        self._prefix_seen = (0, 0)  # the engine's hit and evicted tokens already counted
        # Per proposer, over requests that ran to completion: the gauge's numerator and
        # denominator (a counter's value is not part of prometheus_client's public API).
        self._committed: dict[str, int] = {}
        self._forwards: dict[str, int] = {}

    def observe_http(self, method: str, path: str, status: int) -> None:
        """Count one HTTP response; ``path`` is a route template or ``UNMATCHED_PATH``."""
        self.http_requests.labels(method_label(method), path, str(status)).inc()

    def observe_tenant_http(self, tenant: str | None, status: int) -> None:
        """Count one response to a request with a known key (``tenant`` None: anonymous)."""
        self.tenant_requests.labels(tenant or "", str(status)).inc()

    def observe_first_token(self, proposer: str, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.labels(proposer).observe(ttft_s)
        self.prompt_tokens.labels(proposer).inc(num_prompt_tokens)

    def observe_tokens(self, proposer: str, num_tokens: int, tenant: str | None = None) -> None:
        self.generated_tokens.labels(proposer).inc(num_tokens)
        if tenant is not None:
            self.tenant_tokens.labels(tenant).inc(num_tokens)

    def observe_finished(self, proposer: str, finish_reason: str) -> None:
        self.finished.labels(proposer, finish_reason).inc()

    def observe_result(self, proposer: str, stats: GenerationStats, latency_s: float) -> None:
        """Count the speculation statistics of a request that ran to completion."""
        self.draft_proposed.labels(proposer).inc(stats.draft_tokens_proposed)
        self.draft_accepted.labels(proposer).inc(stats.draft_tokens_accepted)
        self.target_forwards.labels(proposer).inc(stats.target_forwards)
        self._committed[proposer] = self._committed.get(proposer, 0) + stats.generated_tokens
        self._forwards[proposer] = self._forwards.get(proposer, 0) + stats.target_forwards
        if self._forwards[proposer] > 0:
            mean = self._committed[proposer] / self._forwards[proposer]
            self.mean_accepted_length.labels(proposer).set(mean)
        self.latency.labels(proposer).observe(latency_s)

    def set_prefix_cache(self, stats: PrefixCacheStats) -> None:
        """Bring the prefix cache's counters up to the engine's counts (read between steps)."""
        seen_hits, seen_evicted = self._prefix_seen
        self.prefix_hit_tokens.inc(max(0, stats.hit_tokens - seen_hits))
        self.prefix_evicted_tokens.inc(max(0, stats.evicted_tokens - seen_evicted))
        self._prefix_seen = (
            max(seen_hits, stats.hit_tokens),
            max(seen_evicted, stats.evicted_tokens),
        )
        self.prefix_cached_tokens.set(stats.num_cached_tokens)

    def set_step_seconds(self, seconds: Sequence[float]) -> None:
        """Bring the step seconds up to the loop's (``EngineLoop.step_seconds``: the main
        engine's, then the twin's where there is one)."""
        for index, total in enumerate(seconds):
            self.step_seconds.labels(ENGINES[index]).inc(max(0.0, total - self._step_seen[index]))
            self._step_seen[index] = max(self._step_seen[index], total)

    def set_engine_state(self, num_running: int, num_waiting: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)

    def render(self) -> bytes:
        """The exposition in the text format ``CONTENT_TYPE`` names."""
        return generate_latest(_WithoutCreated(self.registry))
