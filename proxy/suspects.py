"""Requests that make servers fail: a query of death is the request's fault, not its servers'.

A request that fails with a 500 on one server and again on another (or drops the connection
of both: a crash), and that no server serves, is far more likely the cause than two servers
that happen to be sick at once: an input the engine's code cannot handle. Counted against the
servers, a handful of such requests (a batch of bad inputs, each failed over by the proxy) eject
healthy servers, and other clients' requests lose them; failed over further, a request that
crashes servers takes down one more with each attempt. So each request keeps its own failures
(`Culprit`), and once it has failed on SPECROUTE_QUERY_OF_DEATH_SERVERS different servers:

- when it ends unanswered, exactly the failures it counted against those servers are taken
  back from their counts in outlier detection (so too when it failed so on every server it
  could be sent to, fewer than that: pinned by a client to a pool of one server, or a follow-up
  only one server can continue, it could not be judged, and one client's bad inputs sent so
  would keep a lone server ejected, each half-open probe failing), and an ejection one of them completed ends when
  the count without it is below the threshold (`OutlierDetector.absolve`). Failures of other
  requests, copies of the same body served elsewhere included, stand;
- when it dropped the connection of that many servers, it is not failed over to another, and
  the same request (a hash of its path and body: the body is never kept) sent again within
  SPECROUTE_QUERY_OF_DEATH_S is refused at once (502 `request_fails_servers`,
  `x-should-retry: false`). A 500 costs a server little: such a request still fails over, and a
  server that serves it shows it was not the cause.

Only failures a request can cause count here: a 5xx but 502-504 (which say the server is
unavailable, not that the request broke it) and a connection the server dropped. Refusals for
load (503, 429), timeouts and unreachable servers are the servers' as before. The memory of
refused requests is bounded (MAX_REQUESTS, the oldest forgotten first) and per process; a body
is hashed only while it holds one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import cachetools

MAX_REQUESTS = 4096
"""Refused requests remembered at once (16-byte keys)."""
GATEWAY_STATUSES = frozenset({"status_502", "status_503", "status_504"})
"""A server's own word that it is unavailable or overloaded: never the request's doing."""
DROPPED = "upstream_disconnected"


def request_key(path: str, body: bytes) -> bytes:
    """What identifies a request sent again: its path and body, hashed (128 bits)."""
    digest = hashlib.blake2b(path.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(body)
    return digest.digest()


def request_may_cause(kind: str) -> bool:
    """Whether an attempt failure of `kind` can be the request's fault (a 5xx but 502-504, or
    the server dropping the connection)."""
    return kind == DROPPED or (kind.startswith("status_5") and kind not in GATEWAY_STATUSES)


@dataclass(slots=True, eq=False)
class Culprit:
    """One request's attempt failures that it may have caused: the servers, each once (a
    request tries a server once). Outlier detection keeps the object itself beside the counts
    it added, so that exactly those can be taken back."""

    servers: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    """Those of them that dropped its connection."""
    confined: bool = False
    """It failed so on every server it could be sent to, fewer than the rule's number (pinned by
    `x-specroute-pool` to a pool of one, a follow-up only its response's server can continue):
    it could not be judged by the rule, and is not held against them either."""

    def failed(self, url: str, kind: str) -> None:
        if url not in self.servers:
            self.servers.append(url)
        if kind == DROPPED and url not in self.dropped:
            self.dropped.append(url)


class Suspects:
    """The rule's threshold, and the requests judged to crash servers (refused for a while)."""

    def __init__(self, servers: int, memory_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.servers = servers
        """Different servers a request must fail on to be judged the cause (0: never judged)."""
        self.memory_s = memory_s
        self.refused: cachetools.TTLCache[bytes, bool] = cachetools.TTLCache(
            maxsize=MAX_REQUESTS, ttl=memory_s, timer=clock
        )

    def judged(self, culprit: Culprit) -> bool:
        """`culprit` failed on enough different servers to be judged their cause, or on every
        one it could be sent to (`confined`), when it ends unanswered."""
        return 0 < self.servers and (self.servers <= len(culprit.servers) or culprit.confined)

    def crashes(self, culprit: Culprit) -> bool:
        """`culprit` dropped the connection of enough different servers: not sent to another."""
        return 0 < self.servers <= len(culprit.dropped)

    def refuse(self, key: bytes) -> None:
        """The request `key` is refused for `memory_s` (it crashed servers)."""
        self.refused[key] = True

    def any(self) -> bool:
        """Whether some request is refused now (then an arriving one is worth hashing)."""
        return bool(self.refused)

    def refuses(self, key: bytes) -> bool:
        return key in self.refused
