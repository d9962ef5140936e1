"""vLLM: no description endpoint; its load comes from GET /metrics (vllm:num_requests_running,
vllm:num_requests_waiting). It exposes no running cap either: the cap in force is learned from
the gauges (`vllm_cap`), starting at vLLM's default --max-num-seqs."""

from __future__ import annotations

from fleet.cadence import gauge_steps
from fleet.readings import Reading, ServerDescription
from proxy.backends.base import Backend
from proxy.backends.prometheus import parse_prometheus

METRIC_NAMES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:kv_cache_usage_perc",
    }
)
MARK_BITS = (1 << 49) - 1
"""An engine mark is a count (fleet.readings.MAX_COUNT bounds it): the hash is cut to 49 bits."""
VLLM_DEFAULT_MAX_NUM_SEQS = 256
"""A vLLM server's running cap until it is seen saturated: vLLM exposes no --max-num-seqs, so
requests kept waiting while the running count holds tell the cap in force (see vllm_cap). 256 is
vLLM's default on most GPUs; newer versions default to 1024 on large-memory ones (H100, H200),
which a reading with more running raises it to."""
VLLM_FULL_FOR_S = 1.0
"""How long a vLLM server must keep requests waiting without running more before its running
count is taken as its cap. Requests that arrive during a step wait for the next one on any server,
far below the cap; a prefill step on a large model lasts tens to hundreds of ms."""


class VLLM(Backend):
    kind = "vllm"
    load_paths = ("/metrics",)

    def __init__(self, load_path: str | None = None) -> None:
        super().__init__(load_path)
        self.cap = VLLM_DEFAULT_MAX_NUM_SEQS
        self.full_since: tuple[float, float] | None = None
        """Since when, and at what running count, it has kept requests waiting (vllm_cap)."""

    @classmethod
    def recognises(cls, path: str, text: str) -> bool:
        return "vllm:num_requests_running" in text

    def default_description(self) -> ServerDescription:
        return ServerDescription(kind=self.kind, speculative=False, max_running=VLLM_DEFAULT_MAX_NUM_SEQS)

    def read(self, text: str, at: float) -> Reading:
        m = parse_prometheus(text, METRIC_NAMES)
        if "vllm:num_requests_running" not in m:
            raise ValueError("no vLLM load gauges in /metrics")
        running = m["vllm:num_requests_running"]
        reading = Reading(
            at=at, running=running, waiting=m.get("vllm:num_requests_waiting", 0.0), accept_steps=gauge_steps(running)
        )
        self.cap, self.full_since = vllm_cap(self.full_since, reading, self.cap)
        return Reading(
            at=at,
            running=reading.running,
            waiting=reading.waiting,
            max_running=self.cap,
            accept_steps=reading.accept_steps,
            engine_mark=vllm_mark(m),
        )


def vllm_mark(m: dict[str, float]) -> float | None:
    """vLLM's engine mark (fleet.readings.Reading.engine_mark): its token counters, which move as
    a step decodes or a prefill ends, with its KV usage, which moves with each chunk of a long
    prefill (its engine allocates blocks for every chunk it schedules). Any of them moving moves
    the mark; None without the counters (its stats turned off)."""
    prompt, generated = m.get("vllm:prompt_tokens_total"), m.get("vllm:generation_tokens_total")
    if prompt is None and generated is None:
        return None
    return float(hash((prompt, generated, m.get("vllm:kv_cache_usage_perc"))) & MARK_BITS)


def vllm_cap(
    full_since: tuple[float, float] | None, reading: Reading, cap: int
) -> tuple[int, tuple[float, float] | None]:
    """A vLLM server's running cap after `reading`, and since when (and at what running count) it
    has kept requests waiting. It is full, so running its cap (--max-num-seqs, or what its KV cache
    holds), once requests have waited VLLM_FULL_FOR_S with the running count unchanged; a server
    seen running more than the cap has a larger one."""
    if reading.waiting <= 0 or reading.running < 1:
        return max(cap, int(reading.running)), None
    if full_since is None or full_since[1] != reading.running:
        return max(cap, int(reading.running)), (reading.at, reading.running)
    if reading.at - full_since[0] >= VLLM_FULL_FOR_S:
        return int(reading.running), full_since
    return max(cap, int(reading.running)), full_since
