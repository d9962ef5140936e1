"""Minimal pass-through proxies, one per HTTP client library, to choose the upstream client.

Each is the same raw-ASGI app under uvicorn (httptools + uvloop): read the body, POST it
upstream, relay status, content-type and body chunks as they arrive. Only the client differs.
Run: python -m bench.proxy_minimal CLIENT UPSTREAM_PORT PORT
CLIENT: httpx, httpx-tuned (big pool), httpx-aiohttp, httpx2, aiohttp; and two variants of the
aiohttp one that change what is around the client: aiohttp+fastapi (the route is a FastAPI
endpoint returning a StreamingResponse) and aiohttp+h11 (uvicorn on h11 and the asyncio loop);
and raw, a bare client on asyncio protocols, as a yardstick for what any library costs.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

Relay = Callable[[bytes, str], Awaitable[tuple[int, bytes, AsyncIterator[bytes], Callable[[], Awaitable[None]]]]]


def httpx_relay(kind: str, base: str) -> Relay:
    import httpx

    if kind == "httpx":
        client = httpx.AsyncClient(base_url=base, timeout=30)
    elif kind == "httpx-tuned":
        client = httpx.AsyncClient(
            base_url=base, timeout=30, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        )
    elif kind == "httpx-aiohttp":
        from httpx_aiohttp import HttpxAiohttpClient

        client = HttpxAiohttpClient(
            base_url=base, timeout=30, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        )
    else:
        import httpx2

        client = httpx2.AsyncClient(  # type: ignore[assignment]
            base_url=base, timeout=30, limits=httpx2.Limits(max_connections=1024, max_keepalive_connections=1024)
        )

    async def relay(body: bytes, path: str):  # type: ignore[no-untyped-def]
        request = client.build_request("POST", path, content=body, headers={"content-type": "application/json"})
        response = await client.send(request, stream=True)
        return (
            response.status_code,
            response.headers.get("content-type", "").encode(),
            response.aiter_raw(),
            response.aclose,
        )

    return relay


def aiohttp_relay(base: str) -> Relay:
    import aiohttp

    session: list[aiohttp.ClientSession] = []

    async def relay(body: bytes, path: str):  # type: ignore[no-untyped-def]
        if not session:  # created inside the running loop
            session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), auto_decompress=False))
        response = await session[0].post(base + path, data=body, headers={"content-type": "application/json"})

        async def release() -> None:
            response.release()

        return response.status, response.headers.get("content-type", "").encode(), response.content.iter_any(), release

    return relay


def raw_relay(port: int) -> Relay:
    """A bare HTTP/1.1 client on asyncio protocols and httptools: the floor under any library
    (no TLS, no timeouts, no backpressure: not a candidate, a yardstick)."""
    import asyncio

    import httptools

    class Conn(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpResponseParser(self)
            self.queue: asyncio.Queue[bytes] = asyncio.Queue()
            self.head: asyncio.Future[tuple[int, bytes]] | None = None
            self.content_type = b""

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_header(self, name: bytes, value: bytes) -> None:
            if name.lower() == b"content-type":
                self.content_type = value

        def on_headers_complete(self) -> None:
            assert self.head is not None
            self.head.set_result((self.parser.get_status_code(), self.content_type))

        def on_body(self, body: bytes) -> None:
            self.queue.put_nowait(body)

        def on_message_complete(self) -> None:
            self.queue.put_nowait(b"")

    idle: list[Conn] = []

    async def relay(body: bytes, path: str):  # type: ignore[no-untyped-def]
        if idle:
            conn = idle.pop()
        else:
            _, conn = await asyncio.get_running_loop().create_connection(Conn, "127.0.0.1", port)
        conn.head = asyncio.get_running_loop().create_future()
        conn.transport.write(
            b"POST %s HTTP/1.1\r\nhost: up\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        status, content_type = await conn.head

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await conn.queue.get():
                yield chunk
            idle.append(conn)

        async def release() -> None:
            pass

        return status, content_type, chunks(), release

    return relay


def make_app(relay: Relay) -> Callable[..., Awaitable[None]]:
    async def app(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        status, content_type, body, close = await relay(b"".join(chunks), scope["path"])
        try:
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await close()

    return app


def make_fastapi_app(relay: Relay) -> Any:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> StreamingResponse:
        status, content_type, body, close = await relay(await request.body(), request.url.path)
        return StreamingResponse(body, status, media_type=content_type.decode(), background=BackgroundTask(close))

    return app


def main() -> None:
    kind, upstream_port, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    base = f"http://127.0.0.1:{upstream_port}"
    client, _, variant = kind.partition("+")
    if client == "raw":
        relay = raw_relay(upstream_port)
    else:
        relay = aiohttp_relay(base) if client == "aiohttp" else httpx_relay(client, base)
    app = make_fastapi_app(relay) if variant == "fastapi" else make_app(relay)
    loop, http = ("asyncio", "h11") if variant == "h11" else ("uvloop", "httptools")
    uvicorn.run(
        app, host="127.0.0.1", port=port, loop=loop, http=http, log_level="warning", access_log=False, backlog=4096
    )


if __name__ == "__main__":
    main()
