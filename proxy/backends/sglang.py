"""SGLang: /server_info describes it; its load comes from GET /v1/loads (0.5.15+), GET /metrics
(with --enable-metrics) or GET /get_load (older), the first it answers. A speculative server's
/metrics also has the token and verify-call counters whose increments are the windowed accept
length, and the recent-interval accept-length gauge: read on the polls fleet.cadence picks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fleet.cadence import gauge_steps, reads_counters
from fleet.readings import MAX_COUNT, Reading, ServerDescription, count_or_none
from proxy.backends.base import Backend
from proxy.backends.prometheus import parse_prometheus

METRIC_NAMES = frozenset(
    {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:generation_tokens_total",
        "sglang:spec_verify_calls_total",
        "sglang:spec_accept_length",
    }
)

RATIO_NAMES = frozenset({"sglang:spec_accept_length"})
"""Gauges that are ratios: averaged over their series (one per dp_rank), not summed."""

MAX_DRAFT_TOKENS = 64
"""More draft tokens per verify step than any speculative server runs (SGLang's EAGLE: 1-16)."""


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
        description = ServerDescription(
            kind=cls.kind,
            speculative=facts["speculative"],
            num_draft_tokens=facts["num_draft_tokens"],
            max_running=(count_or_none(facts["max_running_requests"]) or 0) * facts["replicas"] or None,
            replicas=facts["replicas"],
            time_scale=_twin_scale(doc),
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
        """The reading with a speculative server's token and verify counters. SGLang increments
        spec_verify_calls_total only by a request's count above 0, and a labelled counter has no
        sample before its first increment: absent, both read 0 (so the first requests to finish
        count, rather than becoming the baseline)."""
        m = parse_prometheus(text, METRIC_NAMES, means=RATIO_NAMES)
        if "sglang:num_running_reqs" not in m and "sglang:generation_tokens_total" not in m:
            return reading  # not SGLang's metrics (or no metrics at all): no counters to read
        # The rest as the load reading had it (its engine mark too: one source per server).
        return replace(
            reading,
            accept_length=m.get("sglang:spec_accept_length") or None,
            accept_steps=gauge_steps(reading.running),
            tokens_total=m.get("sglang:generation_tokens_total", 0.0),
            verify_total=m.get("sglang:spec_verify_calls_total", 0.0),
        )


def _twin_scale(doc: Mapping[str, Any]) -> float:
    """A twin's time scale (1 for any other server, and for a value that is no positive number)."""
    scale = doc.get("time_scale") if doc.get("twin") is True else None
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < 1e6:
        return 1.0
    return float(scale)


def _json(text: str) -> Any:
    return json.loads(text)


def server_info_facts(doc: Mapping[str, Any]) -> dict[str, Any]:
    """What /server_info says about speculation and the running cap."""
    algorithm = doc.get("speculative_algorithm")
    steps = count_or_none(doc.get("speculative_num_steps"), MAX_DRAFT_TOKENS) or 0
    return {
        "speculative": bool(algorithm),
        "speculative_algorithm": algorithm,
        "num_draft_tokens": steps if algorithm else 0,
        "speculative_eagle_topk": doc.get("speculative_eagle_topk"),
        "speculative_num_draft_tokens": doc.get("speculative_num_draft_tokens"),
        "max_running_requests": doc.get("max_running_requests"),
        "dp_size": doc.get("dp_size"),
        "replicas": _replicas(doc),
    }


def _replicas(doc: Mapping[str, Any]) -> int:
    """How many times over its max_running_requests the server runs: its data-parallel ranks,
    each a whole replica with that cap (1 with DP attention, whose ranks share one batch)."""
    if doc.get("enable_dp_attention") is True:
        return 1
    return count_or_none(doc.get("dp_size"), 4096) or 1


def reading_from_loads(doc: Mapping[str, Any], at: float) -> Reading:
    """GET /v1/loads: summed over data-parallel ranks; with several, each rank's own mark and
    work beside (Reading.rank_marks)."""
    loads = [entry for entry in doc.get("loads", []) if isinstance(entry, Mapping)]
    if not loads:
        raise ValueError("no loads in /v1/loads answer")
    marks, running, waiting, tokens = _ranks(loads)
    # Its speculative.accept_length is cumulative since start: too slow for routing, not used.
    return Reading(
        at=at,
        running=_sum(loads, "num_running_reqs"),
        waiting=_sum(loads, "num_waiting_reqs"),
        max_running=int(_sum(loads, "max_running_requests")) or None,
        waiting_tokens=_sum(loads, "num_waiting_uncached_tokens"),
        cache_tokens=int(_sum(loads, "max_total_num_tokens")) or None,
        prefill_tokens_total=_total(loads, "total_prefill_uncached_tokens"),
        prefill_busy_us_total=_total(loads, "total_prefill_busy_us"),
        engine_mark=_snapshot_times(loads),
        ranks=len(loads),
        rank_marks=marks,
        rank_running=running,
        rank_waiting=waiting,
        rank_waiting_tokens=tokens,
    )


RankFigures = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], tuple[float, ...]]


