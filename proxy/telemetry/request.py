"""One request's telemetry: its spans, its metric samples and its JSON log line.

Span shape (see docs/observability.md): a SERVER span per request, an INTERNAL `specroute.route`
child for the decision, and one CLIENT span per upstream attempt, named and attributed by the
OpenTelemetry GenAI conventions and ended when the relayed stream ends. W3C traceparent goes
upstream from the attempt span, so the backend's own span lands beneath it.
"""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from proxy.hooks import RequestHooks
from proxy.telemetry import logs
from proxy.telemetry import names as n

if TYPE_CHECKING:
    from policies.types import Decision, Features
    from proxy.telemetry.service import SpecrouteTelemetry


class RequestRecorder(RequestHooks):
    """Called by the request path at fixed points (proxy.hooks.RequestHooks); never per chunk."""

    __slots__ = (
        "_owner", "_endpoint", "_request_id", "_t0", "_t0_ns", "_t_attempt", "_t_first",
        "_server", "_attempt_span", "_pool", "_instance", "_attempt", "_reason", "_stream",
        "_model", "_params", "_in_flight",
    )

    def __init__(self, owner: "SpecrouteTelemetry", endpoint: str) -> None:
        self._owner = owner
        self._endpoint = endpoint
        self._request_id: str | None = None
        self._t0 = time.perf_counter()
        self._t0_ns = time.time_ns()
        self._t_attempt = 0.0
        self._t_first: float | None = None
        self._server: Span | None = None
        self._attempt_span: Span | None = None
        self._pool: str | None = None
        self._instance: str | None = None
        self._attempt = 0
        self._reason: str | None = None
        self._stream = False
        self._model: str | None = None
        self._params: Mapping[str, Any] = {}
        self._in_flight: Any = None

    # -- request ---------------------------------------------------------------------------
    def received(self, *, endpoint: str, request_id: str, headers: Mapping[str, str], body_bytes: int) -> None:
        self._request_id = request_id
        tracer = self._owner.tracer
        if tracer is None:
            return
        # The client's own traceparent (if any) becomes the parent: the proxy joins its trace.
        self._server = tracer.start_span(
            f"POST {endpoint}",
            context=propagate.extract(headers),
            kind=SpanKind.SERVER,
            start_time=self._t0_ns,
            attributes={
                n.HTTP_REQUEST_METHOD: "POST",
                n.HTTP_ROUTE: endpoint,
                n.URL_PATH: endpoint,
                n.URL_SCHEME: "http",
                n.USER_AGENT_ORIGINAL: headers.get("user-agent", ""),
                n.REQUEST_ID: request_id,
            },
        )

    def decided(
        self,
        *,
        decision: "Decision",
        features: "Features",
        model: str | None,
        override: str | None,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        self._reason = decision.reason
        self._stream = features.stream
        self._model = model
        self._params = body if body is not None else {}
        self._owner.metrics.decisions.labels(decision.reason, decision.pool).inc()
        server = self._server
        if server is None or not server.is_recording():
            return
        attributes: dict[str, Any] = {
            n.ROUTE_POLICY: self._owner.policy,
            n.ROUTE_POOL: decision.pool,
            n.ROUTE_REASON: decision.reason,
            n.ROUTE_PROMPT_TOKENS: features.prompt_tokens,
            n.ROUTE_REQUEST_CLASS: features.request_class,
        }
        if override is not None:
            attributes[n.ROUTE_OVERRIDE] = override
        # The policy's predictions and, added by proxy.signals, what it saw: each pool's load,
        # capacity, reading age and staleness, and the speculative pool's alpha.
        for key, value in decision.scores.items():
            attributes[n.ROUTE_INPUT_PREFIX + key] = value
        # The decision span covers reading the body, building features and the policy call.
        span = self._owner.tracer.start_span(  # type: ignore[union-attr]
            n.SPAN_DECISION,
            context=trace.set_span_in_context(server),
            kind=SpanKind.INTERNAL,
            start_time=self._t0_ns,
            attributes=attributes,
        )
        span.end()

    # -- attempts --------------------------------------------------------------------------
    def attempt_started(self, *, pool: str, instance: str, attempt: int) -> None:
        metrics = self._owner.metrics
        if attempt > 1:
            if pool == self._pool:
                metrics.retries.labels(pool).inc()
            else:
                metrics.failovers.labels(self._pool or "none", pool).inc()
        self._pool, self._instance, self._attempt = pool, instance, attempt
        self._t_attempt = time.perf_counter()
        self._in_flight = metrics.in_flight.labels(pool, instance)
        self._in_flight.inc()
        server = self._server
        if server is None or not server.is_recording():
            return
        operation = n.OPERATION_BY_PATH.get(self._endpoint, "chat")
        address, port = self._owner.address_of(instance)
        attributes: dict[str, Any] = {
            n.GEN_AI_OPERATION_NAME: operation,
            n.GEN_AI_PROVIDER_NAME: n.PROVIDER_SGLANG,
            n.SERVER_ADDRESS: address,
            n.SERVER_PORT: port,
            n.GEN_AI_REQUEST_STREAM: self._stream,
            n.ROUTE_POOL: pool,
            n.ATTEMPT_INSTANCE: instance,
            n.ATTEMPT_NUMBER: attempt,
        }
        if self._model:
            attributes[n.GEN_AI_REQUEST_MODEL] = self._model
        attributes.update(request_attributes(self._params))
        if self._owner.trace_content:
            attributes.update(content_attributes(self._params))
        self._attempt_span = self._owner.tracer.start_span(  # type: ignore[union-attr]
            f"{operation} {self._model}" if self._model else operation,
            context=trace.set_span_in_context(server),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )

    def outgoing_headers(self, headers: MutableMapping[str, str]) -> None:
        span = self._attempt_span
        if span is not None:
            propagate.inject(headers, context=trace.set_span_in_context(span))

    def upstream_headers(self, *, status: int, headers: Mapping[str, str]) -> None:
        span = self._attempt_span
        if span is not None and span.is_recording():
            span.set_attribute(n.HTTP_RESPONSE_STATUS_CODE, status)

    def response_headers(self, *, upstream_wait_s: float) -> list[tuple[bytes, bytes]]:
        """x-specroute-overhead-ms: the proxy's own time before the response began; and, for a
        traced request, W3C `traceresponse` (Trace Context Level 2) naming its trace."""
        overhead_ms = max(time.perf_counter() - self._t0 - upstream_wait_s, 0.0) * 1000
        headers = [(n.OVERHEAD_HEADER_BYTES, b"%.3f" % overhead_ms)]
        server = self._server
        if server is not None and server.is_recording():
            context = server.get_span_context()
            headers.append((n.TRACERESPONSE_HEADER_BYTES,
                            b"00-%032x-%016x-%02x" % (context.trace_id, context.span_id, context.trace_flags)))
        return headers

    def first_chunk(self, data: bytes = b"") -> None:
        self._t_first = now = time.perf_counter()
        span = self._attempt_span
        if span is not None and span.is_recording():
            span.set_attribute(n.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, now - self._t_attempt)
            span.add_event(n.EVENT_FIRST_TOKEN)
            # The response's first object (JSON body or first SSE event) opens with its id and
            # model, as SGLang and vLLM write them; a regex over these bytes, never a parse.
            response_id = _RESPONSE_ID.search(data)
            if response_id:
                span.set_attribute(n.GEN_AI_RESPONSE_ID, response_id.group(1).decode(errors="replace"))
            response_model = _RESPONSE_MODEL.search(data)
            if response_model:
                span.set_attribute(n.GEN_AI_RESPONSE_MODEL, response_model.group(1).decode(errors="replace"))

    def attempt_finished(self, *, status: int) -> None:
        # The span stays open until `finished`, which brings usage and finish reasons.
        self._release_instance()

    def attempt_failed(self, *, error: str, retryable: bool) -> None:
        self._release_instance()
        span, self._attempt_span = self._attempt_span, None
        if span is not None:
            span.set_attribute(n.ERROR_TYPE, error)
            span.set_status(Status(StatusCode.ERROR, error))
            span.end()

    def _release_instance(self) -> None:
        if self._in_flight is not None:
            self._in_flight.dec()
            self._in_flight = None

    # -- response --------------------------------------------------------------------------
    def finished(
        self,
        *,
        status: int,
        error_type: str | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        finish_reasons: tuple[str, ...],
        client_disconnected: bool,
        upstream_wait_s: float = 0.0,
    ) -> None:
        end = time.perf_counter()
        duration_s = end - self._t0
        overhead_s = max(duration_s - upstream_wait_s, 0.0)
        self._release_instance()
        if client_disconnected:
            error_type = error_type or "client_disconnected"
        outcome = outcome_of(status, error_type)
        pool = self._pool or "none"
        owner = self._owner
        metrics = owner.metrics
        metrics.requests.labels(pool, owner.policy, outcome).inc()
        metrics.duration.labels(pool).observe(duration_s)
        metrics.overhead.observe(overhead_s)
        ttft_s = None if self._t_first is None else self._t_first - self._t0
        if self._stream and ttft_s is not None:
            metrics.ttft.labels(pool).observe(ttft_s)
            if completion_tokens and completion_tokens > 1:
                metrics.inter_token.labels(pool).observe((end - self._t_first) / (completion_tokens - 1))  # type: ignore[operator]
        if prompt_tokens:
            metrics.tokens.labels(pool, "input").inc(prompt_tokens)
        if completion_tokens:
            metrics.tokens.labels(pool, "output").inc(completion_tokens)
        trace_id = self._trace_id()
        self._end_spans(status, error_type, prompt_tokens, completion_tokens, finish_reasons, overhead_s)
        if owner.request_log is not None:
            logs.write(owner.request_log, {
                "ts": round(time.time(), 3),
                "request_id": self._request_id,
                "endpoint": self._endpoint,
                "status": status,
                "outcome": outcome,
                "pool": self._pool,
                "instance": self._instance,
                "attempts": self._attempt,
                "policy": owner.policy,
                "reason": self._reason,
                "model": self._model,
                "stream": self._stream,
                "ttft_ms": None if ttft_s is None else round(ttft_s * 1000, 3),
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "duration_ms": round(duration_s * 1000, 3),
                "overhead_ms": round(overhead_s * 1000, 3),
                "error_type": error_type,
                "trace_id": trace_id,
            })

    def _end_spans(
        self,
        status: int,
        error_type: str | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        finish_reasons: tuple[str, ...],
        overhead_s: float,
    ) -> None:
        span, self._attempt_span = self._attempt_span, None
        if span is not None:
            if span.is_recording():
                if finish_reasons:
                    span.set_attribute(n.GEN_AI_RESPONSE_FINISH_REASONS, list(finish_reasons))
                if prompt_tokens is not None:
                    span.set_attribute(n.GEN_AI_USAGE_INPUT_TOKENS, prompt_tokens)
                if completion_tokens is not None:
                    span.set_attribute(n.GEN_AI_USAGE_OUTPUT_TOKENS, completion_tokens)
                if error_type:
                    span.set_attribute(n.ERROR_TYPE, error_type)
                    span.set_status(Status(StatusCode.ERROR, error_type))
            span.end()
        server, self._server = self._server, None
        if server is not None:
            if server.is_recording():
                server.set_attribute(n.HTTP_RESPONSE_STATUS_CODE, status)
                server.set_attribute(n.OVERHEAD_MS, round(overhead_s * 1000, 3))
                # HTTP semconv: a SERVER span is an error for 5xx only (4xx is the client's).
                if status >= 500 or (error_type and status >= 400):
                    server.set_attribute(n.ERROR_TYPE, error_type or str(status))
                    server.set_status(Status(StatusCode.ERROR))
            server.end()

    def _trace_id(self) -> str | None:
        server = self._server
        context = server.get_span_context() if server is not None else None
        if context is None or not context.is_valid:
            return None
        return format(context.trace_id, "032x")


_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,200})"')
_RESPONSE_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,300})"')


