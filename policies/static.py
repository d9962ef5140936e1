"""`spec` and `base`: send everything to one pool (baselines, and pinning a deployment)."""

from __future__ import annotations

from dataclasses import dataclass

from fleet.types import Decision, Features, PoolName, Snapshot
from policies.registry import register


@dataclass
class Static:
    pool: PoolName

    @property
    def name(self) -> str:
        return self.pool

    def decide(self, features: Features, snapshot: Snapshot) -> Decision:
        return Decision(pool=self.pool, reason="static")


@register("spec", decisions=(("static", "spec"),))
def always_spec() -> Static:
    return Static("spec")


@register("base", decisions=(("static", "base"),))
def always_base() -> Static:
    return Static("base")
