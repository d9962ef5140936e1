"""GET /v1/specroute/state: the live snapshot, each instance's polling, the acceptance and cost
estimates, and a ring of recent decisions with what each one saw."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fleet import native
from fleet.instance import InstanceSignals
from fleet.model import FleetModel
from fleet.types import Decision, Features, Snapshot
from proxy.poller import Pollers
from proxy.settings import Settings

WORKLOADS_SHOWN = 20
"""Workload keys the state endpoint lists (those with the most evidence)."""


class DecisionLog:
    """The last decisions, each with the fleet inputs it saw added to its scores."""

    def __init__(self, size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.recent: deque[dict[str, Any]] = deque(maxlen=size)

    def explain(self, features: Features, decision: Decision, snapshot: Snapshot) -> Decision:
        """The decision with what it saw added to its scores (for telemetry and the state
        endpoint), recorded in the ring of recent decisions."""
        return self.record(features, decision, snapshot)[0]

    def record(self, features: Features, decision: Decision, snapshot: Snapshot) -> tuple[Decision, dict[str, Any]]:
        """`explain`, and the decision's entry in the ring: the request path fills in where it
        went (`dispatched`)."""
        scores = {**decision_inputs(snapshot), **decision.scores}
        explained = Decision(pool=decision.pool, reason=decision.reason, scores=scores, instance=decision.instance)
        entry = {
            # `at` on the process's monotonic clock (ages against other monotonic readings);
            # `ts` the wall clock, as the request log line's, to find it in logs and traces.
            "at": round(self.clock(), 3),
            "ts": round(time.time(), 3),
            "request_id": None,  # filled in by the request path (its x-request-id)
            "pool": decision.pool,
            "reason": decision.reason,
            "class": features.request_class,
            "prompt_tokens": features.prompt_tokens,
            "workload": features.workload,
            # Prompt tokens credited as cached per instance (URL), trust applied: what the
            # policy read (Features.cached); the instance it named (None: the least loaded).
            "cached": dict(features.cached),
            "chosen": decision.instance,
            # Where the request went (its last attempt) and the tokens credited there.
            "instance": None,
            "cached_tokens": 0,
            "scores": scores,
        }
        self.recent.append(entry)
        return explained, entry


PUBLIC_DECISION_FIELDS = ("at", "ts", "pool", "reason", "class", "refused", "held")
"""What a reader of the state endpoint who is not an operator (SPECROUTE_STATE_ACCESS=keys or open,
with keys on) sees of each recent decision: the routing mix, not the requests. A request's id,
prompt size, workload key (a keyed hash of its system prompt: a reader who can also send
requests confirms a guessed prompt by comparing its own request's key), cached credit, instance
and scores (predictions that grow with the prompt) are another client's business."""


def public_decisions(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{name: entry[name] for name in PUBLIC_DECISION_FIELDS if name in entry} for entry in decisions]


def dispatched(entry: dict[str, Any], url: str, cached_tokens: int) -> None:
    """A decision's request was sent to `url`, credited with `cached_tokens` there."""
    entry["instance"] = url
    entry["cached_tokens"] = cached_tokens


def decision_inputs(snapshot: Snapshot) -> dict[str, float]:
    """Flat numbers of what a decision saw: `<pool>.load`, `<pool>.capacity`, `<pool>.age_s`
    (omitted before any reading), `<pool>.stale` (1.0 or 0.0), `spec.alpha` (once estimated)."""
    out: dict[str, float] = {}
    for name, pool in snapshot.pools.items():
        out[f"{name}.load"] = pool.running + pool.waiting
        out[f"{name}.capacity"] = float(pool.capacity)
        if not math.isinf(pool.age_s):
            out[f"{name}.age_s"] = round(pool.age_s, 4)
        out[f"{name}.stale"] = 1.0 if pool.stale else 0.0
        if pool.speculative and pool.alpha is not None:
            out[f"{name}.alpha"] = round(pool.alpha, 4)
    return out


def _age(seconds: float) -> float | None:
    return None if math.isinf(seconds) else round(seconds, 3)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _per_1k(ms_per_token: float | None) -> float | None:
    """A measured prefill speed as milliseconds per 1,000 tokens (None: not reported)."""
    return None if ms_per_token is None else round(ms_per_token * 1000, 3)


def served(signals: InstanceSignals) -> dict[str, float]:
    """What the instance's serving engines hold in all, and their caps summed."""
    running, waiting, _, serving, cap = signals.serving_load()
    return {"running": running, "waiting": waiting, "max_running": serving * cap}


def fleet_state(
    settings: Settings, fleet: FleetModel, pollers: Pollers, decisions: DecisionLog, now: float
) -> dict[str, Any]:
    snap = fleet.snapshot(now)
    pools: dict[str, Any] = {}
    for name, pool in snap.pools.items():
        instances = []
        for i in pool.instances:
            poller = pollers.by_url[i.url]
            instances.append(
                {
                    "url": i.url,
                    "name": poller.instance.name,
                    # The server's engines serving (several: SGLang data-parallel ranks, a hung
                    # one left out) and what they hold, summed (the policy sees one engine's part).
                    "engines": i.replicas,
                    **served(fleet.instances[i.url]),
                    "healthy": i.healthy,
                    # Its polls went unanswered while a pool-mate's did not: no new requests.
                    "lagging": i.lagging,
                    # Its polls went unanswered while another server's did not (a stopped
                    # process or host): no requests until one is answered (routing.md).
                    "unresponsive": fleet.instances[i.url].unresponsive,
                    "reached": poller.reached,
                    "age_s": _age(i.age_s),
                    "probe": poller.probe,
                    "kind": poller.backend.kind if poller.backend is not None else None,
                    # False for a while after it refused the stream_options the proxy adds
                    # (routing.md, "SLO targets").
                    "takes_stream_options": poller.instance.takes_stream_options(now),
                    "error": poller.error,
                    "server_info": poller.info,
                    "prefix": prefix_state(fleet, i.url, now),
                    "prefill_ms_per_1k_tokens": _per_1k(fleet.instances[i.url].prefill_ms_per_token),
                    # What its counters prefilled of the uncached prompt tokens we sent it (30 s;
                    # under 1: it held prompts the router did not credit; routing.md).
                    "prefilled_share": round(fleet.instances[i.url].prefilled_share(now), 3),
                    # Seconds since it last sent bytes to a request of ours (null: never), and
                    # how many of ours it holds: what the no-progress rule judges (routing.md).
                    "last_byte_age_s": _age(now - poller.instance.progress_at),
                    "attempts": len(poller.instance.attempts),
                    # Seconds since its engine's progress mark (SGLang's load snapshot time,
                    # vLLM's token counters and KV usage) last moved; null: none known to move. An idle
                    # engine's holds still too.
                    "engine_still_s": _rounded(fleet.instances[i.url].engine_still_s(now)),
                    # Its data-parallel ranks (SGLang --dp-size; 1 when it reports none) and
                    # those judged hung among working ones, which its requests avoid.
                    "dp_ranks": max(len(fleet.instances[i.url].rank_marks), 1),
                    "hung_ranks": list(fleet.instances[i.url].out_ranks),
                }
            )
        pools[name] = {
            "speculative": pool.speculative,
            "num_draft_tokens": pool.num_draft_tokens,
            "alpha": pool.alpha,
            # How much one request's TPOT varies around the pool's mean (std / mean; a spec pool's
            # from its requests' own accept lengths; 0: none known) and the responses behind it.
            "tpot_cv": round(pool.tpot_cv, 4),
            "tpot_cv_samples": fleet.pools[name].spread.samples,
            # Its recent requests' TPOT over the TPOT predicted for them (median, last minute;
            # in proportion below `tpot_outcomes_min`), and how many finished in that minute.
            "tpot_bias": round(pool.tpot_bias, 3),
            # Whether the SLO check applies that bias on a plain pool too (flow control on).
            "load_held": pool.load_held,
            "tpot_outcomes": fleet.pools[name].outcomes.samples(now),
            "tpot_outcomes_min": fleet.pools[name].outcomes.min_samples,
            # Its requests finished within the SLO targets in the last minute: per second, and
            # their part of all it finished (null: no targets, or under 30 s of them).
            "slo_met_per_s": _rounded(fleet.pools[name].attainment.rate(now)),
            "slo_met_share": _rounded(fleet.pools[name].attainment.share(now)),
            # This proxy's requests that left it per second over the last minute, however they
            # ended (flow control's fair share of a wait: its requests in the fleet over the
            # pools' sum of this; null as above).
            "finished_per_s": _rounded(pool.finished_per_s),
            "stale": pool.stale,
            "age_s": _age(pool.age_s),
            "instances": instances,
        }
    acceptance = fleet.acceptance("spec")
    workloads = fleet.workload_acceptance("spec")
    pool_tau = acceptance.accept_length() if acceptance is not None else None
    return {
        "policy": settings.policy,
        # Whether the decision runs compiled (make native) or from source, and why.
        "decision_path": asdict(native.status()),
        "poll_interval_ms": settings.poll_interval_ms,
        "stale_ms": settings.stale_ms,
        "pools": pools,
        "acceptance": {
            "accept_length": acceptance.accept_length() if acceptance is not None else None,
            "alpha": acceptance.alpha() if acceptance is not None else None,
            "evidence_steps": round(acceptance.evidence(now), 1) if acceptance is not None else 0.0,
            "half_life_s": settings.acceptance_half_life_s,
            # Per workload key (keys only, never text), the most evidence first: its own accept
            # length and the estimate its requests are routed on (shrunk toward the pool's).
            "workloads": {
                "keys": len(workloads) if workloads is not None else 0,
                "prior_steps": workloads.prior_steps if workloads is not None else None,
                "top": workloads.top(now, WORKLOADS_SHOWN, pool_tau) if workloads is not None else [],
            },
        },
        # The output length a request without max_tokens is predicted to have: the mean of the
        # responses seen (moving), and how many (below the policy's minimum the prior's counts).
        "output": {"mean_tokens": _rounded(snap.mean_output_tokens), "samples": snap.output_samples},
        "cost_model": {
            "profile": settings.profile,
            "decode_step_ms": fleet.cost.estimates(now=now),
            # Per pool: predicted prefill ms by prompt length, and the evidence behind each
            # prediction (observations' worth; 0 = the profile's or the prior's guess alone).
            "learned": fleet.cost.confidence(now=now),
            "half_life_s": settings.costmodel_half_life_s,
            # Seconds since the model last learned anything (null: never); past the lull
            # (SPECROUTE_COSTMODEL_LULL_S, the half-life unless set), what it learned stops aging
            # until traffic returns (routing.md).
            "observed_age_s": _age(now - fleet.cost.last_observed_at)
            if fleet.cost.last_observed_at is not None
            else None,
        },
        "prefix": {
            "block_tokens": fleet.prefix.block_tokens,
            "entries": len(fleet.prefix),
            "max_entries": fleet.prefix.max_blocks,
            "evicted": fleet.prefix.evicted,
            "sessions": len(fleet.sessions),
        },
        "decisions": list(decisions.recent),
    }


def prefix_state(fleet: FleetModel, url: str, now: float) -> dict[str, Any]:
    """An instance's prefix cache as the router sees it: the blocks the index holds for it (and
    its cap), the trust in its claims, what its responses reported (responses with a cache
    report, their prompt and cached tokens, the hit rate) and the tokens credited to them."""
    signals = fleet.instances.get(url)
    stats = signals.cache if signals is not None else None
    rate = stats.hit_rate() if stats is not None else None
    return {
        "blocks": fleet.prefix.blocks(url),
        "capacity_blocks": fleet.prefix.capacity_blocks(url),
        "trust": round(fleet.prefix.trust(url, now), 4),
        "reported_responses": stats.responses if stats is not None else 0,
        "reported_prompt_tokens": stats.prompt_tokens if stats is not None else 0,
        "reported_cached_tokens": stats.cached_tokens if stats is not None else 0,
        "reported_hit_rate": None if rate is None else round(rate, 4),
        "credited_tokens": stats.credited_tokens if stats is not None else 0,
    }
