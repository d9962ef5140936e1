"""First-token latency the proxy adds, against an upstream that behaves like a server.

    python -m bench.first_token            # the full run (a few minutes); docs/benchmarks.md records it
    python -m bench.first_token --quick    # a smoke run (well under a minute)
    python -m bench.first_token upstream PORT [--no-nodelay]    # the upstream alone

The upstream (`serve_upstream`) answers a streamed completion as SGLang's server does: the
response headers at once, in their own write; the first chunk after a prefill of PREFILL_MS;
then each chunk in its own write after a gap drawn from 1-30 ms (uniform, seeded); keep-alive.
Its accepted connections get TCP_NODELAY as uvicorn's do, unless `--no-nodelay` (the control:
the twin's bug before it was fixed, where the first chunk after the headers waits for the
client's delayed ACK, about 40 ms).

Clients, each on keep-alive connections: a raw socket with TCP_NODELAY that writes each request
at once, the same without TCP_NODELAY, and the openai SDK (AsyncOpenAI, its own httpx stack).
Each measures the time from sending a request to its first content chunk, straight to the
upstream and through `specroute serve` (in front of it as its spec pool), in the same run; the
proxy's share is the difference of the two. The ground truth is PREFILL_MS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import uvloop

from bench.proxy_bench import free_port, process, specroute_cmd

PREFILL_MS = 5.0
GAP_MS = (1.0, 30.0)
CHUNKS = 8
BODY = json.dumps(
    {"model": "bench-model", "messages": [{"role": "user", "content": "Say ok."}], "max_tokens": CHUNKS, "stream": True}
).encode()


# -- the upstream ---------------------------------------------------------------------------------


def sse_chunk(i: int) -> bytes:
    event = {
        "id": "cmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench-model",
        "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
    }
    data = b"data: " + json.dumps(event).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST = b"data: [DONE]\n\n"
END = b"%x\r\n%s\r\n0\r\n\r\n" % (len(LAST), LAST)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


async def upstream_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nodelay: bool, rng: random.Random
) -> None:
    sock = writer.get_extra_info("socket")
    # Set either way: asyncio sets TCP_NODELAY on every TCP connection it accepts, so the control
    # has to turn it off to show what a server without it does.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1 if nodelay else 0)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            if not body:  # the proxy's load polls: a server without load endpoints
                writer.write(NOT_FOUND)
                continue
            writer.write(HEAD)
            await writer.drain()
            await asyncio.sleep(PREFILL_MS / 1000)
            for i in range(CHUNKS):
                if i:
                    await asyncio.sleep(rng.uniform(*GAP_MS) / 1000)
                writer.write(sse_chunk(i))
                await writer.drain()
            writer.write(END)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve_upstream(port: int, nodelay: bool) -> None:
    rng = random.Random(7)
    server = await asyncio.start_server(
        lambda r, w: upstream_connection(r, w, nodelay, rng), "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


# -- the clients ----------------------------------------------------------------------------------


def request_bytes(port: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY


class RawClient:
    """One keep-alive connection; reads the chunked stream by hand, notes the first content."""

    def __init__(self, port: int, nodelay: bool) -> None:
        self.port, self.nodelay = port, nodelay
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def first_chunk_s(self) -> float:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
            self.writer.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1 if self.nodelay else 0
            )
        assert self.reader is not None
        started = time.perf_counter()
        self.writer.write(request_bytes(self.port))
        await self.reader.readuntil(b"\r\n\r\n")
        first = None
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            if first is None and b'"content"' in data:
                first = time.perf_counter() - started
        assert first is not None
        return first

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class SdkClient:
    """The openai SDK's async client (httpx, keep-alive), streaming."""

    def __init__(self, port: int) -> None:
        import openai

        self.client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    async def first_chunk_s(self) -> float:
        started = time.perf_counter()
        first = None
        stream = await self.client.chat.completions.create(
            model="bench-model", messages=[{"role": "user", "content": "ok"}], max_tokens=CHUNKS, stream=True
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
        assert first is not None
        return first

    async def close(self) -> None:
        await self.client.close()


CLIENTS: dict[str, Callable[[int], RawClient | SdkClient]] = {
    "raw, TCP_NODELAY": lambda port: RawClient(port, nodelay=True),
    "raw, Nagle on": lambda port: RawClient(port, nodelay=False),
    "openai SDK": SdkClient,
}


async def measure(
    port: int, make: Callable[[int], RawClient | SdkClient], concurrency: int, requests: int
) -> list[float]:
    """First-chunk seconds of `requests` streams from `concurrency` keep-alive clients (each
    client's first request, on a new connection, is left out)."""
    clients = [make(port) for _ in range(concurrency)]
    times: list[float] = []
    per_client = max(requests // concurrency, 1)

    async def loop(client: RawClient | SdkClient) -> None:
        await client.first_chunk_s()
        for _ in range(per_client):
            times.append(await client.first_chunk_s())

    try:
        await asyncio.wait_for(asyncio.gather(*(loop(c) for c in clients)), timeout=300)
    finally:
        for client in clients:
            await client.close()
    return times


def quantiles(times: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered) * 1000, ordered[min(int(0.99 * len(ordered)), len(ordered) - 1)] * 1000


@dataclass
class Row:
    upstream: str
    client: str
    concurrency: int
    direct: tuple[float, float]
    proxied: tuple[float, float]


def run_all(requests: int, concurrencies: Sequence[int], upstreams: Sequence[bool]) -> list[Row]:
    rows = []
    for nodelay in upstreams:
        upstream_port = free_port()
        args = [sys.executable, "-m", "bench.first_token", "upstream", str(upstream_port)]
        with process(args + ([] if nodelay else ["--no-nodelay"]), upstream_port):
            proxy_port = free_port()
            cmd, env = specroute_cmd(upstream_port, proxy_port, {"SPECROUTE_REQUEST_LOG": "false"})
            with process(cmd, proxy_port, env):
                for name, make in CLIENTS.items():
                    for concurrency in concurrencies:
                        n = requests if concurrency == 1 else requests * 2
                        direct = uvloop.run(measure(upstream_port, make, concurrency, n))
                        proxied = uvloop.run(measure(proxy_port, make, concurrency, n))
                        rows.append(
                            Row(
                                "TCP_NODELAY" if nodelay else "no TCP_NODELAY (control)",
                                name,
                                concurrency,
                                quantiles(direct),
                                quantiles(proxied),
                            )
                        )
                        print(table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def table(rows: Sequence[Row]) -> str:
    out = [
        "| upstream | client | concurrency | direct p50 / p99 ms | through specroute p50 / p99 ms | added p50 / p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.upstream} | {r.client} | {r.concurrency} | {r.direct[0]:.1f} / {r.direct[1]:.1f} | "
            f"{r.proxied[0]:.1f} / {r.proxied[1]:.1f} | {r.proxied[0] - r.direct[0]:+.1f} / {r.proxied[1] - r.direct[1]:+.1f} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["upstream"]:
        uvloop.run(serve_upstream(int(argv[1]), nodelay="--no-nodelay" not in argv))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.first_token", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 requests a cell, concurrency 1 only")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[0]
    rows = run_all(20 if args.quick else 200, (1,) if args.quick else (1, 16), (True, False))
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[0]
    print(
        f"\n`python -m bench.first_token{' --quick' if args.quick else ''}` ({time.strftime('%Y-%m-%d %H:%M')}, "
        f"{time.monotonic() - started:.0f} s, load average {load_before} -> {load_after}; upstream prefill "
        f"{PREFILL_MS:g} ms, then {CHUNKS} chunks {GAP_MS[0]:g}-{GAP_MS[1]:g} ms apart):\n"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
