"""OTLP protobuf for finished spans, written on the event loop, and the SDK's two OTLP exporters
sending it.

The SDK's encoder builds a protobuf object per attribute and costs 75-100 us per span here, about
three times the whole budget for tracing a request (docs/observability.md). This one writes the
wire format directly (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto), reusing
the bytes of the attribute pairs that repeat from request to request; spans.py drives it for a
batch of requests at a time, and the batch processor then only moves bytes. Transport, retries,
headers, TLS and endpoint resolution stay the SDK exporters' own.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as SdkGrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as SdkHttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceState

from proxy.telemetry import names as n

_PACK_DOUBLE = struct.Struct("<d").pack
_PACK_FIXED64 = struct.Struct("<Q").pack
_PACK_FIXED32 = struct.Struct("<I").pack
_PACK_TIMES = struct.Struct("<BQBQ").pack  # start_time_unix_nano (7) and end_time_unix_nano (8), fixed64
_SMALL = [bytes((i,)) for i in range(128)]
_MEMO_LIMIT = 4096
# Attributes whose values never repeat: not memoised (they would only crowd out the ones that do).
_UNIQUE = frozenset({n.REQUEST_ID, n.GEN_AI_RESPONSE_ID, n.GEN_AI_INPUT_MESSAGES})
# Span.flags (field 16, fixed32): SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE, and IS_REMOTE for a remote parent.
_LOCAL_PARENT = b"\x85\x01" + _PACK_FIXED32(0x100)
_REMOTE_PARENT = b"\x85\x01" + _PACK_FIXED32(0x300)
# Span.status (field 15) without a description, by code: unset, ok, error.
_STATUS = [b"\x7a\x00", b"\x7a\x02\x18\x01", b"\x7a\x02\x18\x02"]


def varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value] if value >= 0 else varint(value & 0xFFFFFFFFFFFFFFFF)
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length(n: int) -> bytes:
    """varint() of a length, without its loop for the lengths of a span (under 16 KiB)."""
    if n < 128:
        return _SMALL[n]
    if n < 16384:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    return varint(n)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the payload's length, the payload."""
    return tag + length(len(payload)) + payload


def any_value(value: Any) -> bytes:
    """common.v1.AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(value, str):
        return field(b"\x0a", value.encode("utf-8", "replace"))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    # Beyond int64 (a client's "max_tokens": 1e30) an int goes as text: a longer varint corrupts the batch.
    if isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + _PACK_DOUBLE(value)
    if isinstance(value, (list, tuple)):
        return field(b"\x2a", b"".join(field(b"\x0a", any_value(v)) for v in value))
    return field(b"\x0a", str(value).encode("utf-8", "replace"))


def double_prefix(tag: bytes, key: str) -> bytes:
    """Everything of a framed KeyValue with a double value but the value's 8 bytes."""
    key_field = field(b"\x0a", key.encode())
    return tag + varint(len(key_field) + 11) + key_field + b"\x12\x09\x21"


_NO_LAYOUT: Any = object()


def number_layout(
    tag: bytes, prefix: str, keys: Sequence[str], kinds: Sequence[type]
) -> tuple[Callable[..., bytes], list[Any]] | None:
    """A struct packer and its argument template for SpanEncoder.numbers (None: not all float or bool)."""
    formats, args = ["<"], []
    for key, kind in zip(keys, kinds):
        if kind is float:
            framing = double_prefix(tag, prefix + key)
            formats.append(f"{len(framing)}sd")
        elif kind is bool:
            key_field = field(b"\x0a", (prefix + key).encode())
            framing = tag + varint(len(key_field) + 4) + key_field + b"\x12\x02\x10"
            formats.append(f"{len(framing)}s?")
        else:
            return None
        args += [framing, None]
    return struct.Struct("".join(formats)).pack, args


MAX_REQUEST_BYTES = 1 << 20
"""Spans per export request, at most (a collector's gRPC receive limit is 4 MiB by default)."""


