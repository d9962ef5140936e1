"""Live load polling: one poller per instance fetches and hands what it reads to the fleet model.

Per instance, once it answers: its kind's description endpoint (SGLang's GET /server_info: which
instances speculate, max_running_requests, the draft settings), then the first load endpoint it
answers, in the order proxy/backends lists them (GET /v1/loads, GET /metrics, GET /get_load);
the answer tells its kind (proxy/backends/). Then every SPECROUTE_POLL_INTERVAL_MS one load
read. A server that answers no load endpoint is counted by the proxy's own in-flight requests
only (and checked for life on GET /health).

Health: an instance the proxy cannot connect to (at start, on UNREACHABLE_AFTER polls in a row,
or on a request's connect error) is unhealthy, and skipped, until a poll reaches it again; one
not reached yet is learned again every RELEARN_EVERY polls (GPU servers often start minutes after
the proxy). One learned again after polls could not reach it (a restart) is reported
(`on_back`): the proxy's outlier record of the server that went away no longer applies. A load endpoint that keeps answering with an error status sends the instance back to
be learned (the server behind the URL changed). Each instance is polled on its own loop, so a
dead or slow host does not delay the readings of the others.

All routing arithmetic lives beneath (fleet/): this module only does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpx

from fleet.model import FleetModel
from fleet.readings import ServerDescription
from proxy import backends
from proxy.backends import Backend, OpenAICompatible
from proxy.backends.base import RANK_HEADER
from proxy.pools import Instance

log = logging.getLogger("specroute.poller")

UNREACHABLE_AFTER = 3
"""Failed connections in a row after which a polled instance is marked unhealthy."""
RELEARN_EVERY = 10
"""Polls between two tries to learn an instance not reached yet (1 s at the default interval)."""


def found_again_within_s(interval_s: float) -> int:
    """Whole seconds (at least 1) within which the polls, `interval_s` apart, try again every
    server they cannot reach (one not reached is learned again every RELEARN_EVERY polls): the
    `retry-after` of a 503 `no_upstream`, sooner than which asking again finds nothing new."""
    return max(1, math.ceil(RELEARN_EVERY * interval_s))


REPROBE_AFTER = 10
"""Error answers in a row from an instance's load endpoint after which it is learned again."""
LIVENESS_EVERY = 5
"""Polls between two GET /health of an instance that answers no load endpoint."""
# A connection that cannot be made (refused, unresolvable, or not accepted in time): the host
# is down, not merely slow (a slow answer only ages the reading).
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# An answer that does not read as its kind's (the reading then ages and turns stale).
READ_ERRORS = (httpx.HTTPError, ValueError, KeyError, TypeError, ArithmeticError)
MAX_ANSWER_BYTES = 4 * 1024 * 1024
"""The most a load or description answer may hold (decoded): SGLang's /metrics with every
histogram is tens of kilobytes; a 60 MB answer took the proxy from 85 to 743 MB and held its loop
for 0.46 s."""


class AnswerTooLarge(httpx.HTTPError):
    """An upstream's answer to a poll ran past MAX_ANSWER_BYTES (read no further)."""


Get = Callable[[str, str], Awaitable[httpx.Response]]
"""GET (instance url, path) with the instance's credentials."""


