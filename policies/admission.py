"""Admission: refuse a request up front, fast, when the fleet cannot give it a first token in time.

Pure, like the policies: `admit(features, snapshot, decision)` reads what the router knows and
returns None (admit) or a Refusal with the seconds after which a retry may find room. The
rules, top to bottom (docs/routing.md, "Admission control"):

1. `predicted-ttft`: a request whose predicted time to first token on the pool the policy chose
   (its slow end: the wait for a slot at about its 90th percentile, plus the prefill of the
   queue ahead and its own) is past the TTFT limit; a prompt whose own prefill alone takes more
   than 1 - LONG_PROMPT_WAIT of the limit, when the wait ahead of it is past LONG_PROMPT_WAIT of
   it (`ttft_limit_for`): it is refused for what is ahead of it, never on an idle fleet for its
   own length, which no wait would shorten.
2. `predicted-tpot`: a request that would push the pool's time per output token past the TPOT
   limit: the requests decoding there sit through every prompt queued ahead of their next
   token, so a pool can meet every first-token target while its running streams crawl.
3. `shed-batch`: a `batch` request within those limits whose predicted time to first token, or
   its pool's time per output token, is past BATCH_SHARE of them. Batch work is the first to
   go, so latency work keeps its room.

The prediction is goodput's (policies/goodput.py `predict`), whatever policy routes: the queue
ahead, the slots freeing past the cap, the prefill in chunks. A request refused costs the fleet
nothing; one admitted that cannot meet its target costs every request behind it.

Predictions err, most of all in a burst, so the limits are the targets times a `scale` that
follows what happened to the requests admitted (`observe`, told whether each finished one met
both targets): each miss shrinks it, each request that met them grows it a little, balanced so
that it settles where TARGET_ATTAINMENT of the admitted meet their targets. Its floor keeps
admission from closing on a fleet that cannot meet the targets at any load. What shrank it fades
as all learned evidence here does (SCALE_HALF_LIFE_S): after an overload, few requests are
admitted to tell it the fleet is quiet again (batch ones never do), so the outcomes alone would
keep an idle fleet refusing for minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleet.types import Decision, Features, PoolName, Snapshot, StepCost
from policies.goodput import Goodput, Prediction

BATCH_SHARE = 0.5
"""A batch request is shed when its predicted first token is past this share of the limit."""
MIN_RETRY_AFTER_S = 1
LONG_PROMPT_WAIT = 0.5
"""The share of the TTFT limit a prompt may still wait whose own prefill takes more than the rest
of it: the limit it is held to grows with its prefill from there (continuous), so a long prompt
is never refused on an idle fleet, and a prompt a little longer gets no more wait than one a
little shorter."""
TARGET_ATTAINMENT = 0.97
"""The share of admitted requests the scale steers to meet their targets. A controller settles
around its setpoint, below it about half the time, so the setpoint sits above the floor the
admitted should not fall under (95 %): at 0.95 itself an HTTP run at twice the capacity ended at
94.0 % (judged per chunk, docs/reliability.md)."""
GAIN = 0.1
"""How fast the scale moves: a miss multiplies it by about 0.91, a met request by about 1.003."""
MIN_SCALE = 0.1
SCALE_HALF_LIFE_S = 30.0
"""Half-life of the scale's shrink (its logarithm decays toward 0, the targets themselves). Long
beside the stream of outcomes under load, which holds the scale where it settles; short beside
the quiet after an overload: from the floor back to 0.8 in about 100 s with nothing admitted."""


@dataclass(frozen=True, slots=True)
class Refusal:
    rule: str
    predicted_ttft_s: float
    predicted_tpot_s: float
    """The time per output token of the pool's streams with the request admitted (predicted)."""
    retry_after_s: int
    """Whole seconds (the `retry-after` header): about when the queue ahead will have drained."""
    ttft_limit_s: float = 0.0
    """The limits the prediction was held to (the targets at the admission's scale now, and at
    a share of it for `shed-batch`; 0: not checked)."""
    tpot_limit_s: float = 0.0


