"""The per-request recorder on its own: metric samples in the Prometheus text format, the JSON
log line, span attributes and the prompt opt-in (spans decoded from their OTLP bytes by the
protobuf library; the end-to-end path through Jaeger is in test_obs_traces.py)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client.parser import text_string_to_metric_families

from fleet.types import Decision, Features
from proxy.settings import Settings
from proxy.telemetry import SpecrouteTelemetry
from proxy.telemetry import names as n
from proxy.telemetry.logs import RequestLog
from proxy.telemetry.names import MAX_MODEL_CHARS
from proxy.telemetry.tracing import LocalExport, Tracing

PROMPT = "the secret prompt text"
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": 32,
    "temperature": 0.25,
    "top_p": 0.5,
    "seed": 7,
    "stream": True,
}
FIRST = b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","model":"served/m","choices":[]}\n\n'


class Decoded(SpanExporter):
    """Spans as the exporter receives them, parsed back from their wire format."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def export(self, batch: Any) -> SpanExportResult:
        for encoded in batch:  # requests' spans, ScopeSpans.spans fields each
            for message in ScopeSpans.FromString(b"".join(encoded.parts)).spans:
                span = MessageToDict(message)
                span["attrs"] = {kv["key"]: next(iter(kv["value"].values())) for kv in span.get("attributes", [])}
                self.spans.append(span)
        return SpanExportResult.SUCCESS


def telemetry(exporter: Decoded | None = None, **settings: Any) -> SpecrouteTelemetry:
    tracing = Tracing("http/protobuf", "test", exporter=exporter) if exporter is not None else None
    return SpecrouteTelemetry(Settings(policy="spec", **settings), "test", tracing=tracing)


def failover_then_stream(t: SpecrouteTelemetry, first: bytes = FIRST) -> None:
    """The hook calls of a streamed request whose spec attempt failed and base answered (its
    first chunk `first`)."""
    hooks = t.request_hooks("/v1/chat/completions")
    hooks.received(endpoint="/v1/chat/completions", request_id="req-1", headers={"user-agent": "t"}, body_bytes=99)
    hooks.decided(
        decision=Decision("spec", "static", {"spec.load": 3.0, "spec.alpha": 0.6}),
        features=Features(prompt_tokens=10, max_tokens=32, stream=True),
        model="m",
        override=None,
        body=BODY,
    )
    hooks.attempt_started(pool="spec", instance="http://127.0.0.1:1", attempt=1)
    hooks.attempt_failed(error="connect", retryable=True)
    hooks.attempt_started(pool="base", instance="http://127.0.0.1:2", attempt=2)
    outgoing: dict[str, str] = {}
    hooks.outgoing_headers(outgoing)
    hooks.upstream_headers(status=200, headers={})
    extra = hooks.response_headers(waited_s=0.0)
    assert extra[0][0] == b"x-specroute-overhead-ms" and float(extra[0][1]) >= 0
    hooks.first_chunk(first)
    hooks.attempt_finished(status=200)
    hooks.finished(
        status=200,
        error_type=None,
        prompt_tokens=10,
        completion_tokens=5,
        finish_reasons=("stop",),
        client_disconnected=False,
        waited_s=0.0,
    )


