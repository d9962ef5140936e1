"""A traced request as the request path notes it, and its OTLP spans, written a batch of
requests at a time.

The request path only notes values it has at hand (ids, clock readings, strings and numbers it
read anyway) and, when the request ends, packs them into one `RequestTrace`. Everything that
costs (attribute dicts, type checks, regexes, the wire format) happens here, for a batch of
requests in one loop, in the span export process by default (export_process.py): written in the
proxy, each request's spans as it ended cost about three times the same batch loop's CPU, and in
the batch processor's thread more again, its CPU contending with the event loop's for the GIL
(docs/observability.md).

A record holds strings, numbers, bytes and the decision's scores, nothing of the request's own
objects: the queue keeps no prompt, body or connection alive until the export, and it pickles.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags, TraceState

from proxy.telemetry import names as n
from proxy.telemetry.otlp import (
    STATUS_UNSET,
    SpanEncoder,
    context_fields,
    head_fields,
    raw_span,
    status_fields,
    trace_field,
)

log = logging.getLogger("specroute.telemetry")

# The batch processor reads only `context.trace_flags.sampled` of an item; only sampled
# requests are handed to it, so every item shows it this one context.
SAMPLED_CONTEXT = SpanContext(1, 1, False, TraceFlags(TraceFlags.SAMPLED), TraceState())
FIRST_BYTES = 2048
"""How much of an attempt's first chunk is kept for its response id and model (they open it)."""

# Only the first object's first key: an "id" further in may be a tool call's or one an upstream
# echoed from the request, which would put request or completion data on the span. A Responses
# stream's first event (`event: response.created`) holds the response object first.
_RESPONSE_ID = re.compile(
    rb'\s*(?:event:[^\n]{0,100}\n)?(?:data:\s*)?\{\s*(?:"response"\s*:\s*\{\s*)?"id"\s*:\s*"([^"\\]{1,200})"'
)
# Its first MAX_MODEL_CHARS characters, as the request's model is cut (no closing quote needed).
_RESPONSE_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,%d})' % n.MAX_MODEL_CHARS)
STORED_RESPONSE_ID = b"resp_"
"""How a Responses API id opens (SGLang's and OpenAI's)."""
_REQUEST_PARAMS = (
    (n.GEN_AI_REQUEST_MAX_TOKENS, int),
    (n.GEN_AI_REQUEST_TEMPERATURE, float),
    (n.GEN_AI_REQUEST_TOP_P, float),
    (n.GEN_AI_REQUEST_SEED, int),
)
_MEMO_LIMIT = 4096
_ATTRIBUTES = b"\x4a"  # Span.attributes (9)
_SERVER = object()  # the server span's key among the span heads
_DECISION_HEAD = head_fields(n.SPAN_DECISION, SpanKind.INTERNAL)


