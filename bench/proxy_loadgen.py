"""A lean closed-loop HTTP/1.1 load generator (asyncio + uvloop + httptools).

Python clients such as httpx or aiohttp would be the bottleneck at the rates measured here, so
each of `concurrency` keep-alive connections sends one request, waits for the whole response,
and sends the next. Per request it records the latency, the time to the first body byte, and
whether the body is complete (JSON: status 200; stream: the expected number of SSE events and a
final [DONE]).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import cast

import httptools


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0

    @property
    def count(self) -> int:
        return len(self.latencies)


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[tuple[int, bytes]] | None = None
        self.first_byte = 0.0
        self.parts: list[bytes] = []
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio.Protocol passes a BaseTransport; a TCP connection's is a Transport (uvloop's
        # does not subclass it, so a cast rather than an isinstance check).
        self.transport = cast(asyncio.Transport, transport)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))
        if not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self.parts:
            self.first_byte = time.perf_counter()
        self.parts.append(body)

    def on_message_complete(self) -> None:
        assert self.done is not None
        self.done.set_result((self.parser.get_status_code(), b"".join(self.parts)))

    async def request(self, raw: bytes) -> tuple[int, bytes, float]:
        self.done = asyncio.get_running_loop().create_future()
        self.parts = []
        self.transport.write(raw)
        status, body = await self.done
        return status, body, self.first_byte


def build_request(path: str, body: bytes, extra_headers: dict[str, str] | None = None) -> bytes:
    headers = {"host": "bench", "content-type": "application/json", "content-length": str(len(body))}
    headers.update(extra_headers or {})
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


def check(status: int, body: bytes, events: int | None) -> bool:
    if status != 200:
        return False
    if events is None:
        return body.startswith(b"{")
    return body.count(b"data: ") == events and body.endswith(b"data: [DONE]\n\n")


async def run(port: int, raw: bytes, concurrency: int, requests: int, events: int | None) -> Result:
    """Send `requests` requests over `concurrency` connections to 127.0.0.1:port."""
    loop = asyncio.get_running_loop()
    result = Result()
    remaining = [requests]

    async def worker() -> None:
        _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
        try:
            while remaining[0] > 0:
                remaining[0] -= 1
                start = time.perf_counter()
                try:
                    status, body, first = await asyncio.wait_for(conn.request(raw), 30)
                except (TimeoutError, ConnectionError):
                    result.errors += 1
                    conn.transport.close()
                    _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
                    continue
                end = time.perf_counter()
                if check(status, body, events):
                    result.latencies.append(end - start)
                    result.first_bytes.append(first - start)
                else:
                    result.errors += 1
        finally:
            conn.transport.close()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.elapsed = time.perf_counter() - began
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
