"""Flow control: a request no pool can serve in time waits in the proxy, not in a server's queue.

Pure, like the policies and admission: `holds(features, snapshot)` says whether a new request is
lost on every pool because of the load there, `room(features, snapshot)` whether a held one
would now get in without costing a fresh request its targets, `judging_order(waits, snapshot)`
which held requests are judged for room and in what order, `expired(held_s)` whether it has
waited the bound. The rules, top to bottom (docs/routing.md, "Flow control"):

1. `hold-lost`: a latency-class request predicted to miss its targets on both pools (goodput's
   SLO check), while on an idle instance of some pool it would meet them (a request too long
   for its targets on an empty fleet is lost by its size, not the load, and waiting cannot help
   it). Missed only at the check's margin for the spread (the mean prediction in time), it is
   held only while some pool is measured missing its targets (its share of requests within the
   SLO over the last minute under MISSING_SHARE): the margin is the prediction's doubt, and in a
   burst the fleet can absorb a request held on a doubt is lost by the holding.
2. `release-due`: a held request that has waited its fair share goes first when some pool has
   room for it (as in rule 3), oldest first, one for each request that left the fleet, one in for
   one out (`due_allowance`), and nobody passes it meanwhile. Its fair share is the fleet's mean
   time in system (Little's law: this router's requests in it, held ones included, over the rate
   they leave): what a request waits on average when nobody passes anyone. Holding lets fresh requests pass the lost ones; without
   this, in a closed loop (each client sends again only once answered) a fresh request takes
   every freed slot and the oldest wait out the bound: the tail. Unpaced, every due request the
   fleet seemed to have room for went at one look, each judged before the server showed the
   last one's effect, and under lasting overload the plain pool filled past its targets (the 3B
   fleet at Poisson 110 %: 0.72x the oracle split on the virtual clock, 0.89x paced).
3. `release-room`: else the newest held request goes that has room on some pool for it and for a
   fresh request after it: its predicted first token (at about its 90th percentile) no later
   than on an idle instance plus ROOM_SHARE of what the TTFT target leaves beyond that, its time
   per output token within the TPOT target.
4. `release-bound`: a held request goes, wherever the policy sends it, once it has waited
   `max_hold_s`: holding bounds no one's wait past that.

Why: servers serve their queues first come, first served. Sent to a pool, a lost request queues
ahead of (or slows) every request that comes after it, so under overload the pool that takes the
overflow serves almost nothing in time (docs/learning.md, "Which pool should hold the
overflow"). Held in the proxy it costs no one; fresh requests that can meet their targets go at
once, past the held ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fleet.types import POOLS, Features, InstanceState, PoolName, Snapshot
from policies.goodput import Goodput, Prediction

MISSING_SHARE = 0.9
"""A pool whose measured share of requests within the SLO is below this is missing its targets:
the overload is real, not a prediction's doubt."""
MAX_SCAN = 16
"""Held requests judged for room per look, of each kind: due (oldest first) and the newest; up
to twice this many judgements a look, each up to four predictions."""
ROOM_SHARE = 0.5
"""A held request goes when its first token would come within this share of what the TTFT
target leaves past its first token on an idle instance: the rest is the room a fresh request
after it still needs."""


