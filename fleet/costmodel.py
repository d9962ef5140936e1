"""The step-cost model: how long one engine step takes per pool and batch size, learned online.

A seed curve (from the profile SPECROUTE_PROFILE names, else a generic dense-model prior) gives
the shape; observed step times (inter-token latency of the streams, one chunk per engine step)
correct it per pool and batch-size bucket. A policy only reads this object (the `StepCost`
protocol, through `at(now)`: what the model predicts at that moment); the proxy and the
simulator feed it. A learned correction loses trust with its age in observed time (a half-life;
a lull, when nothing is observed at all, counts one half-life at most), so a pool that stopped
being observed while the others were returns toward its seed, but no further than the other
pools' correction (one seed describes every pool's hardware, so its error is mostly shared), and
is tried again.

A spec step drafts k tokens and verifies k+1: step(B, T=k+1) = k * draft(B) + target(B, k+1).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from fleet.profile import Profile, load_profile


class Seed(Protocol):
    """Step times before anything was observed (a profile, or the generic prior)."""

    def target_ms(self, batch: int, tokens_per_seq: int) -> float: ...

    def draft_ms(self, batch: int) -> float: ...

    def prefill_ms(self, tokens: int, speculative: bool = False) -> float: ...

    def overhead_ms(self, batch: int, num_steps: int) -> float:
        """Engine costs per step beyond the GPU's (a profile's `overheads`; 0 if not known)."""
        ...


@dataclass(frozen=True, slots=True)
class AffineSeed:
    """target = c0 + c_tok * B * T; draft = d0 + d_tok * B; prefill = p_tok * tokens.

    The defaults are a rough H200 / 8B dense fit (../shared/calibration): 6 ms fixed, 0.04 ms
    per batched token. Only a prior: observations correct it within a few dozen steps.
    """

    c0: float = 6.0
    c_tok: float = 0.04
    d0: float = 0.23
    d_tok: float = 0.0015
    p_tok: float = 0.03

    def target_ms(self, batch: int, tokens_per_seq: int) -> float:
        return self.c0 + self.c_tok * batch * tokens_per_seq

    def draft_ms(self, batch: int) -> float:
        return self.d0 + self.d_tok * batch

    def prefill_ms(self, tokens: int, speculative: bool = False) -> float:
        return (self.c0 + self.p_tok * tokens) * (1.1 if speculative else 1.0)

    def overhead_ms(self, batch: int, num_steps: int) -> float:
        return 0.0


@dataclass(frozen=True, slots=True)
class ProfileSeed:
    """A twin profile (fleet/profile.py: the SPECROUTE_PROFILE file or built-in name) as a seed,
    at one typical context length per sequence."""

    profile: Profile
    context: float = 1024.0

    def target_ms(self, batch: int, tokens_per_seq: int) -> float:
        return self.profile.target_ms(batch, tokens_per_seq, self.context)

    def draft_ms(self, batch: int) -> float:
        return self.profile.draft_ms(batch, self.context)

    def prefill_ms(self, tokens: int, speculative: bool = False) -> float:
        return self.profile.prefill_ms(tokens, speculative)

    def overhead_ms(self, batch: int, num_steps: int) -> float:
        return self.profile.overhead_ms(batch, num_steps)


def seed_from_profile(name_or_path: str, context: float = 1024.0) -> ProfileSeed:
    """Load a profile by built-in name or JSON path; ValueError if it cannot be read."""
    return ProfileSeed(load_profile(name_or_path), context)


# Batch sizes at which corrections are learned; an observation updates its nearest bucket.
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# A bucket's short memory (observations) and the gap between its short and long means that
# counts as a change of the server (a step time that doubled is followed in about 20
# observations instead of some 400; docs/routing.md, "What is learned").
FAST_MEMORY = 16.0
CHANGE_RATIO = 1.25
# Prompt tokens per prefill iteration at which prefill corrections are learned.
PREFILL_BUCKETS: tuple[int, ...] = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)

STATE_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Batch sizes the state endpoint shows predictions and evidence at: each within a doubling of
the next, so evidence learned anywhere up to 256 shows (quiet traffic runs at 2-4)."""
STATE_PROMPTS: tuple[int, ...] = (64, 256, 1024, 2048, 4096, 8192, 16384)
"""Prompt tokens per prefill iteration the state endpoint shows predictions and evidence at
(PREFILL_BUCKETS' own spacing: each in reach of its neighbours)."""
SEED_MEMO = 4096
"""(batch, width) points of the seed's step curve `seed_step_ms` remembers (then it starts over)."""
POINT_MEMO = 4096
"""Sizes whose place among a curve's buckets the curve remembers (then it starts over)."""
# Seconds of observed time (`StepCostModel.clock`) after which a learned correction that got no
# new observation keeps half its trust (SPECROUTE_COSTMODEL_HALF_LIFE_S; docs/routing.md,
# "Step-cost model", says why 8 s).
DEFAULT_HALF_LIFE_S = 8.0


