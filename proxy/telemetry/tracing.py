"""The tracer provider: OTLP export over http/protobuf or grpc, configured the standard way.

The SDK itself reads OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG),
OTEL_SDK_DISABLED, OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT/HEADERS/TIMEOUT and OTEL_BSP_*. It does
not read OTEL_EXPORTER_OTLP_PROTOCOL when exporters are built in code, so the settings object
reads it and this module picks the exporter class.
"""

from __future__ import annotations

import logging

from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Tracer

log = logging.getLogger("specroute.telemetry")

PROTOCOLS = ("http/protobuf", "grpc")


def make_exporter(protocol: str) -> SpanExporter:
    """An OTLP span exporter; endpoint, headers and timeout come from the OTEL_* variables."""
    if protocol == "grpc":
        # Imported on demand: grpc is heavy and most deployments pick one protocol.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")


def make_resource(version: str) -> Resource:
    """OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win; "specroute" only fills a missing name."""
    resource = Resource.create({SERVICE_VERSION: version})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "specroute"}))
    return resource


class Tracing:
    """Owns one TracerProvider (never the global one, so several apps can live in one process)."""

    def __init__(self, protocol: str, version: str, exporter: SpanExporter | None = None) -> None:
        # The sampler comes from OTEL_TRACES_SAMPLER(_ARG); OTEL_SDK_DISABLED=true makes
        # get_tracer return a no-op tracer. atexit is replaced by an explicit shutdown().
        self.provider = TracerProvider(resource=make_resource(version), shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or make_exporter(protocol)))
        self.tracer: Tracer = self.provider.get_tracer("specroute", version)
        self.protocol = protocol

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Export what is queued, then stop the exporter (called at server shutdown)."""
        if not self.flush(timeout_s):
            log.warning("some spans were not exported within %.0f s at shutdown", timeout_s)
        self.provider.shutdown()
