"""Cheap looks into relayed bytes: SSE events per chunk, and usage/finish reasons at the end.

Chunks are never parsed or re-encoded on the way through; these are byte counts and regular
expressions over small slices, run once per chunk (count) or once per response (summary).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from proxy.errors import response_error_event, stream_error_event

EVENT = b"data:"
DONE = b"data: [DONE]"
NO_CHOICES = b'"choices":[]'
NO_CHOICES_SPACED = b'"choices": []'

# A count of more than nine digits (a billion tokens) is no count an upstream means: it is not
# taken (a 400-digit one overflowed the float arithmetic of the fleet model's means).
_COUNT = rb"(\d{1,9})(?!\d)"
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*' + _COUNT)
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*' + _COUNT)
_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]+)"')
_SPEC_VERIFY_CT = re.compile(rb'"spec_verify_ct"\s*:\s*' + _COUNT)
# usage.prompt_tokens_details.cached_tokens (SGLang --enable-cache-report, vLLM
# --enable-prompt-tokens-details); only inside prompt_tokens_details, so SGLang's
# meta_info.cached_tokens or a completion's text cannot be taken for it.
_CACHED_TOKENS = re.compile(rb'"prompt_tokens_details"\s*:\s*\{[^{}]*?"cached_tokens"\s*:\s*' + _COUNT)
# SGLang writes prompt_tokens_details only when some prompt token was cached (its
# _details_if_cached): null is a miss on a server that reports, and every answer of one that does not.
_NO_CACHED_DETAILS = re.compile(rb'"prompt_tokens_details"\s*:\s*null')


# Chat stream events that carry no text: the opening with the role alone (vLLM and SGLang send
# one per choice with the first token's), and SGLang's closing one per choice with an empty delta
# and the finish reason, after the last token's. Neither is a token nor a step gap. The prefixes
# as SGLang's versions write them: msgspec leaving None out ({} to close), pydantic writing it
# (role, then content), and a StreamDelta writing reasoning_content first, always (SGLang 0.5's
# sse_utils: its closing delta is {"reasoning_content":null}).
TEXTLESS = (
    b'"delta":{"role":"assistant","content":""',
    b'"delta":{}',
    b'"delta":{"role":null,"content":null',
    b'"delta":{"reasoning_content":null,"role":"assistant","content":""',
    b'"delta":{"reasoning_content":null,"role":null,"content":null',
    b'"delta":{"reasoning_content":null}',
)
TOOL_CALL_DELTAS = (
    b'"delta":{"role":null,"content":null,"tool_calls":[',
    b'"delta":{"role":null,"content":null,"reasoning_content":null,"tool_calls":[',
)
"""Pydantic's deltas (SGLang's tool-call chunks) that open as a TEXTLESS one does but carry a
call's tokens: counted back."""


def line_starts(chunk: bytes, prefix: bytes) -> int:
    """Lines of whole SSE events (a chunk opens at an event) that open with `prefix`. Only a line
    start counts: a raw line break cannot be inside JSON, but the model's text, or a field
    echoing the client's (the model name), may read "data: [DONE]"."""
    lone_cr = chunk.count(b"\r" + prefix) if b"\r" in chunk else 0  # old Mac line ends: CR alone
    return chunk.startswith(prefix) + chunk.count(b"\n" + prefix) + lone_cr


def content_events(chunk: bytes) -> int:
    """SSE data events in a chunk, the closing [DONE] and chat events without text (or without a
    choice) not counted."""
    events = line_starts(chunk, EVENT)
    if events and DONE in chunk:
        events -= line_starts(chunk, DONE)
    # A stream's usage event and SGLang's spec_tokens_details one have no choice at all (SGLang
    # and vLLM write JSON without spaces; a server that puts one after the colon is read too).
    if events and (NO_CHOICES in chunk or NO_CHOICES_SPACED in chunk):
        events = max(events - chunk.count(NO_CHOICES) - chunk.count(NO_CHOICES_SPACED), 0)
    # Every TEXTLESS prefix has "r" or "}" after the brace; a text delta as msgspec writes it
    # without reasoning ("delta":{"content":...) has neither, so such chunks pass with two scans.
    if events and (b'"delta":{"r' in chunk or b'"delta":{}' in chunk):
        textless = sum(chunk.count(prefix) for prefix in TEXTLESS)
        if textless and b'"tool_calls":[' in chunk:
            textless -= sum(chunk.count(prefix) for prefix in TOOL_CALL_DELTAS)
        events = max(events - textless, 0)
    return events