class EncodedSpans:
    """Requests' finished spans in OTLP wire format, as the SDK's BatchSpanProcessor carries them
    to the exporter: one item per batch of requests, `parts` one request's spans each
    (ScopeSpans.spans fields). The processor reads only `context`, for the sampled flag."""

    __slots__ = ("context", "parts")

    def __init__(self, context: SpanContext, parts: list[bytes]) -> None:
        self.context = context
        self.parts = parts


def chunks(items: Sequence[EncodedSpans], limit: int = MAX_REQUEST_BYTES) -> Iterator[list[bytes]]:
    """The items' requests' spans in runs of at most `limit` bytes (or one request), for one
    export request each."""
    chunk: list[bytes] = []
    size = 0
    for item in items:
        for part in item.parts:
            if chunk and size + len(part) > limit:
                yield chunk
                chunk, size = [], 0
            chunk.append(part)
            size += len(part)
    if chunk:
        yield chunk


class SpanEncoder:
    """Encodes finished spans on the request path (one event-loop thread: the memo needs no lock)."""

    def __init__(self) -> None:
        # tag -> key -> value -> framed KeyValue; per key, so no tuple is built per attribute.
        self._memo: dict[bytes, dict[str, dict[Any, bytes]]] = {}
        self._memo_size = 0
        self._doubles: dict[tuple[bytes, str], bytes] = {}
        self._heads: dict[tuple[str, SpanKind], bytes] = {}
        self._blocks: dict[tuple[Any, ...], bytes] = {}
        self._layouts: dict[tuple[Any, ...], tuple[Callable[..., bytes], list[Any]] | None] = {}
        self._keys: dict[str, bytes] = {}
        self._events: dict[str, bytes] = {}
        self._event_names: dict[str, bytes] = {}

    def block(self, key: tuple[Any, ...], attributes: Callable[[], Mapping[str, Any]]) -> bytes:
        """Encoded span attributes that are the same for every request with this `key` (a route,
        a model and its sampling parameters on one instance...): one lookup for all of them."""
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= _MEMO_LIMIT:
                self._blocks.clear()
            block = self._blocks[key] = self.attributes(b"\x4a", attributes())
        return block

    def numbers(self, tag: bytes, prefix: str, values: Mapping[str, Any]) -> bytes:
        """Attributes named `prefix` + key with float or bool values (a decision's scores: a
        dozen per request, the same keys and types every time), written by one struct call per
        layout of keys and types: the framing of each pair is a constant of the layout."""
        layout_key = (tag, prefix, tuple(values), tuple(map(type, values.values())))
        layout = self._layouts.get(layout_key, _NO_LAYOUT)
        if layout is _NO_LAYOUT:
            if len(self._layouts) >= _MEMO_LIMIT:
                self._layouts.clear()
            layout = self._layouts[layout_key] = number_layout(tag, prefix, layout_key[2], layout_key[3])
        if layout is None:  # an int, a string...: one by one
            return self.attributes(tag, {prefix + key: value for key, value in values.items()})
        pack, args = layout
        args = args.copy()  # each pair's framing, then a slot for its value
        args[1::2] = values.values()
        return pack(*args)

    def attributes(self, tag: bytes, attributes: Mapping[str, Any]) -> bytes:
        """Attributes as repeated KeyValue fields (key 1, value 2) under `tag`: doubles by
        double(), values that never repeat by string() or afresh, the rest by pair()."""
        out = []
        for key, value in attributes.items():
            if value.__class__ is float:
                out.append(self.double(tag, key, value))
            elif key in _UNIQUE:
                out.append(
                    self.string(tag, key, value)
                    if value.__class__ is str
                    else field(tag, field(b"\x0a", key.encode()) + field(b"\x12", any_value(value)))
                )
            else:
                out.append(self.pair(tag, key, value))
        return b"".join(out)

    def pair(self, tag: bytes, key: str, value: Any) -> bytes:
        """A framed KeyValue, memoised: repeating ones (model, pool, route, status...) cost
        three dict lookups."""
        memo = self._memo.get(tag)
        if memo is None:
            memo = self._memo[tag] = {}
        values = memo.get(key)
        if values is None:
            values = memo[key] = {}
        cls = value.__class__
        # True == 1 as dict keys, but they encode differently: bools and lists get own keys.
        value_key = value if cls is str or cls is int else (cls, tuple(value) if cls is list else value)
        encoded = values.get(value_key)
        if encoded is None:
            encoded = field(tag, field(b"\x0a", key.encode()) + field(b"\x12", any_value(value)))
            self._memo_size += 1
            if self._memo_size > _MEMO_LIMIT:
                memo.clear()  # unique values (ids, counts) would otherwise pile up
                self._memo_size = 0
                values = memo[key] = {}
            values[value_key] = encoded
        return encoded

    def double(self, tag: bytes, key: str, value: float) -> bytes:
        """A KeyValue with a double value (they rarely repeat): a memoised prefix and 8 bytes."""
        prefix = self._doubles.get((tag, key))
        if prefix is None:
            prefix = self._doubles[(tag, key)] = double_prefix(tag, key)
        return prefix + _PACK_DOUBLE(value)

    def string(self, tag: bytes, key: str, value: str) -> bytes:
        """A KeyValue with a string value that never repeats (ids): the key's field is memoised."""
        key_field = self._keys.get(key)
        if key_field is None:
            key_field = self._keys[key] = field(b"\x0a", key.encode())
        data = value.encode("utf-8", "replace")
        value_field = b"\x0a" + length(len(data)) + data
        pair = key_field + b"\x12" + length(len(value_field)) + value_field
        return tag + length(len(pair)) + pair

    def head(self, name: str, kind: SpanKind) -> bytes:
        """A span's name (5) and kind (6; OTLP kinds are the SDK's + 1)."""
        head = self._heads.get((name, kind))
        if head is None:
            if len(self._heads) >= _MEMO_LIMIT:
                self._heads.clear()  # names carry the client's model name: keep them bounded
            head = self._heads[(name, kind)] = head_fields(name, kind)
        return head

    def event(self, name: str, time_ns: int) -> bytes:
        """A Span.events field (11) without attributes."""
        prefix = self._events.get(name)
        if prefix is None:
            name_field = field(b"\x12", name.encode())
            prefix = self._events[name] = b"\x5a" + length(9 + len(name_field)) + b"\x09"
            self._event_names[name] = name_field
        return prefix + _PACK_FIXED64(time_ns) + self._event_names[name]

    def span(
        self,
        name: str,
        trace_id: int,
        span_id: int,
        trace_state: TraceState | None,
        parent_id: int | None,
        parent_remote: bool,
        kind: SpanKind,
        start_ns: int,
        end_ns: int,
        static: bytes,
        attributes: Mapping[str, Any],
        events: Sequence[tuple[str, int]],
        status: StatusCode,
        description: str | None,
    ) -> bytes:
        """trace.v1.Span, framed as a ScopeSpans.spans field: `static` attributes from block(),
        then `attributes`; `events` are (name, time) pairs."""
        return raw_span(
            trace_field(trace_id),
            span_id,
            context_fields(trace_state, parent_id),
            self.head(name, kind),
            start_ns,
            end_ns,
            static + self.attributes(b"\x4a", attributes),
            b"".join(self.event(*e) for e in events) + status_fields(status, description, parent_remote),
        )


