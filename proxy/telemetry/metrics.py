"""Prometheus metrics, in a registry of their own, rendered in the text format at GET /metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from fleet.types import Snapshot
from proxy.telemetry import names as n


class CountedElsewhere(Collector):
    """A counter whose value something else keeps (read at every scrape)."""

    def __init__(self, name: str, documentation: str, source: Callable[[], int]) -> None:
        self.name, self.documentation, self.source = name, documentation, source

    def collect(self) -> Any:
        yield CounterMetricFamily(self.name, self.documentation, value=self.source())


class Metrics:
    """Every specroute metric; one instance per app, so tests and several apps never share counts."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        instances: Mapping[str, Sequence[str]] | None = None,
        policy: str | None = None,
        decisions: Sequence[tuple[str, str]] = (),
    ) -> None:
        """`instances`: the configured upstream URLs by pool; `policy` the policy's name and
        `decisions` the (reason, pool) pairs it is known to decide with. Their series exist
        from the start (see `_zero`)."""
        r = self.registry = CollectorRegistry()
        # The process's own series every Prometheus exporter has (CPU seconds, resident memory,
        # open and max file descriptors, start time; the Python version and its collector's
        # runs): a leak or a CPU-bound proxy shows on the dashboards that watch every service.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            n.M_REQUESTS, "Requests answered, by pool, policy and outcome.", ["pool", "policy", "outcome"], registry=r
        )
        self.decisions = Counter(
            n.M_DECISIONS, "Routing decisions, by reason and chosen pool.", ["reason", "pool"], registry=r
        )
        self.ttft = Histogram(
            n.M_TTFT,
            "Seconds from request received to the first token sent.",
            ["pool"],
            buckets=n.BUCKETS_TTFT,
            registry=r,
        )
        self.inter_token = Histogram(
            n.M_INTER_TOKEN,
            "Mean seconds between output tokens after the first, per request.",
            ["pool"],
            buckets=n.BUCKETS_INTER_TOKEN,
            registry=r,
        )
        self.duration = Histogram(
            n.M_DURATION,
            "Seconds from request received to response end.",
            ["pool"],
            buckets=n.BUCKETS_DURATION,
            registry=r,
        )
        self.tokens = Counter(
            n.M_TOKENS, "Tokens reported by the upstream, by pool and type.", ["pool", "type"], registry=r
        )
        self.prefix_credited = Counter(
            n.M_PREFIX_CREDITED,
            "Prompt tokens the router credited as cached on the instance that served each request, by pool.",
            ["pool"],
            registry=r,
        )
        self.prefix_cached = Counter(
            n.M_PREFIX_CACHED,
            "Prompt tokens the upstream reported found in its prefix cache "
            "(usage.prompt_tokens_details.cached_tokens), by pool.",
            ["pool"],
            registry=r,
        )
        self.in_flight = Gauge(
            n.M_IN_FLIGHT, "Upstream requests this proxy has open, per instance.", ["pool", "instance"], registry=r
        )
        self.alpha = Gauge(n.M_ALPHA, "Observed per-token acceptance rate of a speculative pool.", ["pool"], registry=r)
        self.snapshot_age = Gauge(
            n.M_SNAPSHOT_AGE, "Age in seconds of the freshest load reading per pool.", ["pool"], registry=r
        )
        self.healthy = Gauge(
            n.M_HEALTHY,
            "1 when the proxy sends work to an upstream instance (reachable, not ejected), else 0.",
            ["pool", "instance"],
            registry=r,
        )
        self.ejected = Gauge(
            n.M_EJECTED,
            "1 while outlier detection keeps an upstream instance out of rotation.",
            ["pool", "instance"],
            registry=r,
        )
        self.hung_ranks = Gauge(
            n.M_HUNG_RANKS,
            "Data-parallel ranks of an upstream instance judged hung while its other ranks serve.",
            ["pool", "instance"],
            registry=r,
        )
        self.ejections = Counter(
            n.M_EJECTIONS,
            "Times outlier detection ejected an upstream instance, by the rule that ejected it.",
            ["pool", "instance", "reason"],
            registry=r,
        )
        self.retries = Counter(n.M_RETRIES, "Upstream attempts repeated within the same pool.", ["pool"], registry=r)
        self.failovers = Counter(
            n.M_FAILOVERS, "Upstream attempts moved to the other pool.", ["from_pool", "to_pool"], registry=r
        )
        self.stored = Counter(
            n.M_STORED,
            "Requests about stored responses (the Responses API's get and cancel, and lookups of a "
            "follow-up's previous response), by operation and outcome.",
            ["operation", "outcome"],
            registry=r,
        )
        self.upstream_aborts = Counter(
            n.M_UPSTREAM_ABORTS,
            "Aborts the proxy sent SGLang servers for attempts it abandoned (client gone, timeout, "
            "drain), by pool and outcome: sent, refused (an error answer), failed (no answer), dropped "
            "(too many in flight).",
            ["pool", "outcome"],
            registry=r,
        )
        for pool in ("spec", "base"):
            for outcome in n.UPSTREAM_ABORT_OUTCOMES:
                self.upstream_aborts.labels(pool, outcome)
        self.stored_asked = Counter(
            n.M_STORED_ASKED,
            "Requests the proxy sent servers about stored responses (a miss asks every server).",
            registry=r,
        )
        self.auth_refused = Counter(
            n.M_AUTH_REFUSED,
            "Requests refused by client authentication, by reason (never by key).",
            ["reason"],
            registry=r,
        )
        for reason in n.AUTH_REFUSED_REASONS:
            self.auth_refused.labels(reason)
        self._zero(instances or {}, policy, decisions)
        self.overhead = Histogram(
            n.M_OVERHEAD,
            "Seconds per request spent in the proxy itself (not waiting on upstream).",
            buckets=n.BUCKETS_OVERHEAD,
            registry=r,
        )
        self.unknown_path = Counter(
            n.M_UNKNOWN_PATH, "Requests to a path the proxy does not serve (answered 404 unknown_url).", registry=r
        )
        self.held = Gauge(n.M_HELD, "Requests flow control holds in the proxy now.", registry=r)
        self.hold_released = Histogram(
            n.M_HOLD_RELEASED,
            "Seconds each request flow control held waited, by the rule that let it go.",
            ["rule"],
            buckets=n.BUCKETS_HELD,
            registry=r,
        )
        for rule in n.HOLD_RELEASE_RULES:
            self.hold_released.labels(rule)
        self._dropped_source: Callable[[], int] = lambda: 0
        r.register(
            CountedElsewhere(
                n.M_TRACE_DROPPED,
                "Sampled requests whose spans the proxy dropped before export (the span export "
                "process behind, gone or not started, or spans that could not be written).",
                lambda: self._dropped_source(),
            )
        )
        self._snapshot_source: Callable[[], Snapshot | None] | None = None
        self._held_source: Callable[[], int] | None = None
        # Label children by label values: prometheus_client's labels() takes a lock and builds
        # tuples on every call; a request needs about eight of them.
        self._children: dict[tuple[Any, ...], Any] = {}

    def _zero(
        self, instances: Mapping[str, Sequence[str]], policy: str | None, decisions: Sequence[tuple[str, str]]
    ) -> None:
        """Create at 0 the series whose label values are known before any traffic, and only
        combinations that can occur: an alert on an absent series has no rate to read until its
        first event."""
        pools = [pool for pool, urls in instances.items() if urls]
        # Series an alert watches exist at 0 from the start: an absent series is no rate (an alert
        # on the failovers' rate would wait for the first failover to see its first sample). A
        # pool not configured has none (with none configured, both pools have them).
        alerted = pools or ["spec", "base"]
        for pool in alerted:
            self.retries.labels(pool)
            for other in alerted:
                if other != pool:
                    self.failovers.labels(pool, other)
        for pool in pools:
            for url in instances[pool]:
                self.in_flight.labels(pool, url)
                self.hung_ranks.labels(pool, url)
                # An ejection between two scrapes leaves the ejected gauge at 0 on both: the
                # counter keeps it.
                for reason in n.EJECTION_REASONS:
                    self.ejections.labels(pool, url, reason)
            for kind in ("input", "output"):
                self.tokens.labels(pool, kind)
        if policy is None:
            return
        for pool in pools:
            for outcome in n.ATTEMPTED_OUTCOMES:
                self.requests.labels(pool, policy, outcome)
        for outcome in n.UNATTEMPTED_OUTCOMES:
            self.requests.labels("none", policy, outcome)
        if set(pools) >= {"spec", "base"}:  # with one pool, most of a policy's reasons never come
            for reason, pool in decisions:
                self.decisions.labels(reason, pool)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def decided(self, reason: str, pool: str) -> None:
        self._child(self.decisions, reason, pool).inc()

    def retried(self, pool: str) -> None:
        self._child(self.retries, pool).inc()

    def failed_over(self, from_pool: str, to_pool: str) -> None:
        self._child(self.failovers, from_pool, to_pool).inc()

    def upstream_ejected(self, pool: str, instance: str, reason: str) -> None:
        self.ejections.labels(pool, instance, reason).inc()

    def in_flight_child(self, pool: str, instance: str) -> Any:
        return self._child(self.in_flight, pool, instance)

    def finished(
        self,
        pool: str,
        policy: str,
        outcome: str,
        duration_s: float,
        overhead_s: float,
        ttft_s: float | None,
        inter_token_s: float | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        credited_tokens: int = 0,
        cached_tokens: int | None = None,
    ) -> None:
        """One request's samples (TTFT and inter-token only for streams); `credited_tokens`:
        the prefix credit on the instance that served it, `cached_tokens` the server's report."""
        child = self._child
        child(self.requests, pool, policy, outcome).inc()
        child(self.duration, pool).observe(duration_s)
        self.overhead.observe(overhead_s)
        if ttft_s is not None:
            child(self.ttft, pool).observe(ttft_s)
        if inter_token_s is not None:
            child(self.inter_token, pool).observe(inter_token_s)
        if prompt_tokens:
            child(self.tokens, pool, "input").inc(prompt_tokens)
        if completion_tokens:
            child(self.tokens, pool, "output").inc(completion_tokens)
        if credited_tokens:
            child(self.prefix_credited, pool).inc(credited_tokens)
        if cached_tokens:
            child(self.prefix_cached, pool).inc(cached_tokens)

    def released(self, rule: str, held_s: float) -> None:
        self._child(self.hold_released, rule).observe(held_s)

    def watch_dropped(self, source: Callable[[], int]) -> None:
        """Read the requests whose spans were dropped from `source` at every scrape."""
        self._dropped_source = source

    def watch_held(self, source: Callable[[], int]) -> None:
        """Refresh the held-requests gauge from `source` at every scrape."""
        self._held_source = source

    def watch_snapshot(self, source: Callable[[], Snapshot | None]) -> None:
        """Refresh the alpha and snapshot-age gauges from `source` at every scrape."""
        self._snapshot_source = source

    def record_snapshot(self, snapshot: Snapshot) -> None:
        for name, pool in snapshot.pools.items():
            if pool.alpha is not None:
                self.alpha.labels(name).set(pool.alpha)
            # +Inf until the pool's first load reading: an age alert fires for a pool never read.
            self.snapshot_age.labels(name).set(pool.age_s)
            for instance in pool.instances:
                self.healthy.labels(name, instance.url).set(1.0 if instance.healthy else 0.0)
                self.ejected.labels(name, instance.url).set(1.0 if instance.ejected else 0.0)
                self.hung_ranks.labels(name, instance.url).set(instance.hung_ranks)

    def render(self) -> bytes:
        if self._held_source is not None:
            self.held.set(self._held_source())
        if self._snapshot_source is not None:
            snapshot = self._snapshot_source()
            if snapshot is not None:
                self.record_snapshot(snapshot)
        return generate_latest(self.registry)
