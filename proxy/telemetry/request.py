"""One request's telemetry: its spans, its metric samples and its JSON log line.

Span shape (see docs/observability.md): a SERVER span per request, an INTERNAL `specroute.route`
child for the decision, and one CLIENT span per upstream attempt, named and attributed by the
OpenTelemetry GenAI conventions and ended when the relayed stream ends. W3C traceparent goes
upstream from the attempt span, so the backend's own span lands beneath it. While the request
runs, tracing only notes values in slots; when it ends they go to the span export as one
RequestTrace, which writes the spans in a batch (spans.py), in its own process by default.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from proxy.hooks import RequestHooks
from proxy.telemetry import names as n
from proxy.telemetry.spans import FIRST_BYTES, AttemptTrace, RequestTrace, request_params

if TYPE_CHECKING:
    from fleet.types import Decision, Features
    from proxy.telemetry.service import SpecrouteTelemetry
    from proxy.telemetry.tracing import Tracing

_NO_PARAMS = (None, None, None, None, None)
MAX_USER_AGENT_CHARS = 256
"""The client's User-Agent on spans is cut here (as model names are): it is the client's to write,
and its spans would carry all of it."""
_Route = tuple[float | None, str, str, str, str, str | None, int, Mapping[str, Any]]
"""RequestTrace's decision fields, from `decided` to `scores`."""