def head_fields(name: str, kind: SpanKind) -> bytes:
    """Span.name (5) and Span.kind (6; OTLP kinds are the SDK's + 1)."""
    return field(b"\x2a", name.encode("utf-8", "replace")) + b"\x30" + _SMALL[kind.value + 1]


def trace_field(trace_id: int) -> bytes:
    """Span.trace_id (1)."""
    return b"\x0a\x10" + trace_id.to_bytes(16, "big")


def context_fields(trace_state: TraceState | None, parent_id: int | None) -> bytes:
    """Span.trace_state (3) and parent_span_id (4), when there are."""
    out = field(b"\x1a", trace_state.to_header().encode()) if trace_state else b""
    if parent_id is not None:
        out += b"\x22\x08" + parent_id.to_bytes(8, "big")
    return out


def status_fields(status: StatusCode, description: str | None, parent_remote: bool) -> bytes:
    """Span.status (15) and Span.flags (16)."""
    flags = _REMOTE_PARENT if parent_remote else _LOCAL_PARENT
    if description:
        body = field(b"\x12", description.encode("utf-8", "replace")) + b"\x18" + _SMALL[status.value]
        return field(b"\x7a", body) + flags
    return _STATUS[status.value] + flags


STATUS_UNSET = _STATUS[0] + _LOCAL_PARENT
"""status_fields() of a span without an error under a local parent."""


