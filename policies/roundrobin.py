"""`round-robin`: alternate pools, skipping one with no healthy instance (a naive baseline)."""

from __future__ import annotations

from fleet.types import POOLS, Decision, Features, PoolName, Snapshot
from policies.registry import register


@register("round-robin", decisions=(("round-robin", "spec"), ("round-robin", "base"), ("none-healthy", "base")))
class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def decide(self, features: Features, snapshot: Snapshot) -> Decision:
        for _ in POOLS:
            pool: PoolName = POOLS[self._turn % len(POOLS)]
            self._turn += 1
            state = snapshot.pool(pool)
            if state is not None and state.available:
                return Decision(pool=pool, reason="round-robin")
        return Decision(pool="base", reason="none-healthy")
