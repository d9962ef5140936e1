"""`goodput` (the default): send each request where it is predicted to finish sooner.

For each pool, on the instance the request would join (`predict`):
  wait    = requests over the cap ahead of it x (a typical request's time / cap), 0 below the cap
  prefill = the cost model's prefill time for the waiting prompts and this one (FCFS, chunked),
            less the prefix the instance holds in its prefix cache (`Features.cached`)
  decode  = output tokens / tau(alpha, k) x step(B + 1, k + 1) on spec, tokens x step(B + 1, 1) on base
            (output tokens: max_tokens if the request runs to it, else the recent mean, capped)
  others  = what joining costs the B requests already decoding there (our prefill stalls them,
            and each of their steps gets longer), weighted by `externality` (1 = count their
            time like ours, 0 = ignore it) and, with a TPOT target, by 1 / (1 - TPOT / target)
            (`pressure`: a pool near its target is hurt much more by one more prefill)
Counting the others' slowdown is what keeps the fleet near the best mean latency instead of each
request grabbing the faster pool until it is no longer faster. Prefills stall decode (SGLang
runs them before the next decode step): at the rate this router has sent prompts to an
instance, a share `busy` of its time goes to prefill (at most what the turnover of the batch it
joins brings in: `prefill_share`), and the predicted time per output token (TPOT) there is
step / tau / (1 - busy).

The instance a request would join (`join`): with `cache_credit` (the default), the one of its
pool with the smallest predicted cost, its cached prefix credited; without, the least loaded.
Load weighs against the credit: a busier instance's longer steps, its queue of prompts and what
joining costs its running requests are all in the cost, and past its running cap the wait for a
slot, so a hot prefix spills to another instance at the latest when its holder is full. The
decision names the instance it was predicted on.

`decide` then applies these rules in order; the first that returns a Decision decides
(docs/routing.md, "`goodput`'s rules, in order", describes each under the same name). Three
only amend the case for the rules after them (marked "amends"). The SLO rules need targets
(`slo_ttft_s`, `slo_tpot_ms`; 0 = none, the default) and a `latency` request; `spec-full`
needs a `latency` request. Figures are from the virtual-clock evaluation (`python -m
bench.routing`, seeds 0-2 pooled unless stated), with the commit that recorded them.

Each rule, its reason tokens, and what it earned:

 1. `pool-down` (`spec-down`, `base-down`, `none-healthy`, `spec-only`, `base-only`): no figure
    recorded; every policy has this guard.
 2. `stale` (`stale`): no figure recorded; issue 4 asked for conservative routing on a stale
    reading.
 3. `throughput` (`throughput-spec`, `throughput-base`; batch class): no figure recorded; issue
    4's rule, and the routing evaluation sends latency requests only.
 4. `slo-queue-allowance` (amends: the request may queue on a full spec pool): came with SLO-aware
    routing (dcb59ca, bcedd6d), which together with `slo-one-pool`, the pressure weighting and
    `slot-price` took Poisson 110 % from 0.92-0.99x to 1.04-1.30x the oracle split on the four
    fleets that missed it (missed targets 13 -> 5). Checking TTFT at the wait's 90th percentile
    instead of its mean (94d18a8): queued requests that missed TTFT went from 75 of 870 to 18 of
    823 on kimi-linear at 256 clients, which went from 0.58x to 0.64x the oracle split, kimi-moe
    at 256 clients from 0.97x to 1.01x (96ea7b9, 4e4cf4e).
 5. `slo-one-pool` (`slo-spec`, `slo-base`): it came with SLO-aware routing, whose joint figure is
    under 4. Checking TPOT on a speculative pool at the requests' 90th percentile (their own
    acceptance spreads it, `PoolState.tpot_cv`) instead of the pool's mean: at 128 clients
    llama3b-a10 went from 0.81x to 0.98x the oracle split and llama70b-tp4-h100 from 0.81x to 1.01x
    (bench.learning's cells, own profile; 0.85-0.87x -> 0.96-1.05x with none or a wrong one):
    filled to its cap by requests predicted just inside the target, spec had 43 % of its requests
    past it. Applied to requests allowed to queue on a full spec (f71f61e; they skipped it before,
    and the cost comparison sent requests met on spec only to a base past its TPOT target:
    kimi-linear at 256 clients, seed 0, 1,014 `base-sooner` decisions, 946 of base's 1,069 requests
    past it), with the prefill share bounded by the batch's turnover (bbb2b4c): bench.learning's
    70B at 256 clients 0.92 / 0.91 / 0.89x -> 1.27 / 1.25 / 1.34x (own / none / wrong),
    bench.routing's kimi-linear at 256 clients 0.63x -> 0.84x and kimi-moe 1.10x -> 1.25x, h200
    a=0.45 at Poisson 110 % 1.02x -> 0.99x (per seed 1.00 / 0.97 / 1.01). The TPOT checked on
    spec scaled by how its recent requests came out against their predictions (`tpot_spread`,
    `PoolState.tpot_bias`): bench.learning's llama3b at Poisson 110 % with no profile 0.95x ->
    1.13x (spec's requests past TPOT 57 / 52 -> 21 / 21 on seeds 0 and 1), bench.routing's
    kimi-moe throughput at Poisson 110 % 1.28x -> 1.31x always-base.
 6. `slo-triage` (amends: score `slo_lost`, both pools re-costed): no figure of its own; with the
    two other TPOT corrections of 360d8dd, missed targets went from 3 to 1 and the h200 code
    trace from 1.11x to 1.16x the oracle split (34db47f). Triaging every request instead had cost
    kimi-moe at 90-110 % a third of its SLO goodput.
 7. `lost-together` (amends: a lost request's instance in a full pool): on the Mooncake replay
    (bench.prefix_eval, 2 + 2 instances, seeds 0-8) SLO goodput at 110 % went from 0.37-0.93
    req/s on all nine seeds to 2.26-2.44 on kimi-linear, and on h200 from 0.29 and 0.78 on two
    seeds (4.94-5.95 on the others) to 4.94-5.95 on all nine; at 90 % h200's worst seed went
    from 1.48 to 3.43. One instance per pool (bench.routing) is unchanged.
 8. `spec-backlog` (`spec-backlog`): the h200 code trace went from 1.13x to 1.18x the oracle split
    (mean E2E 6.61 s -> 4.64 s), kimi-linear's from 1.17x to 1.20x (4cd6915, 4e4cf4e).
 9. `spare-spec` (`spare-spec`): on bench.learning's cells (seeds 0-2, own / none / wrong
    profile) llama3b-a10, whose base is capped at 64, went at Poisson 110 % from 0.76 / 0.81 /
    0.88x the oracle split to 1.19 / 1.02 / 1.18x, at 256 clients from 0.86 / 1.23 / 1.09x to
    1.17 / 1.18 / 1.21x, at 128 from 0.98 / 1.01 / 0.96x to 1.15 / 1.10 / 1.15x (with closed
    loops counted in full, which moved these by at most 0.05). Applied below base's cap too it
    cost the Mooncake replay at 70 % its prefix credit's TTFT gain (1.61x -> 1.30x on h200).
10. `spec-full` (`spec-full`): issue 4's rule. Before the SLO rules, removing it made SLO goodput
    at overload worse: 30.1 against 37.0 req/s on h200 a=0.45 (docs/routing.md before bcedd6d).
    Its known cost: kimi-linear at 256 clients, 0.65x the oracle split (docs/routing.md).
11. `slot-price` (amends: spec's cost + the price): with the SLO rules, the overload figure under
    4; without SLO targets Poisson 110 % went from 0.92-1.11x to 0.93-1.26x the oracle split,
    together with the stretched queue prediction (bcedd6d).
12. `sooner` (`spec-sooner`, `base-sooner`; the cost comparison, always decides): the policy as a
    whole, mean E2E 0.17-1.00x the better static policy on every run and p99 at most 1.00x (the
    run of 2026-12-03 in docs/routing.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleet.acceptance import accept_length
from fleet.types import Decision, Features, InstanceState, PoolName, PoolState, Snapshot, StepCost
from policies.base import one_pool_left
from policies.goodput_params import GoodputParams
from policies.registry import register

# Past this share of time spent prefilling, a server's decode is predicted 10x slower; the cap
# keeps a burst's prediction finite.
MAX_PREFILL_SHARE = 0.9
# A pool at (or past) 95 % of its TPOT target weighs the slowdown it suffers 20x, not infinitely.
MAX_TPOT_SHARE = 0.95
# A request may queue for a slot only if it would meet its TTFT target at about the 90th
# percentile of the wait (this many standard deviations above the mean), not just on average;
# likewise its TPOT target at about the 90th percentile of the requests' spread around the mean.
WAIT_QUANTILE_Z = 1.28
# The configured output length counts as this many responses against the learned mean: the first
# few responses of a heavy-tailed length distribution say little about the next.
OUTPUT_PRIOR_SAMPLES = 10


@dataclass(slots=True)
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
    tpot_spread_s: float = 0.0
    """How much slower than `tpot_s` this request's tokens may come (about the 90th percentile:
    on a speculative pool each request's own acceptance varies around the pool's)."""
    own_prefill_s: float = 0.0
    """The prefill of its own uncached prompt alone: its first token's floor, whatever the load."""

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.prefill_s

    @property
    def total_s(self) -> float:
        return self.wait_s + self.prefill_s + self.decode_s

    @property
    def cost_s(self) -> float:
        return self.total_s + self.others_s