def outcome_of(status: int, error_type: str | None) -> str:
    """A low-cardinality label: ok, client_error, error or client_disconnected."""
    if error_type == "client_disconnected":
        return "client_disconnected"
    if status >= 500 or (error_type and status < 400):
        return "error"
    if status >= 400:
        return "client_error"
    return "ok"


_REQUEST_PARAMS = (
    ("max_tokens", n.GEN_AI_REQUEST_MAX_TOKENS, int),
    ("temperature", n.GEN_AI_REQUEST_TEMPERATURE, float),
    ("top_p", n.GEN_AI_REQUEST_TOP_P, float),
    ("seed", n.GEN_AI_REQUEST_SEED, int),
)


def request_attributes(body: Mapping[str, Any]) -> dict[str, Any]:
    """GenAI request attributes from the client's JSON body; values of a wrong type are skipped."""
    attributes: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    for key, name, kind in _REQUEST_PARAMS:
        value = max_tokens if key == "max_tokens" else body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attributes[name] = kind(value)
    choices = body.get("n")
    if isinstance(choices, int) and not isinstance(choices, bool) and choices != 1:
        attributes[n.GEN_AI_REQUEST_CHOICE_COUNT] = choices
    return attributes


def content_attributes(body: Mapping[str, Any]) -> dict[str, Any]:
    """The opt-in prompt (SPECROUTE_TRACE_CONTENT=true) as gen_ai.input.messages, a JSON string."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [
            {"role": m.get("role"), "parts": [{"type": "text", "content": m.get("content")}]}
            for m in messages
            if isinstance(m, Mapping)
        ]
    elif "prompt" in body:
        parts = [{"role": "user", "parts": [{"type": "text", "content": body.get("prompt")}]}]
    else:
        return {}
    return {n.GEN_AI_INPUT_MESSAGES: json.dumps(parts, default=str)}
