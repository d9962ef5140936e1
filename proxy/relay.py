"""POST /v1/chat/completions and /v1/completions: read, route, forward with failover, relay.

A raw ASGI handler (FastAPI serves the other routes): the body is parsed once to learn what
routing needs, then sent upstream byte for byte; the response goes back chunk by chunk as it
arrives. The client sees nothing until the upstream's first body bytes are in, so until then a
failed attempt can still be retried elsewhere, and a first-token timeout can still be a 504.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import secrets
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from time import monotonic, perf_counter
from typing import Any

import aiohttp

from fleet.model import NO_MATCH, PrefixMatch
from fleet.types import Decision, PoolName
from proxy import body as request_body
from proxy import scan
from proxy.aborts import MIN_RID_CHARS, Aborts, new_rid
from proxy.auth import KEY_SCOPE
from proxy.backends.base import RANK_HEADER
from proxy.cache_salt import key_salt
from proxy.connection import ABORT_EXTENSION
from proxy.errors import ProxyError, normalise_upstream_error
from proxy.holding import Held
from proxy.hooks import RequestHooks, Telemetry
from proxy.pools import STREAM_OPTIONS_RECHECK_S, Instance, other_pool
from proxy.response_ids import ResponseIds
from proxy.responses import HeadersFor, ResponseOwners
from proxy.routing import (
    HUNG_RANK,
    NO_PROGRESS,
    Attempt,
    Router,
    RoutingInputError,
    read_overrides,
    read_session,
    read_workload,
)
from proxy.settings import Settings
from proxy.state import dispatched
from proxy.suspects import Culprit, Suspects, request_key
from proxy.telemetry.names import MAX_MODEL_CHARS
from proxy.upstream import (
    CONNECT,
    DISCONNECTED,
    UPSTREAM_ERRORS,
    ClosedThenGone,
    Upstream,
    classify,
    expect_chunk_gaps,
    not_reused,
    read_up_to,
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

COMPLETION_PATHS = frozenset(scan.DIALECTS)
"""The paths generating text: routed, relayed and learned from here."""
REQUEST_ID = "x-request-id"

# Request headers that describe the client's connection, not the request: never forwarded.
NOT_FORWARDED = frozenset(
    {
        "host",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "accept-encoding",
        "expect",
        "x-specroute-pool",
        "x-specroute-class",
        "x-specroute-session",
        # Which data-parallel rank serves a request is the router's to say (it avoids a hung
        # one): a client's would pile requests onto one rank, or onto a hung one.
        RANK_HEADER,
        # x-specroute-workload is forwarded: a server may read it too (the twin draws each
        # request's acceptance from its workload by it).
    }
)
# Response headers the proxy sets itself or that belong to the upstream hop (RFC 9110 7.6.1).
NOT_RELAYED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"date",
        b"server",
        b"x-request-id",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
    }
)
OWN_PREFIX = b"x-specroute-"
"""Response headers only the proxy sets: an upstream's are dropped, never passed on beside ours."""
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""The longest SSE event relayed; an upstream that sends more without ending one is cut off."""
FORWARDED = frozenset(
    {
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-forwarded-port",
        "forwarded",
        "x-real-ip",
        # What other proxies and CDNs set for the client's address: a client sending them could
        # claim any address to a server or sidecar that reads them (a review's probe).
        "true-client-ip",
        "cf-connecting-ip",
        "x-client-ip",
        "x-cluster-client-ip",
        "fastly-client-ip",
    }
)
RETRYABLE = frozenset({CONNECT, DISCONNECTED})
"""Attempt failures worth another instance. Timeouts are not: the next one would wait as long."""
ERROR_BODY_LIMIT = 64 * 1024
RETRY_AFTER = frozenset({b"retry-after", b"retry-after-ms"})
RATE_LIMIT_PREFIX = b"x-ratelimit-"
"""An upstream error's headers the client gets besides RETRY_AFTER: OpenAI's x-ratelimit-* (an
OpenAI-compatible upstream's rate limits, which clients back off by)."""
ERROR_EVENT_SEND_S = 1.0
"""How long the closing error event of a failed stream may wait for the client to read."""
MARKER_BYTES = 64
"""Longer than any marker of a first token (`scan.Dialect.started`)."""

log = logging.getLogger("specroute")


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


class ResponseAborted(Exception):
    """A JSON body was cut short upstream after its first bytes went to the client (or a stream's
    error event could not be sent): the connection is closed, so the client sees a broken
    response rather than a short one."""


class Exchange:
    """One client request's state on the way through."""

    __slots__ = (
        "request_id",
        "send",
        "hooks",
        "started",
        "status",
        "client_gone",
        "done",
        "error_type",
        "decision",
        "instance",
        "summary",
        "waited_s",
        "prompt_tokens",
        "streaming",
        "asked_stream",
        "request_class",
        "workload",
        "client",
        "blocks",
        "match",
        "session",
        "logged",
        "hide_usage",
        "with_usage",
        "choices",
        "dialect",
        "owner",
        "keeps_id",
        "ids_for",
        "client_rid",
        "takes_rid",
        "names_rid",
        "body_bytes",
        "culprit",
        "servers_tried",
        "events",
        "held",
    )

    def __init__(self, request_id: str, send: Send, hooks: RequestHooks) -> None:
        self.request_id = request_id
        self.send = send
        self.hooks = hooks
        self.started = False
        """Whether the response start (status line) went to the client."""
        self.status = 0
        self.client_gone = False
        self.done = False
        self.error_type: str | None = None
        self.decision: Decision | None = None
        self.instance: Instance | None = None
        self.held: Held | None = None
        """Its place in flow control's queue, when it was held (proxy/holding.py)."""
        self.summary = scan.Summary()
        self.waited_s = 0.0
        """Time spent awaiting upstream servers (connect, headers, chunks), held by flow control,
        or awaiting the client (its body's bytes, room to write to it): the rest is ours (the
        overhead). A slow upload or a client that stopped reading read as seconds of overhead."""
        self.prompt_tokens = 0
        self.streaming = False
        """Whether the response being relayed is an SSE stream (an error can still go in-band)."""
        self.request_class = "latency"
        self.workload: str | None = None
        """Its workload key (acceptance evidence is learned per key)."""
        self.client: str | None = None
        """The client's address (the peer of its connection), for X-Forwarded-For."""
        self.blocks: Sequence[int] = ()
        """Its prompt's block hashes (kept for every attempt: hashed once)."""
        self.match: PrefixMatch = NO_MATCH
        """Its prefix credit per instance, taken before the decision."""
        self.session: str | None = None
        """Its session key (a hash; never the name)."""
        self.logged: dict[str, Any] | None = None
        """Its decision's entry in the state endpoint's ring."""
        self.asked_stream = False
        """Whether the client asked for a stream: a JSON answer's headers come only once it is
        complete, so only a stream's first byte is held to the first-token timeout."""
        self.choices = 1
        """Completions it asked for (`n`, times the prompts of a completions batch): with more than
        one, its usage counts all their tokens against one decode time, so its TPOT teaches
        nothing, and SGLang gives each its own engine request id."""
        self.with_usage: bytes | None = None
        """Its body asking for the stream's usage chunk, which the client did not (None: the client
        named `stream_options`, it is no stream, or SPECROUTE_STREAM_USAGE is off)."""
        self.hide_usage = False
        """The current attempt sent `with_usage`: the usage chunk is read (the fleet model learns
        from it) and not passed on."""
        self.dialect = scan.CHAT
        """How its API's answers are looked into (chat and completions, or the Responses API)."""
        self.servers_tried = 0
        """Servers its attempts went to (a second send to the same one does not count)."""
        self.events = 0
        """A stream's text-carrying events relayed to the client: how far one closed early got (its usage,
        and so its token count, never comes)."""
        self.owner: Instance | None = None
        """The server holding the stored response it continues (`previous_response_id`): the
        only one it can go to."""
        self.keeps_id = False
        """A Responses request its server stores (`store` not false): its id's server is noted."""
        self.ids_for: bytes | None = None
        """The digest of the key whose ids each attempt gives the response it asks a server to
        store (`request_id`): one of its own (proxy/response_ids.py), new for each attempt, so
        that a failed attempt a server stored never shares its id with the one answered."""
        self.client_rid: str | None = None
        """The engine request id the client chose (SGLang's `rid`, a Responses `request_id`), at
        least MIN_RID_CHARS long: an abandoned attempt is aborted by it (proxy/aborts.py)."""
        self.takes_rid = False
        """SGLang makes one engine request of it, named by its id field (one choice, one prompt):
        an abandoned attempt can be aborted by that id."""
        self.names_rid = False
        """Its body has an id field (`rid`, a Responses `request_id`), even a null one: the proxy
        adds none of its own (a second key would lose to the client's)."""
        self.body_bytes = 0
        """Its body's size (a Responses answer echoes parts of it after its usage)."""
        self.culprit = Culprit()
        """Its attempts' failures that it may have caused (`proxy.suspects`)."""

    def routing_headers(self) -> list[tuple[bytes, bytes]]:
        """Where the request went: the pool and server of the last attempt, and why (`+failover`
        when a failure moved it to the other pool, `+retry` to another server of the same)."""
        headers = [(b"x-request-id", self.request_id.encode())]
        if self.decision is not None:
            pool, reason = self.decision.pool, self.decision.reason
            if self.instance is not None and self.instance.pool != pool:
                pool, reason = self.instance.pool, reason + "+failover"
            elif self.servers_tried > 1:
                reason += "+retry"
            headers.append((b"x-specroute-pool", pool.encode()))
            headers.append((b"x-specroute-reason", reason.encode()))
        if self.instance is not None:
            headers.append((b"x-specroute-backend", self.instance.name.encode()))
        return headers

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        headers = headers + self.routing_headers() + self.hooks.response_headers(waited_s=self.waited_s)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def fail(self, error: ProxyError) -> None:
        """Answer with an OpenAI-shaped error (only possible before the response started)."""
        self.error_type = error.code or error.type
        if self.started:
            return
        body = error.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += error.headers
        if error.retryable is False:
            headers.append((b"x-should-retry", b"false"))
        await self.start(error.status, headers)
        self.done = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


def apart(value: float, limit: float) -> str:
    """`value` to three significant digits, or as many more (up to six) as tell it from `limit`
    (a prediction of 0.2049 s against 0.2 s read "0.20 against 0.2")."""
    for digits in range(3, 7):
        shown = significant(value, digits)
        if limit <= 0 or shown != significant(limit, digits):
            break
    return shown


def significant(value: float, digits: int) -> str:
    """`value` to `digits` significant digits, in plain notation (1234.5 -> "1235", not "1.23e+03")."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(digits - 1 - math.floor(math.log10(abs(value))), 0)
    shown = f"{round(value, decimals):.{decimals}f}"
    return shown.rstrip("0").rstrip(".") if "." in shown else shown


def limit_note(limit: float, shown: str) -> str:
    """' against <shown> now' (`shown`: the limit with its unit) in an admission refusal's
    message; empty when that limit is not checked (0)."""
    return f" against {shown} now" if limit > 0 else ""


def refuses_stream_options(status: int, payload: bytes | None) -> bool:
    """Whether an upstream's answer (its status, its normalised error body) may refuse the
    `stream_options` the proxy added: a 400 or 422 (a strict schema's "extra inputs are not
    permitted") whose message names the field. It may only quote the request: `forward` sends it
    again without the field to tell."""
    return status in (400, 422) and payload is not None and b"stream_options" in payload


def request_headers(scope: Scope) -> tuple[dict[str, str], list[str]]:
    """The request's headers by lower-case name; a repeated one is joined with ", " (RFC 9110
    5.3), so none is lost on the way upstream and two routing headers that disagree are refused.
    Values are UTF-8 (the upstream client sends them so, byte for byte); the names of values
    that are not come second."""
    headers: dict[str, str] = {}
    undecodable: list[str] = []
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        try:
            value = raw_value.decode("utf-8")
        except UnicodeDecodeError:
            undecodable.append(name)
            value = raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers, undecodable


def request_id_of(headers: dict[str, str]) -> str:
    """The client's x-request-id when it is a sane token, else a new one."""
    given = headers.get(REQUEST_ID)
    if given and len(given) <= 128 and given.isascii() and given.isprintable() and " " not in given:
        return given
    return secrets.token_hex(16)


def outgoing_headers(
    headers: dict[str, str],
    instance: Instance,
    request_id: str,
    client: str | None = None,
    append_forwarded: bool = False,
) -> dict[str, str]:
    """The client's headers minus the hop-by-hop ones (named, or listed in its Connection
    header), with our request id, the pool's key, and X-Forwarded-For: the client's address
    (appended to what the client sent only when the proxy sits behind a trusted one, and then
    to a Forwarded header too; otherwise the client's forwarding headers are dropped)."""
    listed = connection_tokens([headers["connection"]]) if "connection" in headers else set()
    out = {
        name: value
        for name, value in headers.items()
        if name not in NOT_FORWARDED and name not in listed and (append_forwarded or name not in FORWARDED)
    }
    if client:
        given = out.get("x-forwarded-for") if append_forwarded else None
        out["x-forwarded-for"] = f"{given}, {client}" if given else client
        if "forwarded" in out:  # only kept in append mode: the peer goes last here too (RFC 7239)
            node = f'"[{client}]"' if ":" in client else client
            out["forwarded"] = f"{out['forwarded']}, for={node}"
    out[REQUEST_ID] = request_id
    if instance.api_key is not None:
        out["authorization"] = f"Bearer {instance.api_key}"
    return out


def connection_tokens(values: list[bytes] | list[str]) -> set[str]:
    """The header names a Connection header lists (hop-by-hop for this hop, RFC 9110 7.6.1)."""
    names: set[str] = set()
    for value in values:
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        names.update(token.strip().lower() for token in text.split(",") if token.strip())
    return names


def relayed_headers(response: aiohttp.ClientResponse, stream: bool) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers the client may see: no hop-by-hop ones (named or listed in
    its Connection header), none of ours, and no framing of a stream (the proxy frames it anew;
    an upstream stream with a Content-Length that broke off made uvicorn log a traceback)."""
    listed = {
        name.encode() for name in connection_tokens([v for n, v in response.raw_headers if n.lower() == b"connection"])
    }
    out = []
    for name, value in response.raw_headers:
        lower = name.lower()
        if (
            lower in NOT_RELAYED
            or lower in listed
            or lower.startswith(OWN_PREFIX)
            or (stream and lower == b"content-length")
            or not valid_header_value(value)
        ):
            continue
        out.append((lower, value))
    return out


_CONTROL_BYTE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def valid_header_value(value: bytes) -> bool:
    """No control byte but tab (uvicorn refuses to send one: the client's connection dropped)."""
    return _CONTROL_BYTE.search(value) is None


def unusable_answer(response: aiohttp.ClientResponse) -> tuple[str, str] | None:
    """(error code, what the server did) for an answer no client could use, else None: a status
    outside HTTP's (uvicorn cannot send it), a success other than 200 (SGLang, vLLM and OpenAI
    answer completions with 200 alone; a 204 reached clients as an empty body), or a stream in a
    content-encoding the proxy did not ask for (its events cannot be read, so it would reach the
    client only at its end, the usage the proxy added still in it)."""
    status = response.status
    if not 200 <= status <= 599:
        return "upstream_bad_status", f"answered HTTP {status}"
    if 200 < status < 300:
        return "upstream_bad_status", f"answered HTTP {status}, not 200"
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if status == 200 and response.content_type == "text/event-stream" and encoding not in ("", "identity"):
        return "upstream_encoding", f"sent a stream in {encoding[:32]!r} encoding, which was not asked for"
    return None


async def watch_disconnect(receive: Receive, task: asyncio.Task[Any], exchange: Exchange) -> None:
    """Cancel the request's task the moment its client goes away (frees the upstream slot)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not exchange.done:
                exchange.client_gone = True
                task.cancel()
            return


async def read_before(response: aiohttp.ClientResponse, deadline: float, buffered: int, missing: str) -> bytes:
    """The next read of a stream's opening, `buffered` bytes of it held so far, by `deadline` (a
    perf_counter time: the first-token timeout's end) and within MAX_EVENT_BYTES; else a
    first-token timeout, `missing` saying what did not come."""
    left = deadline - perf_counter()
    if left <= 0 or buffered > MAX_EVENT_BYTES:
        raise aiohttp.SocketTimeoutError(f"{missing} within the first-token timeout")
    try:
        async with asyncio.timeout(left):
            return await response.content.readany()
    except TimeoutError:
        raise aiohttp.SocketTimeoutError(f"{missing} within the first-token timeout") from None


def checked_rid(rid: Any, field: str) -> str | None:
    """A client's engine request id (`field`), refused when shorter than MIN_RID_CHARS: SGLang
    aborts every request whose id begins with an aborted one's, its own abort of a gone client's
    request included, so a short one ("a") ended other clients' requests when its client left."""
    if isinstance(rid, str) and len(rid) < MIN_RID_CHARS:
        raise ProxyError(
            400,
            f"'{field}' must be at least {MIN_RID_CHARS} characters (a uuid's hex digits): the server aborts every "
            f"request whose id begins with an aborted one's",
            param=field,
            code="invalid_value",
        )
    return rid if isinstance(rid, str) else None


class CompletionHandler:
    def __init__(self, settings: Settings, router: Router, upstream: Upstream, telemetry: Telemetry) -> None:
        self.settings = settings
        self.router = router
        self.upstream = upstream
        self.telemetry = telemetry
        self.open_requests = 0
        """Completion requests in this handler now (SPECROUTE_MAX_OPEN_REQUESTS bounds them)."""
        self.clients_keys_upstream = not (settings.api_keys or settings.api_keys_file or settings.operator_api_keys)
        """Without proxy keys, a client's Authorization goes upstream (docs/security.md): an
        upstream 401 on a pool without its own key is then the client's to see."""
        self.bodies = request_body.BodyReader(
            settings.max_json_items, settings.max_json_values, keep_content=settings.trace_content
        )
        secret = settings.response_id_secret
        self.secret = secret.get_secret_value().encode() if secret is not None else b""
        self.responses = ResponseOwners(
            router, upstream, self.clients_keys_upstream, telemetry, ResponseIds(self.secret)
        )
        self.aborts = Aborts(upstream, telemetry.upstream_abort)

    def cache_salt(self, owner: bytes | None) -> str | None:
        """The salt a client key's completions are sent with (proxy/cache_salt.py): None without
        keys, or with SPECROUTE_CACHE_SCOPE=shared."""
        if owner is None or self.settings.cache_scope != "key":
            return None
        return key_salt(owner, self.secret)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers, undecodable = request_headers(scope)
        exchange = Exchange(request_id_of(headers), send, self.telemetry.request_hooks(scope["path"]))
        exchange.dialect = scan.DIALECTS[scope["path"]]
        client = scope.get("client")
        exchange.client = client[0] if client else None
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.Task[None] | None = None
        # Before anything can be refused: a 405/413/415 is logged and traced under its request id too.
        declared = headers.get("content-length", "")
        exchange.hooks.received(
            endpoint=scope["path"],
            request_id=exchange.request_id,
            headers=headers,
            body_bytes=int(declared) if declared.isdecimal() else 0,
        )
        self.open_requests += 1
        try:
            bound = self.settings.max_open_requests
            if bound and self.open_requests > bound:
                raise ProxyError(
                    429,
                    f"the proxy holds {bound} requests open already; retry after 1 s",
                    code="too_many_open_requests",
                    headers=[(b"retry-after", b"1")],
                )
            if undecodable:
                # It would reach the upstream changed (the HTTP client there encodes UTF-8).
                raise ProxyError(
                    400, f"header {undecodable[0]} is not valid UTF-8", param=undecodable[0], code="invalid_header"
                )
            if scope["method"] != "POST":
                raise ProxyError(
                    405, f"use POST for {scope['path']}", code="method_not_allowed", headers=[(b"allow", b"POST")]
                )
            began = perf_counter()
            try:
                body = await self.read_body(headers, receive)
            finally:  # a body refused (413) or left half sent took the client's time too
                exchange.waited_s += perf_counter() - began
            exchange.body_bytes = len(body)
            try:
                override, request_class = read_overrides(headers)
                workload = read_workload(headers)
                session = read_session(headers)
            except RoutingInputError as exc:
                raise ProxyError(400, str(exc), param=exc.header, code="invalid_header") from None
            router = self.router
            given = request_body.Given(
                request_class,
                workload,
                session,
                router.fleet.prefix.block_tokens,
                router.prefix_blocks(),
                router.hash_key,
                responses=exchange.dialect is scan.RESPONSES,
                owner=scope.get(KEY_SCOPE),
                cache_salt=self.cache_salt(scope.get(KEY_SCOPE)),
            )
            parsed = await self.bodies.parse(body, given)
            payload, features = parsed.payload, parsed.features
            if parsed.body is not None:  # null members dropped: "not set" to OpenAI, a 400 to SGLang
                body = parsed.body
                exchange.body_bytes = len(body)
            if exchange.dialect is scan.RESPONSES:
                self.check_response_id(exchange, payload, scope.get(KEY_SCOPE))
            else:
                self.check_rid(exchange, payload, scope.get(KEY_SCOPE))
            exchange.prompt_tokens = features.prompt_tokens
            exchange.asked_stream = features.stream
            exchange.request_class = features.request_class
            exchange.workload = features.workload
            exchange.blocks, exchange.session = parsed.blocks, parsed.session
            choices = payload.get("n")
            # An integral float (2.0) is taken as SGLang takes it (proxy/body.py lets it through).
            many = isinstance(choices, int | float) and not isinstance(choices, bool) and choices > 1
            exchange.choices = int(choices) if many and choices is not None else 1  # None: for mypy
            prompt = payload.get("prompt")
            batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
            if batch and isinstance(prompt, list):  # (mypy)
                exchange.choices *= len(prompt)  # a completions batch: one engine request a prompt
            # SGLang ids a batch's requests (even one's) and n > 1's choices itself.
            exchange.takes_rid = exchange.choices == 1 and not batch
            exchange.names_rid = ("request_id" if exchange.dialect is scan.RESPONSES else "rid") in payload
            if (
                self.settings.stream_usage
                and exchange.dialect.stream_usage
                and features.stream
                and "stream_options" not in payload
            ):
                # Its token count is what its time per token, acceptance and output length are
                # learned from (routing.md, "What is learned"); sent to servers that take it.
                exchange.with_usage = scan.with_usage_requested(body)
            snapshot = router.snapshot(features.workload)
            # What each instance likely holds of the prompt, for the policy (and a pinned pool).
            exchange.match = router.cached(parsed.blocks, features, parsed.session)
            features = router.with_credit(features, exchange.match)
            if exchange.dialect is scan.RESPONSES:
                await self.find_owner(exchange, payload, headers, scope.get(KEY_SCOPE))
            held: Held | None = None
            if (
                router.holding is not None
                and override is None
                and exchange.owner is None
                and router.holding.holds(features, snapshot)
            ):
                # Lost on both pools: it waits here, not in a server's queue (flow control).
                watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, task, exchange))
                holding_since = monotonic()
                try:
                    held, rule = await router.holding.wait(features)
                except BaseException:  # its client left (or the drain cut it): it waited, the proxy did not work
                    exchange.waited_s += monotonic() - holding_since
                    raise
                exchange.held = held
                snapshot = router.snapshot(features.workload)
                exchange.match = router.cached(parsed.blocks, features, parsed.session)
                features = router.with_credit(features, exchange.match)
            exchange.decision, exchange.logged = router.decide(features, override, snapshot, exchange.owner)
            if held is not None:
                held_s = round(monotonic() - held.since, 3)
                exchange.waited_s += held_s  # waiting, not the proxy's own work (its overhead)
                decided = exchange.decision
                exchange.decision = Decision(
                    decided.pool, decided.reason, {**decided.scores, "held_s": held_s}, decided.instance
                )
                if exchange.logged is not None:
                    exchange.logged["held"] = {"seconds": held_s, "released_by": rule}
            # The id of its log line and x-request-id, so a decision can be found in both.
            exchange.logged["request_id"] = exchange.request_id
            refusal = router.admit(features, exchange.decision, snapshot)
            if refusal is not None:
                # Its headers and the decision log say what refused it, not where it would have gone.
                decided = exchange.decision
                exchange.decision = Decision(decided.pool, refusal.rule, decided.scores)
                if exchange.logged is not None:
                    exchange.logged["refused"] = refusal.rule
                raise ProxyError(
                    429,
                    f"the fleet cannot serve this request in time now ({refusal.rule}: first token predicted "
                    f"in {apart(refusal.predicted_ttft_s, refusal.ttft_limit_s)} s"
                    f"{limit_note(refusal.ttft_limit_s, f'{significant(refusal.ttft_limit_s, 3)} s')}, "
                    f"{apart(refusal.predicted_tpot_s * 1000, refusal.tpot_limit_s * 1000)} ms per output token"
                    f"{limit_note(refusal.tpot_limit_s, f'{significant(refusal.tpot_limit_s * 1000, 3)} ms')}); "
                    f"retry after {refusal.retry_after_s} s",
                    code="fleet_overloaded",
                    headers=[(b"retry-after", str(refusal.retry_after_s).encode())],
                )
            model = payload.get("model")
            exchange.hooks.decided(
                decision=exchange.decision,
                features=features,
                # Bounded: the name goes into the log line and the spans, and a client chooses it.
                model=model[:MAX_MODEL_CHARS] if isinstance(model, str) else None,
                override=override,
                body=payload,
            )
            if watcher is None:
                watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, task, exchange))
            target = scope["path"]
            if scope.get("query_string"):  # e.g. an SDK's extra_query: passed on as the client sent it
                target += "?" + scope["query_string"].decode("latin-1")
            await self.forward(
                exchange, target, headers, body, pinned=override is not None or exchange.owner is not None
            )
        except ProxyError as error:
            await exchange.fail(error)
        except ClientGone:
            exchange.client_gone = True
        except ResponseAborted as aborted:
            exchange.error_type = str(aborted)
            # the connection closes: the client sees the break (without the extension, uvicorn
            # closes it, logging the incomplete response at ERROR)
            abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
            if abort is not None:
                abort()
        except asyncio.CancelledError:
            if not exchange.client_gone:
                # The server is stopping (its drain timeout passed), not our client leaving: the
                # client is told, and the response is complete, so this request ends normally
                # (re-raising only made uvicorn log the cancellation as an application error).
                await self.interrupted(exchange)
            task.uncancel()
        finally:
            self.open_requests -= 1
            if exchange.held is not None:
                exchange.held.land()  # refused or failed before it was dispatched: the queue goes on
            if watcher is not None:
                watcher.cancel()
            summary = exchange.summary
            exchange.hooks.finished(
                status=exchange.status or 499,
                error_type=exchange.error_type or ("client_disconnected" if exchange.client_gone else None),
                prompt_tokens=summary.prompt_tokens,
                completion_tokens=summary.completion_tokens,
                finish_reasons=summary.finish_reasons,
                client_disconnected=exchange.client_gone,
                waited_s=exchange.waited_s,
                cached_tokens=summary.cached_tokens,
                events=exchange.events if exchange.streaming else None,
            )

    def check_response_id(self, exchange: Exchange, payload: dict[str, Any], client: bytes | None) -> None:
        """A Responses request: whether its server stores the response (`store`, true unless
        said) and its id is noted (`keeps_id`). With proxy keys on (`client`: the digest of the
        client's key) the proxy chooses the id of the response a server stores, one bound to the
        client's key (`ids_for`, proxy/response_ids.py); an id the client chose (SGLang's and
        vLLM's `request_id`) must be one of its own."""
        chosen = payload.get("request_id")
        stored = payload.get("store") is not False
        exchange.client_rid = checked_rid(chosen, "request_id")
        if client is None:
            # An id the client chose is not noted: it could name another client's response, and
            # the follow-ups naming it would then go to this server.
            exchange.keeps_id = stored and chosen is None
            return
        named = "request_id" in payload  # a null one too: the proxy's id would be a second key, and lose
        if named and not (isinstance(chosen, str) and self.responses.ids.belongs(chosen, client)):
            raise ProxyError(
                400,
                "with proxy keys on the proxy chooses the ids of stored responses; leave out 'request_id'",
                param="request_id",
                code="request_id_not_allowed",
            )
        exchange.keeps_id = stored
        if stored and not named:
            exchange.ids_for = client  # each attempt's body gets one (`attempt`)

    def check_rid(self, exchange: Exchange, payload: dict[str, Any], client: bytes | None) -> None:
        """SGLang's `rid` (a chat or completion's engine request id) is at least MIN_RID_CHARS
        long (`checked_rid`). With proxy keys on, it may not name another key's stored response
        (which a stored response's id also is): SGLang refuses a rid running already, which told
        a client whether another's response was running."""
        rid = payload.get("rid")
        named = rid if isinstance(rid, list) else [rid]
        for each in named:
            checked_rid(each, "rid")
        if isinstance(rid, str):
            exchange.client_rid = rid
        if client is None or rid is None:
            return
        ids = self.responses.ids
        if any(isinstance(r, str) and ids.shaped(r) and not ids.belongs(r, client) for r in named):
            raise ProxyError(
                400,
                "with proxy keys on, 'rid' may not name a stored response of another key",
                param="rid",
                code="request_id_not_allowed",
            )

    async def find_owner(
        self, exchange: Exchange, payload: dict[str, Any], headers: dict[str, str], client: bytes | None
    ) -> None:
        """A Responses request: the server holding the response it continues, if any is found
        (else it goes where routing sends it, whose server answers for the id it does not know).
        With proxy keys on, a response of another key's is not found, and no server is asked."""
        previous = payload.get("previous_response_id")
        if isinstance(previous, str) and previous:
            if not self.responses.ids.belongs(previous, client):
                raise ProxyError(
                    404,
                    f"Previous response with id '{previous[:64]}' not found.",
                    param="previous_response_id",
                    code="response_not_found",
                )
            headers_for = self.headers_for(headers, exchange.request_id, exchange.client)
            began = perf_counter()
            found = await self.responses.owner(previous, headers_for, exchange.request_id)
            name = found.instance.name if found.instance is not None else None
            self.telemetry.stored_response("lookup", exchange.request_id, found.status, name, perf_counter() - began)
            if found.status == 200:
                exchange.owner = found.instance
            elif found.status in (409, 502):
                # Held by several servers, or perhaps by one that could not be asked: sent anywhere,
                # it would continue another conversation or be told, wrongly, that none exists.
                ambiguous = found.status == 409
                raise ProxyError(
                    found.status,
                    "stored response lookup failed",
                    code="response_id_ambiguous" if ambiguous else "response_owner_unreachable",
                    retryable=False if ambiguous else None,
                    payload=found.body,
                )
            # Else no server holds it (or none keeps responses): it goes where routing sends it,
            # and that server answers for the id.

    def headers_for(self, headers: dict[str, str], request_id: str, client: str | None) -> HeadersFor:
        """What a request to an instance on a client's behalf carries (`outgoing_headers`): a
        lookup of a stored response as its completions would."""
        append = self.settings.forwarded_headers == "append"
        return lambda instance: outgoing_headers(headers, instance, request_id, client, append)

    async def interrupted(self, exchange: Exchange) -> None:
        """The server cancelled this request at the end of its drain: tell the client so (a 503 the
        SDK may retry elsewhere, or an in-band error event) instead of dropping the connection."""
        if not exchange.started:
            await exchange.fail(ProxyError(503, "the proxy is shutting down; retry", code="shutting_down"))
        elif exchange.streaming and not exchange.done:
            exchange.done = True
            exchange.error_type = "shutting_down"
            message = exchange.dialect.error_event(
                "the proxy is shutting down; the response is incomplete", "server_error", "shutting_down"
            )
            await exchange.send({"type": "http.response.body", "body": message, "more_body": False})

    async def read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise ProxyError(
                415,
                f"Content-Type must be application/json, not {content_type or 'missing'!r}",
                code="unsupported_media_type",
            )
        encoding = headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            # Read as JSON it would be garbage (SGLang and vLLM decode no request body either).
            raise ProxyError(
                415,
                f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                code="unsupported_content_encoding",
            )
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ProxyError(413, f"request body over {limit} bytes", code="request_too_large")
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise ProxyError(413, f"request body over {limit} bytes", code="request_too_large")
            parts.append(part)
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def forward(self, exchange: Exchange, path: str, headers: dict[str, str], body: bytes, pinned: bool) -> None:
        """Try instances until one answers (same pool, then the other unless pinned), bounded."""
        assert exchange.decision is not None
        pool: PoolName = exchange.decision.pool
        prefer = exchange.decision.instance
        loop = asyncio.get_running_loop()
        # End to end: a request's time held counts (SPECROUTE_HOLD_MAX_S is below the total).
        held_s = monotonic() - exchange.held.since if exchange.held is not None else 0.0
        deadline = loop.time() + self.settings.total_timeout_s - held_s
        tried: list[Instance] = []
        failure: ProxyError | None = None
        number = 0
        suspects = self.router.outliers.suspects
        if suspects.any() and suspects.refuses(request_key(path, body)):
            raise ProxyError(
                502,
                f"this request dropped the connection of {suspects.servers} servers within the last "
                f"{suspects.memory_s:g} s (it may crash them): it is not sent again",
                code="request_fails_servers",
                retryable=False,
            )
        for _ in range(self.settings.max_attempts):
            if exchange.owner is not None:  # only the server holding the response can continue it
                instance = exchange.owner if not tried else None
            else:
                instance = self.router.next_instance(pool, tried, pinned, prefer)
            if instance is None:
                break
            tried.append(instance)
            exchange.instance = instance
            exchange.servers_tried = len(tried)
            number += 1
            failure = await self.attempt(exchange, instance, number, path, headers, body, deadline - loop.time())
            if (
                failure is not None
                and exchange.hide_usage
                and refuses_stream_options(failure.status, failure.payload)
                and deadline - loop.time() > 0
            ):
                # The field the proxy added may be what was refused: once more as the client sent
                # it (not counted against max_attempts). The server is marked as refusing the field
                # while it is sent (streams sent to it meanwhile go without it, rather than each
                # being refused in turn) and stays so if it is served: it gets bodies as their
                # clients sent them for STREAM_OPTIONS_RECHECK_S. Refused again, the request
                # itself was (its error quoting the body, say): the mark is taken back and the
                # client gets that answer, as it does when no time is left for the second send.
                number += 1
                marked = instance.refused_stream_options_at
                instance.refused_stream_options_at = now = monotonic()
                failure = await self.attempt(
                    exchange, instance, number, path, headers, body, deadline - loop.time(), usage=False
                )
                if failure is None:
                    log.warning(
                        "%s refused stream_options and served the stream without it: for %.0f s streams "
                        "go to it as their clients sent them, and teach the router their token counts "
                        "only where their clients ask for usage",
                        instance.name,
                        STREAM_OPTIONS_RECHECK_S,
                    )
                elif instance.refused_stream_options_at == now:  # not marked since by another stream
                    instance.refused_stream_options_at = marked
            if failure is None or not failure.retryable:
                break
            if suspects.crashes(exchange.culprit):
                break  # it may crash every server it is sent to
        if failure is None and not tried:
            where = f"in pool {pool!r}" if pinned else "in either pool"
            retry_after = self.router.back_within_s([pool] if pinned else [pool, other_pool(pool)])
            failure = ProxyError(
                503,
                f"no upstream server is available {where}",
                code="no_upstream",
                headers=[(b"retry-after", str(retry_after).encode())],
            )
        if failure is not None and exchange.culprit.servers:
            # Every server it could be sent to (its response's, its pinned pool's, or the fleet's)
            # failed as a request may make one fail: it could not be tried on more.
            pools = [pool] if pinned else [pool, other_pool(pool)]
            reachable = 1 if exchange.owner is not None else sum(len(self.router.pools[p].instances) for p in pools)
            exchange.culprit.confined = len(exchange.culprit.servers) == len(tried) == reachable
            self.absolve(exchange, suspects, path, body)
        if failure is not None:
            if len(tried) > 1:
                failure.retryable = False  # the proxy already failed over: the SDK must not multiply
            elif failure.retryable:
                failure.retryable = None  # one server failed: the SDK's own retry may find another
            # else: a timeout (the generation would run again) or a 4xx: x-should-retry: false
            try:
                raise failure
            finally:
                # The raised error's traceback holds this frame, which held the error: a cycle
                # keeping the body alive until the cyclic collector ran (raised thresholds: a 15 MB
                # prompt the upstream refused stayed for seconds, 1.3 GB with ten clients).
                del failure

    def absolve(self, exchange: Exchange, suspects: Suspects, path: str, body: bytes) -> None:
        """A request that failed on enough servers and was served by none is judged their cause:
        its failures are taken back from their counts (`OutlierDetector.absolve`); one that
        dropped their connections is refused if sent again, for a while."""
        servers = self.router.outliers.absolve(exchange.culprit)
        crashes = suspects.crashes(exchange.culprit)
        if crashes:
            suspects.refuse(request_key(path, body))
        if servers:
            names = {i.url: i.name for pool in self.router.pools.values() for i in pool.instances}
            log.warning(
                "request %s failed on %d server(s) (%s)%s and none served it: judged their cause, its failures "
                "are not counted against them%s",
                exchange.request_id,
                len(servers),
                ", ".join(names.get(url, url) for url in servers),
                ", all it could be sent to," if exchange.culprit.confined else "",
                f"; it dropped their connections and is refused for {suspects.memory_s:g} s" if crashes else "",
            )

    async def attempt(
        self,
        exchange: Exchange,
        instance: Instance,
        number: int,
        path: str,
        headers: dict[str, str],
        body: bytes,
        remaining_s: float,
        usage: bool = True,
    ) -> ProxyError | None:
        """One upstream attempt. None when the client got its answer (or the stream ended with an
        error event); a ProxyError, `retryable` set, when it failed before any byte was sent.
        `usage`: a stream's usage is asked for as the proxy does (`Exchange.with_usage`), where
        the server takes it; False: the body goes as the client sent it."""
        hooks = exchange.hooks
        hooks.attempt_started(
            pool=instance.pool,
            instance=instance.url,
            attempt=number,
            cached_tokens=exchange.match.credit.get(instance.url, 0),
            server_kind=instance.kind,
            resent=not usage,
        )
        with_usage = exchange.with_usage if usage and instance.takes_stream_options(monotonic()) else None
        exchange.hide_usage = with_usage is not None
        if with_usage is not None:
            body = with_usage
        # The engine request id an abandoned attempt is aborted by on SGLang (proxy/aborts.py).
        rid = exchange.client_rid
        if exchange.ids_for is not None:
            rid = self.responses.ids.minted(exchange.ids_for)
            body = scan.with_first_member(body, b'"request_id":"' + rid.encode() + b'"')
        elif exchange.takes_rid and not exchange.names_rid and instance.kind == "sglang":
            # SGLang makes its response's id of it, as of its own: a uuid's hex (`resp_` before it
            # for a Responses request, its stored response's id).
            if exchange.dialect is scan.RESPONSES:
                rid = "resp_" + new_rid()
                body = scan.with_first_member(body, b'"request_id":"' + rid.encode() + b'"')
            else:
                rid = new_rid()
                body = scan.with_first_member(body, b'"rid":"' + rid.encode() + b'"')
        if instance.kind != "sglang" or not exchange.takes_rid:
            rid = None  # vLLM aborts a request whose connection closed at once; SGLang ids each of several
        out = outgoing_headers(
            headers, instance, exchange.request_id, exchange.client, self.settings.forwarded_headers == "append"
        )
        rank = instance.next_rank()
        if rank is not None:
            out[RANK_HEADER] = str(rank)  # a rank of it is hung: the others serve
        hooks.outgoing_headers(out)
        attempt = self.router.dispatch(
            instance,
            exchange.prompt_tokens,
            exchange.asked_stream,
            exchange.request_class,
            exchange.workload,
            blocks=exchange.blocks,
            match=exchange.match,
            session=exchange.session,
            predicted_tpot_s=(
                exchange.decision.predicted_tpot_s(instance.pool)
                if exchange.decision and exchange.choices == 1
                else 0.0
            ),
            culprit=exchange.culprit,
        )
        attempt.rank = rank
        if exchange.logged is not None:
            dispatched(exchange.logged, instance.url, attempt.sent.cached_tokens)
        if exchange.held is not None:
            exchange.held.land()  # counted by the fleet model now: the hold queue may judge again
        response: aiohttp.ClientResponse | None = None
        began = perf_counter()
        reached = True  # the request may be running on the server (no connection refused it)
        answered = False  # the server is done with it (it answered, an error or in full)
        try:
            if remaining_s <= 0:
                reached = False
                raise TimeoutError()
            # aiohttp's own total timer only fires inside its reads; this one also ends a relay
            # blocked on a client that stopped reading.
            async with asyncio.timeout(remaining_s):
                response = await self.upstream.post(
                    instance.url + path, out.items(), body, remaining_s, first_byte_limited=exchange.asked_stream
                )
                hooks.upstream_headers(status=response.status, headers=response.headers)
                unusable = unusable_answer(response)
                if unusable is not None:
                    code, what = unusable
                    attempt.failed(code)
                    hooks.attempt_failed(error=code, retryable=True)
                    return ProxyError(502, f"upstream {instance.pool} server {what}", code=code, retryable=True)
                if response.status in (401, 403) and not (self.clients_keys_upstream and instance.api_key is None):
                    # The credentials it refused are the proxy's (the pool's key, or none with the
                    # client's stopped here), not the client's: a 401 would tell the client its own
                    # key is wrong, and its SDK would not retry.
                    attempt.failed("upstream_auth", refused=True)
                    hooks.attempt_failed(error="upstream_auth", retryable=True)
                    return ProxyError(
                        502,
                        f"upstream {instance.pool} server refused the proxy's credentials (HTTP {response.status}); "
                        f"check SPECROUTE_{instance.pool.upper()}_API_KEY",
                        code="upstream_auth",
                        retryable=True,
                    )
                if response.status >= 400:
                    return await self.upstream_error(exchange, response, attempt)
                if response.status >= 300:
                    # Never followed (it would replay the request elsewhere) nor passed on (its
                    # location is an internal address): a server that redirects is misconfigured.
                    attempt.failed("upstream_redirect")
                    hooks.attempt_failed(error="upstream_redirect", retryable=True)
                    return ProxyError(
                        502,
                        f"upstream {instance.pool} server answered a redirect ({response.status})",
                        code="upstream_redirect",
                        retryable=True,
                    )
                first = await response.content.readany()
                if response.content_type == "text/event-stream":
                    first = await self.first_event(response, first, exchange.dialect.started)
                    if exchange.dialect is scan.CHAT and not scan.first_data_line_ended(first):
                        first = await self.first_line_whole(response, first)
                    refusal = scan.leading_error_event(first) if exchange.dialect is scan.CHAT else None
                    if refusal is not None:
                        answered = True
                        return self.refused_in_band(exchange, attempt, refusal)
                if exchange.keeps_id and response.status == 200:
                    created = scan.response_id(first)
                    if created is not None:
                        self.responses.record(created, instance)
                exchange.waited_s += perf_counter() - began
                began = 0.0
                attempt.first_byte()
                await self.relay(exchange, response, attempt, first)
                return None
        except UPSTREAM_ERRORS as exc:
            kind = classify(exc, attempt.started)
            if kind == CONNECT or isinstance(exc, ClosedThenGone):
                reached = False
                self.router.unreachable(instance)
            attempt.failed(kind)
            hooks.attempt_failed(error=kind, retryable=kind in RETRYABLE and not exchange.started)
            if exchange.started:
                await self.end_with_error(exchange, kind)
                return None
            if kind in RETRYABLE:
                return ProxyError(502, f"upstream {instance.pool} server failed ({kind})", code=kind, retryable=True)
            return ProxyError(504, f"upstream {instance.pool} server timed out ({kind})", code=kind, retryable=False)
        except asyncio.CancelledError:
            why = attempt.abandoned
            if why is None or exchange.client_gone:
                raise  # the client left, or the proxy is stopping
            # Cancelled by Router.abandon_silent or Router.check_progress: its server left it silent.
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            attempt.failed(why)
            hooks.attempt_failed(error=why, retryable=not exchange.started)
            if exchange.started:
                await self.end_with_error(exchange, why)
                return None
            what = {NO_PROGRESS: "made no progress", HUNG_RANK: "left it on a hung data-parallel rank"}.get(
                why, "stopped answering"
            )
            return ProxyError(502, f"upstream {instance.pool} server {what} ({why})", code=why, retryable=True)
        finally:
            # Waiting on the upstream until it answered, failed or this task was cancelled (the
            # client left, the drain ended) is not the proxy's overhead.
            if began:
                exchange.waited_s += perf_counter() - began
            attempt.finished()  # no-op when the attempt already failed
            if response is not None:
                answered = answered or response.status >= 300 or response.content.at_eof()
                if response.content.at_eof():
                    response.release()  # fully read: the connection goes back to the pool
                else:
                    response.close()  # unread bytes: drop the connection, which ends the upstream request
            if rid is not None and reached and not answered:
                # Abandoned (its client left, a timeout, a drain): SGLang would hold its slot until it
                # next checks the connection.
                self.aborts.abort(instance, rid, out.get("authorization"))

    async def first_line_whole(self, response: aiohttp.ClientResponse, first: bytes) -> bytes:
        """A chat stream's first bytes, read on until its first data line has ended (within the
        first-token timeout): a refusal in its first event (`refused_in_band`) split across
        reads is judged whole, not passed on as a 200 or read as a truncated status."""
        buffered = bytearray(first)
        deadline = perf_counter() + self.settings.first_token_timeout_s
        while not scan.first_data_line_ended(bytes(buffered)) and len(buffered) <= MAX_EVENT_BYTES:
            # (Past MAX_EVENT_BYTES the relay cuts the event off: `upstream_event_too_large`.)
            more = await read_before(response, deadline, 0, "no whole first event")
            if not more:
                break  # the stream ended: what came goes on as it is
            buffered += more
        return bytes(buffered)

    async def first_event(
        self, response: aiohttp.ClientResponse, first: bytes, started: Callable[[bytes], bool]
    ) -> bytes:
        """A stream's first bytes, read on until they hold its first token (`started`: a chat's
        first data event; a Responses stream's first delta, past the events its server sends
        before generating): comments and blank lines ahead of it (keep-alives) are no first
        token, which must still come within the first-token timeout (an upstream sending
        `: keep-alive` every half second and never data held a request for the whole total
        timeout)."""
        if started(first):
            return first  # the common case: the first read holds the first token
        buffered = bytearray(first)
        searched = 0
        events = first.count(b"\ndata:")
        deadline = perf_counter() + self.settings.first_token_timeout_s
        # Only the bytes new since the last look, and a marker's length before them, are looked at
        # (from a line break: the stream's start is one). Past PREAMBLE_EVENTS data events the
        # stream has started whatever they are.
        while first and events <= scan.PREAMBLE_EVENTS:
            look = buffered[searched - MARKER_BYTES :] if searched > MARKER_BYTES else b"\n" + buffered
            if started(bytes(look)):
                break
            searched = len(buffered)
            first = await read_before(response, deadline, searched, "no data event")
            buffered += first
            # From a marker's length before the new bytes: one split across reads is counted once.
            events += buffered[max(searched - 5, 0) :].count(b"\ndata:")
        return bytes(buffered)

    def refused_in_band(self, exchange: Exchange, attempt: Attempt, event: bytes) -> ProxyError:
        """A stream whose first event is an error (`event`, its JSON): SGLang's answer, its 200
        sent, to a request its scheduler aborted with a status before any output (a full queue
        or a queue wait past its timeout: 503; 400 for one it found invalid). Nothing reached the
        client yet: it is answered as that status would have been, a 5xx tried on another server
        (the request never ran there), a 4xx the client's as an HTTP error, not a 200 whose
        stream the SDK raises on."""
        status = scan.error_event_status(b"data: " + event) or 502
        if status >= 500:
            attempt.failed(f"status_{status}", refused=True)
            exchange.hooks.attempt_failed(error=f"status_{status}", retryable=True)
        else:
            attempt.refused()
            exchange.hooks.attempt_finished(status=status)
        return ProxyError(
            status,
            "upstream error",
            code=str(status),
            retryable=status >= 500 or None,
            payload=normalise_upstream_error(status, event, exchange.request_id),
        )

    async def upstream_error(
        self, exchange: Exchange, response: aiohttp.ClientResponse, attempt: Attempt
    ) -> ProxyError:
        """An upstream 4xx/5xx: 5xx may go to another instance; 4xx is the client's to see
        (with the upstream's retry-after, which the SDKs honour)."""
        retryable = response.status >= 500
        attempt.reading_since = None  # answered: not a silence to end while its body is read
        if response.status == 500:  # before any await: its connection may be in the pool already
            not_reused(response)
        if not retryable:
            # Before any await: a client leaving while the body is read must not make the
            # refusal count as a request the server ran (its claims on caches would stand).
            attempt.refused()
        raw = await read_up_to(response.content, ERROR_BODY_LIMIT)
        payload = normalise_upstream_error(response.status, raw, exchange.request_id)
        if retryable:
            attempt.failed(f"status_{response.status}")
            exchange.hooks.attempt_failed(error=f"status_{response.status}", retryable=True)
        elif exchange.hide_usage and refuses_stream_options(response.status, payload):
            # Sent again without the field (`forward`): an attempt that failed, its span kept.
            exchange.hooks.attempt_failed(error="stream_options_refused", retryable=True)
        else:
            exchange.hooks.attempt_finished(status=response.status)
        relayed = [
            (name.lower(), value)
            for name, value in response.raw_headers
            if (name.lower() in RETRY_AFTER or name.lower().startswith(RATE_LIMIT_PREFIX)) and valid_header_value(value)
        ]
        # A 4xx is the client's to act on: the SDK retries a 429 (after its retry-after), not a 400.
        return ProxyError(
            response.status,
            "upstream error",
            code=str(response.status),
            retryable=retryable or None,
            payload=payload,
            headers=relayed,
        )

    async def relay(self, exchange: Exchange, response: aiohttp.ClientResponse, attempt: Attempt, first: bytes) -> None:
        """Send the response on as it arrives; counts SSE events, never parses chunks."""
        hooks = exchange.hooks
        send = exchange.send
        content = response.content
        is_stream = exchange.streaming = response.content_type == "text/event-stream"
        per_chunk = is_stream and hooks.wants_chunks
        hide_usage = is_stream and exchange.hide_usage
        dialect = exchange.dialect
        # The tail's usage also feeds the fleet model (output length; acceptance on spec).
        tail = dialect.tail_for(exchange.body_bytes)
        await exchange.start(response.status, relayed_headers(response, is_stream))
        hooks.first_chunk(first)
        expect_chunk_gaps(response, self.settings.chunk_timeout_s)
        chunk = first
        # The client only ever gets whole events: an event split across reads waits for its end,
        # so an upstream that fails mid-event leaves no half event before ours.
        splitter = scan.EventSplitter(MAX_EVENT_BYTES) if is_stream else None
        heard = perf_counter()
        while chunk:
            if is_stream:
                # Comments and blank lines keep the socket busy, not the stream: the chunk timeout
                # is held between data (or a data event still arriving), not between reads, and
                # only data is the server's progress (Router.check_progress).
                now = perf_counter()
                if scan.EVENT in chunk or (splitter is not None and splitter.pending):
                    heard = now
                    attempt.heard()
                elif now - heard > self.settings.chunk_timeout_s:
                    raise aiohttp.SocketTimeoutError("no data event within the chunk timeout")
            else:
                attempt.heard()
            if splitter is not None:
                try:
                    chunk = splitter.feed(chunk)
                except scan.EventTooLarge:
                    attempt.failed("upstream_event_too_large")
                    hooks.attempt_failed(error="upstream_event_too_large", retryable=False)
                    await self.end_with_error(exchange, "upstream_event_too_large")
                    return
            if chunk:
                # Only a stream's usage event is the proxy's to keep: an upstream that answered a
                # stream with JSON (or anything else) goes on whole (its content-length says so).
                passed = scan.without_usage_events(chunk) if hide_usage else chunk
                if passed:
                    sending = perf_counter()
                    await send({"type": "http.response.body", "body": passed, "more_body": True})
                    exchange.waited_s += perf_counter() - sending  # a slow reader's back-pressure
                if is_stream:
                    events = dialect.count(chunk)
                    exchange.events += events
                    attempt.chunk(events)
                    if per_chunk:
                        hooks.chunk(size=len(chunk), events=events, tokens=events)
                    if dialect.ended(chunk):
                        # The client has the whole stream: the openai SDK closes its connection
                        # at [DONE] without waiting for the body's end, which must not cancel
                        # the request before the upstream's end and the usage tail are read.
                        exchange.done = True
                tail.add(chunk)
            began = perf_counter()
            if is_stream:  # waiting on the server: a silence the router may end (Router.abandon)
                attempt.reading_since = monotonic()
            try:
                chunk = await content.readany()
            finally:  # cancelled while waiting (client gone, drain over): still upstream time
                attempt.reading_since = None
                exchange.waited_s += perf_counter() - began
        exchange.done = True
        # The upstream ended cleanly after an unterminated event: it goes on as it came.
        partial = splitter.rest() if splitter is not None else b""
        passed = scan.without_usage_events(partial) if hide_usage else partial
        await send({"type": "http.response.body", "body": passed, "more_body": False})
        if partial:
            tail.add(partial)
        # A chat's usage, spec details and last finish reason sit in the last few hundred bytes;
        # 4 KB keeps the scan ~12 us (16 KB: ~54 us). Earlier choices' reasons of a long n>1 JSON
        # answer can fall outside it. A Responses answer ends with the whole response object.
        exchange.summary = dialect.summary_of(tail)
        if exchange.summary.error_status is not None:
            # The server ended it with an in-band error (SGLang: an abort with a status, a running
            # request's timeout say): relayed as it came, but no success.
            exchange.error_type = "upstream_error_event"
            attempt.finished(exchange.summary)
            hooks.attempt_failed(error="upstream_error_event", retryable=False)
            return
        attempt.finished(exchange.summary, complete=True)
        hooks.attempt_finished(status=response.status)

    async def end_with_error(self, exchange: Exchange, kind: str) -> None:
        """The upstream failed after bytes reached the client: say so in-band, never end clean."""
        exchange.error_type = kind
        if exchange.streaming:
            message = f"upstream failed mid-stream ({kind}); the response is incomplete"
            exchange.done = True
            try:
                # Bounded: a client that stopped reading would block this send for ever.
                async with asyncio.timeout(ERROR_EVENT_SEND_S):
                    await exchange.send(
                        {
                            "type": "http.response.body",
                            "body": exchange.dialect.error_event(message, "server_error", kind),
                            "more_body": False,
                        }
                    )
                return
            except TimeoutError:
                pass
        raise ResponseAborted(kind)