@dataclass(slots=True)
class Context:
    """One decision's case, as the rules after the guards read it. Three rules amend it instead
    of deciding: `slo-queue-allowance` (may_queue_on_spec), `slo-triage` (lost, and the
    predictions re-costed) and `slot-price` (price); every other field is set before the rules."""

    features: Features
    snapshot: Snapshot
    cost: StepCost
    spec: PoolState
    base: PoolState
    joined_spec: InstanceState
    joined_base: InstanceState
    """The instance each pool's prediction is for (`join`)."""
    chosen: dict[str, str]
    """Pool -> the instance the decision names there: one chosen for its cached prefix."""
    n_out: int
    """The output tokens planned for (`Goodput.output_tokens`)."""
    on_spec: Prediction
    on_base: Prediction
    scores: dict[str, float]
    """What the decision exposes (the proxy merges it into traces, logs and the state endpoint)."""
    batch_class: bool
    spec_full: bool
    """The request would queue past the spec instance's running cap."""
    slo_checked: bool = False
    """SLO targets are set and the request is latency class: meets_spec/meets_base are known."""
    meets_spec: bool = False
    meets_base: bool = False
    may_queue_on_spec: bool = False
    lost: bool = False
    price: float = 0.0
    """The slot price added to spec's cost in `sooner`."""


