"""What changes when the twin plays a vLLM OpenAI server (`specroute sim --mode base --server vllm`).

The engine (scheduling, step times) is the same; what a client or a router sees is vLLM's
(0.33.0, V1 engine; ../shared/sglang-facts.md section 5):
- `/metrics` always on, with vLLM's names and labels (`model_name`, `engine`): the gauges
  `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:num_requests_waiting_by_reason{reason}`, `vllm:kv_cache_usage_perc`, updated every step
  (not on SGLang's publishing cadence); the counters `vllm:prompt_tokens_total` and
  `vllm:generation_tokens_total` (iteration stats: every step, a prompt as its prefill ends),
  `vllm:request_success_total{finished_reason}`,
  `vllm:num_preemptions_total`; the histograms of time to first token, inter-token latency
  and end-to-end latency;
- `/health` (200, empty), `/ping`, `/version`, `/load` (`{"server_load": 0}`: vLLM only counts
  with --enable-server-load-tracking), `/v1/models` with `owned_by: "vllm"`;
  no `/v1/loads`, `/server_info`, `/get_load` or `/get_model_info` (404, FastAPI's
  `{"detail": "Not Found"}`);
- usage without SGLang's `reasoning_tokens`; a message's reasoning text under `reasoning`;
- errors nested as `{"error": {"message", "type", "param", "code"}}`;
- a chat stream opens with a chunk of its own carrying only `{"role": "assistant", "content": ""}`,
  then one chunk per token; choices carry `stop_reason` where SGLang's carry `matched_stop`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sim.engine import Engine

VLLM_VERSION = "0.33.0"
# vLLM's default buckets (v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TYPE_BY_STATUS = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": TYPE_BY_STATUS.get(status, "BadRequestError"),
            "param": None,
            "code": status,
        }
    }


def as_vllm_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """An SGLang-shaped choice as vLLM writes it: `stop_reason` for `matched_stop`, and a message's
    `reasoning` for SGLang's `reasoning_content` (vLLM renamed it, PR #33402)."""
    if "matched_stop" in choice:
        # vLLM names a stop string there, or a stop_token_ids token; an EOS stop it leaves null
        matched = choice.pop("matched_stop")
        choice["stop_reason"] = None if isinstance(matched, int) else matched
    message = choice.get("message")
    if isinstance(message, dict) and "reasoning_content" in message:
        message["reasoning"] = message.pop("reasoning_content")
    return choice


def as_vllm_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """vLLM's UsageInfo has no top-level `reasoning_tokens` (SGLang's has)."""
    usage.pop("reasoning_tokens", None)
    return usage


class VllmCollector:
    """The scheduler's gauges, read live from the engine at scrape time (vLLM updates them every
    engine step)."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name, "engine": "0"}

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        names, values = list(self.labels), list(self.labels.values())
        waiting = float(engine.num_waiting)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", float(engine.num_running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.token_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.", labels=names + ["reason"]
        )
        by_reason.add_metric(values + ["capacity"], waiting)  # the twin defers nothing
        by_reason.add_metric(values + ["deferred"], 0.0)
        yield by_reason
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions.", labels=names)
        preemptions.add_metric(values, 0.0)
        yield preemptions
        # Prefix caching is on by default in vLLM V1: prompt tokens looked up at scheduling and
        # those found cached, counted as the scheduler admits each request. The token counters
        # are iteration stats: a prompt counted as its prefill ends, each token as it is made.
        for name, doc, count in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", engine.prefilled_prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", engine.emitted_tokens),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                engine.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                engine.prefix_cache_hits,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, float(count))
            yield counter


class VllmMetrics:
    """The front end's counters and histograms; the same calls as sim.metrics.TwinMetrics."""

    def __init__(self, engine: Engine, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(VllmCollector(engine, model_name))
        labels = ["model_name", "engine"]
        self.values = [model_name, "0"]
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*self.values)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(*self.values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(*self.values)

    def observe_first_token(self, streaming: bool, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_chunk(self, interval_s: float, tokens: int) -> None:
        for _ in range(max(tokens, 0)):
            self.itl.observe(interval_s / tokens)

    def observe_finish(
        self,
        streaming: bool,
        prompt_tokens: int,
        completion_tokens: int,
        e2e_s: float,
        finish_reason: str = "stop",
        cached_tokens: int = 0,
    ) -> None:
        self.success.labels(*self.values, finish_reason).inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
