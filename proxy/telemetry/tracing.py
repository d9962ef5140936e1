"""The trace pipeline: sampling, finished spans, batching and OTLP export over http or grpc.

The SDK itself reads OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG),
OTEL_SDK_DISABLED, OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT/HEADERS/TIMEOUT, OTEL_BSP_* and
OTEL_PROPAGATORS. It does not read OTEL_EXPORTER_OTLP_PROTOCOL when exporters are built in code,
so the settings object reads it and this module picks the exporter.

A request knows every attribute of a span when it ends it, so spans are not SDK Span objects
(validated attribute by attribute, under a lock: about 70 us per span here, three per request,
against a budget of about 40 us for all of a request's tracing, docs/observability.md): a
request hands one RequestTrace (spans.py) over when it ends, and every BATCH of them (or FLUSH_S
after the first of a batch) go to the span export as one list. The export writes them to OTLP
bytes and hands those to the SDK's BatchSpanProcessor as one item, whose thread only sends
bytes: in a child process by default (export_process.py: the event loop only pickles the batch
into a pipe), or in this process (LocalExport: on the event loop; SPECROUTE_TRACE_EXPORT=inline).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from typing import Any, Protocol

from opentelemetry import propagate
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NoOpTracer, SpanContext, SpanKind, TraceState

from proxy.settings import SettingsError
from proxy.telemetry.otlp import EncodedSpans, GrpcExporter, HttpExporter
from proxy.telemetry.spans import SAMPLED_CONTEXT, RequestTrace, SpanWriter

log = logging.getLogger("specroute.telemetry")

PROTOCOLS = ("http/protobuf", "grpc")
W3C_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})
_NO_STATE = TraceState()
BATCH = 64
"""Requests handed to the export together: one pickle (or one loop of the encoder, whose code and
memo then stay in cache: a third of the CPU of writing each request as it ends)."""
FLUSH_S = 0.1
"""The longest a finished request's spans wait for the rest of their batch."""


def make_exporter(protocol: str, resource: Resource, scope: InstrumentationScope) -> SpanExporter:
    """An OTLP span exporter; endpoint, headers and timeout come from the OTEL_* variables."""
    if protocol == "grpc":
        return GrpcExporter(resource, scope)
    if protocol == "http/protobuf":
        return HttpExporter(resource, scope)
    raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")


def make_resource(version: str) -> Resource:
    """OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win; "specroute" only fills a missing name."""
    resource = Resource.create({SERVICE_VERSION: version})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "specroute"}))
    return resource


class SpanExport(Protocol):
    """Where batches of finished requests go to become OTLP spans and leave."""

    @property
    def dropped_requests(self) -> int:
        """Requests whose spans it dropped instead of exporting, so far."""
        ...

    def start(self) -> None: ...

    def send(self, batch: Sequence[RequestTrace]) -> None: ...

    def flush(self, timeout_s: float) -> bool: ...

    def detach(self) -> None:
        """Let go of the event loop: shutdown() is about to run in another thread."""

    def shutdown(self, timeout_s: float) -> None: ...


