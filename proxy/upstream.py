"""The upstream HTTP client: one aiohttp session shared by all instances.

aiohttp, not httpx: in bench/proxy_bench.py the same minimal proxy did about 4x the requests per
second on aiohttp as on httpx, httpx2 or httpx over an aiohttp transport (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import aiohttp
from yarl import URL

from proxy.settings import Settings

# Failures of an attempt, as short stable tokens (telemetry's error.type, the retry decision).
CONNECT = "connect"
FIRST_TOKEN_TIMEOUT = "first_token_timeout"
CHUNK_TIMEOUT = "chunk_timeout"
TOTAL_TIMEOUT = "total_timeout"
DISCONNECTED = "upstream_disconnected"


def classify(exc: BaseException, started: bool) -> str:
    """The failure token for an exception raised while talking to an upstream.

    `started`: whether the attempt had already received response bytes (a read timeout then is
    a gap between chunks rather than a wait for the first token)."""
    if isinstance(exc, (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError)):
        return CONNECT
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return CHUNK_TIMEOUT if started else FIRST_TOKEN_TIMEOUT
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return TOTAL_TIMEOUT
    return DISCONNECTED


UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
UPSTREAM_KEEPALIVE_S = 4.0
"""Seconds an idle upstream connection is kept for reuse: below the 5 s keep-alive of uvicorn (which SGLang and vLLM serve with) upstream."""


class Upstream:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}
        """Parsed upstream URLs (instances x paths: a handful), so yarl parses each only once."""

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # no global cap: each instance has its own (limit_per_host)
            limit_per_host=self.settings.max_connections,
            # Idle connections close before the server closes them: SGLang and vLLM serve with
            # uvicorn's 5 s keep-alive, and a pooled connection reused as its server's FIN was in
            # flight failed the request sent on it ("server disconnected", before any byte).
            keepalive_timeout=UPSTREAM_KEEPALIVE_S,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # bytes pass through as the upstream sent them
            cookie_jar=aiohttp.DummyCookieJar(),  # one client's upstream cookies must never reach another
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited (the app's lifespan did not run)")
        return self._session

    async def post(
        self,
        url: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        total_s: float,
        first_byte_limited: bool = True,
    ) -> aiohttp.ClientResponse:
        """Send a POST; returns once the status line and headers are in (body unread).
        `first_byte_limited`: the wait for them is held to the first-token timeout (a stream);
        otherwise only the total timeout bounds it (a JSON answer's headers come when it is done)."""
        timeout = aiohttp.ClientTimeout(
            total=total_s,
            sock_connect=self.settings.connect_timeout_s,
            sock_read=self.settings.first_token_timeout_s if first_byte_limited else None,
        )
        parsed = self._urls.get(url)
        if parsed is None:
            if "?" in url:  # a client's query: not cached (its values are the client's to vary)
                parsed = URL(url, encoded=True)
            else:
                parsed = self._urls[url] = URL(url)
        return await self.session.post(parsed, data=body, headers=list(headers), timeout=timeout, allow_redirects=False)

    async def get_json(self, url: str, headers: Iterable[tuple[str, str]], timeout_s: float) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.get(url, headers=list(headers), timeout=timeout, allow_redirects=False) as response:
            response.raise_for_status()
            return await response.json(content_type=None)


def not_reused(response: aiohttp.ClientResponse) -> None:
    """Its connection is closed once the response is read, not pooled. A 500 may be an exception
    in a uvicorn server (SGLang, vLLM): after its answer it reads no more and closes the
    connection, too late for the pool to see before the next request reuses it and meets a reset
    (an innocent request's upstream_disconnected, counted against the server). Called before
    the caller awaits anything once the headers are in: a connection aiohttp already pooled is
    then still unused (another task could take it only after an await)."""
    connection = response.connection
    if connection is not None and connection.protocol is not None:
        connection.protocol.force_close()
    else:  # a short body came with the headers: aiohttp pooled its connection at once
        protocol = getattr(response, "_protocol", None)
        if protocol is not None:
            protocol.close()  # closed, the pool skips it


def expect_chunk_gaps(response: aiohttp.ClientResponse, seconds: float) -> None:
    """After the first chunk, reads time out on the inter-chunk gap, not the first-token wait."""
    connection = response.connection
    if connection is not None and connection.protocol is not None:
        connection.protocol.read_timeout = seconds


async def read_up_to(content: aiohttp.StreamReader, limit: int) -> bytes:
    """At most `limit` bytes of a body (a read returns what is buffered: looped until the limit
    or the body's end)."""
    parts: list[bytes] = []
    size = 0
    while size < limit:
        part = await content.read(limit - size)
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)
