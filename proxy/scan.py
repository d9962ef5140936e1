"""Cheap looks into relayed bytes: SSE events per chunk, and usage/finish reasons at the end.

Chunks are never parsed or re-encoded on the way through; these are byte counts and regular
expressions over small slices, run once per chunk (count) or once per response (summary).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EVENT = b"data:"
DONE = b"data: [DONE]"

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
# (role, then content), and a StreamDelta writing reasoning_content first.
TEXTLESS = (
    b'"delta":{"role":"assistant","content":""',
    b'"delta":{}',
    b'"delta":{"role":null,"content":null',
    b'"delta":{"reasoning_content":null,"role":"assistant","content":""',
    b'"delta":{"reasoning_content":null,"role":null,"content":null',
)


def content_events(chunk: bytes) -> int:
    """SSE data events in a chunk, the closing [DONE] and chat events without text not counted."""
    events = chunk.count(EVENT)
    if events and DONE in chunk:
        events -= 1
    # Every TEXTLESS prefix has "r" or "}" after the brace; a text delta as msgspec writes it
    # ("delta":{"content":...) has neither, so most chunks pass with two scans, not five.
    if events and (b'"delta":{"r' in chunk or b'"delta":{}' in chunk):
        events = max(events - sum(chunk.count(prefix) for prefix in TEXTLESS), 0)
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
            # An end may straddle the two reads: look at the last bytes of the rest too.
            probe = self.pending[-1][-3:] + chunk
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
    """The usage said prompt_tokens_details: null (SGLang's answer for a miss when it reports)."""


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
        cached_details_null=not cached and _NO_CACHED_DETAILS.search(tail) is not None,
    )


# Asked of the upstream for a stream whose client did not say (`with_usage_requested`).
USAGE_REQUESTED = b'"stream_options":{"include_usage":true},'
_EVENT_SPLIT = re.compile(b"|".join(b"(?<=" + re.escape(end) + b")" for end in EVENT_ENDS))
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')


def with_usage_requested(body: bytes) -> bytes:
    """A JSON object's body asking for a stream's usage chunk (`stream_options.include_usage`),
    for a body that names no `stream_options` (the caller checked) and has a key already (a
    stream's has `stream`): the member goes first, so nothing else is re-encoded."""
    opening = body.index(b"{") + 1
    return body[:opening] + USAGE_REQUESTED + body[opening:]


def without_usage_events(chunk: bytes) -> bytes:
    """`chunk` (whole SSE events) less the usage chunk a stream sends when asked for it: an event
    with no choices and a usage object. Other choice-less events (SGLang's spec details, say)
    stay. A chunk without a usage object (SGLang's and the twin's content chunks carry
    `"usage":null`) goes on after one scan; only one holding a usage is split into events."""
    if _USAGE_OBJECT.search(chunk) is None:
        return chunk
    events = _EVENT_SPLIT.split(chunk)
    return b"".join(e for e in events if _EMPTY_CHOICES.search(e) is None or _USAGE_OBJECT.search(e) is None)