class LocalExport:
    """Writes batches to OTLP bytes in this process (on the caller's thread: the encoder's memo
    has no lock) and hands each to the SDK's BatchSpanProcessor as one item."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.writer = SpanWriter()
        self.processor = BatchSpanProcessor(exporter)
        self._dropped = 0

    @property
    def dropped_requests(self) -> int:
        """Requests whose spans could not be written (the SDK's queue drops what it cannot hold
        and says so in its log, uncounted here)."""
        return self._dropped

    def start(self) -> None:
        pass

    def send(self, batch: Sequence[RequestTrace]) -> None:
        spans = self.writer.spans
        parts = []
        failed = 0
        for trace in batch:
            try:
                parts.append(spans(trace))
            except Exception:  # a bug must cost one request's spans, not the batch's
                if not failed:
                    log.exception("could not write the spans of request %s", trace.request_id)
                failed += 1
        if failed > 1:
            log.error("could not write the spans of %d requests of one batch; dropped", failed)
        self._dropped += failed
        if parts:
            self.processor.on_end(EncodedSpans(SAMPLED_CONTEXT, parts))  # type: ignore[arg-type]

    def flush(self, timeout_s: float) -> bool:
        return self.processor.force_flush(int(timeout_s * 1000))

    def detach(self) -> None:
        pass

    def shutdown(self, timeout_s: float) -> None:
        if not self.flush(timeout_s):
            log.warning("some spans were not exported within %.0f s at shutdown", timeout_s)
        self.processor.shutdown()


def check_batch_settings() -> None:
    """The SDK reads OTEL_BSP_* when a batch processor is made and refuses some combinations (a
    queue smaller than a batch). Made here, in the proxy's process, a bad value stops start-up in
    one line whichever way spans are exported: in the export child it killed each child as it
    started, and tracing stayed off with the proxy looking healthy."""
    try:
        BatchSpanProcessor(SpanExporter()).shutdown()
    except ValueError as exc:
        raise SettingsError(f"OTEL_BSP_* (the span batch processor's settings): {exc}") from None


class Tracing:
    """Owns one TracerProvider (never the global one, so several apps can live in one process)
    for its sampler and resource, the batching of finished requests, and the span export: a
    child process (`export_process`, the default outside tests) or this process."""

    def __init__(
        self,
        protocol: str,
        version: str,
        exporter: SpanExporter | None = None,
        *,
        export_process: bool = False,
        log_format: str = "text",
    ) -> None:
        """`log_format`: how the export process writes its log lines (SPECROUTE_LOG_FORMAT)."""
        # The sampler comes from OTEL_TRACES_SAMPLER(_ARG); atexit is replaced by shutdown().
        self.provider = TracerProvider(resource=make_resource(version), shutdown_on_exit=False)
        # OTEL_SDK_DISABLED=true: the provider hands out no-op tracers; so does nothing here.
        self.enabled = not isinstance(self.provider.get_tracer("specroute", version), NoOpTracer)
        self.sampler = self.provider.sampler
        self.resource = self.provider.resource
        self.scope = InstrumentationScope("specroute", version)
        self.export: SpanExport
        if self.enabled:
            check_batch_settings()
        if export_process and exporter is None and self.enabled:
            from proxy.telemetry.export_process import ProcessExport  # imports tracing: not at the top

            self.export = ProcessExport(protocol, version, log_format)
        else:
            self.export = LocalExport(
                exporter or (make_exporter(protocol, self.resource, self.scope) if self.enabled else SpanExporter())
            )
        self._pending: list[RequestTrace] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        """Shut down: requests that end later (cancelled at the end of the drain) are not traced."""
        self.protocol = protocol
        # With the default OTEL_PROPAGATORS (tracecontext,baggage) the request path writes and
        # reads traceparent itself, which costs a fifth of the propagator API's calls; the client's
        # baggage and tracestate headers travel upstream unchanged either way.
        self.w3c_only = set(propagate.get_global_textmap().fields) <= W3C_FIELDS

    @staticmethod
    def new_span_id() -> int:
        return random.getrandbits(64) or 1

    def root_context(
        self, parent: SpanContext | None, parent_context: Any, name: str
    ) -> tuple[int, int, bool, TraceState]:
        """The SERVER span's trace id, span id, sampled flag and trace state: the client's trace
        (if it sent one) or a new one, sampled as the configured sampler says."""
        if self.sampler is sampling.DEFAULT_ON:  # the default: the parent's choice, else sampled
            if parent is None:
                return random.getrandbits(128) or 1, self.new_span_id(), True, _NO_STATE
            return parent.trace_id, self.new_span_id(), parent.trace_flags.sampled, parent.trace_state
        if self.sampler is sampling.ALWAYS_ON:  # OTEL_TRACES_SAMPLER=always_on: sampled, whatever the parent
            if parent is None:
                return random.getrandbits(128) or 1, self.new_span_id(), True, _NO_STATE
            return parent.trace_id, self.new_span_id(), True, parent.trace_state
        trace_id = parent.trace_id if parent is not None else (random.getrandbits(128) or 1)
        result = self.sampler.should_sample(parent_context, trace_id, name, SpanKind.SERVER)
        return trace_id, self.new_span_id(), result.decision.is_sampled(), result.trace_state or _NO_STATE

    def submit(self, trace: RequestTrace) -> None:
        """A sampled request's spans, written with those of the next requests (see BATCH)."""
        if self._closed:
            return
        pending = self._pending
        pending.append(trace)
        if len(pending) >= BATCH:
            self.write_pending()
        elif len(pending) == 1:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # outside an event loop (a test, a script): nothing to wait with
                self.write_pending()
                return
            self._timer = loop.call_later(FLUSH_S, self.write_pending)

    def write_pending(self) -> None:
        """Hand the pending requests to the export as one batch."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        if pending:
            self.export.send(pending)

    @property
    def dropped_requests(self) -> int:
        """Sampled requests whose spans were dropped before export, so far."""
        return self.export.dropped_requests

    def start(self) -> None:
        """Start the export (its child process): called once the server starts."""
        self.export.start()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export what is pending; True when it is out (a child process: when it has it)."""
        self.write_pending()
        return self.export.flush(timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Export what is queued, then stop the export; blocks up to `timeout_s`."""
        self.write_pending()
        self._closed = True
        self.export.shutdown(timeout_s)
        self.provider.shutdown()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """shutdown() at server shutdown, its waiting in a thread: the event loop goes on serving
        the requests the drain is ending meanwhile."""
        self.write_pending()
        self._closed = True
        self.export.detach()
        await asyncio.to_thread(self.export.shutdown, timeout_s)
        self.provider.shutdown()
