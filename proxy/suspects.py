"""Requests that make servers fail: a query of death is the request's fault, not its servers'.

A request that fails with a 500 on one server and again on another (or drops the connection
of both: a crash) is far more likely the cause than two servers that happen to be sick at once:
an input the engine's code cannot handle. Counted against the servers, a handful of such
requests (a client retrying one, the proxy's failover) eject healthy servers, and other
clients' requests lose them; sent on, a request that crashes servers takes down one more with
each attempt. So the proxy remembers, for SPECROUTE_QUERY_OF_DEATH_S, each request that failed
that way (a hash of its path and body: the body itself is never kept) and the servers it failed
on. Once it has failed on SPECROUTE_QUERY_OF_DEATH_SERVERS different servers:

- when it ends without an answer, its failures are taken back from those servers' counts in
  outlier detection, an ejection they caused included (`OutlierDetector.absolve`). A request
  that another server then serves was not the cause: its failures stand;
- when it dropped the connection of that many servers, it is not sent to another, and the same
  request sent again within that time is refused at once (502 `request_fails_servers`,
  `x-should-retry: false`). A 500 costs a server little: such a request still fails over, and a
  server that serves it shows it was not the request.

Only failures a request can cause count here: a 5xx but 502-504 (which say the server is
unavailable, not that the request broke it) and a connection the server dropped. Refusals for
load (503, 429), timeouts and unreachable servers are the servers' as before. The memory is
bounded (MAX_REQUESTS, the oldest forgotten first) and per process.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import cachetools

MAX_REQUESTS = 4096
"""Requests remembered at once (a few hundred bytes each)."""
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


@dataclass(slots=True)
class Failures:
    servers: list[str] = field(default_factory=list)
    """The servers it failed on, each once, in order."""
    dropped: list[str] = field(default_factory=list)
    """Those of them that dropped its connection."""


class Suspects:
    def __init__(self, servers: int, memory_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.servers = servers
        """Different servers a request must fail on to be judged the cause (0: never judged)."""
        self.memory_s = memory_s
        self.failures: cachetools.TTLCache[bytes, Failures] = cachetools.TTLCache(
            maxsize=MAX_REQUESTS, ttl=memory_s, timer=clock
        )

    def any(self) -> bool:
        """Whether a request is remembered at all (then an arriving one is worth hashing)."""
        return bool(self.failures)

    def failed(self, key: bytes, url: str, kind: str) -> None:
        """Request `key` failed on `url` in a way (`kind`) it may have caused."""
        if self.servers <= 0:
            return
        failures = self.failures.get(key) or Failures()
        if url not in failures.servers:
            failures.servers.append(url)
        if kind == DROPPED and url not in failures.dropped:
            failures.dropped.append(url)
        self.failures[key] = failures  # stored again: its time starts afresh

    def judged(self, key: bytes) -> list[str]:
        """The servers whose failures `key` is judged to have caused (empty: not judged)."""
        failures = self.failures.get(key)
        if failures is None or self.servers <= 0 or len(failures.servers) < self.servers:
            return []
        return failures.servers

    def condemned(self, key: bytes) -> bool:
        """`key` dropped the connection of enough different servers: it is not sent to another."""
        failures = self.failures.get(key)
        return failures is not None and self.servers > 0 and len(failures.dropped) >= self.servers