def raw_span(
    trace: bytes, span_id: int, context: bytes, head: bytes, start_ns: int, end_ns: int, attributes: bytes, tail: bytes
) -> bytes:
    """trace.v1.Span framed as a ScopeSpans.spans field, from its parts: trace_field(),
    context_fields(), SpanEncoder.head(), the attributes' bytes, then events and status_fields()."""
    body = b"".join(
        (
            trace,
            b"\x12\x08",
            span_id.to_bytes(8, "big"),
            context,
            head,
            _PACK_TIMES(0x39, start_ns, 0x41, end_ns),
            attributes,
            tail,
        )
    )
    return b"\x12" + length(len(body)) + body


def export_request(resource: Resource, scope: InstrumentationScope, data: Sequence[bytes]) -> bytes:
    """ExportTraceServiceRequest holding one resource's spans of one instrumentation scope;
    `data` are ScopeSpans.spans fields."""
    resource_field = field(b"\x0a", SpanEncoder().attributes(b"\x0a", resource.attributes))
    scope_body = field(b"\x0a", scope.name.encode()) + (
        field(b"\x12", scope.version.encode()) if scope.version else b""
    )
    scope_field = field(b"\x0a", scope_body)
    # Framed from the lengths, then joined once: the spans (about 1 MB a batch) are copied once.
    scope_spans = len(scope_field) + sum(map(len, data))
    scope_spans_head = b"\x12" + varint(scope_spans)
    resource_spans = len(resource_field) + len(scope_spans_head) + scope_spans
    return b"".join((b"\x0a", varint(resource_spans), resource_field, scope_spans_head, scope_field, *data))


class HttpExporter(SdkHttpExporter):
    """OTLP over http/protobuf, for spans already encoded (one request per chunks())."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        super().__init__()
        self.resource, self.scope = resource, scope

    def export(self, spans: Sequence[EncodedSpans]) -> SpanExportResult:  # type: ignore[override]
        if self._shutdown:
            return SpanExportResult.FAILURE
        results = [
            self._client.export(export_request(self.resource, self.scope, chunk)).success for chunk in chunks(spans)
        ]
        return SpanExportResult.SUCCESS if all(results) else SpanExportResult.FAILURE


class GrpcExporter(SdkGrpcExporter):
    """OTLP over grpc, for spans already encoded (one request per chunks(); the message is
    parsed from the bytes, in C, for the SDK's stub)."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        super().__init__()
        self.resource, self.scope = resource, scope

    def export(self, spans: Sequence[EncodedSpans]) -> SpanExportResult:  # type: ignore[override]
        export = super().export  # not in the comprehension: its own scope has no super()
        results = [export(chunk) for chunk in chunks(spans)]  # type: ignore[arg-type]
        return (
            SpanExportResult.SUCCESS
            if all(r is SpanExportResult.SUCCESS for r in results)
            else SpanExportResult.FAILURE
        )

    def _translate_data(self, data: Sequence[bytes]) -> ExportTraceServiceRequest:  # type: ignore[override]
        return ExportTraceServiceRequest.FromString(export_request(self.resource, self.scope, data))
