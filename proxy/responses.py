"""Stored responses of the Responses API: which server holds each, and reaching it.

SGLang (`--enable-response-store`) and vLLM keep a stored response in the memory of the server
that made it: a follow-up naming it (`previous_response_id`), `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` only work there. The proxy notes the server of every response
it sees created (a bounded map, the oldest forgotten first) and, for an id it does not know (the
proxy restarted, another replica relayed the creation, the map forgot it), asks every server
with `GET /v1/responses/{id}`: the one answering 200 holds it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

import cachetools

from proxy.errors import error_body, normalise_upstream_error
from proxy.pools import Instance
from proxy.routing import Router
from proxy.upstream import UPSTREAM_ERRORS, Upstream

KNOWN_RESPONSES = 100_000
"""Response ids whose server the proxy remembers (about 200 bytes each: 20 MB at most)."""
LOOKUP_TIMEOUT_S = 5.0
"""How long a server may take to answer whether it holds a response."""
MAX_STORED_BYTES = 16 * 1024 * 1024
"""The largest stored response relayed (a response holds its whole output)."""
RESPONSE_ID = re.compile(r"[A-Za-z0-9_\-]{1,200}")
"""What a response id may be to be asked for: it goes into the servers' URL paths."""

LOOKUP_ERRORS: tuple[type[BaseException], ...] = (*UPSTREAM_ERRORS, ValueError)
"""A server that could not be asked: unreachable, too slow, or its answer past the bound."""

HeadersFor = Callable[[Instance], dict[str, str]]
"""The headers a request to `instance` carries (the client's, the pool's key, the request id)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """A server's answer to a request about a stored response."""

    status: int
    body: bytes
    content_type: str
    instance: Instance | None
    """Who answered (None: the proxy itself, when no server could be asked)."""


def not_found(response_id: str) -> Answer:
    message = f"No response found with id '{response_id}' on any server of the fleet"
    return Answer(
        404, error_body(message, "invalid_request_error", "response_not_found", "response_id"), "application/json", None
    )


class ResponseOwners:
    """Which server holds each stored response, learned as they are created, asked on a miss."""

    def __init__(self, router: Router, upstream: Upstream, size: int = KNOWN_RESPONSES) -> None:
        self.router = router
        self.upstream = upstream
        self.by_id: cachetools.LRUCache[str, str] = cachetools.LRUCache(maxsize=size)
        """Response id -> the URL of the server that made it."""

    def record(self, response_id: str, instance: Instance) -> None:
        self.by_id[response_id] = instance.url

    def known(self, response_id: str) -> Instance | None:
        url = self.by_id.get(response_id)
        return self.router.by_url.get(url) if url is not None else None

    async def owner(self, response_id: str, headers_for: HeadersFor, request_id: str) -> Instance | None:
        """The server holding `response_id`: the one that made it, else the one that says so."""
        known = self.known(response_id)
        if known is not None:
            return known
        answer = await self.ask_all(response_id, headers_for, request_id)
        return answer.instance if answer.status == 200 else None

    async def get(self, response_id: str, headers_for: HeadersFor, request_id: str) -> Answer:
        """`GET /v1/responses/{id}` of the server holding it (every server asked on a miss)."""
        if RESPONSE_ID.fullmatch(response_id) is None:
            return not_found(response_id)
        known = self.known(response_id)
        if known is not None:
            answer = await self.send(known, "GET", f"/v1/responses/{response_id}", headers_for(known), request_id)
            if answer.status != 404:
                return answer
            self.by_id.pop(response_id, None)  # the server forgot it (restarted, evicted)
        return await self.ask_all(response_id, headers_for, request_id)

    async def cancel(self, response_id: str, headers_for: HeadersFor, request_id: str, body: bytes) -> Answer:
        """`POST /v1/responses/{id}/cancel` on the server holding it."""
        if RESPONSE_ID.fullmatch(response_id) is None:
            return not_found(response_id)
        owner = await self.owner(response_id, headers_for, request_id)
        if owner is None:
            return not_found(response_id)
        path = f"/v1/responses/{response_id}/cancel"
        return await self.send(owner, "POST", path, headers_for(owner), request_id, body)

    async def ask_all(self, response_id: str, headers_for: HeadersFor, request_id: str) -> Answer:
        """Every server asked at once; the holder's answer (and it is noted), else the first
        refusal a server gave (a server without a store says why), else the proxy's 404."""
        if RESPONSE_ID.fullmatch(response_id) is None:
            return not_found(response_id)
        instances = [i for i in self.router.instances() if i.healthy]
        path = f"/v1/responses/{response_id}"
        answers = await asyncio.gather(*(self.send(i, "GET", path, headers_for(i), request_id) for i in instances))
        for answer in answers:
            if answer.status == 200 and answer.instance is not None:
                self.record(response_id, answer.instance)
                return answer
        refusals = [a for a in answers if a.status != 404 and a.status < 500]
        if refusals:
            return refusals[0]
        unasked = sum(a.status >= 500 for a in answers)
        if unasked:  # it may be on a server that could not answer: not "not found"
            message = f"response '{response_id}' is on none of the servers that answered; {unasked} could not be asked"
            return Answer(
                502, error_body(message, "server_error", "response_owner_unreachable"), "application/json", None
            )
        return not_found(response_id)

    async def send(
        self, instance: Instance, method: str, path: str, headers: dict[str, str], request_id: str, body: bytes = b""
    ) -> Answer:
        """One request to one server, its answer read whole (bounded); a failure to reach it or
        an answer past the bound is a 502 of the proxy's."""
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                async with self.upstream.session.request(
                    method,
                    instance.url + path,
                    headers=list(headers.items()),
                    data=body if method == "POST" else None,
                    allow_redirects=False,
                ) as response:
                    raw = await response.content.read(MAX_STORED_BYTES + 1)
                    if len(raw) > MAX_STORED_BYTES:
                        raise ValueError("stored response too large")
                    status = response.status
                    content_type = response.headers.get("content-type", "application/json")
        except LOOKUP_ERRORS as exc:
            message = f"upstream {instance.pool} server could not be asked for the response ({type(exc).__name__})"
            return Answer(
                502, error_body(message, "server_error", "upstream_unreachable"), "application/json", instance
            )
        if status >= 400:
            raw = normalise_upstream_error(status, raw, request_id)
            content_type = "application/json"
        return Answer(status, raw, content_type, instance)
