"""Client connections with deadlines and a header size limit: uvicorn's httptools protocol, guarded.

uvicorn closes a keep-alive connection idle between requests (SPECROUTE_KEEP_ALIVE_TIMEOUT_S),
but a client that connects and sends nothing, sends its headers a byte a second, or stops
half-way through its body holds a connection (and the body's bytes) for ever, and a header
of any size is buffered whole. Here:

- headers must be complete SPECROUTE_HEADER_TIMEOUT_S after the connection opened or, between
  keep-alive requests, after the next request's first byte (else 408 and close); a connection
  on which no byte of a request came is closed without an answer, as nginx does, and one idle
  after a response is left to uvicorn's keep-alive timeout: a 408 written on an idle connection
  is read as the answer to whatever request a keep-alive client sends at that moment (the Node
  SDK, which alternates two pooled connections, got such 408s);
- a body must be complete SPECROUTE_BODY_TIMEOUT_S after its headers (else 408 and close; the
  app sees the client gone);
- request line and headers over SPECROUTE_MAX_HEADER_BYTES get 431 and close;
- a response that starts before its request's body is all in (a refusal before asking for it,
  `Expect: 100-continue` never answered, or part-way through it, a 413) closes the connection:
  the rest of the body would be taken for a new request, or read for nothing (a response on a
  connection that closes says only `connection: close`, without the `keep-alive` header others carry);
- pipelined requests: the header deadline starts again only once no later request is past its
  headers (a queued or running one is not held to it, nor are its body bytes counted as headers);
- an HTTP/1.0 request's response of no declared length (a stream) ends where the connection
  closes, not in chunks: HTTP/1.0 has no chunked coding (RFC 9112 6.1), and uvicorn chunks it;
- a chunked body's trailer fields (RFC 9112 7.1.2) are no request headers: uvicorn appended them
  to the request's (a client could set routing headers after the proxy's checks, past the
  header limit, or hold hundreds of MB in one field); they are dropped, and over
  SPECROUTE_MAX_HEADER_BYTES get 431 and close;
- a chunked body's chunks, once past FREE_CHUNKS of them, must average SMALL_CHUNK_BYTES (else
  400 and close): the parser calls back per chunk, and 1 MB sent a byte a chunk cost the proxy
  0.6-0.85 s of its event loop;
- a connection its client resets is let go at once: uvicorn kept an idle one's keep-alive timer
  (and with it the protocol and its last request) until the timeout.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
ABORT_EXTENSION = "specroute.abort"
"""The scope extension an app calls to end a response it cannot complete (`_abort`)."""
CLOSE_EXTENSION = "specroute.close"
"""A scope extension: called before the response starts, the connection closes after it (said
with `connection: close`, the `keep-alive` header left out)."""


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int


def refusal(status: int, code: str, message: str) -> bytes:
    body = b'{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":"%s"}}' % (
        message.encode(),
        code.encode(),
    )
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        status,
        REASONS[status],
        len(body),
        body,
    )


class HeadersTooLarge(httptools.HttpParserError):
    """Raised from a parser callback: uvicorn's protocol stops parsing and calls send_400_response."""


MAX_PIPELINED = 16
"""Requests one connection may have queued behind the one running (HTTP/1.1 pipelining, which
no SDK uses). uvicorn pauses reading when one queues, but parses the whole read first: 256 KB of
pipelined `GET /health` queued 7,900 requests, about 2 KB each, on one connection."""


class Refused(httptools.HttpParserError):
    """Raised from a parser callback: parsing stops, and the request gets `GuardedProtocol.refusing`."""


class TooManyPipelined(httptools.HttpParserError):
    """Raised from a parser callback: the connection is closed (its queued answers are not sent)."""


FREE_CHUNKS = 1024
SMALL_CHUNK_BYTES = 2
"""Once a chunked body has more than FREE_CHUNKS chunks, they must average this many bytes so
far: a generator of a JSON encoder's pieces (httpx and requests send each as a chunk) averages
about 4, never under 3.6 past its first 1,024; 1 MB in 5-byte chunks held the loop 25 ms at
most, in 1-byte ones 113 ms (0.6-0.85 s of work in all)."""