def request_params(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """The client's sampling parameters, unchecked (the export thread checks their types):
    max tokens, temperature, top_p, seed, n."""
    get = body.get
    return (get("max_completion_tokens", get("max_tokens")), get("temperature"), get("top_p"), get("seed"), get("n"))


class AttemptTrace(NamedTuple):
    """One upstream attempt; clock readings are time.perf_counter() seconds."""

    span_id: int
    number: int
    pool: str
    instance: str
    started: float
    ended: float
    status: int | None
    """The upstream's HTTP status, if it answered."""
    first: float | None
    """When its first bytes went to the client."""
    first_data: bytes
    """Up to FIRST_BYTES of its first chunk."""
    error: str | None
    """Why it failed, if it failed (then retried elsewhere, or given up)."""
    credited: int = 0
    """Prompt tokens the router credited its instance with holding in its prefix cache."""
    server_kind: str = ""
    """The kind of server its instance was learned as (proxy/backends: sglang, vllm, openai)."""


class RequestTrace(NamedTuple):
    """A sampled request's spans, as noted on the request path; clock readings are
    time.perf_counter() seconds, placed on the wall clock by (`start_ns`, `start`)."""

    endpoint: str
    request_id: str
    user_agent: str
    trace_id: int
    span_id: int
    trace_state: TraceState | None
    """None when empty (a shared TraceState would keep the record tracked by the collector)."""
    parent_id: int | None
    parent_remote: bool
    start_ns: int
    start: float
    decided: float | None
    """When the route was chosen (None: refused before, no decision span)."""
    policy: str
    pool: str
    reason: str
    request_class: str
    override: str | None
    prompt_tokens: int
    scores: Mapping[str, Any]
    model: str | None
    stream: bool
    params: tuple[Any, ...]
    """request_params() of the body."""
    content: str | None
    """The prompt as gen_ai.input.messages (SPECROUTE_TRACE_CONTENT only)."""
    attempts: tuple[AttemptTrace, ...]
    """Every attempt; the last one, unless it failed, also gets the response's outcome."""
    status: int
    error_type: str | None
    input_tokens: int | None
    output_tokens: int | None
    finish_reasons: tuple[str, ...]
    overhead_s: float
    ended: float
    cached_tokens: int | None = None
    """Prompt tokens the server reported found in its prefix cache, if it did."""


class SpanWriter:
    """Writes RequestTraces as OTLP spans, on one thread only (the encoder's memo
    has no lock)."""

    def __init__(self) -> None:
        self.encoder = SpanEncoder()
        self._addresses: dict[str, tuple[str, int]] = {}
        self._params: dict[tuple[Any, ...], tuple[dict[str, Any], tuple[Any, ...]]] = {}
        self._heads: dict[tuple[str, Any], bytes] = {}

    def spans(self, t: RequestTrace) -> bytes:
        """The request's spans (decision, attempts, server) as ScopeSpans.spans fields."""
        encoder = self.encoder
        start_ns, start = t.start_ns, t.start
        trace = trace_field(t.trace_id)
        under_server = context_fields(t.trace_state, t.span_id)
        out = []
        if t.decided is not None:
            static = encoder.block(
                ("route", t.policy, t.pool, t.reason, t.request_class, t.override),
                lambda: route_attributes(t.policy, t.pool, t.reason, t.request_class, t.override),
            )
            # The policy's predictions and, added by proxy.state.DecisionLog, what it saw: each pool's load,
            # capacity, reading age and staleness, and the speculative pool's alpha.
            attributes = (
                static
                + encoder.pair(_ATTRIBUTES, n.ROUTE_PROMPT_TOKENS, t.prompt_tokens)
                + encoder.numbers(_ATTRIBUTES, n.ROUTE_INPUT_PREFIX, t.scores)
            )
            # The decision span covers reading the body, building features and the policy call.
            out.append(
                raw_span(
                    trace,
                    random.getrandbits(64) or 1,
                    under_server,
                    _DECISION_HEAD,
                    start_ns,
                    start_ns + int((t.decided - start) * 1e9),
                    attributes,
                    STATUS_UNSET,
                )
            )
        last = len(t.attempts) - 1
        for i, attempt in enumerate(t.attempts):
            out.append(self._attempt(t, attempt, i == last and attempt.error is None, trace, under_server))
        status, error_type = t.status, t.error_type
        # HTTP semconv: a SERVER span is an error for 5xx, not 4xx (the client's), and for a
        # response cut after its 200 went out (an upstream that dropped or stalled mid-stream);
        # a client that left is not the server's error.
        failed = status >= 500 or bool(error_type and status < 400 and error_type != "client_disconnected")
        endpoint, user_agent = t.endpoint, t.user_agent
        static = encoder.block(
            ("server", endpoint, user_agent, status, error_type, failed),
            lambda: {
                n.HTTP_REQUEST_METHOD: "POST",
                n.HTTP_ROUTE: endpoint,
                n.URL_PATH: endpoint,
                n.URL_SCHEME: "http",
                n.USER_AGENT_ORIGINAL: user_agent,
                n.HTTP_RESPONSE_STATUS_CODE: status,
                **({n.ERROR_TYPE: error_type or str(status)} if failed else {}),
            },
        )
        attributes = (
            static
            + encoder.string(_ATTRIBUTES, n.REQUEST_ID, t.request_id)
            + encoder.double(_ATTRIBUTES, n.OVERHEAD_MS, round(t.overhead_s * 1000, 3))
        )
        out.append(
            raw_span(
                trace,
                t.span_id,
                context_fields(t.trace_state, t.parent_id),
                self._head(endpoint, _SERVER),
                start_ns,
                start_ns + int((t.ended - start) * 1e9),
                attributes,
                status_fields(StatusCode.ERROR if failed else StatusCode.UNSET, None, t.parent_remote),
            )
        )
        return b"".join(out)

    def _attempt(self, t: RequestTrace, a: AttemptTrace, outcome: bool, trace: bytes, context: bytes) -> bytes:
        """An attempt's CLIENT span; `outcome`: it carries the response's usage, finish reasons
        and error (it was still open when the response ended)."""
        encoder = self.encoder
        params, items = self._request_attributes(t.params)
        attributes = encoder.block(
            ("attempt", t.endpoint, t.model, a.pool, a.instance, a.server_kind, a.number, t.stream, items),
            lambda: attempt_attributes(
                t.endpoint,
                t.model,
                a.pool,
                a.instance,
                a.number,
                t.stream,
                params,
                self.address_of(a.instance),
                a.server_kind,
            ),
        )
        if t.content is not None:
            attributes += encoder.string(_ATTRIBUTES, n.GEN_AI_INPUT_MESSAGES, t.content)
        if a.credited:
            attributes += encoder.pair(_ATTRIBUTES, n.PREFIX_CREDITED_TOKENS, a.credited)
        events = b""
        response_model = None
        start_ns, start = t.start_ns, t.start
        if a.first is not None:
            if t.stream:  # the conventions' time to first chunk is a stream's
                attributes += encoder.double(_ATTRIBUTES, n.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, a.first - a.started)
            events = encoder.event(n.EVENT_FIRST_TOKEN, start_ns + int((a.first - start) * 1e9))
            # The response's first object (JSON body or first SSE event) opens with its id, then
            # its model, as SGLang and vLLM write them; a regex over these bytes, never a parse.
            found = _RESPONSE_ID.match(a.first_data)
            # A stored response's id reads the conversation back (GET /v1/responses/{id}): content,
            # on a span only with the content opt-in.
            if found and (t.content is not None or not found.group(1).startswith(STORED_RESPONSE_ID)):
                attributes += encoder.string(_ATTRIBUTES, n.GEN_AI_RESPONSE_ID, found.group(1).decode(errors="replace"))
            found = _RESPONSE_MODEL.search(a.first_data)
            if found:
                response_model = found.group(1)
        error = a.error
        usage: tuple[tuple[str, ...], int | None, int | None, int | None] = ((), None, None, None)
        if outcome:
            usage = (t.finish_reasons, t.input_tokens, t.output_tokens, t.cached_tokens)
            error = t.error_type
        if error and error.startswith("status_"):
            error = error[7:]  # HTTP semconv: an error status is its code ("503"); ours say status_503
        # What the response said, as one block: it repeats from request to request.
        attributes += encoder.block(
            ("outcome", a.status, response_model, *usage, error),
            lambda: outcome_attributes(a.status, response_model, *usage, error),
        )
        return raw_span(
            trace,
            a.span_id,
            context,
            self._head(t.endpoint, t.model),
            start_ns + int((a.started - start) * 1e9),
            start_ns + int((a.ended - start) * 1e9),
            attributes,
            events + status_fields(StatusCode.ERROR if error else StatusCode.UNSET, error, False),
        )

    def _head(self, endpoint: str, model: Any) -> bytes:
        """Name and kind of the SERVER span (`model` _SERVER) or of an attempt span, named
        `{gen_ai.operation.name} {gen_ai.request.model}` by the GenAI conventions."""
        head = self._heads.get((endpoint, model))
        if head is None:
            if len(self._heads) >= _MEMO_LIMIT:
                self._heads.clear()  # names carry the client's model name: keep them bounded
            if model is _SERVER:
                head = head_fields(f"POST {endpoint}", SpanKind.SERVER)
            else:
                operation = n.OPERATION_BY_PATH.get(endpoint, "chat")
                head = head_fields(f"{operation} {model}" if model else operation, SpanKind.CLIENT)
            self._heads[(endpoint, model)] = head
        return head

    def _request_attributes(self, params: tuple[Any, ...]) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """request_attributes() of request_params(), and their items (a memo key)."""
        try:
            memoised = self._params.get(params)
        except TypeError:  # a list or an object where a number belongs: not kept, not memoised
            attributes = request_attributes(params)
            return attributes, tuple(attributes.items())
        if memoised is None:
            if len(self._params) >= _MEMO_LIMIT:
                self._params.clear()
            attributes = request_attributes(params)
            memoised = self._params[params] = (attributes, tuple(attributes.items()))
        return memoised

    def address_of(self, url: str) -> tuple[str, int]:
        """server.address and server.port of an upstream base URL (parsed once per instance)."""
        address = self._addresses.get(url)
        if address is None:
            if len(self._addresses) >= _MEMO_LIMIT:
                self._addresses.clear()
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            address = self._addresses[url] = (parts.hostname or "", port)
        return address


def outcome_attributes(
    status: int | None,
    response_model: bytes | None,
    finish_reasons: tuple[str, ...],
    input_tokens: int | None,
    output_tokens: int | None,
    cached_tokens: int | None,
    error: str | None,
) -> dict[str, Any]:
    """An attempt span's attributes from its response (and, for the last one, the request's end)."""
    attributes: dict[str, Any] = {}
    if status is not None:
        attributes[n.HTTP_RESPONSE_STATUS_CODE] = status
    if response_model is not None:
        attributes[n.GEN_AI_RESPONSE_MODEL] = response_model.decode(errors="replace")
    if finish_reasons:
        attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] = list(finish_reasons)
    if input_tokens is not None:
        attributes[n.GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
    if output_tokens is not None:
        attributes[n.GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
    if cached_tokens is not None:
        attributes[n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached_tokens
    if error:
        attributes[n.ERROR_TYPE] = error
    return attributes


def route_attributes(policy: str, pool: str, reason: str, request_class: str, override: str | None) -> dict[str, Any]:
    attributes = {
        n.ROUTE_POLICY: policy,
        n.ROUTE_POOL: pool,
        n.ROUTE_REASON: reason,
        n.ROUTE_REQUEST_CLASS: request_class,
    }
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
    server_kind: str = "",
) -> dict[str, Any]:
    """The attempt span's attributes known when it starts (GenAI conventions, then ours)."""
    attributes: dict[str, Any] = {
        n.GEN_AI_OPERATION_NAME: n.OPERATION_BY_PATH.get(endpoint, "chat"),
        n.GEN_AI_PROVIDER_NAME: n.PROVIDER_BY_KIND.get(server_kind, n.PROVIDER_UNKNOWN),
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


def request_attributes(params: tuple[Any, ...]) -> dict[str, Any]:
    """GenAI request attributes from request_params(); values of a wrong type are skipped."""
    attributes: dict[str, Any] = {}
    for (name, kind), value in zip(_REQUEST_PARAMS, params):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attributes[name] = kind(value)
    choices = params[4]
    if isinstance(choices, int) and not isinstance(choices, bool) and choices != 1:
        attributes[n.GEN_AI_REQUEST_CHOICE_COUNT] = choices
    return attributes
