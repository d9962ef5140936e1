"""A deliberately fast fake OpenAI upstream for the proxy benchmark (not the twin).

asyncio + uvloop + httptools, keep-alive, canned answers: POST .../completions returns a small
JSON completion, or with "stream": true a 64-chunk SSE stream (one chunk per write, each a
separate TCP segment as a real server would send them), then usage and [DONE].
Run: python -m bench.proxy_upstream PORT [CHUNKS]
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from typing import cast

import httptools
import uvloop

COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 16}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28},
    }
).encode()
MODELS = json.dumps(
    {"object": "list", "data": [{"id": "bench-model", "object": "model", "owned_by": "bench"}]}
).encode()


def _chunk(i: int) -> bytes:
    event = {
        "id": "cmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench-model",
        "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
    }
    data = b"data: " + json.dumps(event).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def stream_chunks(n: int) -> list[bytes]:
    usage = {
        "id": "cmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench-model",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
    }
    tail = b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
    return [_chunk(i) for i in range(n)] + [b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail)]


def head(status: str, content_type: bytes, length: int | None) -> bytes:
    framing = b"content-length: %d" % length if length is not None else b"transfer-encoding: chunked"
    return b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type + b"\r\n" + framing + b"\r\n\r\n"


class Handler(asyncio.Protocol):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio.Protocol passes a BaseTransport; a TCP connection's is a Transport (uvloop's
        # does not subclass it, so a cast rather than an isinstance check).
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body = []
        if self.url.endswith(b"/models"):
            self.transport.write(head("200 OK", b"application/json", len(MODELS)) + MODELS)
        elif not body:  # GET /server_info, /v1/loads, /metrics: a server without load endpoints
            self.transport.write(head("404 Not Found", b"text/plain", 0))
        elif b'"stream": true' in body or b'"stream":true' in body:
            self.transport.write(head("200 OK", b"text/event-stream", None))
            for chunk in self.chunks:
                self.transport.write(chunk)
        else:
            self.transport.write(head("200 OK", b"application/json", len(COMPLETION)) + COMPLETION)


async def serve(port: int, chunks: int) -> None:
    loop = asyncio.get_running_loop()
    parts = stream_chunks(chunks)
    server = await loop.create_server(lambda: Handler(parts), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 64))