class InstancePoller:
    """One instance: learn it, poll its load or check it is alive, and tell the fleet model."""

    def __init__(
        self,
        instance: Instance,
        fleet: FleetModel,
        get: Get,
        clock: Callable[[], float],
        on_back: Callable[[str], None] | None = None,
        on_unresponsive: Callable[[str], None] | None = None,
        unresponsive_after_s: float = 0.0,
        on_polled: Callable[[str], None] | None = None,
    ) -> None:
        self.instance = instance
        self.url = instance.url
        self.fleet = fleet
        self.get = get
        self.clock = clock
        self.backend: Backend | None = None
        """Its kind, polling its load endpoint (None: not reached yet)."""
        self.info: dict[str, Any] | None = None
        """What it said of itself (for the state endpoint)."""
        self.error: str | None = None
        """The last poll's failure, cleared by a good poll."""
        self.polls = 0
        self.failures = 0
        """Consecutive failed polls (connection failures, or error answers)."""
        self.on_back = on_back
        """Told the URL of an instance learned again after it could not be reached (a restart):
        what the proxy learned of the server that went away, its outlier record, is void."""
        self.lost = False
        """It was reached, then could not be (until it is learned again)."""
        self.on_unresponsive = on_unresponsive
        """Told the URL, each poll, while its reading is older than `unresponsive_after_s` and
        another instance's is fresh (`FleetModel.unresponsive`): it accepts connections but has
        stopped answering."""
        self.unresponsive_after_s = unresponsive_after_s
        self.on_polled = on_polled
        """Told the URL after each poll it answered (each tick while its liveness checks pass, for
        a server with no load endpoint): `Router.check_progress`, a server that answers while its
        engine is stuck."""
        self.said_unreachable = False
        """A warning said it cannot be reached, and no line since that it answers."""
        self.said_unmarked = False
        """A line said its readings carry no engine mark (once per learning)."""
        self.model: str | None = None
        """The model it serves (its /v1/models), once a rank probe asked (vLLM serves no other)."""

    @property
    def reached(self) -> bool:
        return self.backend is not None

    @property
    def probe(self) -> str | None:
        """The load endpoint it is polled on (None: none, local counts only)."""
        return self.backend.load_path if self.backend is not None else None

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.tick()
            except Exception:  # a bug in one poll must not stop polling (readings would go stale)
                log.exception("load poll of %s failed", self.url)

    async def tick(self) -> None:
        """One poll period: learn the instance, poll its load, or check it is alive."""
        self.polls += 1
        if self.backend is None:
            if self.polls % RELEARN_EVERY == 0:
                await self.learn()
        elif self.backend.load_path is not None:
            await self.poll()
            # A pool of one with a stopped server would otherwise stay "healthy" (its connections
            # are still accepted) and keep getting requests, each given up on after seconds.
            silent = self.on_unresponsive is not None and self.fleet.unresponsive(
                self.url, self.clock(), self.unresponsive_after_s
            )
            self.fleet.set_unresponsive(self.url, silent)
            if silent and self.on_unresponsive is not None:
                self.on_unresponsive(self.url)
            elif self.on_polled is not None and self.error is None:
                self.on_polled(self.url)
        else:
            self.fleet.set_unresponsive(self.url, False)  # judged by load readings only
            if self.polls % LIVENESS_EVERY == 0:
                await self.liveness()
            if self.on_polled is not None and self.error is None and self.failures == 0:
                self.on_polled(self.url)

    # -- learning -------------------------------------------------------------------------------

    async def learn(self) -> None:
        """Its description, then the first load endpoint it answers. An instance that cannot be
        reached stays unlearned (and unhealthy) and is tried again later."""
        described = await self._describe()
        if described is None:
            return
        for path in backends.load_paths():
            try:
                response = await self.get(self.url, path)
            except CONNECT_ERRORS as exc:
                self._unreachable(f"{path}: {type(exc).__name__}")
                return
            except httpx.HTTPError as exc:
                self.error = f"{path}: {type(exc).__name__}"
                self.backend = backends.KINDS[0](backends.load_paths()[0])  # answering badly: keep the best
                self.instance.kind = self.backend.kind
                return
            if response.status_code == 200:
                backend = backends.recognise(path, response.text)
                if backend is not None:
                    self._learned(backend, described)
                    return
        self._learned(OpenAICompatible(None), described)
        self.fleet.on_unpolled(self.url)

    async def _describe(self) -> bool | None:
        """Ask the server to describe itself, at each kind's description endpoint (SGLang's
        /server_info). None: unreachable; else whether one of them described it."""
        for kind in backends.describers():
            described = await self._describe_as(kind)
            if described is not False:
                return described
        return False

    async def _describe_as(self, kind: type[Backend]) -> bool | None:
        path = kind.info_path
        assert path is not None
        name = path.lstrip("/")
        try:
            response = await self.get(self.url, path)
        except CONNECT_ERRORS as exc:
            self._unreachable(f"{name}: {type(exc).__name__}")
            return None
        except httpx.HTTPError as exc:  # it answered, slowly or badly: learn what it has
            self.error = f"{name}: {type(exc).__name__}"
            self._reached()
            return False
        self._reached()
        if response.status_code != 200:
            return False
        try:
            description, self.info = kind.describe(response.json())
        except (ValueError, TypeError, AttributeError, ArithmeticError) as exc:
            self.error = f"{name}: {type(exc).__name__}"
            return False
        self._tell(description)
        return True

    def _learned(self, backend: Backend, described: bool) -> None:
        self.backend = backend
        self.said_unmarked = False
        self.model = None
        self.fleet.set_unresponsive(self.url, False)  # learned again: judged afresh
        self.instance.kind = backend.kind
        if self.lost:
            self.lost = False
            if self.on_back is not None:
                self.on_back(self.url)
        # Learned again, the server behind the URL may be another (an upgrade): it is asked for
        # its streams' usage again.
        self.instance.refused_stream_options_at = None
        default = backend.default_description()
        if not described and default is not None:
            self.info = {"server": default.kind, "speculative": default.speculative}
            self._tell(default)

    def _tell(self, description: ServerDescription) -> None:
        if not self.fleet.on_server(self.url, description):
            log.warning(
                "%s is in the %s pool but says speculative=%s", self.url, self.instance.pool, description.speculative
            )

    # -- polling --------------------------------------------------------------------------------

    async def poll(self) -> None:
        backend = self.backend
        assert backend is not None and backend.load_path is not None
        path = backend.load_path
        at = self.clock()
        try:
            response = await self.get(self.url, path)
        except CONNECT_ERRORS as exc:
            self._failed(f"{path}: {type(exc).__name__}", connect=True)
            return
        except httpx.HTTPError as exc:  # it is up (it accepted the connection), but slow or broken
            self.error = f"{path}: {type(exc).__name__}"
            return
        self._reached()
        if response.status_code != 200:
            self._failed(f"{path}: HTTP {response.status_code}", connect=False)
            return
        try:
            reading = backend.read(response.text, at)
            counters = backend.counters_path(self.polls, self.fleet.pools[self.instance.pool].role)
            if counters is not None:
                extra = await self._optional(counters)
                if extra is not None:
                    reading = backend.with_counters(reading, extra)
            reading.check()
        except READ_ERRORS as exc:
            # The reading ages and turns stale; routing acts on that (fleet/model.py).
            self.error = f"{path}: {type(exc).__name__}"
            return
        self.failures = 0
        self.error = None
        if reading.engine_mark is None and not self.said_unmarked:
            self.said_unmarked = True
            # The no-progress rule then has only our own streams to go by (proxy/routing.py).
            log.info(
                "%s server %s: its %s answer carries no engine progress mark; a hung engine there is"
                " judged by our streams alone, after the chunk timeout",
                self.instance.pool,
                self.url,
                path,
            )
        self.fleet.on_reading(self.url, reading)

    async def _optional(self, path: str) -> str | None:
        """A secondary endpoint's answer, None if it gives none (the reading stands without it)."""
        try:
            response = await self.get(self.url, path)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def liveness(self) -> None:
        """An instance with no load endpoint: any answer on its liveness path means it is up."""
        assert self.backend is not None
        path = self.backend.liveness_path
        try:
            await self.get(self.url, path)
        except CONNECT_ERRORS as exc:
            self._failed(f"{path}: {type(exc).__name__}", connect=True)
            return
        except httpx.HTTPError as exc:
            self.error = f"{path}: {type(exc).__name__}"
            return
        self.error = None
        self.failures = 0
        self._reached()

    # -- health ---------------------------------------------------------------------------------

    def _unreachable(self, error: str) -> None:
        """No connection: unhealthy, and learned again (it may come back as anything)."""
        if not self.said_unreachable:  # once per outage: the state endpoint has every poll's error
            self.said_unreachable = True
            log.warning(
                "%s server %s cannot be reached (%s): no requests go to it until it answers",
                self.instance.pool,
                self.url,
                error,
            )
        self.error = error
        self.lost = self.lost or self.backend is not None
        self.backend = None
        self.fleet.set_health(self.url, False)

    def _reached(self) -> None:
        """The instance answered (whatever it said): it is up."""
        if self.said_unreachable:
            self.said_unreachable = False
            # "again" only for one reached before: a server down at the start is reached first now
            log.info("%s server %s answers%s", self.instance.pool, self.url, " again" if self.lost else "")
        self.fleet.set_health(self.url, True)

    def _failed(self, error: str, connect: bool) -> None:
        """A failed poll: connection failures in a row make the instance unreachable; error
        answers in a row send it back to be learned (the server behind the URL changed)."""
        self.error = error
        self.failures += 1
        if connect and self.failures >= UNREACHABLE_AFTER:
            self._unreachable(error)
        elif not connect and self.failures >= REPROBE_AFTER:
            self.failures = 0
            self.backend = None