def samples(t: SpecrouteTelemetry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = t.metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_series_alerts_watch_exist_at_zero_before_any_event() -> None:
    """A user's probe: the failover and authentication series appeared only at their first event,
    so an alert on their rate had nothing to read until then."""
    import re
    from pathlib import Path

    from proxy.telemetry.names import AUTH_REFUSED_REASONS

    got = samples(telemetry(request_log=False))
    for pool, other in (("spec", "base"), ("base", "spec")):
        assert got[("specroute_failovers_total", (("from_pool", pool), ("to_pool", other)))] == 0
        assert got[("specroute_retries_total", (("pool", pool),))] == 0
    for reason in AUTH_REFUSED_REASONS:
        assert got[("specroute_auth_refused_total", (("reason", reason),))] == 0
    # Every reason proxy.auth refuses with is one of them (its last argument, a string literal).
    source = (Path(__file__).resolve().parents[2] / "proxy" / "auth.py").read_text()
    used = set(re.findall(r'AuthRefused\((?:[^()]|\([^()]*\))*?,\s*"([a-z_]+)",?\s*\)', source))
    assert used and used <= set(AUTH_REFUSED_REASONS), used


def test_the_per_outcome_pool_and_instance_series_exist_at_zero_before_any_request() -> None:
    """From an operator's probe: requests, decisions, tokens and in-flight series appeared with
    their first request, so an alert on them had nothing to read before. Only combinations that
    can occur: no pool that is not configured, no `refused` after an attempt, no `ok` without one."""
    spec, base = ["http://s0:1", "http://s1:1"], ["http://b0:1"]
    t = SpecrouteTelemetry(Settings(policy="goodput", spec_urls=spec, base_urls=base, request_log=False), "test")
    got = samples(t)
    requests = {
        dict(labels)["pool"] + "/" + dict(labels)["outcome"]
        for (name, labels) in got
        if name == "specroute_requests_total"
    }
    assert requests == {
        *(
            f"{pool}/{outcome}"
            for pool in ("spec", "base")
            for outcome in ("ok", "client_error", "error", "client_disconnected")
        ),
        *(f"none/{outcome}" for outcome in ("client_error", "refused", "error", "client_disconnected")),
    }
    assert all(v == 0 for (name, _), v in got.items() if name == "specroute_requests_total")
    assert {dict(labels)["policy"] for (name, labels) in got if name == "specroute_requests_total"} == {"goodput"}
    for pool, urls in (("spec", spec), ("base", base)):
        for url in urls:
            assert got[("specroute_in_flight_requests", (("instance", url), ("pool", pool)))] == 0
        for kind in ("input", "output"):
            assert got[("specroute_tokens_total", (("pool", pool), ("type", kind)))] == 0
    for reason, pool in (("spec-sooner", "spec"), ("base-sooner", "base"), ("stale", "base"), ("spec-full", "base")):
        assert got[("specroute_decisions_total", (("pool", pool), ("reason", reason)))] == 0
    assert ("specroute_decisions_total", (("pool", "spec"), ("reason", "base-sooner"))) not in got

    # One pool only: nothing for the other, and no decision series (most reasons never come).
    alone = samples(SpecrouteTelemetry(Settings(policy="goodput", base_urls=base, request_log=False), "test"))
    mine = ("specroute_requests_total", "specroute_tokens_total", "specroute_in_flight_requests")
    pools = {dict(labels)["pool"] for (name, labels) in alone if name in mine}
    assert pools == {"base", "none"}
    assert not [name for (name, _) in alone if name == "specroute_decisions_total"]
    # From the same probe: retries and failovers for a pool that is not configured.
    assert [labels for (name, labels) in alone if name == "specroute_retries_total"] == [(("pool", "base"),)]
    assert not [name for (name, _) in alone if name == "specroute_failovers_total"]


def test_the_process_series_every_exporter_has_are_on_metrics() -> None:
    """From an operator's probe: /metrics had no process series (memory, CPU, descriptors), so
    a dashboard watching every service's showed nothing for the proxy."""
    got = samples(telemetry(request_log=False))
    names = {name for (name, _) in got}
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds", "python_info"):
        assert name in names, name
    assert got[("process_resident_memory_bytes", ())] > 1_000_000
    assert got[("process_open_fds", ())] >= 3
    assert got[("process_start_time_seconds", ())] > 1_600_000_000


def test_every_outcome_and_declared_decision_is_one_the_code_gives() -> None:
    import re
    from pathlib import Path

    from policies import registry
    from proxy.telemetry.request import outcome_of

    assert outcome_of(200, None) in n.ATTEMPTED_OUTCOMES and outcome_of(429, "fleet_overloaded") == "refused"
    assert "refused" not in n.ATTEMPTED_OUTCOMES and "ok" not in n.UNATTEMPTED_OUTCOMES
    root = Path(__file__).resolve().parents[2] / "policies"
    sources = "\n".join(path.read_text() for path in root.glob("*.py") if path.name != "registry.py")
    for policy in registry.names():
        declared = registry.decisions_of(policy)
        assert declared, policy
        for reason, pool in declared:
            # A reason the code names as a literal, each pool named where the code names it.
            assert re.search(rf'(reason\s*=\s*|else\s+)"{re.escape(reason)}"', sources), reason
            literal = re.findall(rf'Decision\(pool="(spec|base)", reason="{re.escape(reason)}"', sources)
            assert not literal or pool in literal, (policy, reason, pool)


def test_ejections_are_counted_per_instance_and_rule_from_zero() -> None:
    """From an operator's probe: an ejection between two scrapes was invisible (a gauge only)."""
    spec, base = ["http://s0:1", "http://s1:1"], ["http://b0:1"]
    t = telemetry(request_log=False, spec_urls=spec, base_urls=base)
    got = samples(t)
    for pool, urls in (("spec", spec), ("base", base)):
        for url in urls:
            for reason in n.EJECTION_REASONS:
                labels = (("instance", url), ("pool", pool), ("reason", reason))
                assert got[("specroute_upstream_ejections_total", labels)] == 0
    t.upstream_ejected("spec", "http://s1:1", "slow-first-token")
    labels = (("instance", "http://s1:1"), ("pool", "spec"), ("reason", "slow-first-token"))
    assert samples(t)[("specroute_upstream_ejections_total", labels)] == 1


def test_metrics_count_requests_decisions_failovers_and_release_in_flight() -> None:
    t = telemetry(request_log=False)
    failover_then_stream(t)
    got = samples(t)
    assert got[("specroute_requests_total", (("outcome", "ok"), ("policy", "spec"), ("pool", "base")))] == 1
    assert got[("specroute_decisions_total", (("pool", "spec"), ("reason", "static")))] == 1
    assert got[("specroute_failovers_total", (("from_pool", "spec"), ("to_pool", "base")))] == 1
    for instance, pool in (("http://127.0.0.1:1", "spec"), ("http://127.0.0.1:2", "base")):
        assert got[("specroute_in_flight_requests", (("instance", instance), ("pool", pool)))] == 0
    assert got[("specroute_time_to_first_token_seconds_count", (("pool", "base"),))] == 1
    assert got[("specroute_inter_token_seconds_count", (("pool", "base"),))] == 1
    assert got[("specroute_request_duration_seconds_count", (("pool", "base"),))] == 1
    assert got[("specroute_overhead_seconds_count", ())] == 1
    assert got[("specroute_tokens_total", (("pool", "base"), ("type", "output")))] == 5


def test_histograms_use_the_genai_bucket_boundaries() -> None:
    t = telemetry(request_log=False)
    failover_then_stream(t)
    got = samples(t)

    def bounds(metric: str) -> list[float]:
        return sorted(
            float(dict(labels)["le"])
            for (name, labels) in got
            if name == metric + "_bucket" and dict(labels).get("pool") == "base"
        )

    assert bounds("specroute_time_to_first_token_seconds") == [*n.BUCKETS_TTFT, float("inf")]
    assert bounds("specroute_inter_token_seconds") == [*n.BUCKETS_INTER_TOKEN, float("inf")]
    assert bounds("specroute_request_duration_seconds") == [*n.BUCKETS_DURATION, float("inf")]


def test_histogram_buckets_tell_the_pools_apart_and_reach_the_timeouts() -> None:
    """From an operator's probe: every inter-token sample of both pools fell in le=0.01, and the
    first-token and duration histograms stopped at 10 s and 81.92 s under 120 s and 600 s
    timeouts."""
    t = telemetry(request_log=False)
    gaps = {"spec": 0.003, "base": 0.02}  # real per-token gaps: 2-60 ms
    for pool, gap in gaps.items():
        t.metrics.finished(pool, "spec", "ok", 90.0, 0.0, 15.0, gap, 10, 100)
    got = samples(t)

    def first_bucket(metric: str, pool: str) -> float:
        """The smallest le whose cumulative count holds the pool's one sample."""
        return min(
            float(dict(labels)["le"])
            for (name, labels), value in got.items()
            if name == metric + "_bucket" and dict(labels)["pool"] == pool and value == 1
        )

    spec, base = (first_bucket("specroute_inter_token_seconds", pool) for pool in ("spec", "base"))
    assert spec == 0.003 and base == 0.02
    fine = [b for b in n.BUCKETS_INTER_TOKEN if 0.001 <= b <= 0.1]
    assert len(fine) >= 10 and all(high / low <= 2 for low, high in zip(fine, fine[1:]))
    assert first_bucket("specroute_time_to_first_token_seconds", "spec") == 20.0  # not +Inf past 10 s
    assert first_bucket("specroute_request_duration_seconds", "spec") == 163.84  # not +Inf past 81.92 s
    defaults = Settings.model_fields
    assert n.BUCKETS_TTFT[-1] >= defaults["first_token_timeout_s"].default
    assert n.BUCKETS_DURATION[-1] >= defaults["total_timeout_s"].default
    assert len(n.BUCKETS_TTFT) + len(n.BUCKETS_INTER_TOKEN) + len(n.BUCKETS_DURATION) <= 60


def test_one_json_log_line_per_request_without_prompt_text() -> None:
    t = telemetry()
    stream = io.BytesIO()
    t.request_log = RequestLog(stream)
    failover_then_stream(t)
    log_lines = stream.getvalue().decode().splitlines()
    assert len(log_lines) == 1
    assert PROMPT not in log_lines[0]
    line = json.loads(log_lines[0])
    assert line["request_id"] == "req-1"
    assert (line["pool"], line["instance"], line["status"], line["reason"]) == (
        "base",
        "http://127.0.0.1:2",
        200,
        "static+failover",
    )
    assert (line["prompt_tokens"], line["completion_tokens"], line["attempts"]) == (10, 5, 2)
    assert line["ttft_ms"] is not None and line["duration_ms"] >= line["ttft_ms"]


def test_spans_carry_genai_attributes_and_no_prompt_by_default() -> None:
    exporter = Decoded()
    t = telemetry(exporter, request_log=False)
    failover_then_stream(t)
    t.tracing.flush()  # type: ignore[union-attr]
    spans = {(s["name"], s["attrs"].get(n.ATTEMPT_NUMBER)): s for s in exporter.spans}
    server = spans[("POST /v1/chat/completions", None)]
    route = spans[(n.SPAN_DECISION, None)]
    failed, answered = spans[("chat m", "1")], spans[("chat m", "2")]  # int64 as strings in JSON
    assert server["kind"] == "SPAN_KIND_SERVER" and answered["kind"] == "SPAN_KIND_CLIENT"
    assert {route["parentSpanId"], failed["parentSpanId"], answered["parentSpanId"]} == {server["spanId"]}
    assert route["attrs"]["specroute.decision.spec.alpha"] == 0.6
    assert failed["attrs"][n.ERROR_TYPE] == "connect" and failed["status"]["code"] == "STATUS_CODE_ERROR"
    a = answered["attrs"]
    assert (a[n.GEN_AI_RESPONSE_ID], a[n.GEN_AI_RESPONSE_MODEL]) == ("chatcmpl-abc", "served/m")
    assert (a[n.GEN_AI_REQUEST_TEMPERATURE], a[n.GEN_AI_REQUEST_TOP_P], a[n.GEN_AI_REQUEST_SEED]) == (0.25, 0.5, "7")
    assert a[n.GEN_AI_RESPONSE_FINISH_REASONS] == {"values": [{"stringValue": "stop"}]}
    assert a[n.GEN_AI_REQUEST_STREAM] is True
    assert [e["name"] for e in answered["events"]] == [n.EVENT_FIRST_TOKEN]
    for span in spans.values():
        assert PROMPT not in json.dumps(span)


@pytest.mark.parametrize(
    "first",
    [
        # An upstream that echoes the request first, and one that writes its keys in another order:
        # the ids inside (a tool call's) are request or completion data, not the response's id.
        b'data: {"messages":[{"role":"tool","tool_call_id":"call-' + PROMPT.encode() + b'"}],"id":"x"}\n\n',
        b'{"choices":[{"message":{"tool_calls":[{"id":"call-' + PROMPT.encode() + b'"}]}}],"id":"chatcmpl-1"}',
    ],
    ids=["echo", "reordered"],
)
def test_only_the_first_key_of_the_first_object_is_taken_as_the_response_id(first: bytes) -> None:
    exporter = Decoded()
    t = telemetry(exporter, request_log=False)
    failover_then_stream(t, first)
    t.tracing.flush()  # type: ignore[union-attr]
    answered = [s for s in exporter.spans if s["name"] == "chat m"][-1]
    assert n.GEN_AI_RESPONSE_ID not in answered["attrs"]
    assert PROMPT not in json.dumps(exporter.spans)


def test_prompt_recorded_only_when_opted_in() -> None:
    exporter = Decoded()
    t = telemetry(exporter, request_log=False, trace_content=True)
    failover_then_stream(t)
    t.tracing.flush()  # type: ignore[union-attr]
    attempts = [s for s in exporter.spans if s["name"] == "chat m"]
    messages = json.loads(attempts[-1]["attrs"][n.GEN_AI_INPUT_MESSAGES])
    assert messages == [{"role": "user", "parts": [{"type": "text", "content": PROMPT}]}]


def test_span_encoder_writes_what_the_sdk_encoder_writes() -> None:
    """The hand-written OTLP encoder against the SDK's own, field for field, every value type."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

    from proxy.telemetry.otlp import export_request

    tracing = Tracing("http/protobuf", "test", exporter=Decoded())
    assert isinstance(tracing.export, LocalExport)
    encoder = tracing.export.writer.encoder
    state = TraceState([("vendor", "x1")])
    parent = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1), trace_state=state)
    context = SpanContext(0xABC, 0x123, is_remote=False, trace_flags=TraceFlags(1), trace_state=state)
    attributes = {
        "s": "text é",
        "i": 7,
        "neg": -3,
        "f": 0.25,
        "b": False,
        "list": ["a", "b"],
        n.REQUEST_ID: "id é" * 40,
    }
    static = encoder.block(("test",), lambda: {"s": "text é", "i": 7})
    dynamic = {"neg": -3, "f": 0.25, "b": False, "list": ["a", "b"], n.REQUEST_ID: "id é" * 40}  # a long unique one
    mine = encoder.span(
        "op",
        0xABC,
        0x123,
        state,
        0xDEF,
        True,
        SpanKind.CLIENT,
        10,
        20,
        static,
        dynamic,
        [("first", 15)],
        StatusCode.ERROR,
        "boom",
    )
    sdk = ReadableSpan(
        name="op",
        context=context,
        parent=parent,
        resource=tracing.resource,
        attributes=attributes,
        events=[Event("first", timestamp=15)],
        kind=SpanKind.CLIENT,
        status=Status(StatusCode.ERROR, "boom"),
        start_time=10,
        end_time=20,
        instrumentation_scope=tracing.scope,
    )
    decoded = ExportTraceServiceRequest.FromString(export_request(tracing.resource, tracing.scope, [mine]))
    assert decoded == encode_spans([sdk])


def test_numbers_beyond_int64_in_a_body_do_not_corrupt_the_export() -> None:
    """A client's `"max_tokens": 1e30` or `"seed": 1e20` becomes an int attribute; written as an
    over-long varint it made the whole OTLP batch unreadable, other requests' spans included."""
    exporter = Decoded()
    t = telemetry(exporter, request_log=False)
    hooks = t.request_hooks("/v1/chat/completions")
    hooks.received(endpoint="/v1/chat/completions", request_id="req-big", headers={}, body_bytes=99)
    hooks.decided(
        decision=Decision("spec", "static", {}),
        features=Features(prompt_tokens=10, max_tokens=None, stream=False),
        model="m",
        override=None,
        body=BODY | {"max_tokens": 1e30, "seed": 1e20, "stream": False},
    )
    hooks.attempt_started(pool="spec", instance="http://127.0.0.1:1", attempt=1)
    hooks.first_chunk(b"{}")
    hooks.attempt_finished(status=200)
    hooks.finished(
        status=200,
        error_type=None,
        prompt_tokens=10,
        completion_tokens=10**21,
        finish_reasons=("stop",),
        client_disconnected=False,
        waited_s=0.0,
    )
    failover_then_stream(t)  # another request in the same batch
    t.tracing.flush()  # type: ignore[union-attr]
    attempt = next(
        s
        for s in exporter.spans
        if s["name"] == "chat m"
        and s["attrs"].get(n.ATTEMPT_NUMBER) == "1"
        and n.GEN_AI_REQUEST_MAX_TOKENS in s["attrs"]
        and s["attrs"][n.GEN_AI_REQUEST_SEED] != "7"
    )
    assert attempt["attrs"][n.GEN_AI_REQUEST_MAX_TOKENS] == str(int(1e30))
    assert attempt["attrs"][n.GEN_AI_USAGE_OUTPUT_TOKENS] == str(10**21)
    assert len([s for s in exporter.spans if s["name"] == "POST /v1/chat/completions"]) == 2


def test_root_context_fast_paths_decide_as_the_sdk_samplers() -> None:
    """The request path skips the sampler call for the default and always_on samplers; what it
    decides must be what the SDK's sampler decides, for a new trace and under a client's
    sampled or unsampled traceparent (its tracestate kept)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import sampling
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    tracing = Tracing("http/protobuf", "test", exporter=Decoded())
    state = TraceState([("vendor", "x")])
    parents = [None] + [SpanContext(0xABC, 0xDEF, True, TraceFlags(flags), state) for flags in (0, 1)]
    try:
        for sampler in (sampling.DEFAULT_ON, sampling.ALWAYS_ON):
            tracing.sampler = sampler
            for parent in parents:
                parent_context = None if parent is None else trace.set_span_in_context(trace.NonRecordingSpan(parent))
                trace_id, span_id, sampled, trace_state = tracing.root_context(
                    parent, parent_context, "/v1/chat/completions"
                )
                want = sampler.should_sample(parent_context, trace_id, "/v1/chat/completions")
                assert sampled == want.decision.is_sampled(), (sampler, parent)
                assert trace_state == (want.trace_state or TraceState()), (sampler, parent)
                if parent is not None:
                    assert trace_id == parent.trace_id and span_id != parent.span_id
    finally:
        tracing.shutdown()


def test_numbers_write_what_the_attribute_encoder_writes() -> None:
    """SpanEncoder.numbers (one struct call per layout of a decision's scores) against the
    one-by-one encoder, which the test above checks against the SDK: floats and bools, a layout
    seen before, and a mapping with an int (no layout: one by one)."""
    from proxy.telemetry.otlp import SpanEncoder

    encoder = SpanEncoder()
    for scores in (
        {"load": 3.0, "stale": True, "alpha": 0.6},
        {"load": 1.5, "stale": False, "alpha": -0.0},
        {"load": 2, "stale": True},
        {},
    ):
        want = SpanEncoder().attributes(b"\x4a", {"p." + key: value for key, value in scores.items()})
        assert encoder.numbers(b"\x4a", "p.", scores) == want, scores


def test_spans_wait_for_their_batch_on_the_loop_and_a_flush_sends_them() -> None:
    """On an event loop a finished request's spans are written with the next ones (or after
    tracing.FLUSH_S); flush() writes and exports what is pending at once."""
    import asyncio

    exporter = Decoded()
    t = telemetry(exporter, request_log=False)

    async def one_request() -> None:
        failover_then_stream(t)
        assert exporter.spans == []  # pending: written with the batch, or by its timer
        t.tracing.flush()  # type: ignore[union-attr]

    asyncio.run(one_request())
    assert len([s for s in exporter.spans if s["name"] == "POST /v1/chat/completions"]) == 1
    t.tracing.shutdown()  # type: ignore[union-attr]


def test_export_requests_are_cut_between_requests() -> None:
    """A batch goes out in export requests of at most MAX_REQUEST_BYTES of spans (a collector's
    gRPC limit is 4 MiB), never splitting one request's spans."""
    from proxy.telemetry.otlp import EncodedSpans, chunks
    from proxy.telemetry.spans import SAMPLED_CONTEXT

    items = [EncodedSpans(SAMPLED_CONTEXT, [b"a" * 400, b"b" * 400]), EncodedSpans(SAMPLED_CONTEXT, [b"c" * 900])]
    assert [[len(p) for p in chunk] for chunk in chunks(items, limit=1000)] == [[400, 400], [900]]
    assert [[len(p) for p in chunk] for chunk in chunks(items, limit=100)] == [[400], [400], [900]]


def cached_after_failover(t: SpecrouteTelemetry) -> None:
    """A request credited with a cached prefix on both instances it tried; the one that answered
    reported the tokens it found cached."""
    hooks = t.request_hooks("/v1/chat/completions")
    hooks.received(endpoint="/v1/chat/completions", request_id="req-2", headers={}, body_bytes=99)
    hooks.decided(
        decision=Decision("spec", "spec-sooner", {"cached_spec_tokens": 512.0}, instance="http://127.0.0.1:1"),
        features=Features(prompt_tokens=1100, stream=True, cached={"http://127.0.0.1:1": 512}),
        model="m",
        override=None,
        body=BODY,
    )
    hooks.attempt_started(
        pool="spec", instance="http://127.0.0.1:1", attempt=1, cached_tokens=512, server_kind="sglang"
    )
    hooks.attempt_failed(error="connect", retryable=True)
    hooks.attempt_started(pool="spec", instance="http://127.0.0.1:3", attempt=2, cached_tokens=256, server_kind="vllm")
    hooks.upstream_headers(status=200, headers={})
    hooks.first_chunk(FIRST)
    hooks.attempt_finished(status=200)
    hooks.finished(
        status=200,
        error_type=None,
        prompt_tokens=1100,
        completion_tokens=5,
        finish_reasons=("stop",),
        client_disconnected=False,
        cached_tokens=300,
    )


def test_cached_tokens_credited_and_reported_on_spans_metrics_and_the_log() -> None:
    exporter = Decoded()
    t = telemetry(exporter)
    stream = io.BytesIO()
    t.request_log = RequestLog(stream)
    cached_after_failover(t)
    failover_then_stream(t)  # nothing credited, nothing reported
    t.tracing.flush()  # type: ignore[union-attr]
    traces: dict[str, dict[Any, dict[str, Any]]] = {}
    for span in exporter.spans:
        traces.setdefault(span["traceId"], {})[(span["name"], span["attrs"].get(n.ATTEMPT_NUMBER))] = span
    by_request = {spans[("POST /v1/chat/completions", None)]["attrs"][n.REQUEST_ID]: spans for spans in traces.values()}
    cached, plain = by_request["req-2"], by_request["req-1"]
    # Each attempt carries the credit on its own instance; the answer, the server's report.
    assert cached[("chat m", "1")]["attrs"][n.PREFIX_CREDITED_TOKENS] == "512"  # int64 as a JSON string
    answered = cached[("chat m", "2")]["attrs"]
    assert answered[n.PREFIX_CREDITED_TOKENS] == "256"
    # Each attempt names the kind of server it went to; one of no known kind is not "openai".
    assert cached[("chat m", "1")]["attrs"][n.GEN_AI_PROVIDER_NAME] == "sglang"
    assert answered[n.GEN_AI_PROVIDER_NAME] == "vllm"
    assert {a["attrs"][n.GEN_AI_PROVIDER_NAME] for k, a in plain.items() if k[1]} == {"openai_compatible"}
    assert answered[n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == "300"
    assert n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS not in cached[("chat m", "1")]["attrs"]
    assert cached[(n.SPAN_DECISION, None)]["attrs"]["specroute.decision.cached_spec_tokens"] == 512.0
    for span in plain.values():
        assert (
            n.PREFIX_CREDITED_TOKENS not in span["attrs"]
            and n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS not in span["attrs"]
        )
    got = samples(t)
    assert got[("specroute_prefix_credited_tokens_total", (("pool", "spec"),))] == 256
    assert got[("specroute_prefix_cached_tokens_total", (("pool", "spec"),))] == 300
    assert ("specroute_prefix_cached_tokens_total", (("pool", "base"),)) not in got
    first = json.loads(stream.getvalue().decode().splitlines()[0])
    assert (first["credited_tokens"], first["cached_tokens"]) == (256, 300)


def one_request(t: SpecrouteTelemetry, *, status: int, error_type: str | None, stream: bool = True) -> None:
    """A request answered by one attempt with `status`, ended with `error_type` (None: well)."""
    hooks = t.request_hooks("/v1/chat/completions")
    hooks.received(
        endpoint="/v1/chat/completions", request_id="req-2", headers={"user-agent": "u" * 9000}, body_bytes=9
    )
    hooks.decided(
        decision=Decision("spec", "static", {}),
        features=Features(prompt_tokens=10, max_tokens=32, stream=stream),
        model="m",
        override=None,
        body=BODY,
    )
    hooks.attempt_started(pool="spec", instance="http://127.0.0.1:1", attempt=1)
    hooks.upstream_headers(status=status, headers={})
    hooks.response_headers(waited_s=0.0)
    hooks.first_chunk(FIRST)
    hooks.attempt_finished(status=status)
    hooks.finished(
        status=status,
        error_type=error_type,
        prompt_tokens=None,
        completion_tokens=None,
        finish_reasons=(),
        client_disconnected=False,
    )


@pytest.mark.parametrize(
    ("status", "error_type", "server_error", "attempt_error"),
    [
        (400, "invalid_request_error", None, "invalid_request_error"),  # the client's: no error on the server span
        (429, "overloaded", None, "overloaded"),
        (200, "upstream_disconnected", "upstream_disconnected", "upstream_disconnected"),  # cut after its 200
        (200, "client_disconnected", None, "client_disconnected"),  # the client left: not the server's error
        (503, "status_503", "status_503", "503"),
    ],
)
def test_the_server_span_is_an_error_for_5xx_and_a_response_cut_after_its_200(
    status: int, error_type: str, server_error: str | None, attempt_error: str
) -> None:
    exporter = Decoded()
    t = telemetry(exporter, request_log=False)
    one_request(t, status=status, error_type=error_type)
    t.tracing.flush()  # type: ignore[union-attr]
    server = next(s for s in exporter.spans if s["name"] == "POST /v1/chat/completions")
    attempt = next(s for s in exporter.spans if s["name"] == "chat m")
    assert server["attrs"].get(n.ERROR_TYPE) == server_error
    assert (server["status"].get("code") == "STATUS_CODE_ERROR") == (server_error is not None)
    assert attempt["attrs"][n.ERROR_TYPE] == attempt_error
    assert len(server["attrs"][n.USER_AGENT_ORIGINAL]) == 256


def test_time_to_first_chunk_is_a_streams_only() -> None:
    exporter = Decoded()
    t = telemetry(exporter, request_log=False)
    one_request(t, status=200, error_type=None, stream=False)
    one_request(t, status=200, error_type=None, stream=True)
    t.tracing.flush()  # type: ignore[union-attr]
    attempts = [s["attrs"] for s in exporter.spans if s["name"] == "chat m"]
    assert [n.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK in a for a in attempts] == [False, True]


def test_the_inter_token_gap_is_per_choice_whether_or_not_the_request_is_traced(monkeypatch) -> None:
    """A stream with n choices reports every choice's tokens in one count: the gap is the time
    after the first token over one choice's tokens. `n` was read only for traced requests, so
    untraced ones (the default) reported 1/n of the gap."""
    import time
    import types

    from proxy.telemetry import request as request_module

    clock = [100.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time, time_ns=time.time_ns)
    monkeypatch.setattr(request_module, "time", fake)
    for traced in (False, True):
        t = telemetry(Decoded() if traced else None, request_log=False)
        hooks = t.request_hooks("/v1/chat/completions")
        hooks.received(endpoint="/v1/chat/completions", request_id="r", headers={}, body_bytes=9)
        hooks.decided(
            decision=Decision("base", "static", {}),
            features=Features(prompt_tokens=10, stream=True),
            model="m",
            override=None,
            body={**BODY, "n": 2},
        )
        hooks.attempt_started(pool="base", instance="http://127.0.0.1:2", attempt=1)
        hooks.upstream_headers(status=200, headers={})
        hooks.first_chunk(FIRST)
        clock[0] += 1.9  # 20 tokens per choice after the first: 0.1 s apart
        hooks.attempt_finished(status=200)
        hooks.finished(
            status=200,
            error_type=None,
            prompt_tokens=10,
            completion_tokens=40,
            finish_reasons=("length", "length"),
            client_disconnected=False,
        )
        got = samples(t)
        assert got[("specroute_inter_token_seconds_sum", (("pool", "base"),))] == pytest.approx(0.1), traced


def test_a_request_to_a_path_the_proxy_does_not_serve_is_logged_and_counted_without_its_query() -> None:
    t = telemetry()
    stream = io.BytesIO()
    t.request_log = RequestLog(stream)
    before = t.metrics.render().decode()
    assert "specroute_unknown_path_requests_total 0.0" in before  # an alert has a series from the start
    t.unknown_path("POST", "/v1/embeddings" + "x" * 500, "req-9")
    line = json.loads(stream.getvalue().decode())
    assert (line["request_id"], line["status"], line["outcome"]) == ("req-9", 404, "unknown_url")
    assert line["endpoint"].startswith("POST /v1/embeddings") and len(line["endpoint"]) <= 5 + 200
    assert "specroute_unknown_path_requests_total 1.0" in t.metrics.render().decode()


def test_a_request_refused_by_authentication_is_logged_and_counted() -> None:
    """A review's finding: refusals were only counted, so a request id a client reported could
    not be found. Never the key (the caller has none to give), nor the query string."""
    t = telemetry()
    stream = io.BytesIO()
    t.request_log = RequestLog(stream)
    t.auth_refused("invalid", "POST", "/v1/chat/completions", "req-7", 401)
    line = json.loads(stream.getvalue().decode())
    assert line == {
        "ts": line["ts"],
        "request_id": "req-7",
        "endpoint": "POST /v1/chat/completions",
        "status": 401,
        "outcome": "auth_refused",
        "reason": "invalid",
    }
    assert 'specroute_auth_refused_total{reason="invalid"} 1.0' in t.metrics.render().decode()
    # A stored response's id reads the conversation back: logged as the stored-response lines
    # write it (a review's finding: a key over its limit logged the id it asked for).
    t.auth_refused("key_concurrency", "POST", "/v1/responses/resp_0123abcd/cancel", "req-8", 429)
    t.unknown_path("GET", "/v1/responses/resp_0123abcd/other", "req-9")
    lines = [json.loads(line) for line in stream.getvalue().decode().splitlines()]
    assert [line["endpoint"] for line in lines[1:]] == ["POST /v1/responses/{id}/cancel", "GET /v1/responses/{id}"]
    assert "resp_0123abcd" not in stream.getvalue().decode()


def test_requests_whose_spans_were_dropped_are_counted_from_zero() -> None:
    """From earlier notes: spans the proxy dropped (its export process behind or gone) were only
    logged. The count is the tracing's, read at every scrape."""
    t = telemetry(request_log=False)
    assert samples(t)[("specroute_trace_dropped_requests_total", ())] == 0
    dropped = [0]
    t.metrics.watch_dropped(lambda: dropped[0])
    dropped[0] = 7
    assert samples(t)[("specroute_trace_dropped_requests_total", ())] == 7


def test_log_lines_say_when_in_utc_and_where_from_as_text_or_json() -> None:
    """SPECROUTE_LOG_FORMAT: text lines start with their UTC time; JSON lines are one object; the
    span export process's say so (`source`)."""
    import json
    import logging
    import re

    from proxy.telemetry.logs import log_formatter

    record = logging.LogRecord("specroute.outliers", logging.WARNING, __file__, 1, "ejected %s", ("spec-0",), None)
    record.created = 0.5  # 1970-01-01T00:00:00.500 UTC, whatever the machine's time zone
    record.msecs = 500.0
    text = log_formatter("text").format(record)
    assert text == "1970-01-01T00:00:00.500Z WARNING specroute.outliers: ejected spec-0", text
    marked = log_formatter("text", source="span-export-process").format(record)
    assert re.match(r"^\S+Z WARNING span-export-process specroute.outliers: ejected spec-0$", marked), marked
    line = json.loads(log_formatter("json", source="span-export-process").format(record))
    assert line == {
        "ts": 0.5,
        "level": "WARNING",
        "logger": "specroute.outliers",
        "message": "ejected spec-0",
        "source": "span-export-process",
    }


@pytest.mark.parametrize("opted_in", [False, True])
def test_a_stored_responses_id_is_on_spans_only_with_the_content_opt_in(opted_in: bool) -> None:
    """A review's finding: `resp_...` reads the whole conversation back (GET /v1/responses/{id}),
    so a trace reader who may call the proxy could read prompts and completions."""
    exporter = Decoded()
    t = telemetry(exporter, request_log=False, trace_content=opted_in)
    first = b'event: response.created\ndata: {"response":{"id":"resp_0123abcd","model":"served/m"}}\n\n'
    failover_then_stream(t, first)
    t.tracing.flush()  # type: ignore[union-attr]
    answered = [s for s in exporter.spans if s["name"] == "chat m"][-1]["attrs"]
    assert answered.get(n.GEN_AI_RESPONSE_ID) == ("resp_0123abcd" if opted_in else None)
    assert answered[n.GEN_AI_RESPONSE_MODEL] == "served/m"


def test_a_long_response_model_is_cut_as_the_requests_is() -> None:
    exporter = Decoded()
    t = telemetry(exporter, request_log=False)
    failover_then_stream(t, b'data: {"id":"chatcmpl-1","model":"' + b"M" * 600 + b'"}\n\n')
    t.tracing.flush()  # type: ignore[union-attr]
    answered = [s for s in exporter.spans if s["name"] == "chat m"][-1]["attrs"]
    assert answered[n.GEN_AI_RESPONSE_MODEL] == "M" * MAX_MODEL_CHARS
