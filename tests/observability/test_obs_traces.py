"""Traces end to end: the OpenAI SDK -> specroute (a real process) -> twin SGLang servers with
--enable-trace, all exporting to a real Jaeger; every assertion reads Jaeger's query API."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from obs_jaeger import Jaeger, by_name, poll
from prometheus_client.parser import text_string_to_metric_families

from sim.testing import RunningTwin, TwinSpec, twins

# The first test may build Jaeger from source (about 6 minutes on 2 cores) when `make jaeger` has
# not run yet; the suite-wide 300 s bound would stop it half-way.
pytestmark = pytest.mark.timeout(1200)

SERVER, INTERNAL_KIND, SERVER_KIND, CLIENT_KIND = "POST /v1/chat/completions", 1, 2, 3
MODEL = "specroute/twin"
PROMPT = "Tell me about speculative decoding, briefly."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """`specroute serve` as a user runs it: a process configured by environment variables."""

    def __init__(self, env: dict[str, str], log_path: Path, cwd: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            env={**os.environ, "SPECROUTE_LOG_LEVEL": "warning", **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
        )
        poll(self._ready, 60, "specroute to answer /health")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"specroute exited: {self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and "request_id" in record:
                    lines.append(record)
        return lines

    def stop(self) -> int:
        self.process.terminate()
        try:
            code = self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(10)
        self._log.close()
        return code


@contextlib.contextmanager
def proxy(tmp_path: Path, name: str, env: dict[str, str]) -> Iterator[Proxy]:
    running = Proxy(env, tmp_path / f"{name}.log")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def fleet(jaeger: Jaeger) -> Iterator[tuple[RunningTwin, RunningTwin]]:
    """A spec and a base twin exporting their request spans to Jaeger over OTLP grpc."""
    trace_args = ("--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{jaeger.otlp_grpc}")
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "sglang"}
    with twins(
        TwinSpec("spec", time_scale=10, args=trace_args + ("--output-len", "fixed:12")),
        TwinSpec("base", time_scale=10, args=trace_args + ("--output-len", "fixed:12")),
        env=env,
    ) as (spec, base):
        yield spec, base


def proxy_env(jaeger: Jaeger, protocol: str, service: str, spec_url: str, base_url: str) -> dict[str, str]:
    endpoint = jaeger.otlp_grpc_endpoint if protocol == "grpc" else jaeger.otlp_http_endpoint
    return {
        "SPECROUTE_SPEC_URLS": spec_url,
        "SPECROUTE_BASE_URLS": base_url,
        "SPECROUTE_POLICY": "spec",  # a fixed decision, so the test knows the pool
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_SERVICE_NAME": service,
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=obs-test,team=routing",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


def client_traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-00f067aa0ba902b7-01"


def new_trace_id() -> str:
    return os.urandom(16).hex()


def trace_id_of(headers: httpx.Headers) -> str:
    traceresponse = headers.get("traceresponse")
    assert traceresponse, f"no traceresponse header in {dict(headers)}"
    return traceresponse.split("-")[1]


def full_trace(spans: list[dict[str, Any]], attempts: int = 1) -> bool:
    return (
        len(by_name(spans, SERVER)) == 1
        and len(by_name(spans, "specroute.route")) == 1
        and len([s for s in spans if s["kind"] == CLIENT_KIND]) == attempts
        and len([s for s in spans if s["service"] == "sglang"]) >= 1
    )


def one(spans: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [s for s in spans if all(s.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one span with {match}, got {[(s['service'], s['name']) for s in found]}"
    return found[0]


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_streaming_and_json_requests_are_traced_through_proxy_and_twin(
    jaeger: Jaeger, fleet: tuple[RunningTwin, RunningTwin], tmp_path: Path, protocol: str
) -> None:
    spec, base = fleet
    service = "specroute-" + protocol.replace("/", "-")
    with proxy(tmp_path, service, proxy_env(jaeger, protocol, service, spec.url, base.url)) as p:
        # Streaming, in a trace the client started: the proxy joins it.
        trace_id = new_trace_id()
        stream = p.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=12,
            temperature=0.7,
            top_p=0.9,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"traceparent": client_traceparent(trace_id)},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
        spans = jaeger.wait_for_spans(trace_id, full_trace)
        check_trace(spans, spec, stream=True, response_id=chunks[0].id)
        server = one(spans, name=SERVER)
        assert server["parentSpanId"] == "00f067aa0ba902b7"
        assert server["resource"]["deployment.environment"] == "obs-test"
        assert server["resource"]["service.name"] == service

        # Not streaming, no client trace: the response's traceresponse header names the trace.
        raw = p.client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=12,
            temperature=0.7,
            top_p=0.9,
        )
        completion = raw.parse()
        assert float(raw.headers["x-specroute-overhead-ms"]) >= 0
        spans = jaeger.wait_for_spans(trace_id_of(raw.headers), full_trace)
        check_trace(spans, spec, stream=False, response_id=completion.id)
        assert not one(spans, name=SERVER).get("parentSpanId")
        assert service in jaeger.services()

        # The same two requests in the Prometheus text format.
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(httpx.get(p.url + "/metrics", timeout=10).text)
            for s in family.samples
        }
        assert samples[("specroute_requests_total", (("outcome", "ok"), ("policy", "spec"), ("pool", "spec")))] == 2
        assert samples[("specroute_time_to_first_token_seconds_count", (("pool", "spec"),))] == 1  # streams only
        assert samples[("specroute_request_duration_seconds_count", (("pool", "spec"),))] == 2
        assert samples[("specroute_overhead_seconds_count", ())] == 2
        assert samples[("specroute_in_flight_requests", (("instance", spec.url), ("pool", "spec")))] == 0
        assert ("specroute_snapshot_age_seconds", (("pool", "spec"),)) in samples
        assert [line["trace_id"] for line in p.log_lines()] == [trace_id, trace_id_of(raw.headers)]


def check_trace(spans: list[dict[str, Any]], spec: RunningTwin, *, stream: bool, response_id: str) -> None:
    server = one(spans, name=SERVER)
    route = one(spans, name="specroute.route")
    attempt = one(spans, kind=CLIENT_KIND)
    backend = one(spans, service="sglang")
    # Parentage: server -> route, server -> attempt -> the twin's own request span.
    assert route["parentSpanId"] == server["spanId"] and route["kind"] == INTERNAL_KIND
    assert attempt["parentSpanId"] == server["spanId"]
    assert backend["parentSpanId"] == attempt["spanId"]
    assert {s["traceId"] for s in spans} == {server["traceId"]}

    assert server["kind"] == SERVER_KIND
    s = server["attrs"]
    assert (s["http.request.method"], s["http.route"], s["http.response.status_code"]) == (
        "POST",
        "/v1/chat/completions",
        200,
    )
    r = route["attrs"]
    assert (r["specroute.policy"], r["specroute.pool"], r["specroute.reason"]) == ("spec", "spec", "static")
    for key in ("spec.load", "base.load", "spec.stale", "base.stale"):
        assert "specroute.decision." + key in r, f"decision input {key} missing from {sorted(r)}"

    a = attempt["attrs"]
    assert attempt["name"] == f"chat {MODEL}"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "sglang"
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 12
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (0.7, 0.9)
    assert a["gen_ai.response.id"] == response_id
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.output_tokens"] == 12 and a["gen_ai.usage.input_tokens"] > 0
    assert (a["server.address"], a["server.port"]) == ("127.0.0.1", spec.port)
    assert a["gen_ai.request.stream"] is stream
    if stream:
        assert 0 < a["gen_ai.response.time_to_first_chunk"]
    else:  # the conventions' time to first chunk is a stream's
        assert "gen_ai.response.time_to_first_chunk" not in a
    assert [e["name"] for e in attempt.get("events", [])] == ["gen_ai.first_token"]
    assert "error.type" not in a
    # The attempt span lasts until the relayed response ended, past the backend's own span.
    assert int(attempt["endTimeUnixNano"]) >= int(backend["endTimeUnixNano"])
    assert int(server["endTimeUnixNano"]) >= int(attempt["endTimeUnixNano"])
    assert backend["attrs"]["gen_ai.usage.completion_tokens"] == 12
    for span in spans:
        assert PROMPT not in json.dumps(span["attrs"]), "prompt text on a span without the opt-in"


def test_a_responses_api_stream_is_traced_as_the_chat_it_amounts_to(
    jaeger: Jaeger, fleet: tuple[RunningTwin, RunningTwin], tmp_path: Path
) -> None:
    spec, base = fleet
    service = "specroute-responses"
    with proxy(tmp_path, service, proxy_env(jaeger, "http/protobuf", service, spec.url, base.url)) as p:
        trace_id = new_trace_id()
        events = list(
            p.client.responses.create(
                model=MODEL,
                input=PROMPT,
                max_output_tokens=14,
                temperature=0.7,
                stream=True,
                extra_headers={"traceparent": client_traceparent(trace_id)},
            )
        )
        final = events[-1].response  # type: ignore[union-attr]
        assert final.usage is not None
        spans = jaeger.wait_for_spans(trace_id, lambda found: len(found) >= 4)
        assert one(spans, name="POST /v1/responses")["attrs"]["http.route"] == "/v1/responses"
        a = one(spans, kind=CLIENT_KIND)["attrs"]
        # A stored response's id reads the conversation back: on spans only with the opt-in.
        assert "gen_ai.response.id" not in a and a["gen_ai.request.max_tokens"] == 14
        assert a["gen_ai.request.temperature"] == 0.7 and a["gen_ai.request.stream"] is True
        assert a["gen_ai.usage.output_tokens"] == final.usage.output_tokens
        assert a["gen_ai.usage.input_tokens"] == final.usage.input_tokens
        assert a["gen_ai.response.finish_reasons"] == ["length"]  # cut by max_output_tokens
        assert 0 < a["gen_ai.response.time_to_first_chunk"]
        for span in spans:
            assert PROMPT not in json.dumps(span["attrs"]), "prompt text on a span without the opt-in"
            if "rid" not in span["attrs"]:  # the server's own span (SGLang's `rid`) is the server's
                assert final.id not in json.dumps(span["attrs"]), "a stored response's id on our span"


def test_otel_variables_in_a_dotenv_file_are_honoured(
    jaeger: Jaeger, fleet: tuple[RunningTwin, RunningTwin], tmp_path: Path
) -> None:
    spec, base = fleet
    env = proxy_env(jaeger, "grpc", "specroute-dotenv", spec.url, base.url)
    dotenv = {name: env.pop(name) for name in list(env) if name.startswith("OTEL_")}
    (tmp_path / ".env").write_text("".join(f"{name}={value}\n" for name, value in dotenv.items()))
    clean = {name: "" for name in os.environ if name.startswith("OTEL_")}  # empty: unset for both readers
    running = Proxy({**clean, **env}, tmp_path / "dotenv.log", cwd=tmp_path)
    try:
        trace_id = new_trace_id()
        running.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            extra_headers={"traceparent": client_traceparent(trace_id)},
        )
        spans = jaeger.wait_for_spans(trace_id, lambda s: any(x["service"] == "specroute-dotenv" for x in s))
    finally:
        running.stop()
    assert one(spans, name=SERVER)["service"] == "specroute-dotenv"


def test_failover_shows_two_sibling_attempt_spans(
    jaeger: Jaeger, fleet: tuple[RunningTwin, RunningTwin], tmp_path: Path
) -> None:
    _, base = fleet
    # A spec server that dies after the proxy learned it (one already down at start is skipped
    # without an attempt); polls far apart, so the request meets it before a poll does.
    with twins(TwinSpec("spec", time_scale=10)) as (doomed,):
        env = proxy_env(jaeger, "http/protobuf", "specroute-failover", doomed.url, base.url)
        env["SPECROUTE_POLL_INTERVAL_MS"] = "60000"
        env["SPECROUTE_STALE_MS"] = "120000"
        with proxy(tmp_path, "failover", env) as p:
            doomed.process.terminate()
            doomed.process.wait(10)
            trace_id = new_trace_id()
            completion = p.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=12,
                extra_headers={"traceparent": client_traceparent(trace_id)},
            )
            assert completion.choices[0].message.content
            spans = jaeger.wait_for_spans(trace_id, lambda s: full_trace(s, attempts=2))
            lines = p.log_lines()
            metrics = httpx.get(p.url + "/metrics", timeout=10).text
    server = one(spans, name=SERVER)
    first, second = sorted(
        (s for s in spans if s["kind"] == CLIENT_KIND), key=lambda s: s["attrs"]["specroute.attempt"]
    )
    assert first["parentSpanId"] == second["parentSpanId"] == server["spanId"]
    assert (first["attrs"]["specroute.pool"], first["attrs"]["error.type"]) == ("spec", "connect")
    assert first["status"]["code"] == 2  # ERROR
    assert (second["attrs"]["specroute.pool"], second["attrs"]["server.port"]) == ("base", base.port)
    assert "error.type" not in second["attrs"]
    assert one(spans, service="sglang")["parentSpanId"] == second["spanId"]
    assert [(line["pool"], line["attempts"], line["status"]) for line in lines] == [("base", 2, 200)]
    assert 'specroute_failovers_total{from_pool="spec",to_pool="base"} 1.0' in metrics
    assert 'specroute_requests_total{outcome="ok",policy="spec",pool="base"} 1.0' in metrics


def test_sampler_from_environment(jaeger: Jaeger, fleet: tuple[RunningTwin, RunningTwin], tmp_path: Path) -> None:
    """OTEL_TRACES_SAMPLER=parentbased_always_off: only requests whose client sampled are traced."""
    spec, base = fleet
    env = proxy_env(jaeger, "http/protobuf", "specroute-sampled", spec.url, base.url)
    env["OTEL_TRACES_SAMPLER"] = "parentbased_always_off"
    started = time.time_ns()
    with proxy(tmp_path, "sampled", env) as p:
        unsampled = p.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4
        )
        assert "traceresponse" not in unsampled.headers
        trace_id = new_trace_id()
        p.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            extra_headers={"traceparent": client_traceparent(trace_id)},
        )
        jaeger.wait_for_spans(trace_id, full_trace)
    # Spans leave in order, so the unsampled request's would be in by now.
    servers = [s for s in jaeger.traces_of("specroute-sampled", started) if s["name"] == SERVER]
    assert [s["traceId"] for s in servers] == [trace_id]


def test_sdk_disabled_sends_nothing_and_still_serves(
    jaeger: Jaeger, fleet: tuple[RunningTwin, RunningTwin], tmp_path: Path
) -> None:
    spec, base = fleet
    env = proxy_env(jaeger, "http/protobuf", "specroute-disabled", spec.url, base.url)
    env["OTEL_SDK_DISABLED"] = "true"
    with proxy(tmp_path, "disabled", env) as p:
        trace_id = new_trace_id()
        raw = p.client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            extra_headers={"traceparent": client_traceparent(trace_id)},
        )
        assert raw.parse().choices[0].message.content
        assert "traceresponse" not in raw.headers
        assert float(raw.headers["x-specroute-overhead-ms"]) >= 0
    # The client's traceparent went upstream untouched, so the twin's span is the only one.
    spans = jaeger.wait_for_spans(trace_id, lambda s: len(s) >= 1)
    assert [s["service"] for s in spans] == ["sglang"]
    assert spans[0]["parentSpanId"] == "00f067aa0ba902b7"
    assert "specroute-disabled" not in jaeger.services()


def test_spans_are_flushed_at_shutdown(jaeger: Jaeger, fleet: tuple[RunningTwin, RunningTwin], tmp_path: Path) -> None:
    """With a long batch delay nothing is exported during the request; SIGTERM must flush it."""
    spec, base = fleet
    env = proxy_env(jaeger, "grpc", "specroute-flush", spec.url, base.url)
    env["OTEL_BSP_SCHEDULE_DELAY"] = "600000"
    trace_id = new_trace_id()
    with proxy(tmp_path, "flush", env) as p:
        p.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            extra_headers={"traceparent": client_traceparent(trace_id)},
        )
        jaeger.wait_for_spans(trace_id, lambda s: any(x["service"] == "sglang" for x in s))
        assert not [s for s in jaeger.spans(trace_id) if s["service"] == "specroute-flush"]
    # proxy() sent SIGTERM and waited for the exit
    jaeger.wait_for_spans(trace_id, full_trace)


def traced_request(t: Any, trace_id: str) -> None:
    """One request's hook calls, under a client's sampled traceparent of `trace_id`."""
    from fleet.types import Decision, Features

    hooks = t.request_hooks("/v1/chat/completions")
    hooks.received(
        endpoint="/v1/chat/completions",
        request_id="req-" + trace_id[:8],
        headers={"traceparent": client_traceparent(trace_id)},
        body_bytes=99,
    )
    hooks.decided(
        decision=Decision("spec", "static", {"spec.load": 1.0}),
        features=Features(prompt_tokens=10, max_tokens=4, stream=False),
        model=MODEL,
        override=None,
        body={"model": MODEL, "max_tokens": 4},
    )
    hooks.attempt_started(pool="spec", instance="http://127.0.0.1:1", attempt=1)
    hooks.first_chunk(b'{"id":"chatcmpl-1","model":"m"}')
    hooks.attempt_finished(status=200)
    hooks.finished(
        status=200,
        error_type=None,
        prompt_tokens=10,
        completion_tokens=4,
        finish_reasons=("stop",),
        client_disconnected=False,
    )


def test_a_killed_export_process_is_seen_and_replaced_at_the_next_batch(
    jaeger: Jaeger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Spans are written and exported by a child process (SPECROUTE_TRACE_EXPORT=process, the
    default). Killed, it costs what it held, never the request path: the next batch sees its exit
    status (logged) and starts a new one (RESTART_S after the last start; 0 here), which exports it."""
    from proxy.settings import Settings
    from proxy.telemetry import SpecrouteTelemetry, export_process
    from proxy.telemetry.tracing import Tracing

    monkeypatch.setattr(export_process, "RESTART_S", 0.0)
    for name, value in {
        "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_http_endpoint,
        "OTEL_SERVICE_NAME": "specroute-restart",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }.items():
        monkeypatch.setenv(name, value)  # the child reads them from the environment it inherits
    tracing = Tracing("http/protobuf", "test", export_process=True)
    export = tracing.export
    assert isinstance(export, export_process.ProcessExport)
    t = SpecrouteTelemetry(Settings(policy="spec", request_log=False), "test", tracing=tracing)
    tracing.start()
    try:
        first = new_trace_id()
        traced_request(t, first)
        assert tracing.flush()
        spans = jaeger.wait_for_spans(first, lambda s: len(s) == 3)
        assert {s["service"] for s in spans} == {"specroute-restart"}
        old = export.child
        assert old is not None
        old.kill()
        old.wait(10)
        after = new_trace_id()
        traced_request(t, after)
        assert tracing.flush()
        assert any(f"exit status {old.returncode}" in r.getMessage() for r in caplog.records)
        assert export.child is not None and export.child.pid != old.pid
        jaeger.wait_for_spans(after, lambda s: len(s) == 3)
    finally:
        tracing.shutdown()
    assert export.child is not None and export.child.returncode == 0
