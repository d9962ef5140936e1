"""`goodput` (the default): send each request where it is predicted to finish sooner.

For each pool, on the instance the request would join:
  wait    = requests over the cap ahead of it x (a typical request's time / cap), 0 below the cap
  prefill = the cost model's prefill time for the waiting prompts and this one (FCFS, chunked)
  decode  = output tokens / tau(alpha, k) x step(B + 1, k + 1) on spec, tokens x step(B + 1, 1) on base
            (output tokens: max_tokens if the request runs to it, else the recent mean, capped)
  others  = what joining costs the B requests already decoding there (our prefill stalls them,
            and each of their steps gets longer),
            weighted by `externality` (1 = count their time like ours, 0 = ignore it)
and picks the smaller sum. Counting the others' slowdown is what keeps the fleet near the best
mean latency instead of each request grabbing the faster pool until it is no longer faster.
Taking the spec pool's last free slot also costs the *slot price*: the next request then has to
go to base, where a prompt of the recent mean length costs the requests running there its
prefill. So when spec is about full its slots go to the long prompts (whose prefill would stall
base's large batch most) and short prompts go to base.

Prefills stall decode (SGLang runs them before the next decode step): at the rate this router has
sent prompts to an instance, a share `busy` of its time goes to prefill, and the time per output
token there is step / tau / (1 - busy). That is the predicted TPOT.

With a service-level objective (`slo_ttft_s`, `slo_tpot_ms`; 0 = none) a `latency` request that
meets it on one pool only goes there (`slo-spec`, `slo-base`); one that can meet it queued on a
full spec pool may queue there (and then competes on cost); one met on neither pool queues there
when base's prefill backlog would outlast spec's queue by more than a TTFT target
(`spec-backlog`); and the slowdown imposed on the others is weighted by 1 / (1 - TPOT / target)
(a pool near its TPOT target is hurt much more by one more prefill). Without an SLO:

Request classes:
- `latency` never queues on the spec pool past its cap (`spec-full` sends it to base), but for the
  SLO exceptions above (it meets its targets there, or `spec-backlog`: it is served sooner there);
- `batch` goes where the fleet's total token throughput gains most from one more sequence.

A stale spec reading (older than SPECROUTE_STALE_MS) is not trusted: the request goes to base
(`stale`), the pool that degrades gracefully under load, until fresh readings return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleet.acceptance import accept_length
from fleet.types import Decision, Features, InstanceState, PoolState, Snapshot, StepCost
from policies.registry import register

# Past this share of time spent prefilling, a server's decode is predicted 10x slower; the cap
# keeps a burst's prediction finite.
MAX_PREFILL_SHARE = 0.9
# A pool at (or past) 95 % of its TPOT target weighs the slowdown it suffers 20x, not infinitely.
MAX_TPOT_SHARE = 0.95
# A request may queue for a slot only if it would meet its TTFT target at about the 90th
# percentile of the wait (this many standard deviations above the mean), not just on average.
WAIT_QUANTILE_Z = 1.28
# The configured output length counts as this many responses against the learned mean: the first
# few responses of a heavy-tailed length distribution say little about the next.
OUTPUT_PRIOR_SAMPLES = 10


@dataclass(frozen=True, slots=True)
class Prediction:
    """Seconds a request would spend on a pool, and the decode batch it would join."""

    wait_s: float
    prefill_s: float
    decode_s: float
    others_s: float
    batch: int
    tokens_per_s: float
    """Pool throughput (tokens/s) at the joined batch, for the batch class."""
    over_cap: float
    """How far past the running cap the request is expected to arrive (> 0: it would queue)."""
    tpot_s: float = 0.0
    """Predicted seconds per output token: the decode step / tau, stretched by the prefills."""
    wait_spread_s: float = 0.0
    """How much longer than `wait_s` the wait for a slot may be (about its 90th percentile)."""
    others_tpot_s: float = 0.0
    """Predicted seconds per output token of the requests already decoding there, with the
    prompts queued ahead (this one's included) stalling them."""

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.prefill_s

    @property
    def total_s(self) -> float:
        return self.wait_s + self.prefill_s + self.decode_s

    @property
    def cost_s(self) -> float:
        return self.total_s + self.others_s


@register("goodput")
class Goodput:
    name = "goodput"

    def __init__(
        self,
        default_output_tokens: int = 256,
        default_alpha: float = 0.5,
        externality: float = 1.0,
        margin: float = 0.0,
        prefill_chunk_tokens: int = 8192,
        slo_ttft_s: float = 0.0,
        slo_tpot_ms: float = 0.0,
    ):
        self.default_output_tokens = default_output_tokens
        self.default_alpha = default_alpha
        self.externality = externality
        self.margin = margin
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_ms = slo_tpot_ms

    @property
    def slo_aware(self) -> bool:
        return self.slo_ttft_s > 0 or self.slo_tpot_ms > 0

    def output_tokens(self, features: Features, learned: float | None = None, samples: int = 0) -> int:
        """The output length to plan for: max_tokens when the request runs to it, else the
        recent requests' mean (`learned`, over `samples` responses) weighed against the
        configured default as OUTPUT_PRIOR_SAMPLES responses' worth, capped by max_tokens."""
        typical = self.default_output_tokens
        if learned and samples > 0:
            typical = int(
                round((OUTPUT_PRIOR_SAMPLES * typical + samples * learned) / (OUTPUT_PRIOR_SAMPLES + samples))
            )
        if features.max_tokens is None:
            return max(typical, 1)
        if features.ignore_eos:
            return max(features.max_tokens, 1)
        return max(min(features.max_tokens, typical), 1)

    def accept_length(self, pool: PoolState) -> tuple[float, int]:
        """(tau, tokens per sequence in a step) for a pool."""
        k = pool.num_draft_tokens if pool.speculative else 0
        if k <= 0:
            return 1.0, 1
        alpha = pool.alpha if pool.alpha is not None else self.default_alpha
        return accept_length(alpha, k), k + 1

    def prefill_share(self, pool: PoolState, instance: InstanceState, cost: StepCost, n_out: int = 0) -> float:
        """The share of the instance's time its prefills take, at the rate prompts were sent to it
        lately (each prefilled alone, at the recent mean length: they mostly arrive one by one).

        A server at its running cap admits a prompt only when a slot frees: prompts sent faster
        than that wait in its queue instead of stalling its decode. A slot is held for a typical
        decode (`n_out` tokens at the full batch) stretched by the prefills themselves, so the
        cap's turnover bounds the share at a / (1 + a), a = cap x prefill / decode."""
        if instance.dispatches_per_s <= 0:
            return 0.0
        mean_prompt = max(int(instance.prompt_tokens_per_s / instance.dispatches_per_s), 1)
        prefill_ms = cost.prefill_ms(pool.name, mean_prompt)
        busy = instance.dispatches_per_s * prefill_ms / 1000
        cap = max(instance.max_running, 1)
        if n_out > 1 and instance.load + 1 >= cap:
            tau, width = self.accept_length(pool)
            held_ms = (n_out - 1) * cost.decode_step_ms(pool.name, cap, width) / tau
            a = cap * prefill_ms / held_ms
            busy = min(busy, a / (1 + a))
        return min(busy, MAX_PREFILL_SHARE)

    def predict(
        self,
        pool: PoolState,
        instance: InstanceState,
        features: Features,
        cost: StepCost,
        n_out: int,
        triage: bool = False,
    ) -> Prediction:
        """`n_out`: the output tokens planned for (`output_tokens`); `triage`: see `pressure`."""
        tau, width = self.accept_length(pool)
        cap = max(instance.max_running, 1)
        load = max(instance.load, 0.0)
        waiting = max(instance.waiting, 0.0)
        batch = int(min(load + 1, cap))
        step_ms = cost.decode_step_ms(pool.name, batch, width)
        tpot_ms = step_ms / tau / (1 - self.prefill_share(pool, instance, cost, n_out))
        # The own decode is costed unstretched: the prefills stall both pools' decodes alike, and
        # what joining adds to them is in `others`.
        decode_ms = max(n_out - 1, 0) / tau * step_ms
        prompt = max(features.prompt_tokens, 1)
        # SGLang prefills the queue first come, first served, before any decode step: the first
        # token comes after every waiting prompt (their tokens when the server reports them, else
        # each assumed as long as this one) and this one, in chunks of `prefill_chunk_tokens`.
        ahead = instance.waiting_tokens if instance.waiting_tokens is not None else waiting * prompt
        queued = ahead + prompt
        chunks = math.ceil(queued / self.prefill_chunk_tokens)
        prefill_ms = chunks * cost.prefill_ms(pool.name, math.ceil(queued / chunks))
        own_prefill_ms = cost.prefill_ms(pool.name, prompt)
        # Past the cap, a slot frees every (typical request time / cap): the queue drains at that
        # rate. A typical request holds its slot for its decode at the stretched TPOT. (Counting
        # the slots running requests free while the prompts ahead are prefilled admitted too
        # many: the requests still running are the long ones.)
        typical_ms = max(n_out - 1, 0) * tpot_ms + own_prefill_ms
        over = load + 1 - cap
        wait_ms = over * typical_ms / cap if over > 0 else 0.0
        # Slots free at random (output lengths vary widely): waiting for the n-th is a sum of n
        # about exponential gaps, whose 90th percentile is some 1.3 standard deviations above it.
        spread_ms = WAIT_QUANTILE_Z * math.sqrt(over) * typical_ms / cap if over > 0 else 0.0
        others_ms = 0.0
        running = min(max(instance.running, 0.0), cap - 1)
        if running >= 1 and over <= 0:
            # Joining costs the running requests our prefill (decode stalls while it runs) and a
            # longer step for the rest of their decode (on average half their output is left).
            slower = step_ms - cost.decode_step_ms(pool.name, max(int(load), 1), width)
            others_ms = running * (own_prefill_ms + max(slower, 0.0) * (n_out / 2) / tau)
        # The requests decoding there sit through the prompts queued ahead of us and ours before
        # their next token: spread over what they have left (about half an output), that stall
        # is part of their TPOT, which sets how much they mind it (`pressure`). Our own TPOT
        # leaves it out: the queue ahead is prefilled before our first token (TTFT).
        others_tpot_ms = tpot_ms + prefill_ms / max(n_out / 2, 1.0)
        return Prediction(
            wait_s=wait_ms / 1000,
            prefill_s=prefill_ms / 1000,
            decode_s=decode_ms / 1000,
            others_s=self.externality * self.pressure(others_tpot_ms, triage) * others_ms / 1000,
            batch=batch,
            tokens_per_s=batch * tau / step_ms * 1000,
            over_cap=max(over, 0.0),
            wait_spread_s=spread_ms / 1000,
            tpot_s=tpot_ms / 1000,
            others_tpot_s=others_tpot_ms / 1000,
        )

    def decide(self, features: Features, snapshot: Snapshot) -> Decision:
        spec, base = snapshot.pool("spec"), snapshot.pool("base")
        spec_up = spec is not None and spec.available
        base_up = base is not None and base.available
        if not spec_up:
            return Decision(pool="base", reason="spec-down" if base_up else "none-healthy")
        if not base_up:
            return Decision(pool="spec", reason="base-down")
        assert spec is not None and base is not None
        if spec.stale:
            return Decision(pool="base", reason="stale")
        if snapshot.cost is None:
            raise ValueError("the goodput policy needs a step-cost model in the snapshot")
        joined_spec, joined_base = spec.least_loaded(), base.least_loaded()
        assert joined_spec is not None and joined_base is not None
        n_out = self.output_tokens(features, snapshot.mean_output_tokens, snapshot.output_samples)
        on_spec = self.predict(spec, joined_spec, features, snapshot.cost, n_out)
        on_base = self.predict(base, joined_base, features, snapshot.cost, n_out)
        scores = {
            "t_spec_s": round(on_spec.total_s, 6),
            "t_base_s": round(on_base.total_s, 6),
            "cost_spec_s": round(on_spec.cost_s, 6),
            "cost_base_s": round(on_base.cost_s, 6),
            "batch_spec": float(on_spec.batch),
            "batch_base": float(on_base.batch),
            "tpot_spec_ms": round(on_spec.tpot_s * 1000, 3),
            "tpot_base_ms": round(on_base.tpot_s * 1000, 3),
        }
        spec_full = on_spec.over_cap > 0
        if features.request_class == "batch":
            gain_spec = 0.0 if spec_full else self._gain(spec, joined_spec, snapshot.cost)
            gain_base = 0.0 if on_base.over_cap > 0 else self._gain(base, joined_base, snapshot.cost)
            scores["gain_spec_tok_s"] = round(gain_spec, 3)
            scores["gain_base_tok_s"] = round(gain_base, 3)
            if gain_spec > 0 or gain_base > 0:
                pool = "spec" if gain_spec > gain_base else "base"
                return Decision(pool=pool, reason=f"throughput-{pool}", scores=scores)
        else:
            if self.slo_aware:
                meets_spec, meets_base = self.meets_slo(on_spec), self.meets_slo(on_base)
                scores["slo_spec"], scores["slo_base"] = float(meets_spec), float(meets_base)
                if spec_full and meets_spec:
                    spec_full = False  # queued on spec it still meets its target: it may wait
                elif meets_spec != meets_base:
                    pool = "spec" if meets_spec else "base"
                    return Decision(pool=pool, reason=f"slo-{pool}", scores=scores)
                elif not meets_spec:
                    # Met on neither pool: this request is lost whatever we do. It should cost
                    # the requests that can still meet theirs as little as possible, and those
                    # running on a pool already past its TPOT target cannot: their delay counts
                    # as plain latency there, not near-target pressure.
                    scores["slo_lost"] = 1.0
                    on_spec = self.predict(spec, joined_spec, features, snapshot.cost, n_out, triage=True)
                    on_base = self.predict(base, joined_base, features, snapshot.cost, n_out, triage=True)
                    scores["cost_spec_s"] = round(on_spec.cost_s, 6)
                    scores["cost_base_s"] = round(on_base.cost_s, 6)
                    # Keeping a lost request out of spec's queue spares spec's slots for requests
                    # it can still serve in time, but in a burst it piles the whole overflow onto
                    # base's prefill queue: spec empties and idles while base works through a
                    # backlog that every arrival after the burst then finds in the way (spec alone
                    # takes them and misses too). Once base's first token is more than a TTFT
                    # target later than spec's, spec would sit ready a whole target's time while
                    # base still cannot serve anyone: the lost request queues on spec instead,
                    # where its own first token also comes sooner. Not past base's cap: there
                    # base's queue is one for slots too, which does not clear when the burst ends.
                    if spec_full and on_base.over_cap <= 0 and on_base.ttft_s - on_spec.ttft_s > self.slo_ttft_s > 0:
                        return Decision(pool="spec", reason="spec-backlog", scores=scores)
            if spec_full:
                return Decision(pool="base", reason="spec-full", scores=scores)
        price = 0.0
        if joined_spec.load + 1 >= joined_spec.max_running:
            price = self.slot_price(snapshot, base, joined_base, features)
            scores["slot_price_s"] = round(price, 6)
        if (on_spec.cost_s + price) * (1 + self.margin) < on_base.cost_s:
            return Decision(pool="spec", reason="spec-sooner", scores=scores)
        return Decision(pool="base", reason="base-sooner", scores=scores)

    def slot_price(self, snapshot: Snapshot, base: PoolState, joined_base: InstanceState, features: Features) -> float:
        """What taking the spec pool's last free slot costs: the next request then goes to base,
        where a prompt of the recent mean length costs the requests running there its prefill."""
        sent = sum(i.dispatches_per_s for p in snapshot.pools.values() for i in p.healthy_instances)
        tokens = sum(i.prompt_tokens_per_s for p in snapshot.pools.values() for i in p.healthy_instances)
        if sent <= 0 or snapshot.cost is None:
            return 0.0
        typical = Features(
            prompt_tokens=max(int(tokens / sent), 1), max_tokens=features.max_tokens, ignore_eos=features.ignore_eos
        )
        n_out = self.output_tokens(typical, snapshot.mean_output_tokens, snapshot.output_samples)
        return self.predict(base, joined_base, typical, snapshot.cost, n_out).others_s

    def meets_slo(self, p: Prediction) -> bool:
        """Whether a prediction meets the configured targets (a target of 0 is not checked)."""
        ttft_ok = self.slo_ttft_s <= 0 or p.ttft_s + p.wait_spread_s <= self.slo_ttft_s
        tpot_ok = self.slo_tpot_ms <= 0 or p.tpot_s * 1000 <= self.slo_tpot_ms
        return ttft_ok and tpot_ok

    def pressure(self, tpot_ms: float, triage: bool = False) -> float:
        """How much a pool's running requests mind being slowed: 1 without a TPOT target, else
        1 / (1 - TPOT / target) (near its target, a little more delay makes them miss it).
        With `triage` (for a request that meets its target on neither pool), a pool predicted
        past its TPOT target counts 1: its requests miss their target anyway."""
        if self.slo_tpot_ms <= 0:
            return 1.0
        if triage and tpot_ms >= self.slo_tpot_ms:
            return 1.0
        return 1 / (1 - min(tpot_ms / self.slo_tpot_ms, MAX_TPOT_SHARE))

    def _gain(self, pool: PoolState, instance: InstanceState, cost: StepCost) -> float:
        """Tokens/s the pool's instance adds by taking one more sequence into its batch."""
        tau, width = self.accept_length(pool)
        running = int(min(max(instance.load, 0.0), instance.max_running - 1))
        after = running + 1
        rate_after = after * tau / cost.decode_step_ms(pool.name, after, width)
        rate_now = running * tau / cost.decode_step_ms(pool.name, running, width) if running else 0.0
        return (rate_after - rate_now) * 1000