@dataclass(slots=True)
class _Bucket:
    ratio: float = 1.0
    weight: float = 0.0
    """Observations' worth of trust as of `at`; it halves every half-life after."""
    at: float = 0.0
    """When the bucket was last fed, in observed time (`StepCostModel.clock`)."""
    recent: float = 1.0
    """A short-memory mean of the same ratios (about FAST_MEMORY observations): when it leaves
    the long mean by more than CHANGE_RATIO, the server changed, and the long mean restarts from
    it instead of averaging the change away over `memory` observations."""

    def trust(self, now: float, half_life_s: float) -> float:
        age = now - self.at
        return self.weight if age <= 0 else self.weight * 2.0 ** (-age / half_life_s)


@dataclass(slots=True)
class _Curve:
    """Learned corrections along one axis (batch size, or prompt tokens per prefill chunk)."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)
    xs: list[float] = field(default_factory=list)
    """log(size) of the learned buckets, ascending (read per decision: kept, not sorted then)."""
    learned: list[_Bucket] = field(default_factory=list)
    """The learned buckets in the order of `xs`."""
    points: dict[float, tuple[int, float]] = field(default_factory=dict)
    """size -> where it falls among `xs` (`point`), remembered until a bucket is added."""
    nearby: dict[float, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """size -> its nearest buckets and their distance discounts (`near`), likewise."""

    def bucket(self, size: int, now: float) -> _Bucket:
        bucket = self.buckets.get(size)
        if bucket is None:
            bucket = self.buckets[size] = _Bucket(at=now)
            x = math.log(size)
            i = bisect.bisect_left(self.xs, x)
            self.xs.insert(i, x)
            self.learned.insert(i, bucket)
            self.points.clear()
            self.nearby.clear()
        return bucket

    def point(self, size: float) -> tuple[int, float]:
        """Where `size` falls among the learned buckets (some must be): (i, t) to interpolate
        between buckets i - 1 and i with weight t on i, or (i, -1.0) to take bucket i alone
        (past either end). What `_corrected` computes before it reads the buckets' trust,
        which alone changes with time."""
        found = self.points.get(size)
        if found is None:
            xs = self.xs
            x = math.log(size) if size > 1 else 0.0
            i = bisect.bisect_left(xs, x)
            if i == 0:
                found = (0, -1.0)
            elif i >= len(xs):
                found = (len(xs) - 1, -1.0)
            else:
                found = (i, (x - xs[i - 1]) / (xs[i] - xs[i - 1]))
            if len(self.points) >= POINT_MEMO:
                self.points.clear()
            self.points[size] = found
        return found

    def near(self, size: float) -> tuple[tuple[int, float], ...]:
        """The learned buckets around `size` (some must be) and the discount of each for its
        distance in doublings: what `StepCostModel.evidence` divides their trust by."""
        found = self.nearby.get(size)
        if found is None:
            xs = self.xs
            x = math.log(max(size, 1.0))
            i = bisect.bisect_left(xs, x)
            # At a learned bucket, both its neighbours are near it too (`_corrected`).
            around = (i - 1, i, i + 1) if i < len(xs) and xs[i] == x else (i - 1, i)
            found = tuple((j, 1.0 + abs(x - xs[j]) / math.log(2.0)) for j in around if 0 <= j < len(xs))
            if len(self.nearby) >= POINT_MEMO:
                self.nearby.clear()
            self.nearby[size] = found
        return found


@dataclass(slots=True)
class _PoolModel:
    tokens_per_seq: int
    decode: _Curve = field(default_factory=_Curve)
    """Corrections of the decode step, by batch size."""
    prefill: _Curve = field(default_factory=_Curve)
    """Corrections of a prefill iteration, by its prompt tokens."""


class StepCostModel:
    """Seed curve x learned correction, per pool: decode steps by batch-size bucket, prefill
    iterations by prompt-token bucket.

    Each bucket keeps a running mean of observed/seed time ratios; the running mean forgets
    (its weight is capped at `memory` observations) so a changed server is followed. Between
    learned buckets the correction is interpolated in log-size; past them the nearest one holds.
    `prior_weight` observations' worth of trust stays with the seed; a bucket's own trust halves
    every `half_life_s` of observed time without observations of its own, so its correction
    returns toward 1 (the seed). Observed time (`clock`) is the time the model is being fed: a
    gap between two observations counts up to one half-life, no more, so a lull (no traffic at
    all) ages a correction by at most one half-life, while a pool avoided as the others are
    served ages as before.

    Nothing here reads a clock: `observe(..., now=)` stamps the bucket it feeds, and `at(now)`
    (called by the snapshot builder) gives the model as it predicts at that time. Calls without
    `now` use the latest time the model was told.
    """

    def __init__(
        self,
        seed: Seed | None = None,
        num_draft_tokens: int = 3,
        memory: float = 200.0,
        prior_weight: float = 2.0,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        pools: Mapping[str, int] | None = None,
        lull_s: float | None = None,
    ):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, not {half_life_s!r}")
        if lull_s is not None and not lull_s > 0:  # NaN too
            raise ValueError(f"lull_s must be positive (math.inf: the wall clock), not {lull_s!r}")
        self.seed: Seed = seed or AffineSeed()
        self.memory = memory
        self.prior_weight = prior_weight
        self.half_life_s = half_life_s
        self.lull_s = half_life_s if lull_s is None else lull_s
        """The longest gap between observations that observed time counts (`clock`): one
        half-life by default (SPECROUTE_COSTMODEL_LULL_S); math.inf ages by the wall clock, as
        before 2026-12-06 (bench/lull.py compares the two)."""
        self.now = 0.0
        """The latest time the model was told (by `observe` or `at`)."""
        self._fed_at = -math.inf
        """The latest time an observation carried (-inf: none yet)."""
        self._fed_clock = 0.0
        """`_fed_at` on the observed-time clock (`clock`)."""
        self._prev_at = -math.inf
        self._prev_clock = 0.0
        """The observation before the latest one, likewise."""
        self._pools: dict[str, _PoolModel] = {}
        self._seed_steps: dict[tuple[int, int], float] = {}
        self._memo_seed: Seed | None = None
        self.version = 0
        """Bumped by everything that changes a prediction (a learned observation, a new verify
        width): a `StepCostAt` remembers its predictions while it stays the same. (Nothing
        reassigns `seed`, `prior_weight` or `half_life_s` after construction; a change there
        would reach only the snapshots taken after it.)"""
        # Pool name -> tokens drafted per verify step (0: plain); the mission's two by default.
        for name, k in (pools if pools is not None else {"spec": num_draft_tokens, "base": 0}).items():
            self.set_draft_tokens(name, k)

    def set_draft_tokens(self, pool: str, num_draft_tokens: int) -> None:
        """What /server_info said: the verify width changes the seed curve (learning restarts)."""
        width = num_draft_tokens + 1 if num_draft_tokens > 0 else 1
        known = self._pools.get(pool)
        if known is None or known.tokens_per_seq != width:
            self._pools[pool] = _PoolModel(tokens_per_seq=width)
            self.version += 1

    def tokens_per_seq(self, pool: str) -> int:
        return self._pools[pool].tokens_per_seq

    def seed_step_ms(self, batch: float, tokens_per_seq: int) -> float:
        """The seed's step at a batch size, remembered per (batch, width): a seed is a fixed
        curve, and a decision asks for the same few points again and again."""
        b = max(int(round(batch)), 1)
        seed = self.seed
        if self._memo_seed is not seed or len(self._seed_steps) >= SEED_MEMO:
            self._seed_steps.clear()
            self._memo_seed = seed
        key = (b, tokens_per_seq)
        step = self._seed_steps.get(key)
        if step is None:
            step = seed.target_ms(b, tokens_per_seq) + seed.overhead_ms(b, tokens_per_seq - 1)
            if tokens_per_seq > 1:
                step += (tokens_per_seq - 1) * seed.draft_ms(b)
            self._seed_steps[key] = step
        return step

    def observe(self, pool: str, batch: float, step_ms: float, weight: float = 1.0, now: float | None = None) -> None:
        """One observed engine step (or a mean of `weight` steps) at this batch size, at `now`."""
        if batch < 1 or step_ms <= 0 or not math.isfinite(step_ms) or weight <= 0:
            return
        if now is not None and not math.isfinite(now):
            return
        model = self._pools[pool]
        clock = self._feed(self._tell(now))
        ratio = step_ms / self.seed_step_ms(batch, model.tokens_per_seq)
        self._learn(model.decode.bucket(_nearest(BUCKETS, batch), clock), ratio, weight, clock)

    def observe_prefill(
        self, pool: str, tokens: float, prefill_ms: float, now: float | None = None, weight: float = 1.0
    ) -> None:
        """One observed prefill iteration of `tokens` prompt tokens (the time to first token of a
        request that found a free slot, less the wait for the step in flight), or a mean of
        `weight` iterations, at `now`."""
        if tokens < 1 or prefill_ms <= 0 or not math.isfinite(prefill_ms) or weight <= 0:
            return
        if now is not None and not math.isfinite(now):
            return
        model = self._pools[pool]
        clock = self._feed(self._tell(now))
        ratio = prefill_ms / self.seed.prefill_ms(max(int(round(tokens)), 1), model.tokens_per_seq > 1)
        self._learn(model.prefill.bucket(_nearest(PREFILL_BUCKETS, tokens), clock), ratio, weight, clock)

    @property
    def last_observed_at(self) -> float | None:
        """The latest time an observation carried (None: none yet); more than `lull_s` before
        now, what was learned has stopped aging (the state endpoint shows it)."""
        return None if self._fed_at == -math.inf else self._fed_at

    def clock(self, now: float) -> float:
        """`now` in observed time, the time a learned correction ages by: seconds since the
        latest observation count up to `lull_s`, one half-life (`_feed` adds the same between two
        observations). Between the two latest observations the same rule holds (a reading
        stamped just before the one that ended a lull is in observed time just before it too);
        before them, seconds count as they are."""
        if self._fed_at == -math.inf:  # nothing observed yet: no gap to count
            return now
        if now >= self._fed_at:
            return self._fed_clock + min(now - self._fed_at, self.lull_s)
        if now >= self._prev_at:  # at most `_fed_clock`: `_feed` added the same gap, capped alike
            return self._prev_clock + min(now - self._prev_at, self.lull_s)
        return self._prev_clock - (self._prev_at - now)

    def _feed(self, now: float) -> float:
        """An observation carried `now`: the observed-time clock moves to it; its reading there."""
        clock = self.clock(now)
        if now > self._fed_at:
            if self._fed_at == -math.inf:  # the first: both points at it (earlier times count as they are)
                self._prev_at, self._prev_clock = now, clock
            else:
                self._prev_at, self._prev_clock = self._fed_at, self._fed_clock
            self._fed_at, self._fed_clock = now, clock
        return clock

    def _learn(self, bucket: _Bucket, ratio: float, weight: float, now: float) -> None:
        """Feed `bucket` an observed ratio at `now` on the observed-time clock."""
        self.version += 1
        # No observation outweighs the bucket's whole memory: past it, the update below would
        # overshoot the observed ratio (to below zero: a server's prefill counters once weighed
        # a reading as 3,000 iterations, and the next log() of the ratio raised).
        weight = min(weight, self.memory)
        fresh = bucket.weight == 0
        bucket.weight = min(bucket.trust(now, self.half_life_s) + weight, self.memory)
        bucket.ratio += (ratio - bucket.ratio) * weight / bucket.weight
        bucket.recent = ratio if fresh else bucket.recent + (ratio - bucket.recent) * min(weight / FAST_MEMORY, 1.0)
        bucket.at = max(bucket.at, now)
        if bucket.weight > FAST_MEMORY and abs(math.log(bucket.recent / bucket.ratio)) > math.log(CHANGE_RATIO):
            bucket.ratio, bucket.weight = bucket.recent, FAST_MEMORY

    def at(self, now: float) -> StepCostAt:
        """The model as it predicts at `now` (what a Snapshot carries; the StepCost protocol)."""
        return StepCostAt(self, self._tell(now))

    def _tell(self, now: float | None) -> float:
        if now is None:
            return self.now
        if now > self.now:
            self.now = now
        return now

    def correction(self, pool: str, batch: float, now: float | None = None) -> float:
        return self._anchored(pool, False, batch, self._weigher(now))

    def prefill_correction(self, pool: str, tokens: float, now: float | None = None) -> float:
        return self._anchored(pool, True, tokens, self._weigher(now))

    def evidence(self, pool: str, batch: float, now: float | None = None, prefill: bool = False) -> float:
        """Observations' worth behind the pool's own correction at `batch` (or at `tokens` per
        prefill iteration): the learned buckets next to it on the grid of buckets (`_in_reach`),
        their trust aged to `now`, discounted by how far (in doublings) the nearest lies. 0:
        nothing was seen near there (a batch size never seen): the prediction is a reach from
        elsewhere (the nearest bucket's ratio, the other pools' correction, or the seed's guess)."""
        model = self._pools.get(pool)
        if model is None:
            return 0.0
        curve = model.prefill if prefill else model.decode
        return _evidence(curve, self._weigher(now)(curve), batch, PREFILL_BUCKETS if prefill else BUCKETS)

    def _weigher(self, now: float | None) -> Callable[[_Curve], list[float]]:
        """Each learned bucket's trust at `now`, per curve (what `StepCostAt` remembers)."""
        at = self.clock(self.now if now is None else now)
        half_life_s = self.half_life_s
        return lambda curve: [bucket.trust(at, half_life_s) for bucket in curve.learned]

    def _anchored(self, pool: str, prefill: bool, size: float, weights: Callable[[_Curve], list[float]]) -> float:
        """The pool's correction at `size`: its learned buckets weighed against `prior_weight`
        observations' worth of a target that takes the other pools' correction there into
        account (`_anchor`, `_corrected`), not the seed's alone.

        All pools share one seed, which assumes they run the same hardware and model: where it
        is wrong, it is wrong for every pool by nearly the same factor (kimi-moe on the generic
        prior: 3.0x on spec's step at batch 1, 2.6x on base's). Shrunk toward 1 instead, a pool
        left unobserved for some half-lives fell back to the seed's error: on one client, base
        (learned at 15.7 ms a step, seeded at 6.0) looked faster than spec every 30-60 s and took
        a request at 1.7x spec's time per token (docs/learning.md). Where the other pools
        have no evidence, the seed it is (None)."""
        pools = self._pools
        curve = pools[pool].prefill if prefill else pools[pool].decode
        anchor: float | None = None
        if len(pools) > 1:
            others = [
                (other, weights(other))
                for name, known in pools.items()
                if name != pool
                for other in (known.prefill if prefill else known.decode,)
                if other.xs
            ]
            if others:
                anchor = _anchor(others, size, self.prior_weight)
        return _corrected(curve, weights(curve) if curve.xs else [], size, self.prior_weight, anchor)

    # StepCost protocol (what policies read; a snapshot carries `at(now)` instead)

    def decode_step_ms(self, pool: str, batch: int, tokens_per_seq: int, now: float | None = None) -> float:
        batch = max(batch, 1)
        return self.seed_step_ms(batch, tokens_per_seq) * self.correction(pool, batch, now)

    def prefill_ms(self, pool: str, tokens: int, now: float | None = None) -> float:
        tokens = max(tokens, 1)
        model = self._pools[pool]
        return self.seed.prefill_ms(tokens, model.tokens_per_seq > 1) * self.prefill_correction(pool, tokens, now)

    def estimates(
        self, batches: tuple[int, ...] = STATE_BATCHES, now: float | None = None
    ) -> dict[str, dict[str, float]]:
        """Predicted step ms per pool at a few batch sizes (for /v1/specroute/state)."""
        return {
            pool: {str(b): round(self.decode_step_ms(pool, b, model.tokens_per_seq, now), 3) for b in batches}
            for pool, model in self._pools.items()
        }

    def confidence(
        self,
        batches: tuple[int, ...] = STATE_BATCHES,
        prompts: tuple[int, ...] = STATE_PROMPTS,
        now: float | None = None,
    ) -> dict[str, dict[str, dict[str, float]]]:
        """Per pool: predicted prefill ms at a few prompt lengths, and the evidence (observations'
        worth, 0 = the seed's guess alone) behind the decode and prefill predictions."""
        return {
            pool: {
                "prefill_ms": {str(n): round(self.prefill_ms(pool, n, now), 3) for n in prompts},
                "decode_evidence": {str(b): round(self.evidence(pool, b, now), 2) for b in batches},
                "prefill_evidence": {str(n): round(self.evidence(pool, n, now, prefill=True), 2) for n in prompts},
            }
            for pool in self._pools
        }


class StepCostAt:
    """A StepCostModel's predictions at one moment: learned corrections weighed by their trust
    at `now`. Cheap to make (one per snapshot); it reads the model, it copies nothing.

    A decision asks for the same few points again and again (a pool's step at each instance's
    batch, the prefill of the same prompt on each instance), so each answer is remembered, as
    is each learned bucket's trust at `now`, while the model's `version` stays the same (it
    learned nothing since): the same floats as the model's own methods, computed once."""

    __slots__ = ("model", "now", "_clock", "_version", "_steps", "_prefills", "_evidence", "_curves")

    def __init__(self, model: StepCostModel, now: float):
        self.model = model
        self.now = now
        self._clock = model.clock(now)
        """`now` in the model's observed time (an observation fed since may move it)."""
        self._version = model.version
        self._steps: dict[tuple[str, int, int], float] = {}
        self._prefills: dict[tuple[str, int], float] = {}
        self._evidence: dict[tuple[str, float, bool], float] = {}
        self._curves: dict[int, list[float]] = {}
        """id(curve) -> its learned buckets' trust at `now`, in the order of its `xs` (the curves
        live while the version holds)."""

    def _check(self) -> None:
        if self._version != self.model.version:
            self._version = self.model.version
            self._clock = self.model.clock(self.now)
            self._steps.clear()
            self._prefills.clear()
            self._evidence.clear()
            self._curves.clear()

    def _weights(self, curve: _Curve) -> list[float]:
        found = self._curves.get(id(curve))
        if found is None:
            clock, half_life_s = self._clock, self.model.half_life_s
            found = self._curves[id(curve)] = [bucket.trust(clock, half_life_s) for bucket in curve.learned]
        return found

    def decode_step_ms(self, pool: str, batch: int, tokens_per_seq: int) -> float:
        """StepCostModel.decode_step_ms at `now`."""
        if self._version != self.model.version:
            self._check()
        key = (pool, batch, tokens_per_seq)
        step = self._steps.get(key)
        if step is None:
            model = self.model
            batch = max(batch, 1)
            seed = model._seed_steps.get((batch, tokens_per_seq)) if model._memo_seed is model.seed else None
            if seed is None:  # seed_step_ms remembers it (an integer batch is its own key there)
                seed = model.seed_step_ms(batch, tokens_per_seq)
            step = seed * model._anchored(pool, False, batch, self._weights)
            self._steps[key] = step
        return step

    def prefill_ms(self, pool: str, tokens: int) -> float:
        """StepCostModel.prefill_ms at `now`."""
        if self._version != self.model.version:
            self._check()
        key = (pool, tokens)
        ms = self._prefills.get(key)
        if ms is None:
            tokens = max(tokens, 1)
            known = self.model._pools[pool]
            ms = self.model.seed.prefill_ms(tokens, known.tokens_per_seq > 1) * self.model._anchored(
                pool, True, tokens, self._weights
            )
            self._prefills[key] = ms
        return ms

    def evidence(self, pool: str, batch: float, prefill: bool = False) -> float:
        """StepCostModel.evidence at `now`."""
        self._check()
        key = (pool, batch, prefill)
        found = self._evidence.get(key)
        if found is not None:
            return found
        known = self.model._pools.get(pool)
        curve = None if known is None else known.prefill if prefill else known.decode
        grid = PREFILL_BUCKETS if prefill else BUCKETS
        value = 0.0 if curve is None else _evidence(curve, self._weights(curve), batch, grid)
        self._evidence[key] = value
        return value


def _corrected(curve: _Curve, weights: list[float], size: float, prior: float, anchor: float | None) -> float:
    """A curve's correction at `size`: each learned bucket's running ratio weighed by its trust
    (`weights`) against `prior` observations' worth of a target, interpolated in log-size between
    the buckets around it (past either end, the nearest alone).

    The target is what the bucket returns to as its trust fades: with no `anchor`, 1 (the seed);
    with one (the other pools' correction), the lower of it and the bucket's own ratio, and
    where nothing is learned the lower of it and 1. A pool avoided as slower than the others
    is so retried once its evidence fades, as with the seed alone, but a pool seen as fast as
    theirs (or faster) keeps what it showed: the seed's error is common to the pools, but not
    its shape, and returning to theirs made base on kimi-moe at 4 clients, really 17-30 % faster
    than spec's correction says, never tried again (0.95x the SLO goodput)."""
    if not curve.xs:
        return 1.0 if anchor is None or anchor > 1.0 else anchor
    i, t = curve.point(size)
    if t < 0:  # past either end: the nearest bucket, its inner neighbour informing its target
        return _shrunk(curve, weights, i, prior, anchor)
    return _shrunk(curve, weights, i - 1, prior, anchor) * (1 - t) + _shrunk(curve, weights, i, prior, anchor) * t


def _shrunk(curve: _Curve, weights: list[float], j: int, prior: float, anchor: float | None) -> float:
    """Bucket j's correction: its ratio, `weights[j]` observations' worth, against `prior` of its
    target (`_corrected`), which its learned neighbours on either side move toward their own
    ratios by their trust, discounted by the doublings between them. A bucket whose trust has
    faded then returns toward a fresh neighbour before the seed: each shrunk toward the target
    alone, spec's prefill at 4,096 tokens (its bucket aged) fell to 147 ms against a true 280
    while its neighbour at 2,048 tokens was fresh at 2.4x the seed (a helper's probe, no
    profile). Both neighbours count, whichever side of j the size lies: with only the one toward
    the size, an aged bucket at batch 8 beside a fresh one at 16 predicted 8.0 ms at batch 8 and
    24.4 at batch 9 (a review), the curve 3x apart one batch apart."""
    learned = curve.learned
    ratio = learned[j].ratio
    target = 1.0 if anchor is None else ratio if ratio < anchor else anchor
    pulled = prior * target
    weighed = prior
    for k in (j - 1, j + 1):
        if 0 <= k < len(learned):
            near = weights[k] / (1.0 + abs(curve.xs[j] - curve.xs[k]) / LOG_2)
            pulled += near * learned[k].ratio
            weighed += near
    target = pulled / weighed
    weight = weights[j]
    return (prior * target + ratio * weight) / (prior + weight)


LOG_2 = math.log(2.0)


def _in_reach(grid: tuple[int, ...], learned: float, size: float) -> bool:
    """A bucket learned at `learned` is evidence at `size` when no other bucket of the grid lies
    between them: farther, its ratio still shapes the prediction, but nothing was seen there."""
    low, high = (learned, size) if learned < size else (size, learned)
    return not any(low * 1.0001 < g < high * 0.9999 for g in grid)


def _evidence(curve: _Curve, weights: list[float], size: float, grid: tuple[int, ...] | None = None) -> float:
    """Observations' worth behind a curve's correction at `size`: its learned neighbours' trust,
    each divided by its discount for distance (1 + doublings); with a `grid`, only those in reach
    of `size` on it (`_in_reach`)."""
    value = 0.0
    for j, discount in curve.near(size) if curve.xs else ():
        near = weights[j] / discount
        if near > value and (grid is None or _in_reach(grid, math.exp(curve.xs[j]), size)):
            value = near
    return value


def _anchor(others: list[tuple[_Curve, list[float]]], size: float, prior: float) -> float | None:
    """What the other pools' curves (each with its buckets' trust) say the seed's error is at
    `size`: their own corrections (shrunk toward 1), weighed by the evidence behind each; None
    where they have none (the pool then returns to its seed)."""
    total = weighted = 0.0
    for curve, weights in others:
        evidence = _evidence(curve, weights, size)
        if evidence > 0:
            total += evidence
            weighted += evidence * _corrected(curve, weights, size, prior, None)
    return weighted / total if total > 0 else None


def _nearest(buckets: tuple[int, ...], size: float) -> int:
    x = math.log(max(size, 1.0))
    return min(buckets, key=lambda b: abs(math.log(b) - x))
