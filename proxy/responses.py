"""Stored responses of the Responses API: which server holds each, and reaching it.

SGLang (`--enable-response-store`) and vLLM keep a stored response in the memory of the server
that made it: a follow-up naming it (`previous_response_id`), `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` only work there. The proxy notes the server of every response
it sees created (a bounded map, the oldest forgotten first) and, for an id it does not know (the
proxy restarted, another replica relayed the creation, the map forgot it), asks every server
with `GET /v1/responses/{id}`: the one answering 200 holds it.

What a client can make the proxy do here is bounded: at most LOOKUPS requests about stored
responses run at once on each server (the rest wait their turn, within LOOKUP_TIMEOUT_S), an id
that is no server's (not `resp_...`) is answered by the proxy, an id found nowhere is not asked
about again for MISS_S, a server that refused every lookup (SGLang without its store answers 400
"Response store is disabled"; `refuses_lookups`) is not asked again for REFUSED_S (its refusal is
answered for it), and one that could not be reached, or did not answer in time, is not asked for
DOWN_S.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import cachetools

from proxy import scan
from proxy.errors import error_body, normalise_upstream_error
from proxy.hooks import Telemetry
from proxy.pools import Instance
from proxy.response_ids import ResponseIds
from proxy.routing import Router
from proxy.upstream import UPSTREAM_ERRORS, Upstream, read_up_to

KNOWN_RESPONSES = 100_000
"""Response ids whose server the proxy remembers (about 200 bytes each: 20 MB at most)."""
LOOKUP_TIMEOUT_S = 5.0
"""How long a server may take to answer about a stored response."""
LOOKUPS = 4
"""Requests about stored responses (lookups, GETs, cancels) running at once on one server."""
DOWN_S = 5.0
"""How long a server that could not be reached about a stored response is not asked again."""
MAX_STORED_BYTES = 16 * 1024 * 1024
"""The largest stored response relayed (it holds its whole output)."""
MISS_S = 2.0
"""How long an id no server holds is answered as such without asking again."""
REFUSED_S = 60.0
"""How long a server that refused a lookup (no store) is answered for without being asked."""
RESPONSE_ID = re.compile(scan.RESPONSE_ID)
"""What a response id may be to be asked for: one a server makes (SGLang and vLLM refuse an id
not opening with `resp_`); it goes into the servers' URL paths."""
LOOKUP_ERRORS: tuple[type[BaseException], ...] = (*UPSTREAM_ERRORS, ValueError)
"""A server that could not be asked: unreachable, too slow, or its answer past the bound."""
JSON = "application/json"

HeadersFor = Callable[[Instance], dict[str, str]]
"""The headers a request to `instance` carries (the client's, the pool's key, the request id)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """A server's answer to a request about a stored response."""

    status: int
    body: bytes
    content_type: str
    instance: Instance | None
    """Who answered (None: the proxy itself, for no server or several)."""


def refuses_lookups(answer: Answer, response_id: str) -> bool:
    """Whether a server's refusal is of every lookup (no store: SGLang's 400 "Response store is
    disabled"; no Responses API: 405, 501), not of this one request. Kept for REFUSED_S and
    answered for the server, a refusal of one request (a 400 quoting its id, or a front's 400
    for its headers) turned every client's lookups away for a minute, with what it quoted in
    their errors: any client could send one (a review's probe)."""
    if answer.status in (405, 501):
        return True
    body = answer.body.lower()  # the id too: a client's id could carry the phrase
    return answer.status == 400 and b"store is disabled" in body and response_id.lower().encode() not in body


def not_found(response_id: str) -> Answer:
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    message = f"No response found with id '{shown}' on any server of the fleet"
    return Answer(404, error_body(message, "invalid_request_error", "response_not_found", "response_id"), JSON, None)


def proxy_error(status: int, message: str, code: str) -> Answer:
    return Answer(status, error_body(message, "server_error", code), JSON, None)