def _ranks(loads: list[Mapping[str, Any]]) -> RankFigures:
    """Each rank's snapshot time, running and waiting requests and queued prompt tokens, in
    dp_rank order; empty for one rank, or when a rank's number or time is missing or no count."""
    none: RankFigures = ((), (), (), ())
    if len(loads) < 2:
        return none
    ranks: dict[int, tuple[float, float, float, float]] = {}
    for entry in loads:
        rank = count_or_none(entry.get("dp_rank"), 4096)
        mark = entry.get("timestamp")
        if rank is None or rank in ranks or isinstance(mark, bool) or not isinstance(mark, int | float):
            return none
        if not 0 <= mark <= MAX_COUNT:
            return none
        ranks[rank] = (
            float(mark),
            float(count_or_none(entry.get("num_running_reqs")) or 0),
            float(count_or_none(entry.get("num_waiting_reqs")) or 0),
            float(count_or_none(entry.get("num_waiting_uncached_tokens")) or 0),
        )
    order = sorted(ranks)
    if order != list(range(len(order))):
        return none  # not ranks 0..N-1: no rank an x-data-parallel-rank header could name by position
    columns = [tuple(ranks[r][i] for r in order) for i in range(4)]
    return columns[0], columns[1], columns[2], columns[3]


def _snapshot_times(loads: list[Mapping[str, Any]]) -> float | None:
    """The ranks' snapshot times (epoch seconds, to the fraction: a snapshot is republished within
    a second), summed: it moves while any rank's scheduler publishes. None when a rank has none."""
    total = 0.0
    for entry in loads:
        value = entry.get("timestamp")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_COUNT:
            return None
        total += float(value)
    return total


def _sum(loads: list[Mapping[str, Any]], field: str) -> float:
    """A count summed over the ranks (0 where a rank leaves it out); ValueError for a value that
    is no count (a string, a bool, NaN, a negative or absurd number)."""
    total = 0
    for entry in loads:
        value = entry.get(field, 0)
        count = count_or_none(value)
        if count is None:
            raise ValueError(f"/v1/loads {field} is not a count: {value!r}")
        total += count
    return float(total)


def _total(loads: list[Mapping[str, Any]], field: str) -> float | None:
    """A counter summed over the ranks, None when a rank does not report it (an older server)."""
    if not all(field in e for e in loads):
        return None
    return _sum(loads, field)


def reading_from_metrics(text: str, at: float) -> Reading:
    m = parse_prometheus(text, METRIC_NAMES, means=RATIO_NAMES)
    if "sglang:num_running_reqs" not in m:
        raise ValueError("no SGLang load gauges in /metrics")
    running = m["sglang:num_running_reqs"]
    # No cap here: SGLang exports none (only max_running_requests_under_SLO, rarely set); it
    # comes from /server_info.
    return Reading(
        at=at,
        running=running,
        waiting=m.get("sglang:num_queue_reqs", 0.0),
        accept_length=m.get("sglang:spec_accept_length") or None,
        accept_steps=gauge_steps(running),
        # A labelled counter has no sample before its first increment: absent reads 0 (as
        # with_counters; only a speculative pool's counters are used).
        tokens_total=m.get("sglang:generation_tokens_total", 0.0),
        verify_total=m.get("sglang:spec_verify_calls_total", 0.0),
        # No engine mark: SGLang's token counters are its front's, counted as requests finish.
    )


def reading_from_get_load(doc: Any, at: float) -> Reading:
    entries = doc if isinstance(doc, list) else [doc]
    entries = [e for e in entries if isinstance(e, Mapping)]
    if not entries:
        raise ValueError("empty /get_load answer")
    total = _sum(entries, "num_reqs")
    waiting = _sum(entries, "num_waiting_reqs")
    return Reading(at=at, running=max(total - waiting, 0.0), waiting=waiting)
