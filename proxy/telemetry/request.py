"""One request's telemetry: its spans, its metric samples and its JSON log line.

Span shape (see docs/observability.md): a SERVER span per request, an INTERNAL `specroute.route`
child for the decision, and one CLIENT span per upstream attempt, named and attributed by the
OpenTelemetry GenAI conventions and ended when the relayed stream ends. W3C traceparent goes
upstream from the attempt span, so the backend's own span lands beneath it. Spans are plain
attribute dicts while the request runs and go to the exporter when they end (see tracing.py).
"""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode

from proxy.hooks import RequestHooks
from proxy.telemetry import names as n

if TYPE_CHECKING:
    from policies.types import Decision, Features
    from proxy.telemetry.service import SpecrouteTelemetry
    from proxy.telemetry.tracing import Tracing


class RequestRecorder(RequestHooks):
    """Called by the request path at fixed points (proxy.hooks.RequestHooks); never per chunk."""

    __slots__ = (
        "_owner", "_tracing", "_endpoint", "_request_id", "_t0", "_t0_ns", "_t_attempt", "_t_first",
        "_pool", "_instance", "_attempt", "_reason", "_stream", "_model", "_in_flight",
        "_server", "_parent", "_server_static", "_server_attrs", "_sampled", "_attempt_id",
        "_attempt_start_ns", "_attempt_static", "_attempt_attrs", "_attempt_events", "_spans",
        "_body", "_params",
    )

    def __init__(self, owner: "SpecrouteTelemetry", endpoint: str) -> None:
        self._owner = owner
        self._tracing: Tracing | None = owner.tracing
        self._endpoint = endpoint
        self._request_id: str | None = None
        self._t0 = time.perf_counter()
        self._t0_ns = time.time_ns()
        self._t_attempt = 0.0
        self._t_first: float | None = None
        self._pool: str | None = None
        self._instance: str | None = None
        self._attempt = 0
        self._reason: str | None = None
        self._stream = False
        self._model: str | None = None
        self._body: Mapping[str, Any] = {}
        self._params: dict[str, Any] = {}
        """GenAI request attributes (max_tokens, temperature, top_p, ...) from the body."""
        self._in_flight: Any = None
        # Tracing: contexts always (for propagation), attributes only when sampled.
        self._server: SpanContext | None = None
        self._parent: SpanContext | None = None
        self._server_static = b""
        self._server_attrs: dict[str, Any] = {}
        self._attempt_static = b""
        self._sampled = False
        self._attempt_id = 0
        """The current attempt's span id (0: none), also the parent id sent upstream."""
        self._attempt_start_ns = 0
        self._attempt_attrs: dict[str, Any] | None = None
        self._attempt_events: list[tuple[str, int]] = []
        self._spans: list[bytes] = []
        """Finished spans' bytes, submitted together when the request ends."""

    # -- request ---------------------------------------------------------------------------
    def received(self, *, endpoint: str, request_id: str, headers: Mapping[str, str], body_bytes: int) -> None:
        self._request_id = request_id
        tracing = self._tracing
        if tracing is None:
            return
        # The client's own traceparent (if any) becomes the parent: the proxy joins its trace.
        parent_context = None
        if not tracing.w3c_only or "traceparent" in headers:
            parent_context = propagate.extract(headers)
            parent = trace.get_current_span(parent_context).get_span_context()
            self._parent = parent if parent.is_valid else None
        self._server = tracing.root_context(self._parent, parent_context, endpoint)
        self._sampled = self._server.trace_flags.sampled
        if self._sampled:
            user_agent = headers.get("user-agent", "")
            self._server_static = tracing.encoder.block(("server", endpoint, user_agent), lambda: {
                n.HTTP_REQUEST_METHOD: "POST",
                n.HTTP_ROUTE: endpoint,
                n.URL_PATH: endpoint,
                n.URL_SCHEME: "http",
                n.USER_AGENT_ORIGINAL: user_agent,
            })
            self._server_attrs = {n.REQUEST_ID: request_id}

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
        self._owner.metrics.decided(decision.reason, decision.pool)
        if not self._sampled:
            return
        self._body = body if body is not None else {}
        self._params = request_attributes(self._body)
        policy = self._owner.policy
        static = self._tracing.encoder.block(  # type: ignore[union-attr]
            ("route", policy, decision.pool, decision.reason, features.request_class, override),
            lambda: route_attributes(policy, decision.pool, decision.reason, features.request_class, override))
        attributes: dict[str, Any] = {n.ROUTE_PROMPT_TOKENS: features.prompt_tokens}
        # The policy's predictions and, added by proxy.signals, what it saw: each pool's load,
        # capacity, reading age and staleness, and the speculative pool's alpha.
        score_keys = self._owner.score_keys
        for key, value in decision.scores.items():
            name = score_keys.get(key)
            if name is None:
                name = score_keys[key] = n.ROUTE_INPUT_PREFIX + key
            attributes[name] = value
        tracing, server = self._tracing, self._server
        assert tracing is not None and server is not None
        # The decision span covers reading the body, building features and the policy call.
        self._spans.append(tracing.encode_child(n.SPAN_DECISION, server, tracing.new_span_id(),
                                                SpanKind.INTERNAL, self._t0_ns, static, attributes))

    # -- attempts --------------------------------------------------------------------------
    def attempt_started(self, *, pool: str, instance: str, attempt: int) -> None:
        metrics = self._owner.metrics
        if attempt > 1:
            if pool == self._pool:
                metrics.retried(pool)
            else:
                metrics.failed_over(self._pool or "none", pool)
        self._pool, self._instance, self._attempt = pool, instance, attempt
        self._t_attempt = time.perf_counter()
        self._in_flight = metrics.in_flight_child(pool, instance)
        self._in_flight.inc()
        tracing, server = self._tracing, self._server
        if tracing is None or server is None:
            return
        self._attempt_id = tracing.new_span_id()
        if not self._sampled:
            return
        self._attempt_start_ns = time.time_ns()
        self._attempt_events = []
        model, stream, params = self._model, self._stream, self._params
        endpoint = self._endpoint
        self._attempt_static = tracing.encoder.block(
            ("attempt", endpoint, model, pool, instance, attempt, stream, *params.items()),
            lambda: attempt_attributes(endpoint, model, pool, instance, attempt, stream, params,
                                       self._owner.address_of(instance)))
        self._attempt_attrs = content_attributes(self._body) if self._owner.trace_content else {}

    def outgoing_headers(self, headers: MutableMapping[str, str]) -> None:
        server, span_id = self._server, self._attempt_id
        if server is None or not span_id:
            return
        if self._tracing.w3c_only:  # type: ignore[union-attr]
            headers["traceparent"] = "00-%032x-%016x-%02x" % (server.trace_id, span_id, server.trace_flags)
        else:
            context = SpanContext(server.trace_id, span_id, False, server.trace_flags, server.trace_state)
            propagate.inject(headers, context=trace.set_span_in_context(NonRecordingSpan(context)))

    def upstream_headers(self, *, status: int, headers: Mapping[str, str]) -> None:
        if self._attempt_attrs is not None:
            self._attempt_attrs[n.HTTP_RESPONSE_STATUS_CODE] = status

    def response_headers(self, *, upstream_wait_s: float) -> list[tuple[bytes, bytes]]:
        """x-specroute-overhead-ms: the proxy's own time before the response began; and, for a
        traced request, W3C `traceresponse` (Trace Context Level 2) naming its trace."""
        overhead_ms = max(time.perf_counter() - self._t0 - upstream_wait_s, 0.0) * 1000
        headers = [(n.OVERHEAD_HEADER_BYTES, b"%.3f" % overhead_ms)]
        server = self._server
        if server is not None and self._sampled:
            headers.append((n.TRACERESPONSE_HEADER_BYTES, b"00-%032x-%016x-01" % (server.trace_id, server.span_id)))
        return headers

    def first_chunk(self, data: bytes = b"") -> None:
        self._t_first = now = time.perf_counter()
        attributes = self._attempt_attrs
        if attributes is None:
            return
        attributes[n.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = now - self._t_attempt
        self._attempt_events.append((n.EVENT_FIRST_TOKEN, time.time_ns()))
        # The response's first object (JSON body or first SSE event) opens with its id and
        # model, as SGLang and vLLM write them; a regex over these bytes, never a parse.
        response_id = _RESPONSE_ID.search(data)
        if response_id:
            attributes[n.GEN_AI_RESPONSE_ID] = response_id.group(1).decode(errors="replace")
        response_model = _RESPONSE_MODEL.search(data)
        if response_model:
            attributes[n.GEN_AI_RESPONSE_MODEL] = response_model.group(1).decode(errors="replace")

    def attempt_finished(self, *, status: int) -> None:
        # The span stays open until `finished`, which brings usage and finish reasons.
        self._release_instance()

    def attempt_failed(self, *, error: str, retryable: bool) -> None:
        self._release_instance()
        attributes = self._attempt_attrs
        if attributes is not None:
            attributes[n.ERROR_TYPE] = error
            self._end_attempt(StatusCode.ERROR, error)
        self._attempt_id = 0

    def _release_instance(self) -> None:
        if self._in_flight is not None:
            self._in_flight.dec()
            self._in_flight = None

    def _end_attempt(self, status: StatusCode, description: str | None) -> None:
        tracing, server, attributes = self._tracing, self._server, self._attempt_attrs
        assert tracing is not None and server is not None and attributes is not None
        operation = n.OPERATION_BY_PATH.get(self._endpoint, "chat")
        self._spans.append(tracing.encode_child(
            f"{operation} {self._model}" if self._model else operation, server, self._attempt_id,
            SpanKind.CLIENT, self._attempt_start_ns, self._attempt_static, attributes, self._attempt_events,
            status, description))
        self._attempt_attrs = None

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
        ttft_s = None if self._t_first is None else self._t_first - self._t0
        inter_token_s = None
        if self._stream and self._t_first is not None and completion_tokens and completion_tokens > 1:
            inter_token_s = (end - self._t_first) / (completion_tokens - 1)
        owner.metrics.finished(pool, owner.policy, outcome, duration_s, overhead_s,
                               ttft_s if self._stream else None, inter_token_s, prompt_tokens, completion_tokens)
        if self._sampled:
            self._end_spans(status, error_type, prompt_tokens, completion_tokens, finish_reasons, overhead_s)
        if owner.request_log is not None:
            server = self._server
            owner.request_log.write({
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
                "trace_id": "%032x" % server.trace_id if server is not None and self._sampled else None,
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
        attributes = self._attempt_attrs
        if attributes is not None:
            if finish_reasons:
                attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] = list(finish_reasons)
            if prompt_tokens is not None:
                attributes[n.GEN_AI_USAGE_INPUT_TOKENS] = prompt_tokens
            if completion_tokens is not None:
                attributes[n.GEN_AI_USAGE_OUTPUT_TOKENS] = completion_tokens
            if error_type:
                attributes[n.ERROR_TYPE] = error_type
            self._end_attempt(StatusCode.ERROR if error_type else StatusCode.UNSET, error_type)
        server_attrs = self._server_attrs
        server_attrs[n.HTTP_RESPONSE_STATUS_CODE] = status
        server_attrs[n.OVERHEAD_MS] = round(overhead_s * 1000, 3)
        server_status = StatusCode.UNSET
        # HTTP semconv: a SERVER span is an error for 5xx only (4xx is the client's).
        if status >= 500 or (error_type and status >= 400):
            server_attrs[n.ERROR_TYPE] = error_type or str(status)
            server_status = StatusCode.ERROR
        tracing, server = self._tracing, self._server
        assert tracing is not None and server is not None
        self._spans.append(tracing.encode_server(f"POST {self._endpoint}", server, self._parent, self._t0_ns,
                                                 self._server_static, server_attrs, server_status))
        tracing.submit(server, self._spans)


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


def route_attributes(policy: str, pool: str, reason: str, request_class: str, override: str | None) -> dict[str, Any]:
    attributes = {n.ROUTE_POLICY: policy, n.ROUTE_POOL: pool, n.ROUTE_REASON: reason,
                  n.ROUTE_REQUEST_CLASS: request_class}
    if override is not None:
        attributes[n.ROUTE_OVERRIDE] = override
    return attributes


def attempt_attributes(
    endpoint: str,
    model: str | None,
    pool: str,
    instance: str,
    attempt: int,
    stream: bool,
    params: Mapping[str, Any],
    address: tuple[str, int],
) -> dict[str, Any]:
    """The attempt span's attributes known when it starts (GenAI conventions, then ours)."""
    attributes: dict[str, Any] = {
        n.GEN_AI_OPERATION_NAME: n.OPERATION_BY_PATH.get(endpoint, "chat"),
        n.GEN_AI_PROVIDER_NAME: n.PROVIDER_SGLANG,
        n.SERVER_ADDRESS: address[0],
        n.SERVER_PORT: address[1],
        n.GEN_AI_REQUEST_STREAM: stream,
        n.ROUTE_POOL: pool,
        n.ATTEMPT_INSTANCE: instance,
        n.ATTEMPT_NUMBER: attempt,
    }
    if model:
        attributes[n.GEN_AI_REQUEST_MODEL] = model
    attributes.update(params)
    return attributes


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
