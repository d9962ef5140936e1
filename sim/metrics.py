"""The twin's /metrics: SGLang's metric names in the Prometheus text format.

Scheduler gauges are read from the engine's last published values, which it refreshes on
SGLang's cadence (load gauges after every prefill batch; throughput and acceptance every
`decode_log_interval` decode iterations; everything when the server goes idle). Tokenizer-side counters count finished requests (labelled
`is_streaming`, as SGLang's are); the TTFT, ITL and E2E histograms are observed as tokens are
delivered. All durations are in the twin's simulated
seconds (wall seconds times --time-scale), which is what the GPU server would report.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sim.engine import Engine

# SGLang's default buckets (srt/observability/metrics_collector.py).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 150, 200, 250, 300, 350, 500, 1000)


class EngineCollector:
    """Scheduler gauges (one series per data-parallel rank, labelled `dp_rank` when there are
    several, as SGLang's) and request counters, read from the engines at scrape time."""

    def __init__(self, engines: Sequence[Engine], model_name: str):
        self.engines = list(engines)
        self.model_name = model_name

    def _labels(self, engine: Engine) -> dict[str, str]:
        labels = {"model_name": self.model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        if len(self.engines) > 1:
            labels["dp_rank"] = str(engine.dp_rank)
        return labels

    def collect(self) -> Iterator[Metric]:
        names = list(self._labels(self.engines[0]))
        speculative = self.engines[0].config.speculative
        gauge_docs = [
            ("num_running_reqs", "The number of running requests."),
            ("num_queue_reqs", "The number of requests in the waiting queue."),
            ("token_usage", "The token usage."),
            ("gen_throughput", "The generation throughput (token/s)."),
            ("cache_hit_rate", "The prefix cache hit rate."),
        ]
        if speculative:
            gauge_docs += [
                ("spec_accept_length", "The average acceptance length of speculative decoding."),
                ("spec_accept_rate", "The average acceptance rate of speculative decoding."),
            ]
        for name, doc in gauge_docs:
            g = GaugeMetricFamily(f"sglang:{name}", doc, labels=names)
            for engine in self.engines:
                g.add_metric(list(self._labels(engine).values()), float(engine.gauges.get(name, 0.0)))
            yield g
        if speculative:
            g = GaugeMetricFamily("sglang:spec_num_steps", "Speculative draft steps.", labels=names)
            for engine in self.engines:
                g.add_metric(list(self._labels(engine).values()), float(engine.config.num_steps))
            yield g
        tok_names, tok_values = ["model_name"], [self.model_name]
        for name, doc, value in (
            ("num_aborted_requests", "Number of requests aborted.", sum(e.aborted_requests for e in self.engines)),
            (
                "spec_verify_calls",
                "The number of verification forward calls in speculative decoding.",
                sum(e.finished_verify_ct for e in self.engines),
            ),
        ):
            # SGLang counts these only when there is something to count (a labelled counter has no
            # sample before): a base server never shows spec_verify_calls_total.
            if value > 0:
                c = CounterMetricFamily(f"sglang:{name}", doc, labels=tok_names)
                c.add_metric(tok_values, float(value))
                yield c


class TwinMetrics:
    """Tokenizer-side metrics, labelled `is_streaming` where SGLang labels them."""

    def __init__(self, engines: Sequence[Engine], model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engines, model_name))
        by_stream = ["model_name", "is_streaming"]
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", by_stream, registry=self.registry
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", by_stream, registry=self.registry
        )
        self.num_requests = Counter(
            "sglang:num_requests", "Number of requests processed.", by_stream, registry=self.registry
        )
        # SGLang labels it by where the prefix was found (device, host, storage); the twin's
        # cache is the device's radix tree only.
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens.",
            ["model_name", "cache_source"],
            registry=self.registry,
        ).labels(model_name, "device")
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            by_stream,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            by_stream,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )

    def for_rank(self, rank: int) -> TwinMetrics:
        """The metrics of the requests one rank serves: SGLang's tokenizer counts them all as one."""
        return self

    def observe_first_token(self, streaming: bool, ttft_s: float) -> None:
        self.ttft.labels(self.model_name, _flag(streaming)).observe(ttft_s)

    def observe_chunk(self, interval_s: float, tokens: int) -> None:
        """SGLang spreads a chunk's interval over its tokens: `tokens` observations of interval/tokens."""
        if tokens <= 0:
            return
        per_token = interval_s / tokens
        for _ in range(tokens):
            self.itl.observe(per_token)

    def observe_finish(
        self,
        streaming: bool,
        prompt_tokens: int,
        completion_tokens: int,
        e2e_s: float,
        finish_reason: str = "stop",
        cached_tokens: int = 0,
    ) -> None:
        flag = _flag(streaming)
        self.prompt_tokens.labels(self.model_name, flag).inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.labels(self.model_name, flag).inc(completion_tokens)
        self.num_requests.labels(self.model_name, flag).inc()
        self.e2e.labels(self.model_name, flag).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _flag(streaming: bool) -> str:
    return "true" if streaming else "false"