class RequestRecorder(RequestHooks):
    """Called by the request path at fixed points (proxy.hooks.RequestHooks); never per chunk."""

    __slots__ = (
        "_owner",
        "_tracing",
        "_endpoint",
        "_request_id",
        "_t0",
        "_t0_ns",
        "_t_attempt",
        "_t_first",
        "_pool",
        "_decided_pool",
        "_instance",
        "_attempt",
        "_reason",
        "_stream",
        "_model",
        "_in_flight",
        "_trace_id",
        "_span_id",
        "_sampled",
        "_trace_state",
        "_parent",
        "_user_agent",
        "_decided_at",
        "_decision",
        "_features",
        "_override",
        "_params",
        "_content",
        "_attempt_id",
        "_attempt_status",
        "_first_data",
        "_failed",
        "_credited",
        "_server_kind",
        "_choices",
    )

    def __init__(self, owner: SpecrouteTelemetry, endpoint: str) -> None:
        self._owner = owner
        self._tracing: Tracing | None = owner.tracing
        self._endpoint = endpoint
        self._request_id = ""
        self._t0 = time.perf_counter()
        self._t0_ns = time.time_ns()
        self._t_attempt = 0.0
        self._t_first: float | None = None
        self._pool: str | None = None
        self._decided_pool: str | None = None
        self._instance: str | None = None
        self._attempt = 0
        self._servers = 0
        """Servers its attempts went to (a second send to the same one does not count)."""
        self._reason: str | None = None
        self._stream = False
        self._model: str | None = None
        self._in_flight: Any = None
        # Tracing: ids always (for propagation), the rest only when sampled; plain values that
        # finished() packs into a RequestTrace for the span export.
        self._trace_id = 0
        """0: tracing is off for this request (no context to propagate)."""
        self._span_id = 0
        self._sampled = False
        self._trace_state: TraceState | None = None
        self._parent: SpanContext | None = None
        self._user_agent = ""
        self._decided_at: float | None = None
        self._decision: Decision | None = None
        self._features: Features | None = None
        self._override: str | None = None
        self._params = _NO_PARAMS
        self._content: str | None = None
        self._attempt_id = 0
        """The current attempt's span id (0: none), also the parent id sent upstream."""
        self._attempt_status: int | None = None
        self._first_data = b""
        self._failed: tuple[AttemptTrace, ...] = ()
        """Attempts that failed, as they ended."""
        self._credited = 0
        """Prompt tokens credited as cached on the current attempt's instance."""
        self._server_kind = ""
        self._choices: Any = None
        """The request's `n` as the client sent it (unchecked: the server judges it)."""

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
        self._trace_id, self._span_id, self._sampled, self._trace_state = tracing.root_context(
            self._parent, parent_context, endpoint
        )
        if self._sampled:
            self._user_agent = headers.get("user-agent", "")[:MAX_USER_AGENT_CHARS]

    def decided(
        self,
        *,
        decision: Decision,
        features: Features,
        model: str | None,
        override: str | None,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        self._reason = decision.reason
        self._decided_pool = decision.pool
        self._stream = features.stream
        self._model = model
        # The inter-token metric divides a stream's tokens by its choices, traced or not.
        self._choices = body.get("n") if body is not None else None
        self._owner.metrics.decided(decision.reason, decision.pool)
        if not self._sampled:
            return
        # The decision span covers reading the body, building features and the policy call.
        self._decided_at = time.perf_counter()
        self._decision, self._features, self._override = decision, features, override
        if body is not None:
            self._params = request_params(body)
            if self._owner.trace_content:
                self._content = content_json(body)

    def _logged_reason(self) -> str | None:
        """The decision's reason, with `+failover` when the request ended on the other pool and
        `+retry` on another server of the same, as its x-specroute-reason header says."""
        if self._reason is not None and self._pool is not None and self._pool != self._decided_pool:
            return self._reason + "+failover"
        if self._reason is not None and self._servers > 1:
            return self._reason + "+retry"
        return self._reason

    # -- attempts --------------------------------------------------------------------------
    def attempt_started(
        self,
        *,
        pool: str,
        instance: str,
        attempt: int,
        cached_tokens: int = 0,
        server_kind: str = "",
        resent: bool = False,
    ) -> None:
        metrics = self._owner.metrics
        self._credited = cached_tokens
        self._server_kind = server_kind
        if attempt > 1 and not resent:
            if pool == self._pool:
                metrics.retried(pool)
            else:
                metrics.failed_over(self._pool or "none", pool)
        if instance != self._instance:
            self._servers += 1
        self._pool, self._instance, self._attempt = pool, instance, attempt
        self._t_attempt = time.perf_counter()
        self._in_flight = metrics.in_flight_child(pool, instance)
        self._in_flight.inc()
        if self._trace_id:
            self._attempt_id = self._tracing.new_span_id()  # type: ignore[union-attr]
            self._attempt_status = None  # not the previous attempt's 503

    def outgoing_headers(self, headers: MutableMapping[str, str]) -> None:
        span_id = self._attempt_id
        if not span_id:
            return
        flags = 1 if self._sampled else 0
        if self._tracing.w3c_only:  # type: ignore[union-attr]
            headers["traceparent"] = f"00-{self._trace_id:032x}-{span_id:016x}-{flags:02x}"
        else:
            context = SpanContext(self._trace_id, span_id, False, TraceFlags(flags), self._trace_state)
            propagate.inject(headers, context=trace.set_span_in_context(NonRecordingSpan(context)))

    def upstream_headers(self, *, status: int, headers: Mapping[str, str]) -> None:
        self._attempt_status = status

    def response_headers(self, *, waited_s: float) -> list[tuple[bytes, bytes]]:
        """x-specroute-overhead-ms: the proxy's own time before the response began; and, for a
        traced request, W3C `traceresponse` (Trace Context Level 2) naming its trace."""
        overhead_ms = max(time.perf_counter() - self._t0 - waited_s, 0.0) * 1000
        headers = [(n.OVERHEAD_HEADER_BYTES, b"%.3f" % overhead_ms)]
        if self._sampled:
            headers.append((n.TRACERESPONSE_HEADER_BYTES, b"00-%032x-%016x-01" % (self._trace_id, self._span_id)))
        return headers

    def first_chunk(self, data: bytes = b"") -> None:
        self._t_first = time.perf_counter()
        if self._sampled:
            self._first_data = data[:FIRST_BYTES]  # the same object when shorter

    def attempt_finished(self, *, status: int) -> None:
        # The span stays open until `finished`, which brings usage and finish reasons.
        self._release_instance()

    def attempt_failed(self, *, error: str, retryable: bool) -> None:
        self._release_instance()
        if self._sampled and self._attempt_id:
            self._failed += (self._attempt_trace(time.perf_counter(), error),)
        self._attempt_id = 0

    def _release_instance(self) -> None:
        if self._in_flight is not None:
            self._in_flight.dec()
            self._in_flight = None

    def _attempt_trace(self, ended: float, error: str | None) -> AttemptTrace:
        pool, instance = self._pool, self._instance
        assert pool is not None and instance is not None  # attempt_started set them with the span id
        return AttemptTrace(
            self._attempt_id,
            self._attempt,
            pool,
            instance,
            self._t_attempt,
            ended,
            self._attempt_status,
            self._t_first,
            self._first_data,
            error,
            self._credited,
            self._server_kind,
        )

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
        waited_s: float = 0.0,
        cached_tokens: int | None = None,
        events: int | None = None,
    ) -> None:
        end = time.perf_counter()
        duration_s = end - self._t0
        overhead_s = max(duration_s - waited_s, 0.0)
        self._release_instance()
        if client_disconnected:
            error_type = error_type or "client_disconnected"
        outcome = outcome_of(status, error_type)
        pool = self._pool or "none"
        owner = self._owner
        ttft_s = None if self._t_first is None else self._t_first - self._t0
        inter_token_s = None
        if self._stream and self._t_first is not None and completion_tokens:
            # The time per output token of one choice: with n > 1 the count sums every choice's.
            choices = self._choices
            per_choice = completion_tokens / choices if type(choices) is int and choices > 1 else completion_tokens
            if per_choice > 1:
                inter_token_s = (end - self._t_first) / (per_choice - 1)
        owner.metrics.finished(
            pool,
            owner.policy,
            outcome,
            duration_s,
            overhead_s,
            ttft_s if self._stream else None,
            inter_token_s,
            prompt_tokens,
            completion_tokens,
            self._credited if self._pool is not None else 0,
            cached_tokens,
        )
        if self._sampled:
            self._submit(
                end, status, error_type, prompt_tokens, completion_tokens, finish_reasons, overhead_s, cached_tokens
            )
        if owner.request_log is not None:
            owner.request_log.write(
                {
                    "ts": round(time.time(), 3),
                    "request_id": self._request_id,
                    "endpoint": self._endpoint,
                    "status": status,
                    "outcome": outcome,
                    "pool": self._pool,
                    "instance": self._instance,
                    "attempts": self._attempt,
                    "policy": owner.policy,
                    "reason": self._logged_reason(),
                    "model": self._model,
                    "stream": self._stream,
                    "ttft_ms": None if ttft_s is None else round(ttft_s * 1000, 3),
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "events": events,
                    "cached_tokens": cached_tokens,
                    "credited_tokens": self._credited,
                    "duration_ms": round(duration_s * 1000, 3),
                    "overhead_ms": round(overhead_s * 1000, 3),
                    "error_type": error_type,
                    "trace_id": f"{self._trace_id:032x}" if self._sampled else None,
                }
            )

    def _submit(
        self,
        end: float,
        status: int,
        error_type: str | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        finish_reasons: tuple[str, ...],
        overhead_s: float,
        cached_tokens: int | None = None,
    ) -> None:
        """Pack the request's spans into one RequestTrace for the exporter (the attempt still
        open, if any, ends now and carries the response's outcome)."""
        attempts = self._failed
        if self._attempt_id:
            attempts += (self._attempt_trace(end, None),)
        decision, features, parent = self._decision, self._features, self._parent
        tracing = self._tracing
        assert tracing is not None  # only a sampled request is submitted, and only with tracing on
        if decision is None or features is None:  # refused before a route was chosen
            route: _Route = (None, "", "", "", "", None, 0, {})
        else:
            route = (
                self._decided_at,
                self._owner.policy,
                decision.pool,
                decision.reason,
                features.request_class,
                self._override,
                features.prompt_tokens,
                decision.scores,
            )
        tracing.submit(
            RequestTrace(
                self._endpoint,
                self._request_id,
                self._user_agent,
                self._trace_id,
                self._span_id,
                self._trace_state or None,
                parent.span_id if parent else None,
                parent.is_remote if parent else False,
                self._t0_ns,
                self._t0,
                *route,
                self._model,
                self._stream,
                self._params,
                self._content,
                attempts,
                status,
                error_type,
                prompt_tokens,
                completion_tokens,
                finish_reasons,
                overhead_s,
                end,
                cached_tokens,
            )
        )


SHED = frozenset({"fleet_overloaded", "too_many_open_requests"})
"""The proxy's own 429s for load (admission control, its open-request bound): `refused`, so an
alert can watch them apart from clients' mistakes."""


def outcome_of(status: int, error_type: str | None) -> str:
    """A low-cardinality label: ok, client_error, refused, error or client_disconnected."""
    if error_type == "client_disconnected":
        return "client_disconnected"
    if status == 429 and error_type in SHED:
        return "refused"
    if status >= 500 or (error_type and status < 400):
        return "error"
    if status >= 400:
        return "client_error"
    return "ok"


def content_json(body: Mapping[str, Any]) -> str | None:
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
        return None
    return json.dumps(parts, default=str)