class GuardedProtocol(HttpToolsProtocol):
    limits: Limits  # set by `guarded_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_headers = True
        self.header_bytes = 0
        self.header_tail = b""
        """The last bytes of the header block read so far (its end may straddle two reads)."""
        self.oversized = False
        self.deadline: asyncio.TimerHandle | None = None
        self.chunk_quiet = False
        """A chunk's size line was parsed and none of its data since: the last (zero) chunk's
        trailer fields are being read, or the next read brings the chunk's data."""
        self.trailer_bytes = 0
        self.chunks = 0
        self.body_bytes = 0
        self.refusing: tuple[int, str, str] | None = None
        """The answer of a request refused from a parser callback (`Refused`)."""
        self.progressed = False
        """The read being parsed brought a chunk's data or end, or a new request."""
        self.earlier: Any = None
        """The request before the newest on this connection (uvicorn's RequestResponseCycle),
        which may still be answering while a pipelined one is read."""

    # -- deadlines --------------------------------------------------------------------------------
    def _arm(self, seconds: float, status: int, code: str, message: str) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(seconds, self._expire, status, code, message)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self, status: int, code: str, message: str) -> None:
        self.deadline = None
        if self.in_headers and self.header_bytes == 0:
            self.transport.close()  # nothing of a request came: no answer (module docstring)
            return
        self._refuse(status, code, message)

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer `status` unless a response is under way or done for this request, or an
        earlier pipelined request's is under way (the answer would land inside it: a review saw
        a 400 in a stream), then close the connection (connection_lost tells an app waiting for
        the body that the client is gone)."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        # While headers are read, `cycle` is the request before (if any); after, `earlier` is.
        before = cycle if self.in_headers else self.earlier
        answering_before = before is not None and before.response_started and not before.response_complete
        if not answering_before and (self.in_headers or (cycle is not None and not cycle.response_started)):
            self.transport.write(refusal(status, code, message))
        self.transport.close()

    # -- uvicorn's protocol -------------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser refused (bad bytes in the request line or a header): answered
        in OpenAI's error shape, like every other error, instead of uvicorn's plain text."""
        if self.oversized:
            self._refuse(431, "headers_too_large", self.too_large_message())
        elif self.refusing is not None:
            self._refuse(*self.refusing)
        elif not self.transport.is_closing():
            self.transport.write(refusal(400, "invalid_http", "the request is not valid HTTP/1.1"))
        self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        """An `Upgrade` a client asks is not taken (the request is served as plain HTTP): no
        warning lines of uvicorn's, which a client could write at will."""

    def too_large_message(self) -> str:
        return f"request line and headers over {self.limits.max_header_bytes} bytes"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, 408, "header_timeout", "request headers not received in time")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        # uvicorn tells only the newest request: an earlier one still answering, and those queued,
        # are gone too (its next write met a closed transport: an ERROR with a traceback, which a
        # pipelining client could have written at will).
        for cycle in (self.earlier, *(queued for queued, _ in self.pipeline)):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)
        # uvicorn cancels an idle connection's keep-alive timer only when it closed cleanly: one
        # reset by its client (a client gone mid-stream after the proxy wrote its last chunk) stayed
        # held by the timer, protocol and request with it, for SPECROUTE_KEEP_ALIVE_TIMEOUT_S
        # (the soak's memory grew by about 250 bytes a request).
        self._unset_keepalive_if_required()

    def data_received(self, data: bytes) -> None:
        if self.in_headers:
            if self.deadline is None:  # a kept-alive connection's next request begins
                self._arm(self.limits.header_timeout_s, 408, "header_timeout", "request headers not received in time")
            # Counted before the parser sees them, up to the end of the header block: a block
            # that arrives whole in one read is parsed, and its request started, within this call
            # (measured after it, a 70 KB header in one read went upstream).
            seen = self.header_tail + data
            end = seen.find(b"\r\n\r\n")
            self.header_bytes += len(data) if end < 0 else max(end + 4 - len(self.header_tail), 0)
            self.header_tail = seen[-3:]
            if self.header_bytes > self.limits.max_header_bytes:
                self._refuse(431, "headers_too_large", self.too_large_message())
                return
            super().data_received(data)
            return
        quiet, self.progressed = self.chunk_quiet, False
        super().data_received(data)
        # A whole read after a chunk's size line that brought none of its data, nor a chunk's
        # end, nor a new request: trailer fields, which the parser buffers whole until each ends
        # (one field of 200 MB held 380 MB).
        if quiet and self.chunk_quiet and not self.progressed and not self.in_headers:
            self.count_trailer(len(data))

    def on_chunk_header(self) -> None:
        self.chunk_quiet = True
        self.chunks += 1
        if self.chunks > FREE_CHUNKS and self.body_bytes < SMALL_CHUNK_BYTES * self.chunks:
            message = f"a chunked body's chunks must average {SMALL_CHUNK_BYTES} bytes or more"
            self.refusing = (400, "chunks_too_small", message)
            raise Refused

    def on_body(self, body: bytes) -> None:
        self.chunk_quiet, self.progressed = False, True
        self.body_bytes += len(body)
        super().on_body(body)

    def on_chunk_complete(self) -> None:
        self.chunk_quiet, self.progressed = False, True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_headers:
            super().on_header(name, value)
        elif self.count_trailer(len(name) + len(value) + 4):  # a trailer field: counted, dropped
            raise Refused

    def count_trailer(self, size: int) -> bool:
        """Counts trailer bytes; True (and the connection refused) once past the header limit."""
        self.trailer_bytes += size
        if self.trailer_bytes <= self.limits.max_header_bytes:
            return False
        self.refusing = (431, "trailers_too_large", f"trailer fields over {self.limits.max_header_bytes} bytes")
        self._refuse(*self.refusing)
        return True

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_headers, self.progressed = True, True
        self.chunk_quiet = False
        self.trailer_bytes = 0
        self.chunks = 0
        self.body_bytes = 0
        self.refusing = None

    def on_headers_complete(self) -> None:
        # A pipelined request whose headers came in the same read as an earlier request's was
        # not counted above: measured as parsed, and refused before its request starts (the
        # parser's error path answers it, send_400_response).
        parsed = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if parsed > self.limits.max_header_bytes:
            self.oversized = True
            raise HeadersTooLarge
        if len(self.pipeline) >= MAX_PIPELINED:
            self.transport.close()
            raise TooManyPipelined
        self.in_headers = False
        self.header_bytes = 0
        self.header_tail = b""
        self._disarm()
        self.earlier = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None:
            return
        extensions: dict[str, Any] = cycle.scope.setdefault("extensions", {})
        # Weak: the scope belongs to the cycle, and a closure holding the cycle and this protocol
        # would make a reference cycle per request for the collector to find.
        extensions[ABORT_EXTENSION] = partial(_abort, weakref.ref(self), weakref.ref(cycle))
        extensions[CLOSE_EXTENSION] = partial(_close_after, weakref.ref(cycle))
        if not cycle.keep_alive:  # HTTP/1.0, or the client's `Connection: close`
            _closing(cycle)
        if cycle.scope.get("http_version") == "1.0":
            cycle.send = partial(_close_delimited, cycle, cycle.send)  # type: ignore[method-assign]
        has_body = any(
            name in (b"content-length", b"transfer-encoding") and value not in (b"0",) for name, value in self.headers
        )
        if has_body and not cycle.response_complete:
            self._arm(self.limits.body_timeout_s, 408, "body_timeout", "request body not received in time")
        if not has_body:
            return
        send = cycle.send

        async def close_if_body_unread(message: Any) -> None:
            # A response that starts before its request's body is all in (a refusal before or
            # while reading it, e.g. an unanswered Expect: 100-continue or a 413) closes the
            # connection: the rest of the body would be read as requests or read for nothing.
            if message["type"] == "http.response.start" and cycle.more_body:
                _closing(cycle)
            await send(message)

        cycle.send = close_if_body_unread  # type: ignore[method-assign]

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def shutdown(self) -> None:
        super().shutdown()  # the server stops: a running response is its connection's last
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            _closing(cycle)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Idle only when no later request is past its headers: a pipelined one, now running
        # or queued, keeps its own (body) deadline, and its body bytes are not header bytes.
        cycle = self.cycle
        if not self.transport.is_closing() and (cycle is None or cycle.response_complete):
            # Idle: uvicorn's keep-alive timeout closes it; the next request's first byte arms
            # the header deadline (data_received).
            self.in_headers = True
            self.header_bytes = 0
            self.header_tail = b""
            self._disarm()