class ResponseOwners:
    """Which server holds each stored response, learned as they are created, asked on a miss."""

    def __init__(
        self,
        router: Router,
        upstream: Upstream,
        clients_keys_upstream: bool,
        telemetry: Telemetry | None = None,
        ids: ResponseIds | None = None,
    ) -> None:
        self.router = router
        self.ids = ids or ResponseIds()
        """The ids bound to clients' keys (with proxy keys on)."""
        self.upstream = upstream
        self.telemetry = telemetry or Telemetry()
        self.clients_keys_upstream = clients_keys_upstream
        """Whether a client's own Authorization goes upstream (no proxy keys): an upstream 401 is
        then the client's to see; otherwise the proxy's credentials were refused (a 502)."""
        self.by_id: cachetools.LRUCache[str, str] = cachetools.LRUCache(maxsize=KNOWN_RESPONSES)
        """Response id -> the URL of the server that made it."""
        self.missed: cachetools.TTLCache[str, bool] = cachetools.TTLCache(maxsize=10_000, ttl=MISS_S)
        self.refused: dict[str, tuple[float, Answer]] = {}
        """Server URL -> (until when, its refusal of a lookup)."""
        self.down: dict[str, float] = {}
        """Server URL -> until when it is not asked (it could not be reached)."""
        self.turns: dict[str, asyncio.Semaphore] = {}
        """Server URL -> its turns (LOOKUPS at once)."""

    def record(self, response_id: str, instance: Instance) -> None:
        self.by_id[response_id] = instance.url
        self.missed.pop(response_id, None)

    def known(self, response_id: str) -> Instance | None:
        url = self.by_id.get(response_id)
        return self.router.by_url.get(url) if url is not None else None

    async def owner(self, response_id: str, headers_for: HeadersFor, request_id: str) -> Answer:
        """Who holds `response_id`: the server that made it, else the one that says so (status
        200, `instance` it); else why none was found (`ask_all`)."""
        known = self.known(response_id)
        if known is not None:
            return Answer(200, b"", JSON, known)
        return await self.ask_all(response_id, headers_for, request_id, with_body=False)

    async def get(
        self, response_id: str, headers_for: HeadersFor, request_id: str, client: bytes | None, query: str = ""
    ) -> Answer:
        """`GET /v1/responses/{id}` of the server holding it (every server asked on a miss), for
        the client whose key's digest is `client` (another key's response is not found)."""
        if RESPONSE_ID.fullmatch(response_id) is None or not self.ids.belongs(response_id, client):
            return not_found(response_id)
        path = f"/v1/responses/{response_id}" + (f"?{query}" if query else "")
        known = self.known(response_id)
        if known is not None:
            answer = await self.send(known, "GET", path, headers_for(known), request_id)
            if answer.status != 404:
                return answer
            self.by_id.pop(response_id, None)  # the server forgot it (restarted, evicted)
        return await self.ask_all(response_id, headers_for, request_id, path=path)

    async def cancel(
        self, response_id: str, headers_for: HeadersFor, request_id: str, client: bytes | None, query: str = ""
    ) -> Answer:
        """`POST /v1/responses/{id}/cancel` on the server holding it, for its owner (as `get`)."""
        if RESPONSE_ID.fullmatch(response_id) is None or not self.ids.belongs(response_id, client):
            return not_found(response_id)
        known = self.known(response_id)
        if known is None:
            found = await self.ask_all(response_id, headers_for, request_id, with_body=False)
            if found.status != 200 or found.instance is None:
                return found
            known = found.instance
        path = f"/v1/responses/{response_id}/cancel" + (f"?{query}" if query else "")
        return await self.send(known, "POST", path, headers_for(known), request_id, b"")

    async def ask_all(
        self,
        response_id: str,
        headers_for: HeadersFor,
        request_id: str,
        path: str | None = None,
        with_body: bool = True,
    ) -> Answer:
        """Every server asked at once (those out of rotation too: they still hold what they
        made); the holder's answer, and it is noted. Else a refusal a server gave (a server
        without a store says why), else a 502 when some server could not be asked, else 404."""
        if RESPONSE_ID.fullmatch(response_id) is None or response_id in self.missed:
            return not_found(response_id)
        path = path or f"/v1/responses/{response_id}"
        now = time.monotonic()
        asked: list[Instance] = []
        refusals: list[Answer] = []
        unasked = 0
        for instance in self.router.instances():
            memo = self.refused.get(instance.url)
            if memo is not None and memo[0] > now:
                refusals.append(memo[1])
            elif not instance.signals.healthy or self.down.get(instance.url, 0.0) > now:
                unasked += 1  # unreachable: it may hold the response (an ejected one is asked)
            else:
                asked.append(instance)
        answers = await asyncio.gather(
            *(self.send(i, "GET", path, headers_for(i), request_id, with_body=with_body) for i in asked)
        )
        holders = [a for a in answers if a.status == 200 and a.instance is not None]
        if len(holders) > 1:  # ids are random: only a client choosing one (SGLang's request_id) makes this
            names = ", ".join(a.instance.name for a in holders if a.instance is not None)
            message = f"response '{response_id}' is held by several servers ({names}); it cannot be told which is meant"
            return Answer(
                409, error_body(message, "invalid_request_error", "response_id_ambiguous", "response_id"), JSON, None
            )
        if holders:
            assert holders[0].instance is not None
            self.record(response_id, holders[0].instance)
            return holders[0]
        for answer in answers:
            if answer.instance is not None and refuses_lookups(answer, response_id):
                self.refused[answer.instance.url] = (now + REFUSED_S, answer)  # not asked for a while
        refusals += [a for a in answers if a.status not in (404, 502) and a.status < 500]
        if refusals:
            return refusals[0]
        unasked += sum(a.status >= 500 for a in answers)
        if unasked:  # it may be on a server that could not answer: not "not found"
            message = f"response '{response_id}' is on none of the servers that answered; {unasked} could not be asked"
            return proxy_error(502, message, "response_owner_unreachable")
        self.missed[response_id] = True
        return not_found(response_id)

    async def send(
        self,
        instance: Instance,
        method: str,
        path: str,
        headers: dict[str, str],
        request_id: str,
        body: bytes = b"",
        with_body: bool = True,
    ) -> Answer:
        """One request to one server, its answer read whole (bounded; only its status when not
        `with_body` and it succeeded); a failure to reach it, or an answer past the bound, is a
        502 of the proxy's."""
        turns = self.turns.get(instance.url)
        if turns is None:
            turns = self.turns[instance.url] = asyncio.Semaphore(LOOKUPS)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOOKUP_TIMEOUT_S
        try:
            # The wait for a turn counts: a server that holds its turns does not hold a client
            # longer. But time lost in the proxy's queue (other lookups, a client's flood of
            # them) is not the server's silence: it is marked down only for a lookup that had at
            # least half the time once its turn came.
            async with asyncio.timeout_at(deadline):
                await turns.acquire()
        except TimeoutError:
            return lookups_busy(instance)
        fair = deadline - loop.time() >= LOOKUP_TIMEOUT_S / 2
        try:
            async with asyncio.timeout_at(deadline):
                self.telemetry.stored_response_asked()
                async with self.upstream.session.request(
                    method,
                    instance.url + path,
                    headers=list(headers.items()),
                    data=body if method == "POST" else None,
                    allow_redirects=False,
                ) as response:
                    status = response.status
                    content_type = response.headers.get("content-type", JSON)
                    if status == 200 and not with_body:
                        return Answer(status, b"", content_type, instance)  # the connection is closed unread
                    raw = await read_up_to(response.content, MAX_STORED_BYTES + 1)
                    if len(raw) > MAX_STORED_BYTES:
                        raise ValueError(f"stored response over {MAX_STORED_BYTES} bytes")
        except LOOKUP_ERRORS as exc:
            if isinstance(exc, TimeoutError) and not fair:
                return lookups_busy(instance)
            if not isinstance(exc, ValueError):
                self.down[instance.url] = time.monotonic() + DOWN_S
            message = f"upstream {instance.pool} server could not be asked about the response ({type(exc).__name__})"
            return Answer(502, error_body(message, "server_error", "upstream_unreachable"), JSON, instance)
        finally:
            turns.release()
        self.down.pop(instance.url, None)
        if status in (401, 403) and not (self.clients_keys_upstream and instance.api_key is None):
            message = (
                f"upstream {instance.pool} server refused the proxy's credentials (HTTP {status}); "
                f"check SPECROUTE_{instance.pool.upper()}_API_KEY"
            )
            return Answer(502, error_body(message, "server_error", "upstream_auth"), JSON, instance)
        if status >= 400:
            raw = normalise_upstream_error(status, raw, request_id)
            content_type = JSON
        return Answer(status, raw, content_type, instance)


def lookups_busy(instance: Instance) -> Answer:
    """A lookup that lost its time in the proxy's queue for `instance`'s turns."""
    message = f"upstream {instance.pool} server has too many questions about stored responses waiting"
    return Answer(503, error_body(message, "server_error", "lookups_busy"), JSON, instance)
