"""The twin's request tracing, as SGLang does it with --enable-trace --otlp-traces-endpoint.

SGLang (srt/observability/trace.py) extracts W3C traceparent/tracestate from the request headers,
parents a root span per request on it and, when the request finishes, sets gen_ai.* attributes
(its own, older names). The exporter is chosen by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc by
default with a bare host:port endpoint, or http/protobuf with a full URL; the twin reads the
variable the same way so that it can stand in for SGLang in a deployment's configuration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from sim.engine import Request

PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    # SGLang passes host:port with insecure=True.
    return GrpcExporter(endpoint=endpoint, insecure=True)


class TwinTracer:
    """One per twin server: a tracer provider of its own, flushed at shutdown."""

    def __init__(self, endpoint: str, exporter: SpanExporter | None = None) -> None:
        protocol = os.environ.get(PROTOCOL_VARIABLE, "grpc")
        # As SGLang's process_tracing_init: service "sglang" whatever OTEL_SERVICE_NAME says (it
        # has no flag for it); OTEL_RESOURCE_ATTRIBUTES' other attributes are kept.
        resource = Resource.create({SERVICE_NAME: "sglang"})
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or otlp_exporter(endpoint, protocol)))
        self.tracer = self.provider.get_tracer("sglang")
        self.propagator = TraceContextTextMapPropagator()

    def extract(self, headers: Mapping[str, str]) -> Context:
        return self.propagator.extract(headers)

    def start(self, req: Request, parent: Context | None) -> TwinSpan:
        span = self.tracer.start_span(
            f"Req {req.rid[:8]}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rid": req.rid, "module": "sglang::request"},
        )
        return TwinSpan(span)

    def shutdown(self) -> None:
        self.provider.force_flush(10_000)
        self.provider.shutdown()


class TwinSpan:
    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def finish(self, req: Request) -> None:
        """End the span with SGLang's finish attributes (times in the twin's own seconds)."""
        span = self.span
        if span.is_recording():
            span.set_attributes(
                {
                    "gen_ai.usage.prompt_tokens": req.prompt_tokens,
                    "gen_ai.usage.completion_tokens": req.output_tokens,
                    "gen_ai.response.finish_reasons": [req.finish_reason or ""],
                }
            )
            if req.max_new_tokens is not None:
                span.set_attribute("gen_ai.request.max_tokens", req.max_new_tokens)
            if req.finish_time is not None:
                span.set_attribute("gen_ai.latency.e2e", req.finish_time - req.arrival)
            if req.first_token_time is not None:
                span.set_attribute("gen_ai.latency.time_to_first_token", req.first_token_time - req.arrival)
        span.end()
