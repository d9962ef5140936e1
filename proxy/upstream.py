"""The upstream HTTP client: one aiohttp session shared by all instances.

aiohttp, not httpx: in bench/proxy_bench.py the same minimal proxy did about 4x the requests per
second on aiohttp as on httpx, httpx2 or httpx over an aiohttp transport (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import aiohttp
from yarl import URL

from proxy.settings import Settings

log = logging.getLogger("specroute.upstream")

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
RESEND_WITHIN_S = UPSTREAM_KEEPALIVE_S
"""A pooled connection closed unanswered this soon after the request went is resent (`post`):
a keep-alive close crossing the request comes at once, or as a stalled server resumes; one that
held the request longer may have run it (an idle timeout of a balancer between, a minute in)."""


class ClosedThenGone(aiohttp.ClientConnectionError):
    """A pooled connection closed unanswered, and a new one could not be made (refused, or not
    accepted in time): the server is gone, likely crashed on the request. It reads as that
    request's close (`upstream_disconnected`, which the query-of-death guard counts), and the
    server as unreachable."""


class Sent:
    """What one POST's trace saw (aiohttp's trace_request_ctx)."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False
        """It went on a pooled keep-alive connection."""


async def _on_reuse(_: aiohttp.ClientSession, context: SimpleNamespace, __: object) -> None:
    sent = context.trace_request_ctx
    if isinstance(sent, Sent):
        sent.reused = True


def closed_unanswered(exc: BaseException) -> bool:
    """The connection ended before any byte of an answer: closed (EOF) or reset, as a server
    closing an idle keep-alive connection does to a request that crossed its close (uvicorn
    closes with the request unread, which resets it)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return (
        isinstance(exc, aiohttp.ClientOSError)
        and not isinstance(exc, aiohttp.ClientConnectorError)
        and exc.errno in (errno.ECONNRESET, errno.EPIPE)
    )


class Upstream:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        """A session whose every connection is new (and closed after its answer): a request
        resent after its pooled connection turned out closed."""
        self.resent = 0
        """Requests sent again on a new connection after a pooled one ended unanswered."""
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
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_on_reuse)
        self._session = self._new_session(connector, [reuse])
        fresh = aiohttp.TCPConnector(limit=0, limit_per_host=self.settings.max_connections, force_close=True)
        self._fresh = self._new_session(fresh, [])

    @staticmethod
    def _new_session(connector: aiohttp.BaseConnector, traces: list[aiohttp.TraceConfig]) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # bytes pass through as the upstream sent them
            cookie_jar=aiohttp.DummyCookieJar(),  # one client's upstream cookies must never reach another
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
            trace_configs=traces,
        )

    async def stop(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

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
        otherwise only the total timeout bounds it (a JSON answer's headers come when it is done).

        Sent on a pooled connection that ends before any byte of an answer within
        RESEND_WITHIN_S, it is sent once more on a new one: the server closed that connection as
        the request crossed its close (uvicorn's keep-alive timer, late after a stall), unread.
        Counted against the server and failed over, it failed requests pinned to a pool of one
        and ejected a healthy server. Go's HTTP client resends a POST only when nothing was
        written, which bytes in a socket's buffer do not show; Envoy's `reset-before-request`
        retry is the same trade. A server that crashed on the request is not asked twice: the
        new connection is refused (`ClosedThenGone`; the query-of-death guard counts it). Behind
        one URL that balances over several processes (a Kubernetes Service) the new connection
        may reach another, which then gets the request too. A connection that was new is never
        resent; new connections for resends have a cap of their own (max_connections)."""
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
        items = list(headers)
        sent = Sent()
        began = asyncio.get_running_loop().time()
        try:
            return await self.session.post(
                parsed, data=body, headers=items, timeout=timeout, allow_redirects=False, trace_request_ctx=sent
            )
        except aiohttp.ClientError as exc:
            soon = asyncio.get_running_loop().time() - began <= RESEND_WITHIN_S
            if not (sent.reused and soon and closed_unanswered(exc)):
                raise
            first = exc
        self.resent += 1
        log.debug("%s closed a pooled connection unanswered: sent again on a new one", parsed.origin())
        assert self._fresh is not None  # started with the pooled session
        try:
            return await self._fresh.post(parsed, data=body, headers=items, timeout=timeout, allow_redirects=False)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise ClosedThenGone(f"{type(first).__name__}, then {type(exc).__name__}") from first

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
