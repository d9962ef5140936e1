"""SGLang: /server_info describes it; its load comes from GET /v1/loads (0.5.15+), GET /metrics
(with --enable-metrics) or GET /get_load (older), the first it answers. A speculative server's
/metrics also has the token and verify-call counters whose increments are the windowed accept
length, and the recent-interval accept-length gauge: read on the polls fleet.cadence picks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fleet.cadence import gauge_steps, reads_counters
from fleet.readings import Reading, ServerDescription
from proxy.backends.base import Backend
from proxy.backends.prometheus import parse_prometheus

METRIC_NAMES = frozenset(
    {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:max_running_requests",
        "sglang:generation_tokens_total",
        "sglang:spec_verify_calls_total",
        "sglang:spec_accept_length",
    }
)


class SGLang(Backend):
    kind = "sglang"
    load_paths = ("/v1/loads", "/metrics", "/get_load")
    info_path = "/server_info"

    @classmethod
    def recognises(cls, path: str, text: str) -> bool:
        return path != "/metrics" or "sglang:num_running_reqs" in text

    @classmethod
    def describe(cls, doc: Mapping[str, Any]) -> tuple[ServerDescription, dict[str, Any]]:
        facts = server_info_facts(doc)
        cap = facts["max_running_requests"]
        description = ServerDescription(
            kind=cls.kind,
            speculative=facts["speculative"],
            num_draft_tokens=facts["num_draft_tokens"],
            max_running=int(cap) if cap else None,
        )
        return description, facts

    def read(self, text: str, at: float) -> Reading:
        if self.load_path == "/v1/loads":
            return reading_from_loads(_json(text), at)
        if self.load_path == "/metrics":
            return reading_from_metrics(text, at)
        return reading_from_get_load(_json(text), at)

    def counters_path(self, poll: int, speculative: bool) -> str | None:
        return "/metrics" if self.load_path == "/v1/loads" and speculative and reads_counters(poll) else None

    def with_counters(self, reading: Reading, text: str) -> Reading:
        m = parse_prometheus(text, METRIC_NAMES)
        if "sglang:spec_verify_calls_total" not in m:
            return reading
        return Reading(
            at=reading.at,
            running=reading.running,
            waiting=reading.waiting,
            max_running=reading.max_running,
            waiting_tokens=reading.waiting_tokens,
            accept_length=m.get("sglang:spec_accept_length") or None,
            accept_steps=gauge_steps(reading.running),
            tokens_total=m.get("sglang:generation_tokens_total", 0.0),  # no sample before a request finished
            verify_total=m["sglang:spec_verify_calls_total"],
        )


def _json(text: str) -> Any:
    return json.loads(text)


def server_info_facts(doc: Mapping[str, Any]) -> dict[str, Any]:
    """What /server_info says about speculation and the running cap."""
    algorithm = doc.get("speculative_algorithm")
    steps = doc.get("speculative_num_steps") or 0
    return {
        "speculative": bool(algorithm),
        "speculative_algorithm": algorithm,
        "num_draft_tokens": int(steps) if algorithm else 0,
        "speculative_eagle_topk": doc.get("speculative_eagle_topk"),
        "speculative_num_draft_tokens": doc.get("speculative_num_draft_tokens"),
        "max_running_requests": doc.get("max_running_requests"),
    }


def reading_from_loads(doc: Mapping[str, Any], at: float) -> Reading:
    """GET /v1/loads: summed over data-parallel ranks."""
    loads = [entry for entry in doc.get("loads", []) if isinstance(entry, Mapping)]
    if not loads:
        raise ValueError("no loads in /v1/loads answer")
    # Its speculative.accept_length is cumulative since start: too slow for routing, not used.
    return Reading(
        at=at,
        running=float(sum(e.get("num_running_reqs", 0) for e in loads)),
        waiting=float(sum(e.get("num_waiting_reqs", 0) for e in loads)),
        max_running=int(sum(e.get("max_running_requests", 0) for e in loads)) or None,
        waiting_tokens=float(sum(e.get("num_waiting_uncached_tokens", 0) for e in loads)),
        cache_tokens=int(sum(e.get("max_total_num_tokens", 0) for e in loads)) or None,
        prefill_tokens_total=_total(loads, "total_prefill_uncached_tokens"),
        prefill_busy_us_total=_total(loads, "total_prefill_busy_us"),
    )


def _total(loads: list[Mapping[str, Any]], field: str) -> float | None:
    """A counter summed over the ranks, None when a rank does not report it (an older server)."""
    values = [e.get(field) for e in loads]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    return float(sum(values))  # type: ignore[arg-type]


def reading_from_metrics(text: str, at: float) -> Reading:
    m = parse_prometheus(text, METRIC_NAMES)
    if "sglang:num_running_reqs" not in m:
        raise ValueError("no SGLang load gauges in /metrics")
    running = m["sglang:num_running_reqs"]
    return Reading(
        at=at,
        running=running,
        waiting=m.get("sglang:num_queue_reqs", 0.0),
        max_running=int(m["sglang:max_running_requests"]) if m.get("sglang:max_running_requests") else None,
        accept_length=m.get("sglang:spec_accept_length") or None,
        accept_steps=gauge_steps(running),
        # A labelled counter has no sample until its first child exists (no request finished).
        tokens_total=m.get("sglang:generation_tokens_total", 0.0) if "sglang:spec_verify_calls_total" in m else None,
        verify_total=m.get("sglang:spec_verify_calls_total"),
    )


def reading_from_get_load(doc: Any, at: float) -> Reading:
    entries = doc if isinstance(doc, list) else [doc]
    entries = [e for e in entries if isinstance(e, Mapping)]
    if not entries:
        raise ValueError("empty /get_load answer")
    total = sum(e.get("num_reqs", 0) for e in entries)
    waiting = sum(e.get("num_waiting_reqs", 0) for e in entries)
    return Reading(at=at, running=float(total - waiting), waiting=float(waiting))