class Goodput:
    name = "goodput"

    def __init__(self, params: GoodputParams | None = None, *, margin: float = 0.0, prefill_chunk_tokens: int = 8192):
        params = params or GoodputParams()
        self.default_output_tokens = params.output_tokens
        self.default_alpha = params.default_alpha
        self.externality = params.externality
        self.margin = margin
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.slo_ttft_s = params.slo_ttft_s
        self.slo_tpot_ms = params.slo_tpot_ms
        self.cache_credit = params.cache_credit

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

    def tpot_spread(self, pool: PoolState) -> float:
        """How much slower than the predicted mean TPOT the SLO check takes a request's on the
        pool, as a share of it (`Prediction.tpot_spread_s`): on a speculative pool, the mean
        corrected by how its recent requests' TPOT came out against their predictions
        (`PoolState.tpot_bias`) and taken at about the 90th percentile of the requests' own
        acceptance (`PoolState.tpot_cv`), never below the mean as predicted. A plain pool's
        requests share one step, and its batch is not capped near its TPOT target: what they
        got past the prediction is the load that came after them, not an error of the model
        (docs/routing.md, "SLO targets"); unless flow control holds what would push it past
        its targets (`PoolState.load_held`): then the mean is corrected by the bias there too.
        Without that correction a plain pool filled to where a newcomer's predicted TPOT just
        met the target, and most of its requests, sharing that batch, missed it."""
        if not pool.speculative:
            bias = pool.tpot_bias if pool.load_held else 1.0
            return bias - 1 if bias > 1 else 0.0
        checked = pool.tpot_bias * (1 + WAIT_QUANTILE_Z * pool.tpot_cv)
        return checked - 1 if checked > 1 else 0.0

    def prefill_share(self, pool: PoolState, instance: InstanceState, cost: StepCost, n_out: int = 0) -> float:
        """The share of the instance's time its prefills take, at the rate prompts were sent to it
        lately (each prefilled alone, at the recent mean length: they mostly arrive one by one).

        Over a request's decode, the prompts that reach its batch are about the batch's own
        turnover: B requests (the batch it joins, the cap when full) each hold a slot for a
        typical decode (`n_out` tokens at that batch) stretched by the prefills themselves, so
        the share is at most a / (1 + a), a = B x prefill / decode. At the cap, prompts sent
        faster wait in the queue instead of stalling its decode; below it, a burst sent faster
        stalls the decode only while it lasts, shorter than a decode."""
        tau, width = self.accept_length(pool)
        batch = self.joined_batch(instance)
        step_ms = cost.decode_step_ms(pool.name, batch, width)
        return self._prefill_share(pool.name, instance, cost, n_out, tau, batch, step_ms)

    def joined_batch(self, instance: InstanceState) -> int:
        """The decode batch a request joining the instance runs in: its running and waiting
        requests and this one, at most its running cap (at least 1)."""
        max_running = instance.max_running
        cap = 1 if 1 > max_running else max_running
        load = instance.running + instance.waiting
        load = 0.0 if 0.0 > load else load
        return int(cap if cap < load + 1 else load + 1)

    def _prefill_share(
        self,
        pool: PoolName,
        instance: InstanceState,
        cost: StepCost,
        n_out: int,
        tau: float,
        batch: int,
        step_ms: float,
    ) -> float:
        """`prefill_share`, the pool's accept length, the joined batch (`joined_batch`; 0: no
        bound) and its decode step given (the prediction has it already; max and min written
        out as in `_predict`)."""
        sent = instance.dispatches_per_s
        if sent <= 0:
            return 0.0
        mean_prompt = int(instance.prompt_tokens_per_s / sent)
        prefill_ms = cost.prefill_ms(pool, 1 if 1 > mean_prompt else mean_prompt)
        busy = sent * prefill_ms / 1000
        if n_out > 1 and batch > 0:
            held_ms = (n_out - 1) * step_ms / tau
            a = batch * prefill_ms / held_ms
            bound = a / (1 + a)
            busy = bound if bound < busy else busy
        return MAX_PREFILL_SHARE if MAX_PREFILL_SHARE < busy else busy

    def predict(
        self,
        pool: PoolState,
        instance: InstanceState,
        features: Features,
        cost: StepCost,
        n_out: int,
        triage: bool = False,
        now: bool = False,
    ) -> Prediction:
        """`n_out`: the output tokens planned for (`output_tokens`); `triage`: see `pressure`;
        `now`: the prefill share at the rate prompts were sent lately, bounded only at the cap:
        what the streams decoding there sit through in the next moments (admission judges
        those), not over a request's whole decode (`prefill_share`)."""
        tau, width = self.accept_length(pool)
        return self._predict(
            pool.name, instance, features, cost, n_out, triage, tau, width, self.tpot_spread(pool), now
        )

    def _predict(
        self,
        pool: PoolName,
        instance: InstanceState,
        features: Features,
        cost: StepCost,
        n_out: int,
        triage: bool,
        tau: float,
        width: int,
        tpot_spread: float = 0.0,
        now: bool = False,
    ) -> Prediction:
        """`predict`, the pool named, its accept length and `tpot_spread` given (a decision
        computes them once per pool, then predicts on each of its instances). Its
        clamps are written out: `b if b > a else a` is max(a, b) and `b if b < a else a` min(a,
        b), exactly (ties and all), without a builtin call each."""
        running, waiting, max_running = instance.running, instance.waiting, instance.max_running
        cap = 1 if 1 > max_running else max_running
        load = running + waiting
        load = 0.0 if 0.0 > load else load
        waiting = 0.0 if 0.0 > waiting else waiting
        batch = self.joined_batch(instance)
        step_ms = cost.decode_step_ms(pool, batch, width)
        # `now`: the turnover bounds the share only at the cap (0: no bound).
        bounded = (batch if load + 1 >= cap else 0) if now else batch
        tpot_ms = step_ms / tau / (1 - self._prefill_share(pool, instance, cost, n_out, tau, bounded, step_ms))
        # The own decode is costed unstretched: the prefills stall both pools' decodes alike, and
        # what joining adds to them is in `others`.
        rest = 0 if 0 > n_out - 1 else n_out - 1
        decode_ms = rest / tau * step_ms
        prompt_tokens = features.prompt_tokens
        prompt = prompt_tokens - self.cached(features, instance)
        prompt = 1 if 1 > prompt else prompt
        # SGLang prefills the queue first come, first served, before any decode step: the first
        # token comes after every waiting prompt (their tokens when the server reports them, else
        # each assumed as long as this one) and this one, in chunks of `prefill_chunk_tokens`.
        ahead = instance.waiting_tokens
        if ahead is None:
            ahead = waiting * (1 if 1 > prompt_tokens else prompt_tokens)
        queued = ahead + prompt
        chunks = math.ceil(queued / self.prefill_chunk_tokens)
        prefill_ms = chunks * cost.prefill_ms(pool, math.ceil(queued / chunks))
        own_prefill_ms = cost.prefill_ms(pool, prompt)
        # Past the cap, a slot frees every (typical request time / cap): the queue drains at that
        # rate. A typical request holds its slot for its decode at the stretched TPOT. (Counting
        # the slots running requests free while the prompts ahead are prefilled admitted too
        # many: the requests still running are the long ones.)
        typical_ms = rest * tpot_ms + own_prefill_ms
        over = load + 1 - cap
        wait_ms = over * typical_ms / cap if over > 0 else 0.0
        # Slots free at random (output lengths vary widely): waiting for the n-th is a sum of n
        # about exponential gaps, whose 90th percentile is some 1.3 standard deviations above it.
        spread_ms = WAIT_QUANTILE_Z * math.sqrt(over) * typical_ms / cap if over > 0 else 0.0
        others_ms = 0.0
        running = 0.0 if 0.0 > running else running
        running = cap - 1 if cap - 1 < running else running
        if running >= 1 and over <= 0:
            # Joining costs the running requests our prefill (decode stalls while it runs) and a
            # longer step for the rest of their decode (on average half their output is left).
            joined = int(load)
            slower = step_ms - cost.decode_step_ms(pool, 1 if 1 > joined else joined, width)
            others_ms = running * (own_prefill_ms + (0.0 if 0.0 > slower else slower) * (n_out / 2) / tau)
        # The requests decoding there sit through the prompts queued ahead of us and ours before
        # their next token: spread over what they have left (about half an output), that stall
        # is part of their TPOT, which sets how much they mind it (`pressure`). Our own TPOT
        # leaves it out: the queue ahead is prefilled before our first token (TTFT).
        half = n_out / 2
        others_tpot_ms = tpot_ms + prefill_ms / (1.0 if 1.0 > half else half)
        return Prediction(
            wait_ms / 1000,
            prefill_ms / 1000,
            decode_ms / 1000,
            self.externality * self.pressure(others_tpot_ms, triage) * others_ms / 1000,
            batch,
            batch * tau / step_ms * 1000,
            0.0 if 0.0 > over else over,
            tpot_ms / 1000,
            spread_ms / 1000,
            others_tpot_ms / 1000,
            tpot_spread * tpot_ms / 1000,
            self.alone_prefill_ms(pool, prompt, cost) / 1000,
        )

    def alone_prefill_ms(self, pool: PoolName, prompt: int, cost: StepCost) -> float:
        """The prefill of `prompt` uncached tokens with nothing queued ahead, in chunks as
        `predict` costs the queue's."""
        chunks = math.ceil(prompt / self.prefill_chunk_tokens)
        return chunks * cost.prefill_ms(pool, math.ceil(prompt / chunks))

    # -- The decision: guards on the snapshot, then the rules on the predictions, in order. ----
    # Each returns a Decision, or None to pass on; docs/routing.md, "`goodput`'s rules, in order",
    # describes each under the same name, and the module docstring says what each one earned.

    def decide(self, features: Features, snapshot: Snapshot) -> Decision:
        decision = self.pool_down(snapshot)
        if decision is None:
            decision = self.stale(snapshot)
        if decision is not None:
            return decision
        c = self.context(features, snapshot)
        for rule in (
            self.throughput,
            self.slo_queue_allowance,
            self.slo_one_pool,
            self.slo_triage,
            self.lost_together,
            self.spec_backlog,
            self.spare_spec,
            self.spec_full,
            self.slot_price,
        ):
            if (decision := rule(c)) is not None:
                return self.on_instance(c, decision)
        return self.on_instance(c, self.sooner(c))

    def on_instance(self, c: Context, decision: Decision) -> Decision:
        """The decision names the instance its pool's prediction was for, when `join` chose it
        for its cached prefix or `lost-together` moved it (else the router takes the least
        loaded)."""
        instance = c.chosen.get(decision.pool)
        return decision.on_instance(instance) if instance is not None else decision

    # Guards: the snapshot alone.

    def pool_down(self, snapshot: Snapshot) -> Decision | None:
        """`pool-down`: a pool with no healthy instance gets nothing (`spec-down`, `base-down`;
        `none-healthy` when neither has one, and base is named; `base-only`, `spec-only` when
        the other pool has no instance at all: a fleet of one pool, nothing down)."""
        return one_pool_left(snapshot)

    def stale(self, snapshot: Snapshot) -> Decision | None:
        """`stale`: a spec reading older than SPECROUTE_STALE_MS is not trusted; base degrades
        gracefully under load, a wrong spec decision can queue past its cap."""
        spec = snapshot.pool("spec")
        if spec is not None and spec.stale:
            return Decision(pool="base", reason="stale")
        return None

    def context(self, features: Features, snapshot: Snapshot) -> Context:
        """The predictions on both pools (both up, as the guards made sure) and what the rules
        after the guards read; `scores` holds what the decision exposes."""
        pools = snapshot.pools
        spec, base = pools.get("spec"), pools.get("base")
        assert spec is not None and base is not None
        cost = snapshot.cost
        if cost is None:
            raise ValueError("the goodput policy needs a step-cost model in the snapshot")
        n_out = self.output_tokens(features, snapshot.mean_output_tokens, snapshot.output_samples)
        chosen: dict[str, str] = {}
        joined_spec, on_spec = self.join(spec, features, cost, n_out, chosen)
        joined_base, on_base = self.join(base, features, cost, n_out, chosen)
        t_spec, t_base = on_spec.total_s, on_base.total_s
        # Prefill evidence at the tokens per prefill iteration its prompt runs in (learned so): a
        # prompt past a chunk is prefilled chunk by chunk.
        iteration = self.prefill_iteration(features.prompt_tokens)
        scores = {
            "t_spec_s": t_spec,
            "t_base_s": t_base,
            "cost_spec_s": t_spec + on_spec.others_s,  # cost_s
            "cost_base_s": t_base + on_base.others_s,
            "batch_spec": float(on_spec.batch),
            "batch_base": float(on_base.batch),
            "tpot_spec_ms": on_spec.tpot_s * 1000,
            "tpot_base_ms": on_base.tpot_s * 1000,
            # How much the cost model has seen near these predictions (0: nothing seen near there).
            "evidence_spec": cost.evidence("spec", on_spec.batch),
            "evidence_base": cost.evidence("base", on_base.batch),
            "prefill_evidence_spec": cost.evidence("spec", iteration, prefill=True),
            "prefill_evidence_base": cost.evidence("base", iteration, prefill=True),
            # The verify steps behind spec's alpha for this request (its workload's own, if known).
            "alpha_evidence_spec": spec.alpha_evidence,
        }
        if features.cached and self.cache_credit:
            scores["cached_spec_tokens"] = float(self.cached(features, joined_spec))
            scores["cached_base_tokens"] = float(self.cached(features, joined_base))
        c = Context(
            features=features,
            snapshot=snapshot,
            cost=cost,
            spec=spec,
            base=base,
            joined_spec=joined_spec,
            joined_base=joined_base,
            chosen=chosen,
            n_out=n_out,
            on_spec=on_spec,
            on_base=on_base,
            scores=scores,
            batch_class=features.request_class == "batch",
            spec_full=on_spec.over_cap > 0,
        )
        # The SLO check: latency requests only, with targets set.
        c.slo_checked = self.slo_aware and not c.batch_class
        if c.slo_checked:
            c.meets_spec, c.meets_base = self.meets_slo(on_spec), self.meets_slo(on_base)
            scores["slo_spec"], scores["slo_base"] = float(c.meets_spec), float(c.meets_base)
            if self.slo_tpot_ms > 0:
                # What the check compared with the TPOT target: the prediction corrected by the
                # pool's measured bias and spread (`tpot_spread`), traced so a decision can be followed.
                scores["tpot_checked_spec_ms"] = (on_spec.tpot_s + on_spec.tpot_spread_s) * 1000
                scores["tpot_checked_base_ms"] = (on_base.tpot_s + on_base.tpot_spread_s) * 1000
        return c

    def prefill_iteration(self, prompt_tokens: int) -> int:
        """Tokens per prefill iteration of a prompt alone: in chunks of `prefill_chunk_tokens`,
        split evenly (as `_predict` costs a queue's prefill)."""
        prompt = 1 if 1 > prompt_tokens else prompt_tokens
        chunks = math.ceil(prompt / self.prefill_chunk_tokens)
        return math.ceil(prompt / chunks)

    def cached(self, features: Features, instance: InstanceState) -> int:
        """Prompt tokens credited as cached on `instance` (none with `cache_credit` off)."""
        if not self.cache_credit or not features.cached:
            return 0
        return min(features.cached.get(instance.url, 0), max(features.prompt_tokens - 1, 0))

    def join(
        self, pool: PoolState, features: Features, cost: StepCost, n_out: int, chosen: dict[str, str]
    ) -> tuple[InstanceState, Prediction]:
        """The instance of `pool` the request would join, and its prediction there: with
        `cache_credit`, the one with the smallest predicted cost (its queue of prompts, its
        cached prefix, its batch; ties: the least loaded), recorded in `chosen`; without it,
        the least loaded."""
        healthy = pool.healthy_instances
        least = pool.least_loaded()
        assert least is not None
        tau, width = self.accept_length(pool)
        spread = self.tpot_spread(pool)
        on_least = self._predict(pool.name, least, features, cost, n_out, False, tau, width, spread)
        if len(healthy) < 2 or not self.cache_credit:
            return least, on_least
        best, on_best, best_cost = least, on_least, on_least.cost_s
        for instance in healthy:
            if instance is not least:
                prediction = self._predict(pool.name, instance, features, cost, n_out, False, tau, width, spread)
                prediction_cost = prediction.cost_s
                if prediction_cost < best_cost:
                    best, on_best, best_cost = instance, prediction, prediction_cost
        # Named when it is not the least loaded, or holds part of the prompt (among equally
        # loaded instances the router would rotate away from it).
        if best is not least or self.cached(features, best):
            chosen[pool.name] = best.url
        return best, on_best

    # The batch class.

    def throughput(self, c: Context) -> Decision | None:
        """`throughput`: a batch request goes where the fleet's token throughput gains most from
        one more sequence (`throughput-spec`, `throughput-base`); a pool past its cap gains
        nothing. When neither gains, it passes on to `slot-price` and `sooner` (the SLO rules and
        `spec-full` are for latency requests)."""
        if not c.batch_class:
            return None
        gain_spec = 0.0 if c.spec_full else self._gain(c.spec, c.joined_spec, c.cost)
        gain_base = 0.0 if c.on_base.over_cap > 0 else self._gain(c.base, c.joined_base, c.cost)
        c.scores["gain_spec_tok_s"] = gain_spec
        c.scores["gain_base_tok_s"] = gain_base
        if gain_spec > 0 or gain_base > 0:
            pool: PoolName = "spec" if gain_spec > gain_base else "base"
            return Decision(pool=pool, reason=f"throughput-{pool}", scores=c.scores)
        return None

    # SLO rules: latency requests, with targets set (`slo_checked`).

    def slo_queue_allowance(self, c: Context) -> Decision | None:
        """`slo-queue-allowance`: a request that meets its targets even queued past spec's cap
        (TTFT at the wait's 90th percentile) may queue there: it skips `spec-full`, and met on
        base too it competes on cost, slot price included (met on spec only, `slo-one-pool`
        sends it there). Decides nothing itself."""
        if c.slo_checked and c.spec_full and c.meets_spec:
            c.may_queue_on_spec = True
        return None

    def slo_one_pool(self, c: Context) -> Decision | None:
        """`slo-one-pool`: a request that meets its targets on one pool only goes there
        (`slo-spec`, `slo-base`), on spec queued past its cap too (`slo-queue-allowance`)."""
        if c.slo_checked and c.meets_spec != c.meets_base:
            pool: PoolName = "spec" if c.meets_spec else "base"
            return Decision(pool=pool, reason=f"slo-{pool}", scores=c.scores)
        return None

    def slo_triage(self, c: Context) -> Decision | None:
        """`slo-triage`: a request met on neither pool is lost whatever we do; it should cost the
        requests that can still meet theirs as little as possible, and those running on a pool
        already past its TPOT target cannot: their delay is re-costed as plain latency there
        (`predict(triage=True)`, score `slo_lost`). Decides nothing itself: `spec-backlog`,
        `spec-full` or `sooner` do, on the re-costed predictions."""
        if not (c.slo_checked and not c.meets_spec and not c.meets_base):
            return None
        c.lost = True
        c.scores["slo_lost"] = 1.0
        c.on_spec = self.predict(c.spec, c.joined_spec, c.features, c.cost, c.n_out, triage=True)
        c.on_base = self.predict(c.base, c.joined_base, c.features, c.cost, c.n_out, triage=True)
        c.scores["cost_spec_s"] = c.on_spec.cost_s
        c.scores["cost_base_s"] = c.on_base.cost_s
        return None

    def lost_together(self, c: Context) -> Decision | None:
        """`lost-together`: a lost request (`slo-triage`) joins, in a pool whose every healthy
        instance is past its running cap, that pool's most loaded instance (the most requests
        relative to its cap; score `lost_together_<pool>`) instead of the cheapest one. In a
        full pool the queues are where requests miss their targets: lost requests spread over
        every queue keep every instance missing, a state the cost comparison never leaves on
        its own; gathered on one instance they leave the others' queues short enough for the
        requests that can still meet their targets. Decides nothing itself: the pool's
        prediction is re-costed on that instance for the rules after it."""
        if not c.lost:
            return None
        for pool in (c.spec, c.base):
            healthy = pool.healthy_instances
            if len(healthy) < 2 or not self.full(pool):
                continue
            worst = healthy[0]
            for instance in healthy[1:]:
                if instance.load / max(instance.max_running, 1) > worst.load / max(worst.max_running, 1):
                    worst = instance
            on_worst = self.predict(pool, worst, c.features, c.cost, c.n_out, triage=True)
            c.chosen[pool.name] = worst.url
            c.scores[f"lost_together_{pool.name}"] = 1.0
            c.scores[f"cost_{pool.name}_s"] = on_worst.cost_s
            c.scores[f"tpot_{pool.name}_ms"] = on_worst.tpot_s * 1000
            if pool is c.spec:
                c.joined_spec, c.on_spec = worst, on_worst
            else:
                c.joined_base, c.on_base = worst, on_worst
        return None

    def spec_backlog(self, c: Context) -> Decision | None:
        """`spec-backlog`: a lost request queues on a full spec pool when base, below its cap,
        would give its first token more than a TTFT target later than spec.

        Keeping a lost request out of spec's queue spares spec's slots for requests it can still
        serve in time, but in a burst it piles the whole overflow onto base's prefill queue:
        spec empties and idles while base works through a backlog that every arrival after the
        burst then finds in the way (spec alone takes them and misses too). Once base's first
        token is more than a TTFT target later than spec's, spec would sit ready a whole
        target's time while base still cannot serve anyone: the lost request queues on spec
        instead, where its own first token also comes sooner. Not past base's cap: there base's
        queue is one for slots too, which does not clear when the burst ends."""
        if (
            c.lost
            and c.spec_full
            and c.on_base.over_cap <= 0
            and c.on_base.ttft_s - c.on_spec.ttft_s > self.slo_ttft_s > 0
        ):
            return Decision(pool="spec", reason="spec-backlog", scores=c.scores)
        return None

    def spare_spec(self, c: Context) -> Decision | None:
        """`spare-spec`: a lost request goes to base when every base instance is past its running
        cap and spec, below its cap, has its time per output token with the request predicted
        past the TPOT target (at the requests' 90th percentile).

        Under overload one pool keeps serving within the SLO and the other holds what it cannot
        take: past its cap, base's queue is holding it (`spec-full` sends latency requests there
        when spec is full). A lost request the cost comparison would send to spec instead,
        because base's queue makes it cheaper there, adds its prefill stall and a sequence to
        spec's batch: past the TPOT target spec's running requests, which could still meet
        theirs, miss it too, and both pools are lost. Below its cap base takes the request at
        once and holds no overflow; a request lost there (by a long prompt's first token, say)
        goes where it is cheaper."""
        if (
            c.lost
            and not c.spec_full  # `spec-full` sends it to base anyway
            and self.slo_tpot_ms > 0
            and (c.on_spec.tpot_s + c.on_spec.tpot_spread_s) * 1000 > self.slo_tpot_ms
            and self.full(c.base)
        ):
            return Decision(pool="base", reason="spare-spec", scores=c.scores)
        return None

    def spec_full(self, c: Context) -> Decision | None:
        """`spec-full`: a latency request never queues on the spec pool past its cap (but for
        `slo-queue-allowance`, which lets `slo-one-pool` and the cost comparison queue it there,
        and `spec-backlog` above): it goes to base."""
        if not c.batch_class and c.spec_full and not c.may_queue_on_spec:
            return Decision(pool="base", reason="spec-full", scores=c.scores)
        return None

    # The cost comparison.

    def slot_price(self, c: Context) -> Decision | None:
        """`slot-price`: taking spec's last free slot (or a place in its queue) costs the next
        request its turn; it is added to spec's side in `sooner`. Decides nothing itself."""
        if c.joined_spec.load + 1 >= c.joined_spec.max_running:
            c.price = self.last_slot_cost(c.snapshot, c.base, c.joined_base, c.features)
            c.scores["slot_price_s"] = c.price
        return None

    def sooner(self, c: Context) -> Decision:
        """`sooner`: the smaller predicted cost wins (`spec-sooner`, `base-sooner`); spec must be
        cheaper by `margin`, its slot price included. Always decides."""
        if (c.on_spec.cost_s + c.price) * (1 + self.margin) < c.on_base.cost_s:
            return Decision(pool="spec", reason="spec-sooner", scores=c.scores)
        return Decision(pool="base", reason="base-sooner", scores=c.scores)

    # Helpers of the rules.

    def last_slot_cost(
        self, snapshot: Snapshot, base: PoolState, joined_base: InstanceState, features: Features
    ) -> float:
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

    def full(self, pool: PoolState) -> bool:
        """Every healthy instance of the pool is at its running cap: one more request would queue
        (`lost-together`, `spare-spec`)."""
        return all(i.load + 1 > i.max_running for i in pool.healthy_instances)

    def meets_slo(self, p: Prediction) -> bool:
        """Whether a prediction meets the configured targets (a target of 0 is not checked)."""
        ttft_ok = self.slo_ttft_s <= 0 or p.ttft_s + p.wait_spread_s <= self.slo_ttft_s
        tpot_ok = self.slo_tpot_ms <= 0 or (p.tpot_s + p.tpot_spread_s) * 1000 <= self.slo_tpot_ms
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


# Registered by a call, not as a decorator: mypyc compiles a decorated class as a plain Python
# class (attribute reads through its dict), an undecorated one natively (fleet/native.py).
register(
    "goodput",
    params=GoodputParams,
    decisions=(
        ("spec-sooner", "spec"),
        ("base-sooner", "base"),
        ("spec-full", "base"),
        ("stale", "base"),
        ("spec-down", "base"),
        ("base-down", "spec"),
        ("none-healthy", "base"),
        ("base-only", "base"),
        ("spec-only", "spec"),
    ),
)(Goodput)