def _closing(cycle: Any) -> None:
    """The connection closes after this response (uvicorn then adds `connection: close`): the
    default `keep-alive: timeout=N` header (proxy.server) goes, or the response would say both."""
    cycle.keep_alive = False
    cycle.default_headers = [(name, value) for name, value in cycle.default_headers if name != b"keep-alive"]


async def _close_delimited(cycle: Any, send: Any, message: Any) -> None:
    """An HTTP/1.0 response without a length: its body goes out as it is, the connection's
    close ends it (uvicorn keeps no HTTP/1.0 connection alive). uvicorn's own framing is told a
    length that each part fills, the last one exactly."""
    if message["type"] == "http.response.start":
        names = {name.lower() for name, _ in message.get("headers", ())}
        if b"content-length" not in names and b"transfer-encoding" not in names:
            cycle.chunked_encoding = False
            cycle.close_delimited = True
    elif message["type"] == "http.response.body" and getattr(cycle, "close_delimited", False):
        cycle.expected_content_length = len(message.get("body", b"")) + (1 if message.get("more_body") else 0)
    await send(message)


def _close_after(cycle: weakref.ref[Any]) -> None:
    live = cycle()
    if live is not None and not live.response_started:
        _closing(live)


def _abort(protocol: weakref.ref[GuardedProtocol], cycle: weakref.ref[Any]) -> None:
    """End a response the app cannot complete (its upstream broke after bytes went out): the
    connection closes, and the cycle counts as disconnected, so uvicorn does not log the return
    as an application error (a client could have written ERROR lines at will)."""
    live_protocol, live_cycle = protocol(), cycle()
    if live_cycle is not None:
        live_cycle.disconnected = True
    if live_protocol is not None:
        live_protocol.transport.close()


def guarded_protocol(limits: Limits) -> type[GuardedProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits})