class FlowControl:
    def __init__(self, predictor: Goodput, max_hold_s: float) -> None:
        if not predictor.slo_aware:
            raise ValueError("flow control needs SLO targets (slo_ttft_s or slo_tpot_ms)")
        self.predictor = predictor
        self.max_hold_s = max_hold_s

    def predict(
        self, features: Features, snapshot: Snapshot, pool_name: PoolName, idle: bool = False
    ) -> Prediction | None:
        """Goodput's prediction on the instance a request of `pool_name` would join, or with
        `idle` on that instance with nothing running, queued or sent lately."""
        pool = snapshot.pool(pool_name)
        if pool is None or snapshot.cost is None or not pool.available:
            return None
        instance = pool.least_loaded()
        if instance is None:
            return None
        if idle:
            instance = idle_instance(instance)
        n_out = self.predictor.output_tokens(features, snapshot.mean_output_tokens, snapshot.output_samples)
        return self.predictor.predict(pool, instance, features, snapshot.cost, n_out)

    def meets_on_average(self, p: Prediction) -> bool:
        g = self.predictor
        ttft_ok = g.slo_ttft_s <= 0 or p.ttft_s <= g.slo_ttft_s
        tpot_ok = g.slo_tpot_ms <= 0 or p.tpot_s * 1000 <= g.slo_tpot_ms
        return ttft_ok and tpot_ok

    def holds(self, features: Features, snapshot: Snapshot) -> bool:
        """`hold-lost` (a batch request, or one with nothing known to judge by, is never held)."""
        if features.request_class != "latency":
            return False
        servable, lost_on_average = False, True
        for pool in POOLS:
            p = self.predict(features, snapshot, pool)
            if p is None or self.predictor.meets_slo(p):
                return False
            lost_on_average = lost_on_average and not self.meets_on_average(p)
            idle = self.predict(features, snapshot, pool, idle=True)
            servable = servable or (idle is not None and self.predictor.meets_slo(idle))
        return servable and (lost_on_average or missing_targets(snapshot))

    def room(self, features: Features, snapshot: Snapshot) -> bool:
        """`release-room` on either pool."""
        g = self.predictor
        for pool in POOLS:
            p = self.predict(features, snapshot, pool)
            if p is None:
                return True  # nothing known to judge by: the pool decides, as for a request not held
            if g.slo_tpot_ms > 0 and (p.tpot_s + p.tpot_spread_s) * 1000 > g.slo_tpot_ms:
                continue
            if g.slo_ttft_s <= 0:
                return True
            idle = self.predict(features, snapshot, pool, idle=True)
            floor = idle.ttft_s if idle is not None else 0.0
            if p.ttft_s + p.wait_spread_s <= floor + ROOM_SHARE * max(g.slo_ttft_s - floor, 0.0):
                return True
        return False

    def judging_order(self, waits: Sequence[float], snapshot: Snapshot) -> list[tuple[int, str]]:
        """Which held requests (`waits`: each one's seconds held, oldest first) are judged for room,
        in order, each with the rule that lets it go: those past their fair share, oldest first
        (`release-due`), then the newest (`release-room`); at most MAX_SCAN of each. The first
        with room goes, but a due one only while the look's `due_allowance` lasts: else nobody
        goes this look, as nobody passes a request past its fair share."""
        fair = fair_wait_s(snapshot, len(waits))
        due = [] if fair is None else [i for i in range(min(len(waits), MAX_SCAN)) if waits[i] >= fair]
        newest = [i for i in range(len(waits) - 1, max(len(waits) - MAX_SCAN, 0) - 1, -1) if i not in due]
        return [(i, "release-due") for i in due] + [(i, "release-room") for i in newest]

    def expired(self, held_s: float) -> bool:
        """`release-bound`: a request held this long goes, wherever the policy sends it."""
        return held_s >= self.max_hold_s


def fair_wait_s(snapshot: Snapshot, held: int) -> float | None:
    """The fleet's mean time in system as this router sees it (Little's law): its requests in
    the fleet (`InstanceState.in_flight`, on every instance, an ejected one's included: they end
    there too) and `held` in the proxy, over the rate its requests leave the pools
    (`PoolState.finished_per_s`). Both are this router's own: several proxies in front of the
    same servers each see their part of the load and of the departures (the servers' figures
    over one proxy's departures made each replica's share N times too long). None before any
    pool's rate is measured (SLO targets and half a minute of finished requests) or while
    nothing finishes."""
    rate, in_system, measured = 0.0, float(held), False
    for pool in snapshot.pools.values():
        if pool.finished_per_s is not None:
            rate += pool.finished_per_s
            measured = True
        for st in pool.instances:
            in_system += st.in_flight
    return in_system / rate if measured and rate > 0 else None


def left_total(snapshot: Snapshot) -> int:
    """This router's requests that ever left the fleet (every pool's count)."""
    return sum(pool.left_total for pool in snapshot.pools.values())


def due_allowance(allowance: int, left: int, snapshot: Snapshot) -> int:
    """How many held requests past their fair share may go (`release-due`) once `left` more of
    this router's requests left the fleet: one in for one out, kept at most one look's worth
    (what left since the last look, at least one), and at least one on a fleet with none of
    ours in it (nothing would leave to let one in)."""
    allowance = min(allowance + left, max(1, left))
    if allowance < 1 and not any(st.in_flight for pool in snapshot.pools.values() for st in pool.instances):
        return 1
    return allowance


def missing_targets(snapshot: Snapshot) -> bool:
    """Some pool is measured missing its SLO targets (its share within them under MISSING_SHARE)."""
    for pool in snapshot.pools.values():
        if pool.slo_share is not None and pool.slo_share < MISSING_SHARE:
            return True
    return False


def idle_instance(instance: InstanceState) -> InstanceState:
    """The instance with nothing running, queued or sent to it lately."""
    return replace(
        instance,
        running=0.0,
        waiting=0.0,
        waiting_tokens=None if instance.waiting_tokens is None else 0.0,
        prompt_tokens_per_s=0.0,
        dispatches_per_s=0.0,
    )
