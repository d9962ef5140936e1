"""A misbehaving upstream for the failure tests: it stands in for a broken GPU server.

The twin (sim/) is a faithful SGLang that does not fail on purpose; this server fails exactly
as told, over a real socket on 127.0.0.1, and records what it was sent:

    with FaultServer("status:503") as bad:       # every request gets a 503 (SGLang's flat error, retry-after: 1, an x-ratelimit-*)
    with FaultServer("cut:3") as bad:            # 200 SSE, 3 chunks, then the connection drops
    with FaultServer("cutjson") as bad:          # 200 JSON, a few bytes of it, then the connection drops
    with FaultServer("cutmid:3") as bad:         # 200 SSE, 3 chunks and half of a 4th, then the connection drops
    with FaultServer("split:3") as bad:          # 200 SSE, 3 events, each split across two writes, then [DONE]
    with FaultServer("errorevent:2") as bad:     # 200 SSE, 2 events, SGLang's in-band error event (a 503 abort), [DONE]
    with FaultServer("refusal:8") as bad:        # 200 SSE opening with SGLang's 503 refusal event, its first 8 bytes in a write of their own, [DONE]
    with FaultServer("stall:2") as bad:          # 200 SSE, 2 chunks, then silence
    with FaultServer("hang") as bad:             # reads the request, never answers
    with FaultServer("flood") as bad:            # 200 SSE, chunks as fast as they are read, never ending
    with FaultServer("drip:30") as bad:          # 200 SSE, 30 events 0.1 s apart, then [DONE]; 2.5 s late to a body holding "slowstart"
    with FaultServer("echo") as bad:             # answers 200 JSON; bad.requests holds what came
    with FaultServer("trace500") as bad:         # 500 whose body is a traceback with paths and addresses
    with FaultServer("redirect") as bad:         # 307 to an internal address
    with FaultServer("ssecl:3") as bad:          # 200 SSE framed by a Content-Length, 3 events, then the connection drops
    with FaultServer("noblank:5") as bad:        # 200 SSE, 5 MB without a blank line (no event ever ends)
    with FaultServer("hopheaders") as bad:       # 200 JSON with hop-by-hop, connection-listed and x-specroute-* headers
    with FaultServer("drop") as bad:             # reads the request, closes the connection without a byte
    with FaultServer("lateend:0.5") as bad:      # 200 SSE, 2 events, usage, [DONE]; the body's end 0.5 s later
    with FaultServer("rawstatus:999") as bad:    # a completion's JSON under status 999 (any status: 204, 206...)
    with FaultServer("ctlheader") as bad:        # 200 JSON with a control byte in a header's value
    with FaultServer("usagejson") as bad:        # 200 JSON, a usage object with no choices (to a stream too)
    with FaultServer("gzipsse") as bad:          # 200 SSE in gzip, unasked for
    with FaultServer("keepalive:2") as bad:      # 200 SSE, 2 events, then only `: keep-alive` comments
    with FaultServer("poison:WORD") as bad:      # a 500 to a request whose body holds WORD; 200 JSON to others
    with FaultServer("poisondrop:WORD") as bad:  # closes the connection of a request whose body holds WORD; 200 JSON to others
    with FaultServer("poisondie:WORD") as bad:   # as poisondrop, and stops listening (a server that crashed on it)
    with FaultServer("staleconn:rst") as bad:    # 200 JSON to a connection's first POST; the next on it: reset unanswered ("fin": closed; "late": reset 4.5 s later)
    with FaultServer("poison500close:WORD") as bad:  # as poison, then reads no more and resets that connection 0.3 s later (uvicorn after an exception)

Load polls (GET) get 404, as from a server with no load endpoint, unless `probe` names the one
it answers: "/get_load" (older SGLang's JSON) or "/metrics" (SGLang's Prometheus gauges), with
`load` = (running, waiting), or `load_text` as the answer's body.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import threading
from dataclasses import dataclass, field

FLAT_ERROR = {
    "object": "error",
    "message": "Service unavailable: engine overloaded",
    "type": "ServiceUnavailable",
    "param": None,
    "code": 503,
}
STRICT_ERROR = {  # FastAPI's answer for a field its model forbids (pydantic v2)
    "detail": [{"type": "extra_forbidden", "loc": ["body", "stream_options"], "msg": "Extra inputs are not permitted"}]
}
COMPLETION = {
    "id": "fault-1",
    "object": "chat.completion",
    "created": 0,
    "model": "fault",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


STREAM_USAGE = {
    "id": "fault-1",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "fault",
    "choices": [],
    "usage": {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32},
    },
}


def sse_event(i: int) -> bytes:
    event = {
        "id": "fault-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fault",
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse_chunk(i: int) -> bytes:
    return http_chunk(sse_event(i))


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FaultServer:
    behaviour: str
    probe: str = ""
    load: tuple[int, int] = (0, 0)
    load_text: str | None = None
    requests: list[Received] = field(default_factory=list)
    port: int = 0
    open_connections: int = 0
    """Open connections that carried a completion request (a proxy that gives up closes its own;
    the proxy's load polls use other connections and are not counted)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultServer:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault server did not start")
        if self._error is not None:
            raise self._error  # its port taken, say
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop.is_closed():  # stopped already (a test taking the server away)
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._error: OSError | None = None
        try:
            self._loop.run_until_complete(self._serve(ready))
        except OSError as exc:  # could not listen: __enter__ raises it
            self._error = exc
            ready.set()
        finally:
            self._loop.close()

    async def _serve(self, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        server = self._listener = await asyncio.start_server(self._connection, "127.0.0.1", self.port)  # 0: any
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await self._stop.wait()
        # Connections still open (a hung or flooding answer) end here, on a loop that still runs,
        # not when the closed loop's leftovers are collected.
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        posted = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append(Received(method, path, headers, body))
                if method == "POST" and not posted:
                    posted = True
                    self.open_connections += 1
                elif method == "POST" and self.behaviour.startswith("staleconn:"):
                    # A server's keep-alive close crossing the request: never answered ("late":
                    # an idle timeout between, long after the request went, which may have run).
                    if self.behaviour.endswith(":late"):
                        await asyncio.sleep(4.5)
                    if not self.behaviour.endswith(":fin"):
                        writer.transport.abort()
                    return
                if method == "GET" and path == self.probe:
                    writer.write(self._load_answer())
                    await writer.drain()
                    continue
                if not await self._answer(method, reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            if posted:
                self.open_connections -= 1
            writer.close()

    def _load_answer(self) -> bytes:
        running, waiting = self.load
        if self.load_text is not None:
            body = self.load_text.encode()
            kind = b"application/json" if self.probe != "/metrics" else b"text/plain; version=0.0.4"
        elif self.probe == "/get_load":
            body = json.dumps([{"num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": 0}]).encode()
            kind = b"application/json"
        else:
            body = (
                f'sglang:num_running_reqs{{model_name="fault"}} {running}.0\n'
                f'sglang:num_queue_reqs{{model_name="fault"}} {waiting}.0\n'
            ).encode()
            kind = b"text/plain; version=0.0.4"
        return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (kind, len(body), body)

    async def _answer(self, method: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Respond per the behaviour; False closes the connection."""
        kind, _, arg = self.behaviour.partition(":")
        if kind == "staleconn":
            kind = "echo"
        if kind in ("poison", "poisondrop", "poisondie", "poison500close"):  # an input its code cannot handle
            if arg.encode() not in self.requests[-1].body:
                kind = "echo"
            elif kind == "poisondie":  # the process gone: its connections reset, new ones refused
                self._listener.close()
                kind = "drop"
            elif kind == "poisondrop":
                kind = "drop"
            elif kind == "poison500close":  # uvicorn: the 500 sent, it reads no more, then closes
                writer.write(
                    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    b"content-length: 21\r\n\r\nInternal Server Error"
                )
                await writer.drain()
                await asyncio.sleep(0.3)
                writer.transport.abort()
                return False
            else:
                kind, arg = "status", "500"
        if method == "GET":  # /server_info, /v1/loads, /metrics polls: not an SGLang we know
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            return True
        if kind == "status":
            body = json.dumps(FLAT_ERROR | {"code": int(arg)}).encode()
            writer.write(
                b"HTTP/1.1 %s Error\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                b"x-ratelimit-remaining-requests: 0\r\nx-internal: no\r\n"
                b"content-length: %d\r\n\r\n%s" % (arg.encode(), len(body), body)
            )
        elif kind == "echo":
            body = json.dumps(COMPLETION).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        elif kind in ("strict", "quoting"):
            # strict: a schema without stream_options (extra fields refused) that includes usage
            # in every stream by default; quoting: takes stream_options, and answers a request
            # naming top_logprobs without logprobs with a 400 quoting the request's start. Else
            # N events (and the usage chunk, when included), then [DONE].
            body = self.requests[-1].body
            error: dict | None = None
            if kind == "strict" and b'"stream_options"' in body:
                error = STRICT_ERROR
            elif kind == "quoting" and b'"top_logprobs"' in body:
                error = {"object": "error", "message": f"`logprobs` must be true [input={body[:60]!r}]", "code": 400}
            if error is not None:
                status = b"422 Unprocessable Entity" if kind == "strict" else b"400 Bad Request"
                answer = json.dumps(error).encode()
                writer.write(
                    b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (status, len(answer), answer)
                )
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for i in range(int(arg)):
                    writer.write(sse_chunk(i))
                    await writer.drain()
                if kind == "strict" or b'"include_usage":true' in body:
                    writer.write(http_chunk(b"data: " + json.dumps(STREAM_USAGE).encode() + b"\n\n"))
                writer.write(http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif kind == "rawstatus":
            body = b"" if arg in ("204", "304") else json.dumps(COMPLETION).encode()  # no content, by HTTP
            writer.write(
                b"HTTP/1.1 %s Whatever\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (arg.encode(), len(body), body)
            )
        elif kind == "usagejson":  # a stream asked for, answered as one JSON object with no choices
            body = json.dumps(STREAM_USAGE).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        elif kind == "ctlheader":
            body = json.dumps(COMPLETION).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-note: a\x01b\r\nretry-after: 1\x7f\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
        elif kind == "gzipsse":
            body = gzip.compress(sse_event(0) + sse_event(1) + b"data: [DONE]\n\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
        elif kind == "keepalive":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(int(arg)):
                writer.write(sse_chunk(i))
            try:
                while True:  # until the proxy gives up and closes the connection
                    writer.write(http_chunk(b": keep-alive\n\n"))
                    await writer.drain()
                    await asyncio.sleep(0.05)
            except ConnectionError:
                return False
        elif kind == "hugeusage":  # an answer whose usage counts more tokens than any float holds
            body = json.dumps(COMPLETION | {"usage": {"prompt_tokens": 10**400, "completion_tokens": 10**400}}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        elif kind == "cutjson":  # announces a full JSON body, sends a few bytes, drops the connection
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{"id": ')
            await writer.drain()
            writer.transport.abort()
            return False
        elif kind == "errorevent":  # serving_chat's create_streaming_error_response, json.dumps's spacing
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(int(arg)):
                writer.write(sse_chunk(i))
                await writer.drain()
            error = {"object": "error", "message": "Request running timeout reached.", "type": "SERVICE_UNAVAILABLE"}
            event = b"data: " + json.dumps({"error": error | {"param": None, "code": 503}}).encode() + b"\n\n"
            writer.write(http_chunk(event) + http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif kind == "refusal":  # a full queue's refusal, SGLang's first event, split where told
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            error = {"object": "error", "message": "The request queue is full.", "type": "SERVICE_UNAVAILABLE"}
            event = b"data: " + json.dumps({"error": error | {"param": None, "code": 503}}).encode() + b"\n\n"
            for part in (event[: int(arg)], event[int(arg) :]):
                writer.write(http_chunk(part))
                await writer.drain()
                await asyncio.sleep(0.05)  # two reads for the proxy
            writer.write(http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif kind in ("cut", "stall"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(int(arg)):
                writer.write(sse_chunk(i))
                await writer.drain()
                await asyncio.sleep(0.01)
            if kind == "cut":
                writer.transport.abort()
                return False
            await self._until_closed(reader)
            return False
        elif kind in ("cutmid", "split"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(int(arg) + (kind == "cutmid")):
                event = sse_event(i)
                halves = (event[: len(event) // 2], event[len(event) // 2 :])
                for half in halves[:1] if kind == "cutmid" and i == int(arg) else halves:
                    writer.write(http_chunk(half))
                    await writer.drain()
                    await asyncio.sleep(0.01)  # two TCP segments: the proxy reads them apart
            if kind == "cutmid":
                writer.transport.abort()
                return False
            writer.write(http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif kind == "hang":
            await self._until_closed(reader)
            return False
        elif kind == "drop":
            writer.transport.abort()
            return False
        elif kind == "trace500":
            body = (
                b'Traceback (most recent call last):\n  File "/opt/sglang/python/sglang/srt/managers/io.py", '
                b"line 42, in generate\nConnectionRefusedError: [Errno 111] connect to 10.20.30.40:7000 refused\n"
            )
            writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )
        elif kind == "redirect":
            writer.write(
                b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://10.20.30.40:30000/v1/chat/completions\r\n"
                b"content-length: 0\r\n\r\n"
            )
        elif kind == "ssecl":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100000\r\n\r\n")
            for i in range(int(arg)):
                writer.write(sse_event(i))
                await writer.drain()
            writer.transport.abort()
            return False
        elif kind == "noblank":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(http_chunk(b'data: {"x": "'))
            piece = http_chunk(b"a" * 65536)
            try:
                for _ in range(int(arg) * 16):
                    writer.write(piece)
                    await writer.drain()
            except ConnectionError:
                return False
            await self._until_closed(reader)
            return False
        elif kind == "hopheaders":
            body = json.dumps(COMPLETION).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: keep-alive, x-internal-hop\r\nx-internal-hop: secret\r\n"
                b"proxy-authenticate: Basic realm=internal\r\nproxy-connection: keep-alive\r\nte: trailers\r\n"
                b"keep-alive: timeout=77, max=9\r\nx-specroute-backend: http://10.20.30.40:30000\r\n"
                b"proxy-authorization: Basic c2VjcmV0\r\nupgrade: h2c\r\ntrailer: x-sum\r\n"
                b"x-upstream-note: caf\xc3\xa9\r\n\r\n%s" % (len(body), body)
            )
        elif kind == "lateend":  # a whole stream, but the body's end (the last chunk) comes late
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(
                sse_chunk(0) + sse_chunk(1) + http_chunk(b"data: " + json.dumps(STREAM_USAGE).encode() + b"\n\n")
            )
            writer.write(http_chunk(b"data: [DONE]\n\n"))
            await writer.drain()
            await asyncio.sleep(float(arg))
            writer.write(b"0\r\n\r\n")
        elif kind == "drip":  # a healthy slow stream: bytes keep coming, each after a gap
            if b"slowstart" in self.requests[-1].body:  # queued behind others: silent a while
                await asyncio.sleep(2.5)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(int(arg)):
                writer.write(sse_chunk(i))
                await writer.drain()
                await asyncio.sleep(0.1)
            writer.write(http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif kind == "flood":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in itertools.count():
                writer.write(sse_chunk(i))
                await writer.drain()  # ends with ConnectionError once the proxy drops the connection
        await writer.drain()
        return True

    async def _until_closed(self, reader: asyncio.StreamReader) -> None:
        """Wait (silently) until the peer closes the connection or the server stops."""
        eof = asyncio.ensure_future(reader.read())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait((eof, stop), return_when=asyncio.FIRST_COMPLETED)
        eof.cancel()
        stop.cancel()
