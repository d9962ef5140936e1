"""OTLP protobuf for finished spans, written on the request path, and the SDK's two OTLP
exporters sending it.

The SDK's encoder builds a protobuf object per attribute and costs 75-100 us per span here, about
three times the whole budget for tracing a request (docs/observability.md). This one writes the
wire format directly (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto), reusing
the bytes of the attribute pairs that repeat from request to request, when a span ends; the batch
processor then only moves bytes. Transport, retries, headers, TLS and endpoint resolution stay
the SDK exporters' own.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping, Sequence

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as SdkGrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as SdkHttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, StatusCode

_PACK_DOUBLE = struct.Struct("<d").pack
_PACK_FIXED64 = struct.Struct("<Q").pack
_PACK_FIXED32 = struct.Struct("<I").pack
_SMALL = [bytes((i,)) for i in range(128)]
_MEMO_LIMIT = 8192


def varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value] if value >= 0 else varint(value & 0xFFFFFFFFFFFFFFFF)
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the payload's length, the payload."""
    return tag + varint(len(payload)) + payload


def any_value(value: Any) -> bytes:
    """common.v1.AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(value, str):
        return field(b"\x0a", value.encode("utf-8", "replace"))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + _PACK_DOUBLE(value)
    if isinstance(value, (list, tuple)):
        return field(b"\x2a", b"".join(field(b"\x0a", any_value(v)) for v in value))
    return field(b"\x0a", str(value).encode("utf-8", "replace"))


class EncodedSpan:
    """A finished span in OTLP wire format, as the SDK's BatchSpanProcessor carries it to the
    exporter (the processor reads only `context`, for the sampled flag)."""

    __slots__ = ("context", "data")

    def __init__(self, context: SpanContext, data: bytes) -> None:
        self.context = context
        self.data = data


class SpanEncoder:
    """Encodes finished spans on the request path (one event-loop thread: the memo needs no lock)."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[bytes, str, type, Any], bytes] = {}

    def attributes(self, tag: bytes, attributes: Mapping[str, Any]) -> bytes:
        """Attributes as repeated KeyValue fields (key 1, value 2) under `tag`; each framed pair
        is memoised, so repeating ones (model, pool, route, status...) cost one dict lookup."""
        memo = self._pairs
        out = []
        for key, value in attributes.items():
            # The type is part of the key: True, 1 and 1.0 are equal but encode differently.
            memo_key = (tag, key, value.__class__, tuple(value) if isinstance(value, list) else value)
            encoded = memo.get(memo_key)
            if encoded is None:
                encoded = field(tag, field(b"\x0a", key.encode()) + field(b"\x12", any_value(value)))
                if len(memo) >= _MEMO_LIMIT:
                    memo.clear()  # unique values (ids, timings) would otherwise pile up
                memo[memo_key] = encoded
            out.append(encoded)
        return b"".join(out)

    def span(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any],
        events: Sequence[tuple[str, int]],
        status: StatusCode,
        description: str | None,
    ) -> EncodedSpan:
        """trace.v1.Span; `events` are (name, time) pairs."""
        parts = [
            b"\x0a\x10", context.trace_id.to_bytes(16, "big"),
            b"\x12\x08", context.span_id.to_bytes(8, "big"),
        ]
        if context.trace_state:
            parts.append(field(b"\x1a", context.trace_state.to_header().encode()))
        flags = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
        if parent is not None:
            parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
            if parent.is_remote:
                flags |= 0x200
        parts.append(field(b"\x2a", name.encode("utf-8", "replace")))
        parts.append(b"\x30" + _SMALL[kind.value + 1])  # OTLP kinds are the SDK's + 1
        parts.append(b"\x39" + _PACK_FIXED64(start_ns))
        parts.append(b"\x41" + _PACK_FIXED64(end_ns))
        parts.append(self.attributes(b"\x4a", attributes))
        for event_name, event_ns in events:
            parts.append(field(b"\x5a", b"\x09" + _PACK_FIXED64(event_ns) + field(b"\x12", event_name.encode())))
        body = b"\x18" + _SMALL[status.value] if status.value else b""
        if description:
            body = field(b"\x12", description.encode("utf-8", "replace")) + body
        parts.append(field(b"\x7a", body))
        parts.append(b"\x85\x01" + _PACK_FIXED32(flags))  # field 16, fixed32
        return EncodedSpan(context, b"".join(parts))


def export_request(resource: Resource, scope: InstrumentationScope, spans: Sequence[EncodedSpan]) -> bytes:
    """ExportTraceServiceRequest holding one resource's spans of one instrumentation scope."""
    resource_body = SpanEncoder().attributes(b"\x0a", resource.attributes)
    scope_body = field(b"\x0a", scope.name.encode()) + (field(b"\x12", scope.version.encode()) if scope.version else b"")
    scope_spans = field(b"\x0a", scope_body) + b"".join(field(b"\x12", span.data) for span in spans)
    return field(b"\x0a", field(b"\x0a", resource_body) + field(b"\x12", scope_spans))


class HttpExporter(SdkHttpExporter):
    """OTLP over http/protobuf, for spans encoded on the request path."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        super().__init__()
        self.resource, self.scope = resource, scope

    def export(self, spans: Sequence[EncodedSpan]) -> SpanExportResult:  # type: ignore[override]
        if self._shutdown:
            return SpanExportResult.FAILURE
        result = self._client.export(export_request(self.resource, self.scope, spans))
        return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE


class GrpcExporter(SdkGrpcExporter):
    """OTLP over grpc, for spans encoded on the request path (the message is parsed from the
    bytes, in C, for the SDK's stub)."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        super().__init__()
        self.resource, self.scope = resource, scope

    def _translate_data(self, data: Sequence[EncodedSpan]) -> ExportTraceServiceRequest:  # type: ignore[override]
        return ExportTraceServiceRequest.FromString(export_request(self.resource, self.scope, data))