# What ends an SSE event (a blank line), by line ending; a line may end one way and the blank
# line another (LF then CRLF is an event's end too: a stream ended so lost its [DONE]).
EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n")


class EventTooLarge(Exception):
    """An upstream SSE event grew past the limit without ending."""


class EventSplitter:
    """Whole SSE events out of reads that split them anywhere, in time linear in the bytes: an
    unterminated rest is kept as pieces and joined once its end arrives (re-joining it on every
    read was quadratic: 60 MB without a blank line took 7.5 s of the event loop)."""

    __slots__ = ("limit", "pending", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending: list[bytes] = []
        self.size = 0

    def feed(self, chunk: bytes) -> bytes:
        """The whole events that `chunk` completes (b"" if none); raises EventTooLarge."""
        if not self.pending and chunk.endswith(b"\n\n"):
            return chunk
        if self.pending:
            # An end may straddle the reads: look at the rest's last 3 bytes too (over its last
            # three pieces: a piece may be a single byte).
            probe = b"".join(self.pending[-3:])[-3:] + chunk
            if not any(end in probe for end in EVENT_ENDS):
                return self._keep(chunk)
            chunk = b"".join(self.pending) + chunk
            self.pending, self.size = [], 0
        whole, rest = split_at_event_end(chunk)
        if rest:
            self._keep(rest)
        return whole

    def _keep(self, piece: bytes) -> bytes:
        self.pending.append(piece)
        self.size += len(piece)
        if self.size > self.limit:
            raise EventTooLarge(f"an upstream event grew past {self.limit} bytes without ending")
        return b""

    def rest(self) -> bytes:
        return b"".join(self.pending)


def split_at_event_end(chunk: bytes) -> tuple[bytes, bytes]:
    """(the whole SSE events at the start of `chunk`, the unterminated rest)."""
    end = 0
    for boundary in EVENT_ENDS:
        at = chunk.rfind(boundary)
        if at >= 0:
            end = max(end, at + len(boundary))
    return chunk[:end], chunk[end:]


@dataclass(frozen=True, slots=True)
class Summary:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reasons: tuple[str, ...] = ()
    spec_verify_ct: int | None = None
    """SGLang's verify steps for the request (sglext.spec_tokens_details), when it sent them."""
    cached_tokens: int | None = None
    """Prompt tokens the server found in its prefix cache (usage.prompt_tokens_details.cached_tokens),
    when it reports them."""
    cached_details_null: bool = False
    """The usage said prompt_tokens_details: null, or had none (SGLang's answer for a miss when it
    reports: a completions stream's usage chunk is dumped without its null fields)."""
    error_status: int | None = None
    """The status of an in-band error event the stream ended with (`error_event_status`)."""


# An SSE line opening an error event (a raw line break cannot be inside JSON: the model's text
# cannot open one). SGLang writes it with json.dumps's spacing, the proxy's own compactly.
_ERROR_EVENT = re.compile(rb'(?:\A|[\r\n])data: ?(\{"error": ?\{[^\r\n]*)')
_ERROR_CODE = re.compile(rb'"code": ?(\d{3})\b')


def error_event_status(events: bytes) -> int | None:
    """The HTTP status of the first in-band error event among whole SSE events, None without one.
    SGLang ends a stream so when its scheduler aborts the request with a status (a full queue
    503, a timeout 503, a validation 400: serving_chat's `create_streaming_error_response`, then
    [DONE]); a stream's first event when it is refused so, its 200 having gone with it. Its
    `code` is the status (502 when it names none in 400-599)."""
    found = _ERROR_EVENT.search(events)
    if found is None:
        return None
    code = _ERROR_CODE.search(found.group(1))
    status = int(code.group(1)) if code is not None else 0
    return status if 400 <= status < 600 else 502


def first_data_line_ended(buffered: bytes) -> bool:
    """Whether a stream's first bytes hold its first data line whole (or no data line yet): an
    error event split across reads is judged once it is whole (`leading_error_event`)."""
    start = 0 if buffered.startswith(EVENT) else buffered.find(b"\n" + EVENT)
    if start < 0:
        return True
    rest = buffered[start + 1 :]
    return b"\n" in rest or b"\r" in rest


def leading_error_event(first: bytes) -> bytes | None:
    """The JSON of the error event a stream opens with (its first data event), None when its first
    data event is anything else."""
    found = _ERROR_EVENT.search(first)
    if found is None:
        return None
    opening = found.start() + (0 if first[found.start() : found.start() + 1] == b"d" else 1)
    if line_starts(first[:opening], EVENT):
        return None  # a data event came before it
    return found.group(1)


def summarise(tail: bytes) -> Summary:
    """Usage and finish reasons found in the last bytes of a response (JSON body or SSE tail)."""
    prompt = _PROMPT_TOKENS.findall(tail)
    completion = _COMPLETION_TOKENS.findall(tail)
    verify = _SPEC_VERIFY_CT.findall(tail)
    cached = _CACHED_TOKENS.findall(tail)
    return Summary(
        prompt_tokens=int(prompt[-1]) if prompt else None,
        completion_tokens=int(completion[-1]) if completion else None,
        finish_reasons=tuple(reason.decode() for reason in _FINISH_REASON.findall(tail)),
        spec_verify_ct=int(verify[-1]) if verify else None,
        cached_tokens=int(cached[-1]) if cached else None,
        cached_details_null=not cached
        and (_NO_CACHED_DETAILS.search(tail) is not None or (bool(prompt) and b'"prompt_tokens_details"' not in tail)),
        error_status=error_event_status(tail),
    )


# Asked of the upstream for a stream whose client did not say (`with_usage_requested`).
USAGE_REQUESTED = b'"stream_options":{"include_usage":true}'
_EVENT_SPLIT = re.compile(b"|".join(b"(?<=" + re.escape(end) + b")" for end in EVENT_ENDS))
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_EMPTY_REST = re.compile(rb"[ \t\r\n]*\}")


def with_usage_requested(body: bytes) -> bytes:
    """A JSON object's body asking for a stream's usage chunk (`stream_options.include_usage`),
    for a body that names no `stream_options` (the caller checked) and has a key already (a
    stream's has `stream`)."""
    return with_first_member(body, USAGE_REQUESTED)


def with_first_member(body: bytes, member: bytes) -> bytes:
    """A JSON object's body with `member` (`"name":value`) put first, so nothing else is
    re-encoded; for a body that does not have it already (the caller checked)."""
    opening = body.index(b"{") + 1
    empty = _EMPTY_REST.match(body, opening) is not None  # read in place: the body may be MBs
    return body[:opening] + member + (b"" if empty else b",") + body[opening:]


def without_usage_events(chunk: bytes) -> bytes:
    """`chunk` (whole SSE events) less the usage chunk a stream sends when asked for it: an event
    with no choices and a usage object. Other choice-less events (SGLang's spec details, say)
    stay. A chunk without a usage object (SGLang's and the twin's content chunks carry
    `"usage":null`) goes on after one scan; only one holding a usage is split into events."""
    if _USAGE_OBJECT.search(chunk) is None:
        return chunk
    events = _EVENT_SPLIT.split(chunk)
    return b"".join(e for e in events if _EMPTY_CHOICES.search(e) is None or _USAGE_OBJECT.search(e) is None)


# The Responses API (POST /v1/responses): named events, `event: <type>` then `data: {...}`. Text,
# reasoning and tool-call arguments arrive as `response.*.delta` events; the events before the
# first of them (response.created, response.in_progress, an output item and content part added)
# carry no token, and SGLang sends them before generation starts. No [DONE] closes the stream:
# response.completed (or .incomplete, .failed, or an error event) is its last event, with usage.
# Events are told by their `event:` line, never by bytes inside their data: the data echoes what
# the client sent (instructions, metadata) and holds the model's text, any of which may read
# "response.completed" or "event: error"; a raw line break cannot be inside JSON.
DELTA_LINES = (b".delta\ndata:", b".delta\r\ndata:")
"""The end of a delta event's `event:` line and the start of its data line."""
END_TYPES = (b"response.completed", b"response.incomplete", b"response.failed", b"error")
END_OPENINGS = tuple(b"event: " + kind + ending for kind in END_TYPES for ending in (b"\n", b"\r\n"))
"""A stream's last event's `event:` line."""
END_LINES = tuple(b"\n" + opening for opening in END_OPENINGS)
"""The same after the line break before it (a chunk of whole events may also open with one)."""
PREAMBLE_EVENTS = 8
"""Data events held at most while waiting for a stream's first token: past them it is taken as
started (a server whose events carry no `event:` line is relayed, not held to its end)."""
RESPONSE_ID = r"resp_[A-Za-z0-9_\-]{1,195}"
"""What SGLang and vLLM make a response's id (`resp_` and hex digits; both refuse, with a 400, an
id not opening with `resp_`), at most 200 characters."""
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(' + RESPONSE_ID.encode() + rb')"')
_EVENT_TYPE = re.compile(rb"event: response\.([a-z_.]+)\r?\n")
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*')
_STATUS = re.compile(rb'"status"\s*:\s*"([a-z_]+)"')
_INPUT_TOKENS = re.compile(rb'"input_tokens"\s*:\s*' + _COUNT)
_OUTPUT_TOKENS = re.compile(rb'"output_tokens"\s*:\s*' + _COUNT)
_INPUT_CACHED = re.compile(rb'"input_tokens_details"\s*:\s*\{[^{}]*?"cached_tokens"\s*:\s*' + _COUNT)
_INCOMPLETE_REASON = re.compile(rb'"incomplete_details"\s*:\s*\{[^{}]*?"reason"\s*:\s*"([A-Za-z_]+)"')
USAGE_BYTES = 1024
"""The longest usage object read (SGLang's is about 200 bytes)."""
STATUS_BYTES = 256
"""How far before its usage a JSON answer's own status is looked for (SGLang writes it just before)."""
END_STATUSES = frozenset({b"completed", b"incomplete", b"failed"})
TAIL_BYTES = 64 * 1024
"""What a Responses answer keeps of its end beyond its request's size: all of the response object
after its usage is the server's fields and what it echoes of the request."""
FINISH_OF_STATUS = {b"completed": "stop", b"failed": "error", b"cancelled": "abort"}
FINISH_OF_INCOMPLETE = {b"max_output_tokens": "length", b"content_filter": "content_filter"}


def response_events(chunk: bytes) -> int:
    """Delta events (each a token or a few, as a chat chunk) in whole Responses API events."""
    return chunk.count(DELTA_LINES[0]) + chunk.count(DELTA_LINES[1])


def response_started(buffered: bytes) -> bool:
    """Whether a Responses stream's first bytes (from the stream's start, or from a line break on)
    hold its first token or its end: what comes before is held, as a chat stream is until its
    first chunk, so that a server failing before its first token is still failed over and the
    first-token timeout still holds."""
    return any(line in buffered for line in DELTA_LINES) or any(line in buffered for line in END_LINES)


def response_ended(chunk: bytes) -> bool:
    """Whether whole events (a chunk starts at an event) hold the stream's last event."""
    return chunk.startswith(END_OPENINGS) or any(line in chunk for line in END_LINES)


def response_id(first: bytes) -> str | None:
    """A Responses answer's id (`resp_...`): the first `id` of a JSON answer or of a stream's
    response.created event, both of which open with the response object."""
    found = _RESPONSE_ID.search(first)
    return found.group(1).decode() if found else None


def usage_object(region: bytes) -> tuple[int, bytes | None]:
    """(where the response's `usage` key is, -1 if nowhere; its object, None when it is null).
    The response's own key is the first in `region` (the response object, or a stream's last
    event): it comes before the fields that echo the client's objects (tools, metadata), whose
    keys a client chooses, and text is in strings, where a quote is escaped."""
    found = region.find(b'"usage":')
    if found >= 0:
        value = found + 8
    else:
        match = _USAGE_KEY.search(region)
        if match is None:
            return -1, None
        found, value = match.start(), match.end()
    while value < len(region) and region[value] in b" \t\r\n":
        value += 1
    if value >= len(region) or region[value] != 0x7B:  # null (a queued or failed response)
        return found, None
    depth = 0
    for at in range(value, min(len(region), value + USAGE_BYTES)):
        byte = region[at]
        if byte == 0x7B:  # {
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return found, region[value : at + 1]
    return found, None


def summarise_response(tail: bytes) -> Summary:
    """`summarise` for the Responses API, from the answer's end: a stream's last event when it
    is one that ends it with the response (completed, incomplete, failed: else nothing is taken,
    for the client's own echoed objects may be all that is left), or a JSON answer's response
    object (`tail` holds all of it that follows its usage: `Dialect.tail_bytes`). Usage as input
    and output tokens; a finish reason from how the response ended (completed: "stop";
    incomplete for its max_output_tokens: "length"; failed: "error")."""
    at = tail.rfind(b"\nevent: ") + 1
    if at > 0 or tail.startswith(b"event: "):  # a stream: its last event only
        last = _EVENT_TYPE.match(tail, at)
        status = last.group(1) if last is not None else None
        if status not in END_STATUSES:
            return Summary(finish_reasons=("error",) if tail.startswith(b"event: error", at) else ())
        region = tail[at:]
        _, usage = usage_object(region)
    else:  # a JSON answer: the response's own status is the one just before its usage
        region = tail
        found, usage = usage_object(region)
        statuses = _STATUS.findall(region, max(found - STATUS_BYTES, 0), found) if found >= 0 else []
        status = statuses[-1] if statuses else None
    finish: tuple[str, ...] = ()
    if status == b"incomplete":
        reason = _INCOMPLETE_REASON.search(region)
        finish = (FINISH_OF_INCOMPLETE.get(reason.group(1), reason.group(1).decode()) if reason else "length",)
    elif status in FINISH_OF_STATUS:
        finish = (FINISH_OF_STATUS[status],)
    if usage is None:
        return Summary(finish_reasons=finish)
    prompt = _INPUT_TOKENS.search(usage)
    completion = _OUTPUT_TOKENS.search(usage)
    cached = _INPUT_CACHED.search(usage)
    return Summary(
        prompt_tokens=int(prompt.group(1)) if prompt else None,
        completion_tokens=int(completion.group(1)) if completion else None,
        finish_reasons=finish,
        cached_tokens=int(cached.group(1)) if cached else None,
    )


class Tail:
    """The end of a response as it was relayed: its last chunks, at least `limit` bytes of them
    (all, when it is shorter), for `summarise` to read once it is over."""

    __slots__ = ("chunks", "size", "limit")

    def __init__(self, limit: int) -> None:
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.limit = limit

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        while self.size - len(self.chunks[0]) >= self.limit:
            self.size -= len(self.chunks.popleft())

    def last(self, cut: bool) -> bytes:
        """The kept bytes; `cut`: only the last `limit` of them."""
        joined = b"".join(self.chunks)
        return joined[-self.limit :] if cut else joined


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one API's answers are looked into: its token events, its first token, its usage."""

    count: Callable[[bytes], int]
    """Token-carrying events in a chunk of whole events."""
    started: Callable[[bytes], bool]
    """Whether a stream's first bytes hold its first token."""
    summarise: Callable[[bytes], Summary]
    tail_bytes: int
    """How much of the answer's end `summarise` reads (a chat's usage is in its last few hundred
    bytes), beyond the request's size where the answer `echoes_request`."""
    echoes_request: bool
    """Its answer ends with the whole response object, whose usage is followed by what the server
    echoes of the request: the tail keeps that much more, and its last event is read whole."""
    stream_usage: bool
    """Whether its streams send usage only when asked (`stream_options`, chat and completions)."""
    ended: Callable[[bytes], bool]
    """Whether a chunk holds the stream's last event (the client may close on it)."""
    error_event: Callable[[str, str, str | None], bytes]
    """What ends a stream the proxy cannot finish: (message, type, code) -> its last event."""

    def tail_for(self, request_bytes: int) -> Tail:
        """The tail a response to a request of `request_bytes` keeps."""
        return Tail(self.tail_bytes + request_bytes if self.echoes_request else self.tail_bytes)

    def summary_of(self, tail: Tail) -> Summary:
        """What the tail says."""
        return self.summarise(tail.last(cut=not self.echoes_request))


def chat_started(buffered: bytes) -> bool:
    return EVENT in buffered


def chat_ended(chunk: bytes) -> bool:
    """Whether whole events hold the stream's closing `data: [DONE]` line."""
    return DONE in chunk and line_starts(chunk, DONE) > 0


CHAT = Dialect(content_events, chat_started, summarise, 4096, False, True, chat_ended, stream_error_event)
RESPONSES = Dialect(
    response_events, response_started, summarise_response, TAIL_BYTES, True, False, response_ended, response_error_event
)
DIALECTS = {"/v1/chat/completions": CHAT, "/v1/completions": CHAT, "/v1/responses": RESPONSES}