class Admission:
    def __init__(self, ttft_limit_s: float, tpot_limit_s: float = 0.0, predictor: Goodput | None = None) -> None:
        self.ttft_limit_s = ttft_limit_s
        self.tpot_limit_s = tpot_limit_s
        self.predictor = predictor or Goodput()
        self.scale = 1.0
        """The limits in force are the targets times this (in [MIN_SCALE, 1]), as of `scale_at`."""
        self.scale_at = 0.0
        """When `scale` was last moved (the caller's clock: monotonic, or the virtual one)."""

    def scale_now(self, now: float) -> float:
        """The scale at `now`: its shrink faded by the time since it was last moved."""
        elapsed = now - self.scale_at
        if elapsed <= 0 or self.scale >= 1.0:
            return self.scale
        return min(1.0, self.scale ** (0.5 ** (elapsed / SCALE_HALF_LIFE_S)))

    def alone_prefill_s(self, pool: PoolName, prompt_tokens: int, cached_tokens: int, cost: StepCost) -> float:
        """A finished request's own prefill with nothing ahead (its uncached tokens), as its
        admission predicted it: what `met` is given."""
        return self.predictor.alone_prefill_ms(pool, max(prompt_tokens - cached_tokens, 1), cost) / 1000

    def met(self, ttft_s: float, tpot_s: float, own_prefill_s: float) -> bool:
        """Whether a finished request met the limits it was held to at the targets themselves
        (what `observe` is told): its first token within `ttft_limit_for` its own prefill alone
        (`Goodput.alone_prefill_ms`) at scale 1, which no scale admits past; its tokens at the
        TPOT target. Judged against the TTFT target itself, a long prompt admitted to wait was
        a miss, and its misses tightened the limits every other request is held to."""
        ttft_limit = self.ttft_limit_for(own_prefill_s)
        return (ttft_limit <= 0 or ttft_s <= ttft_limit) and (self.tpot_limit_s <= 0 or tpot_s <= self.tpot_limit_s)

    def observe(self, met: bool, now: float) -> None:
        """An admitted request finished at `now`; `met`: it met both targets. In expectation the
        scale stands still where a share 1 - TARGET_ATTAINMENT of them miss."""
        miss = 0.0 if met else 1.0
        scale = self.scale_now(now)
        self.scale = min(1.0, max(MIN_SCALE, scale * math.exp(GAIN * ((1 - TARGET_ATTAINMENT) - miss))))
        self.scale_at = max(self.scale_at, now)

    @property
    def enabled(self) -> bool:
        return self.ttft_limit_s > 0 or self.tpot_limit_s > 0

    def predict(self, features: Features, snapshot: Snapshot, decision: Decision) -> Prediction | None:
        pool = snapshot.pool(decision.pool)
        if pool is None or snapshot.cost is None:
            return None
        instance = pool.least_loaded()
        if instance is None:
            return None
        n_out = self.predictor.output_tokens(features, snapshot.mean_output_tokens, snapshot.output_samples)
        # The streams decoding there now sit through the prompts sent lately at their rate.
        return self.predictor.predict(pool, instance, features, snapshot.cost, n_out, now=True)

    def ttft_limit_for(self, own_prefill_s: float, share: float = 1.0) -> float:
        """The TTFT limit a request is held to (0: none): the target at `share`, or its own
        prefill plus LONG_PROMPT_WAIT of that when this is more. Held to the target, a prompt
        whose own prefill is past it was refused (429, retry in a second) on an idle fleet, on
        every retry; held to its own prefill alone, behind any queue at all."""
        if self.ttft_limit_s <= 0:
            return 0.0
        limit = self.ttft_limit_s * share
        return max(limit, own_prefill_s + LONG_PROMPT_WAIT * limit)

    def past_limits(self, ttft_s: float, tpot_s: float, share: float, own_prefill_s: float = 0.0) -> str | None:
        """The rule a prediction breaks with the limits at `share` of the targets, if any."""
        if self.ttft_limit_s > 0 and ttft_s > self.ttft_limit_for(own_prefill_s, share):
            return "predicted-ttft"
        if self.tpot_limit_s > 0 and tpot_s > self.tpot_limit_s * share:
            return "predicted-tpot"
        return None

    def admit(self, features: Features, snapshot: Snapshot, decision: Decision, now: float) -> Refusal | None:
        if not self.enabled:
            return None
        p = self.predict(features, snapshot, decision)
        if p is None:
            return None  # nothing known to judge by (no reading yet): the pool decides
        ttft = p.ttft_s + p.wait_spread_s
        tpot = max(p.tpot_s, p.others_tpot_s)
        scale = self.scale_now(now)
        own = p.own_prefill_s
        rule = self.past_limits(ttft, tpot, scale, own)
        if (
            rule is None
            and features.request_class == "batch"
            and self.past_limits(ttft, tpot, scale * BATCH_SHARE, own)
        ):
            rule, scale = "shed-batch", scale * BATCH_SHARE
        if rule is None:
            return None
        # About when the queue ahead will have drained: its prefill (not the request's own), or
        # (for TPOT) the time the running requests need to get through what stalls them.
        retry = max(MIN_RETRY_AFTER_S, math.ceil(max(p.prefill_s - p.own_prefill_s, 0.0) + p.wait_s))
        return Refusal(
            rule=rule,
            predicted_ttft_s=ttft,
            predicted_tpot_s=tpot,
            retry_after_s=retry,
            ttft_limit_s=self.ttft_limit_for(own, scale),
            tpot_limit_s=self.tpot_limit_s * scale,
        )
