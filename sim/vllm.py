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

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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
    """vLLM's UsageInfo has no top-level `reasoning_tokens` nor `completion_tokens_details` (SGLang's has)."""
    usage.pop("reasoning_tokens", None)
    usage.pop("completion_tokens_details", None)
    return usage


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What one engine's scheduler reports with each step's outputs (vLLM's SchedulerStats and
    iteration counters): the front end's gauges and counters show the last ones it heard."""

    running: float
    waiting: float
    kv_usage: float
    prompt_tokens: int
    generation_tokens: int
    cache_queries: int
    cache_hits: int

    @classmethod
    def of(cls, engine: Engine) -> EngineStats:
        return cls(
            float(engine.num_running),
            float(engine.num_waiting),
            engine.token_usage,
            engine.prefilled_prompt_tokens,
            engine.emitted_tokens,
            engine.prefix_cache_queries,
            engine.prefix_cache_hits,
        )


class VllmCollector:
    """The scheduler's gauges and counters, one series per engine (label `engine`, its
    data-parallel rank), read live from each engine at scrape time (vLLM updates them every
    engine step); a hung engine's as they stood when it hung (its core sends no more stats)."""

    def __init__(self, engines: Sequence[Engine], model_name: str, frozen: dict[int, EngineStats]):
        self.engines = engines
        self.model_name = model_name
        self.frozen = frozen

    def collect(self) -> Iterator[Metric]:
        names = ["model_name", "engine"]
        series = [
            ([self.model_name, str(rank)], self.frozen.get(rank) or EngineStats.of(engine))
            for rank, engine in enumerate(self.engines)
        ]
        for name, doc, field in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=names)
            for values, stats in series:
                gauge.add_metric(values, float(getattr(stats, field)))
            yield gauge
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.", labels=names + ["reason"]
        )
        for values, stats in series:
            by_reason.add_metric(values + ["capacity"], stats.waiting)  # the twin defers nothing
            by_reason.add_metric(values + ["deferred"], 0.0)
        yield by_reason
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions.", labels=names)
        for values, _ in series:
            preemptions.add_metric(values, 0.0)
        yield preemptions
        # Prefix caching is on by default in vLLM V1: prompt tokens looked up at scheduling and
        # those found cached, counted as the scheduler admits each request. The token counters
        # are iteration stats: a prompt counted as its prefill ends, each token as it is made.
        for name, doc, field in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
            ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                "cache_queries",
            ),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "cache_hits"),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            for values, stats in series:
                counter.add_metric(values, float(getattr(stats, field)))
            yield counter


class DataParallelBalancer:
    """vLLM's internal load balancing over its data-parallel engines (DPLBAsyncMPClient): a
    request goes to the engine with the least waiting x 4 + running as the front end last heard
    them (the DP coordinator publishes every engine's counts each 100 ms), the lowest rank on a
    tie; the front end counts each request it sends as waiting there until the next counts."""

    PUBLISH_S = 0.1

    def __init__(self, engines: int) -> None:
        self.counts = [[0, 0] for _ in range(engines)]
        """[waiting, running] per engine, as the front end believes them."""
        self.published_at = -math.inf

    def pick(self, now: float, stats: Callable[[], Sequence[EngineStats]]) -> int:
        if now - self.published_at >= self.PUBLISH_S:
            self.counts = [[int(s.waiting), int(s.running)] for s in stats()]
            self.published_at = now
        rank = min(range(len(self.counts)), key=lambda r: self.counts[r][0] * 4 + self.counts[r][1])
        self.counts[rank][0] += 1
        return rank


def named_rank(value: str | None, engines: int) -> int | None:
    """The engine an `X-data-parallel-rank` header names, as vLLM reads it: none for a value
    that is no integer (the balancer then picks), a 400 for one out of range."""
    if value is None:
        return None
    try:
        rank = int(value)
    except ValueError:
        return None
    if not 0 <= rank < engines:
        raise ValueError(f"data_parallel_rank {rank} is out of range [0, {engines}).")
    return rank


class VllmMetrics:
    """The front end's counters and histograms, labelled by the engine that served (`for_rank`);
    the same calls as sim.metrics.TwinMetrics."""

    def __init__(self, engines: Sequence[Engine], model_name: str):
        self.model_name = model_name
        self.engines = engines
        self.frozen: dict[int, EngineStats] = {}
        """The stats a hung engine last sent, by rank (`freeze`)."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(VllmCollector(engines, model_name, self.frozen))
        labels = ["model_name", "engine"]
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
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.ranks = [EngineMetrics(self, str(rank)) for rank in range(len(engines))]

    def for_rank(self, rank: int) -> EngineMetrics:
        return self.ranks[rank]

    def stats(self) -> list[EngineStats]:
        """Every engine's counts as the front end last heard them."""
        return [self.frozen.get(rank) or EngineStats.of(engine) for rank, engine in enumerate(self.engines)]

    def freeze(self, rank: int, hung: bool) -> None:
        """A hung engine's core sends no stats: its series keep the values they had."""
        if hung:
            self.frozen.setdefault(rank, EngineStats.of(self.engines[rank]))
        else:
            self.frozen.pop(rank, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineMetrics:
    """The front end's metrics of the requests one engine serves."""

    def __init__(self, metrics: VllmMetrics, engine: str):
        values = [metrics.model_name, engine]
        self.values = values
        self.success = metrics.success
        self.ttft = metrics.ttft.labels(*values)
        self.itl = metrics.itl.labels(*values)
        self.e2e = metrics.e2e.labels(*values)

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
