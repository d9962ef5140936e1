"""vLLM: no description endpoint; its load comes from GET /metrics (vllm:num_requests_running,
vllm:num_requests_waiting). It exposes no running cap either: the cap in force is learned from
the gauges (`vllm_cap`), starting at vLLM's default --max-num-seqs. With --data-parallel-size N
its series carry `engine` 0..N-1, one per engine (a batch, a queue and a cap of its own): the
reading then has each engine's figures and marks, as SGLang's /v1/loads has each rank's."""

from __future__ import annotations

from fleet.cadence import gauge_steps
from fleet.readings import Reading, ServerDescription
from proxy.backends.base import Backend
from proxy.backends.prometheus import parse_prometheus, parse_prometheus_by

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
        self.caps = [VLLM_DEFAULT_MAX_NUM_SEQS]
        """Each engine's running cap (one per data-parallel engine: --max-num-seqs is per rank)."""
        self.full_since: list[tuple[float, float] | None] = [None]
        """Since when, and at what running count, each engine has kept requests waiting (vllm_cap)."""
        self.marks: list[float | None] = [None]
        """Each engine's mark as last read (vllm_mark)."""

    @classmethod
    def recognises(cls, path: str, text: str) -> bool:
        return "vllm:num_requests_running" in text

    def default_description(self) -> ServerDescription:
        return ServerDescription(
            kind=self.kind, speculative=False, max_running=VLLM_DEFAULT_MAX_NUM_SEQS, ranks_separate=True
        )

    def read(self, text: str, at: float) -> Reading:
        by_engine = parse_prometheus_by(text, METRIC_NAMES, "engine")
        numbered = [by_engine.get(str(rank), {}) for rank in range(len(by_engine))]
        figures = numbered if len(numbered) > 1 and all("vllm:num_requests_running" in e for e in numbered) else []
        if not figures:  # one engine, or engines not numbered 0..N-1: the server's sums
            figures = [parse_prometheus(text, METRIC_NAMES)]
        if "vllm:num_requests_running" not in figures[0]:
            raise ValueError("no vLLM load gauges in /metrics")
        if len(figures) != len(self.caps):  # the first reading, or a server restarted with other engines
            self.caps = [VLLM_DEFAULT_MAX_NUM_SEQS] * len(figures)
            self.full_since = [None] * len(figures)
            self.marks = [None] * len(figures)
        marks = [vllm_mark(m) for m in figures]
        readings = []
        for rank, m in enumerate(figures):
            running = m["vllm:num_requests_running"]
            reading = Reading(at=at, running=running, waiting=m.get("vllm:num_requests_waiting", 0.0))
            if marks[rank] is not None and marks[rank] == self.marks[rank]:
                # Its counters held still: a hung core's frozen gauges (requests waiting, the
                # running count unchanged) read as full; a full engine's counters move.
                self.full_since[rank] = None
            else:
                self.caps[rank], self.full_since[rank] = vllm_cap(self.full_since[rank], reading, self.caps[rank])
            readings.append(reading)
        self.marks = marks
        running, waiting = sum(r.running for r in readings), sum(r.waiting for r in readings)
        total = (
            None
            if any(mark is None for mark in marks)
            else float(hash(tuple(marks)) & MARK_BITS)
            if len(marks) > 1
            else marks[0]
        )
        # Each engine's figures, when there are several: a hung one among working ones is judged
        # by its own marks (InstanceSignals.hung_ranks); without its counters no engine can be.
        ranked = len(figures) > 1 and total is not None
        return Reading(
            at=at,
            running=running,
            waiting=waiting,
            max_running=sum(self.caps),
            accept_steps=gauge_steps(running),
            engine_mark=total,
            ranks=len(figures),
            rank_marks=tuple(float(m or 0.0) for m in marks) if ranked else (),
            rank_running=tuple(r.running for r in readings) if ranked else (),
            rank_waiting=tuple(r.waiting for r in readings) if ranked else (),
            rank_waiting_tokens=(0.0,) * len(figures) if ranked else (),
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