class Pollers:
    """Every instance's poller, one HTTP client, the background loops."""

    def __init__(
        self,
        instances: Iterable[Instance],
        fleet: FleetModel,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_back: Callable[[str], None] | None = None,
        on_unresponsive: Callable[[str], None] | None = None,
        unresponsive_after_s: float = 0.0,
        on_polled: Callable[[str], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.by_url = {
            i.url: InstancePoller(i, fleet, self._get, clock, on_back, on_unresponsive, unresponsive_after_s, on_polled)
            for i in instances
        }
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def _get(self, url: str, path: str) -> httpx.Response:
        assert self._client is not None
        key = self.by_url[url].instance.api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with self._client.stream("GET", url + path, headers=headers) as response:
            body = bytearray()
            async for data in response.aiter_bytes():
                body += data
                if len(body) > MAX_ANSWER_BYTES:
                    raise AnswerTooLarge(f"{path} answered more than {MAX_ANSWER_BYTES} bytes")
        # decoded already: only the type goes with it (a content-encoding would decode it twice)
        kept = {"content-type": response.headers["content-type"]} if "content-type" in response.headers else {}
        return httpx.Response(response.status_code, headers=kept, content=bytes(body))

    async def probe_rank(self, url: str, rank: int, timeout_s: float) -> bool | None:
        """Whether one data-parallel rank of the server at `url` answers a one-token completion
        named to it (`x-data-parallel-rank`, which SGLang and vLLM read) within `timeout_s`:
        False when it does not; None when the server cannot be asked (unreachable, an error
        answer, no model it names)."""
        assert self._client is not None
        poller = self.by_url[url]
        key = poller.instance.api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        timeout = httpx.Timeout(timeout_s, connect=self.timeout_s)
        if poller.model is None:
            try:  # no verdict when it cannot be read (a slow answer included): nothing was sent
                models = await self._get(url, "/v1/models")
                poller.model = str(models.json()["data"][0]["id"]) if models.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                return None
            if poller.model is None:
                return None
        try:
            body = {"model": poller.model, "prompt": "ok", "max_tokens": 1, "temperature": 0}
            answer = await self._client.post(
                url + "/v1/completions", json=body, headers=headers | {RANK_HEADER: str(rank)}, timeout=timeout
            )
        except httpx.ReadTimeout:  # sent, and no answer in time
            return False
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return None
        return True if answer.status_code == 200 else None

    async def start(self) -> None:
        """Learn each instance, poll once, then keep polling in the background."""
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), trust_env=False)
        await asyncio.gather(*(poller.learn() for poller in self.by_url.values()))
        await self.poll_once()
        self._tasks = [
            asyncio.create_task(poller.run(self.interval_s), name=f"specroute-poller {url}")
            for url, poller in self.by_url.items()
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def poll_once(self) -> None:
        """Every instance once (at start, and in tests); the background loops do the rest."""
        await asyncio.gather(*(poller.tick() for poller in self.by_url.values()))
