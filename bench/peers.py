"""The peers' cache-aware routing, as a baseline for the evaluation (not a served policy).

SGLang Model Gateway's `cache_aware` policy (its default; vLLM production-stack's `prefixaware`
and llm-d's prefix scorer work alike) picks the worker inside a pool: when the pool's load is
balanced, the worker holding the longest prefix of the prompt if that prefix is more than
`cache_threshold` of the prompt, else the least loaded; when it is imbalanced (max - min
in-flight requests over `balance_abs_threshold` and max over `balance_rel_threshold` x min),
the least loaded. Defaults as published (docs/concepts/routing/cache-aware.md of the SMG
repository: 0.3, 64, 1.5). The peers do not decide speculation, so the pool comes from
another policy (the evaluation gives it `goodput` without the cache credit, today's rule).

The prefix each worker holds is the fleet model's prefix index (`Features.cached`) before
trust, rather than a tree of routed text: the same information, at block granularity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fleet.types import Decision, Features, Snapshot
from policies.base import Policy

PREFIX_LEAST_LOAD = "prefix-least-load"


@dataclass
class PrefixLeastLoad:
    """Pool from `pool_policy`; instance by prefix match, then least load (the module's rule)."""

    pool_policy: Policy
    cache_threshold: float = 0.3
    balance_abs_threshold: float = 64
    balance_rel_threshold: float = 1.5
    name: str = PREFIX_LEAST_LOAD

    def decide(self, features: Features, snapshot: Snapshot) -> Decision:
        decision = self.pool_policy.decide(features, snapshot)
        pool = snapshot.pool(decision.pool)
        if pool is None or not features.cached:
            return replace(decision, instance=None)
        healthy = pool.healthy_instances
        if len(healthy) < 2:
            return replace(decision, instance=None)
        loads = [i.load for i in healthy]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return replace(decision, instance=None)  # imbalanced: the least loaded
        best = max(healthy, key=lambda i: (features.cached.get(i.url, 0), -i.load))
        held = features.cached.get(best.url, 0)
        if held > self.cache_threshold * max(features.prompt_tokens, 1):
            return replace(decision, instance=best.url)
        return replace(decision, instance=None)
