"""Flow control: a request no pool can serve in time waits in the proxy, not in a server's queue.

Pure, like the policies and admission: `holds(features, snapshot)` says whether a new request is
lost on every pool (its predicted time to first token or per output token past the SLO targets
on both: goodput's own check, `Goodput.meets_slo`), and `releases(features, snapshot, held_s)`
whether a held one goes now. The rules, top to bottom (docs/routing.md, "Flow control"):

1. `hold-lost`: a request predicted to miss its targets on both pools is held.
2. `release-room`: a held request goes when the pool the policy would send it to has room for it
   and for a fresh request after it: its predicted first token within ROOM_SHARE of the TTFT
   target, its time per output token within the TPOT target.
3. `release-bound`: a held request goes, wherever the policy sends it, once it has waited
   `max_hold_s`: holding bounds no one's wait past that.

Why: servers serve their queues first come, first served. Sent to a pool, a lost request queues
ahead of (or slows) every request that comes after it, so under overload the pool that takes the
overflow serves almost nothing in time (docs/learning.md, "Which pool should hold the
overflow"). Held in the proxy it costs no one; fresh requests that can meet their targets go at
once, past the held ones. What it costs: the held requests wait longer than they would in a
queue (they were lost already), up to `max_hold_s`.
"""

from __future__ import annotations

from fleet.types import POOLS, Features, PoolName, Snapshot
from policies.goodput import Goodput, Prediction

ROOM_SHARE = 0.5
"""A held request goes when its predicted first token is within this share of the TTFT target:
the rest of the target is the room a fresh request after it still needs."""


class FlowControl:
    def __init__(self, predictor: Goodput, max_hold_s: float) -> None:
        if not predictor.slo_aware:
            raise ValueError("flow control needs SLO targets (slo_ttft_s or slo_tpot_ms)")
        self.predictor = predictor
        self.max_hold_s = max_hold_s

    def predict(self, features: Features, snapshot: Snapshot, pool_name: PoolName) -> Prediction | None:
        pool = snapshot.pool(pool_name)
        if pool is None or snapshot.cost is None or not pool.available:
            return None
        instance = pool.least_loaded()
        if instance is None:
            return None
        n_out = self.predictor.output_tokens(features, snapshot.mean_output_tokens, snapshot.output_samples)
        return self.predictor.predict(pool, instance, features, snapshot.cost, n_out)

    def holds(self, features: Features, snapshot: Snapshot) -> bool:
        """`hold-lost`: met on neither pool (a batch request, or one with nothing known to judge
        by, is never held)."""
        if features.request_class != "latency":
            return False
        for pool in POOLS:
            p = self.predict(features, snapshot, pool)
            if p is None or self.predictor.meets_slo(p):
                return False
        return True

    def expired(self, held_s: float) -> bool:
        """`release-bound`: a request held this long goes, wherever the policy sends it."""
        return held_s >= self.max_hold_s

    def room(self, features: Features, snapshot: Snapshot, pool: PoolName) -> bool:
        """`release-room`: `pool` (the policy's choice for a held request) has room for it and
        a fresh request after it."""
        p = self.predict(features, snapshot, pool)
        if p is None:
            return True  # nothing known to judge by: the pool decides, as for a request not held
        g = self.predictor
        ttft_ok = g.slo_ttft_s <= 0 or p.ttft_s + p.wait_spread_s <= ROOM_SHARE * g.slo_ttft_s
        tpot_ok = g.slo_tpot_ms <= 0 or (p.tpot_s + p.tpot_spread_s) * 1000 <= g.slo_tpot_ms
        return ttft_ok and tpot_ok
