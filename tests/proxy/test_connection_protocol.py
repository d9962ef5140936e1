"""The guarded HTTP protocol (proxy/connection.py) fed reads at exact boundaries: what a socket
cannot be made to deliver on demand (a read ending right after a chunk's size line, a pipelined
request refused while the one before it streams)."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from proxy.connection import GuardedProtocol, Limits, guarded_protocol


class Transport(asyncio.Transport):
    """What the protocol writes, and whether it closed; closing tells the protocol, as a socket's does."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.protocol: GuardedProtocol | None = None

    def write(self, data: Any) -> None:
        if self.closed:
            raise RuntimeError("the handler is closed")  # uvloop's word for a write after close
        self.out += data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.protocol is not None:
                self.protocol.connection_lost(None)

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def streaming_app(scope: Any, receive: Any, send: Any) -> None:
    """Reads its body, then answers: `/stream` with chunks until told the client is gone."""
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(50):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
            await asyncio.sleep(0.001)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def connection(max_header_bytes: int = 8192) -> tuple[GuardedProtocol, Transport]:
    config = uvicorn.Config(streaming_app, lifespan="off", log_level="warning")
    config.load()
    protocol = guarded_protocol(Limits(10.0, 10.0, max_header_bytes))(
        config=config, server_state=ServerState(), app_state={}
    )
    transport = Transport()
    transport.protocol = protocol
    protocol.connection_made(transport)
    return protocol, transport


async def settle() -> None:
    for _ in range(200):
        await asyncio.sleep(0.001)


def test_reads_that_end_just_after_a_chunk_size_line_are_body_not_trailers() -> None:
    """A review's read pattern: each read is a chunk's data, its CRLF and the next chunk's size
    line. The first trailer count took each such read for trailer fields (431 past 8 KiB)."""

    async def send_in_chunks() -> bytes:
        protocol, transport = connection()
        body = b"x" * 100_000
        parts = [body[i : i + 16384] for i in range(0, len(body), 16384)]
        protocol.data_received(
            b"POST /echo HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n" % len(parts[0])
        )
        for part, following in zip(parts, [*parts[1:], b""], strict=True):
            protocol.data_received(part + b"\r\n%x\r\n" % len(following) + (b"\r\n" if not following else b""))
            await asyncio.sleep(0)
        await settle()
        return bytes(transport.out)

    assert asyncio.run(send_in_chunks()).startswith(b"HTTP/1.1 200 ")


def test_a_pipelined_request_refused_while_the_one_before_streams_is_not_answered_inside_it() -> None:
    """A request pipelined behind a stream and refused (here its chunks too small) got its 400
    written inside the stream, and the stream's next write, on the closed connection, raised in
    the app (uvicorn's ERROR with a traceback, which a client could write at will; a review).
    Now nothing is written for it, and every request on the connection is told it is gone."""

    async def pipelined() -> tuple[bytes, bool]:
        protocol, transport = connection()
        protocol.data_received(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.005)  # the stream under way
        first = protocol.cycle
        assert first is not None and first.response_started
        tiny = b"".join(b"1\r\nx\r\n" for _ in range(3000))
        protocol.data_received(b"POST /echo HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n" + tiny)
        await settle()
        return bytes(transport.out), first.disconnected

    written, told = asyncio.run(pipelined())
    assert b"chunks_too_small" not in written and written.count(b"HTTP/1.1 ") == 1, written[-300:]
    assert told
