"""Passive outlier detection: stop sending work to a server that answers, but answers badly.

A load poll only says a server is up. A server whose completions fail (5xx, resets, a first
token that never comes, a stream that stops) or whose first tokens come far later than its
pool's others' is found from the requests themselves, as Envoy's outlier detection does:

- `consecutive-failures`: SPECROUTE_OUTLIER_CONSECUTIVE_FAILURES failed attempts in a row (an
  attempt abandoned because its server stopped answering, `upstream_unresponsive`, counts);
- `slow-first-token`: its first-token time (a moving average over its streams) is more than
  SPECROUTE_OUTLIER_SLOW_FACTOR times the median of its pool's other instances (at least
  SLOW_MIN_SAMPLES streams each, and SLOW_FLOOR_S above them);
- `no-progress`: it answers its load polls but sent no byte to the requests waiting on it for
  SPECROUTE_NO_PROGRESS_S while its engine mark held still (`proxy.routing.stalled`: a hung
  engine behind a live HTTP front). The requests it left waiting fail over
  (`upstream_no_progress`).

Attempts sent before a server's latest ejection do not count when they end after it: requests
in flight when it failed all fail with it (a stall breaks every stream at once), and counted
one by one they would eject it again, or fail its half-open probe, for twice as long; nor does
one that succeeds end its probation.

Either ejects it for SPECROUTE_OUTLIER_EJECTION_S times the number of times it was ejected (at
most SPECROUTE_OUTLIER_MAX_EJECTION_S); that count falls by one for every
SPECROUTE_OUTLIER_MAX_EJECTION_S it then serves without ejection (Envoy's ejection multiplier
does the same). Never more than half of a pool is ejected at once (one instance of a pool of one
or two), and never the fleet's last available instance. When its time is up it is half-open: one
request at a time until one succeeds (back to full traffic, its first-token average judged
afresh) or fails (ejected again, for longer); a probe whose first token is as slow as the rule
above judges slow fails (a slow probe counted as a success put a still slow server back, and its
slow samples then ejected it again once it had healed). A server restarted (the load polls could
not reach it, then reached it again) is back at once (`restarted`). An ejected instance is
unhealthy in the fleet snapshot, so the policy routes as if it were down.

A request that fails on several servers and that none serves is judged their cause, not them
(`proxy.suspects`): the failures it counted are taken back (`absolve`), and an ejection one of
them completed ends.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fleet.model import FleetModel
from proxy.pools import Instance, Pool
from proxy.suspects import Culprit, Suspects

FAILURES = frozenset(
    {
        "connect",
        "upstream_disconnected",
        "first_token_timeout",
        "chunk_timeout",
        "upstream_unresponsive",
        "upstream_no_progress",
    }
)
"""Attempt failures that count against a server, besides any 5xx (status_5xx). A total timeout
does not: a long generation can meet it on a healthy server."""
TTFT_WEIGHT = 0.2
"""Weight of a new first-token time in the moving average (about the last 5-10 streams)."""
SLOW_MIN_SAMPLES = 5
SLOW_FLOOR_S = 0.5
"""A first token is only slow if it is also this much later than the pool's median: queueing
noise in a quiet pool (10 ms against 2 ms) is not sickness."""

OK, EJECTED, PROBING = "ok", "ejected", "probing"

RULES = ("consecutive-failures", "slow-first-token", "no-progress", "probe-failed", "probe-slow-first-token")
"""Every rule that ejects (a reason's part before any `:kind`): the ejection counter's `reason`
label, whose series exist at 0 from the start (proxy.telemetry.names.EJECTION_REASONS)."""

log = logging.getLogger("specroute.outliers")


@dataclass(slots=True)
class Record:
    state: str = OK
    consecutive: int = 0
    ejections: int = 0
    until: float = 0.0
    probe_in_flight: bool = False
    ttft_s: float | None = None
    ttft_samples: int = 0
    reason: str | None = None
    """Why it was last ejected."""
    ok_since: float = 0.0
    """When it last came back (or its ejection count last fell)."""
    run: deque[Culprit] = field(default_factory=deque)
    """The requests behind the failures of its current count that a request may have caused
    (the latest `consecutive_failures` of them)."""
    ejected_at: float = float("-inf")
    """When it was last ejected: the failures of attempts sent before are that ejection's."""
    ejected_by: Culprit | None = None
    """The request whose failure completed its ejection, when a request may have caused it."""


class OutlierDetector:
    def __init__(
        self,
        pools: Iterable[Pool],
        fleet: FleetModel,
        *,
        consecutive_failures: int,
        ejection_s: float,
        max_ejection_s: float,
        slow_factor: float,
        suspects: Suspects | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_ejected: Callable[[str, str, str], None] | None = None,
    ) -> None:
        """`on_ejected(pool, url, rule)`: told of every ejection (the ejection counter), `rule`
        one of RULES."""
        self.pools = list(pools)
        self.fleet = fleet
        self.consecutive_failures = consecutive_failures
        self.ejection_s = ejection_s
        self.max_ejection_s = max_ejection_s
        self.slow_factor = slow_factor
        self.clock = clock
        self.on_ejected = on_ejected
        self.suspects = suspects if suspects is not None else Suspects(0, 1.0)
        self.records: dict[str, Record] = {i.url: Record() for pool in self.pools for i in pool.instances}
        self.pool_of: dict[str, Pool] = {i.url: pool for pool in self.pools for i in pool.instances}

    def refresh(self) -> None:
        """Ejections whose time is up turn half-open now (they count as healthy again)."""
        for url, record in self.records.items():
            if record.state == EJECTED:
                self._expire(url, record)

    # -- questions ---------------------------------------------------------------------------
    def admits(self, instance: Instance) -> bool:
        """Whether `instance` may take a request now (not ejected; a half-open one takes one)."""
        record = self.records[instance.url]
        if record.state == OK:
            return True
        self._expire(instance.url, record)
        if record.state == EJECTED:
            return False
        return not record.probe_in_flight

    def state_of(self, url: str) -> dict[str, Any]:
        record = self.records[url]
        if record.state != OK:
            self._expire(url, record)
        left = max(0.0, record.until - self.clock()) if record.state == EJECTED else 0.0
        return {
            "state": record.state,
            "ejections": record.ejections,
            "ejected_for_s": round(left, 3),
            "reason": record.reason,
            "consecutive_failures": record.consecutive,
            "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 4),
        }

    def ejected(self, url: str) -> bool:
        return self.records[url].state == EJECTED

    def ejected_for_s(self, url: str) -> float:
        """Seconds left of the instance's ejection (0 when it is not ejected)."""
        record = self.records[url]
        if record.state != EJECTED:
            return 0.0
        self._expire(url, record)
        return max(0.0, record.until - self.clock()) if record.state == EJECTED else 0.0

    # -- events ------------------------------------------------------------------------------
    def dispatched(self, instance: Instance) -> None:
        record = self.records[instance.url]
        self._expire(instance.url, record)
        if record.state == PROBING:
            record.probe_in_flight = True

    def succeeded(self, instance: Instance, ttft_s: float | None, dispatched_at: float | None = None) -> None:
        """`dispatched_at`: when the attempt was sent; one sent before the server's latest
        ejection says nothing of it since (it is no half-open probe)."""
        record = self.records[instance.url]
        if dispatched_at is not None and dispatched_at < record.ejected_at:
            return
        record.consecutive = 0
        record.run.clear()
        now = self.clock()
        if record.state == PROBING:
            record.probe_in_flight = False
            if ttft_s is not None and self.slow_factor > 0 and self._too_slow(instance.url, ttft_s):
                self._eject(instance.url, record, "probe-slow-first-token", probe_failed=True)
                return
            record.state, record.ok_since = OK, now
            log.info("upstream %s is back in full rotation: its half-open probe succeeded", instance.url)
        elif record.ejections and now - record.ok_since >= self.max_ejection_s:
            record.ejections -= 1
            record.ok_since = now
        if ttft_s is not None:
            record.ttft_s = ttft_s if record.ttft_s is None else record.ttft_s + TTFT_WEIGHT * (ttft_s - record.ttft_s)
            record.ttft_samples += 1
            if self.slow_factor > 0 and self._slow(instance.url, record):
                self._eject(instance.url, record, "slow-first-token")

    def failed(
        self, instance: Instance, kind: str, culprit: Culprit | None = None, dispatched_at: float | None = None
    ) -> None:
        """An attempt failed; `culprit`: its request's failures, when the request may have
        caused this one (`proxy.suspects.request_may_cause`); `dispatched_at`: when it was sent
        (on this detector's clock): one sent before the server's last ejection is not counted."""
        if kind not in FAILURES and not kind.startswith("status_5"):
            # Not the server's failure: a half-open probe may be tried again, as when the client
            # leaves (a probe ended so held the server out of rotation for good).
            self.released(instance, dispatched_at)
            return
        record = self.records[instance.url]
        if culprit is not None:
            culprit.failed(instance.url, kind)
        if dispatched_at is not None and dispatched_at < record.ejected_at:
            return  # in flight when it was ejected: the same failure, counted already
        record.consecutive += 1
        if culprit is not None and self.consecutive_failures:
            record.run.append(culprit)
            if len(record.run) > self.consecutive_failures:  # an ejection refused: the count goes on
                record.run.popleft()
        if record.state == PROBING:
            record.probe_in_flight = False
            self._eject(instance.url, record, f"probe-failed:{kind}", probe_failed=True, culprit=culprit)
        elif self.consecutive_failures and record.consecutive >= self.consecutive_failures:
            self._eject(instance.url, record, f"consecutive-failures:{kind}", culprit=culprit)

    def answering(self, url: str) -> None:
        """Its load polls are answered again: an ejection its silence completed (the failure that
        ejected it, a probe's included, was `upstream_unresponsive`: a stopped process, a paused
        host) ends now,
        half-open, rather than keeping a server that stalled for 20 s out for 30 s more (a
        server restarted is back at once too, `restarted`)."""
        record = self.records.get(url)
        if record is None or record.state != EJECTED or not (record.reason or "").endswith(":upstream_unresponsive"):
            return
        record.state, record.probe_in_flight, record.ejected_by = PROBING, False, None
        self.fleet.set_ejected(url, False)
        log.info("upstream %s let back half-open (one request at a time): it answers its polls again", url)

    def hung(self, instance: Instance) -> None:
        """Its engine is stuck behind a live HTTP front (`proxy.routing.Router.check_progress`):
        ejected at once, or, half-open, again."""
        record = self.records[instance.url]
        self._expire(instance.url, record)
        if record.state == EJECTED:
            return
        if record.state == PROBING:
            record.probe_in_flight = False
            self._eject(instance.url, record, "probe-failed:upstream_no_progress", probe_failed=True)
        else:
            self._eject(instance.url, record, "no-progress")

    def absolve(self, culprit: Culprit) -> list[str]:
        """A request ended unanswered: when it failed on enough servers to be judged their
        cause, the failures it counted against them are taken back; an ejection one of them
        completed ends, the count without it being below the threshold (half-open: one request
        at a time until one succeeds, as after any ejection; its ejection count as before).
        The servers absolved (empty: it was not judged)."""
        if not self.suspects.judged(culprit):
            return []
        for url in culprit.servers:
            record = self.records.get(url)
            if record is None:
                continue
            if record.state == EJECTED and record.ejected_by is culprit:
                record.state, record.probe_in_flight, record.ejected_by = PROBING, False, None
                record.ejections = max(record.ejections - 1, 0)
                self.fleet.set_ejected(url, False)
                log.info(
                    "upstream %s let back half-open (one request at a time): the request that ejected it (%s)"
                    " failed on %d servers and is judged their cause",
                    url,
                    record.reason,
                    len(culprit.servers),
                )
            elif culprit in record.run:
                record.run.remove(culprit)
                record.consecutive -= 1
        return culprit.servers

    def restarted(self, url: str) -> None:
        """The server behind `url` went away and is back (the pollers could not reach it, then
        learned it again): an ejection ends now and its first-token average starts afresh, as
        Envoy's active health check unejects a host. The ejection count stays (it falls as
        usual), so a server that crashes again and again is ejected for longer each time."""
        record = self.records.get(url)
        if record is None:
            return
        if record.state != OK:
            self.fleet.set_ejected(url, False)
            log.info("upstream %s is back in rotation: it restarted while %s (%s)", url, record.state, record.reason)
        record.state, record.probe_in_flight, record.consecutive = OK, False, 0
        record.run.clear()
        record.ttft_s, record.ttft_samples = None, 0
        record.ok_since = self.clock()

    def released(self, instance: Instance, dispatched_at: float | None = None) -> None:
        """An attempt ended neither way (the client left): a half-open probe may be tried again
        (not for one sent before the server's latest ejection: that was no probe)."""
        record = self.records[instance.url]
        if dispatched_at is not None and dispatched_at < record.ejected_at:
            return
        if record.state == PROBING:
            record.probe_in_flight = False

    # -- rules -------------------------------------------------------------------------------
    def _slow(self, url: str, record: Record) -> bool:
        if record.ttft_samples < SLOW_MIN_SAMPLES or record.ttft_s is None:
            return False
        return self._too_slow(url, record.ttft_s)

    def _too_slow(self, url: str, ttft_s: float) -> bool:
        """`ttft_s` is past slow_factor times its pool's others' median, and SLOW_FLOOR_S past it."""
        others = [self.records[i.url] for i in self.pool_of[url].instances if i.url != url]
        peers = [
            r.ttft_s for r in others if r.ttft_s is not None and r.ttft_samples >= SLOW_MIN_SAMPLES and r.state == OK
        ]
        if not peers:
            return False
        median = statistics.median(peers)
        return ttft_s > self.slow_factor * median and ttft_s > median + SLOW_FLOOR_S

    def _may_eject(self, url: str) -> bool:
        pool = self.pool_of[url]
        ejected_in_pool = sum(1 for i in pool.instances if self.records[i.url].state == EJECTED)
        if ejected_in_pool + 1 > max(1, len(pool.instances) // 2):
            return False
        # Never the fleet's last available instance: a sick server beats no server.
        others = [i for p in self.pools for i in p.instances if i.url != url]
        return any(i.healthy for i in others)

    def _eject(
        self, url: str, record: Record, reason: str, probe_failed: bool = False, culprit: Culprit | None = None
    ) -> None:
        """`culprit`: the request whose failure ejects it (when a request may have caused it)."""
        if not self._may_eject(url):
            if probe_failed:  # no room to eject it again: it stays half-open, a request at a time
                record.state = PROBING
            return
        record.ejections += 1
        record.state = EJECTED
        record.ejected_at = self.clock()
        period = min(self.ejection_s * record.ejections, self.max_ejection_s)
        record.until = self.clock() + period
        record.reason = reason
        record.ejected_by = culprit
        record.consecutive = 0
        record.run.clear()
        record.ttft_s, record.ttft_samples = None, 0  # judged afresh after its return
        self.fleet.set_ejected(url, True)
        pool = self.pool_of[url].name
        log.warning(
            "upstream %s (%s pool) ejected for %g s: %s (ejection %d)", url, pool, period, reason, record.ejections
        )
        if self.on_ejected is not None:
            self.on_ejected(pool, url, reason.partition(":")[0])

    def _expire(self, url: str, record: Record) -> None:
        if record.state == EJECTED and self.clock() >= record.until:
            record.state, record.probe_in_flight = PROBING, False
            self.fleet.set_ejected(url, False)
            log.info(
                "upstream %s let back half-open (one request at a time): its ejection (%s) ended", url, record.reason
            )
