"""Acceptance: accept length <-> alpha, and a half-life-smoothed estimate from evidence.

Accept length (tau) is what servers report: tokens committed per request per verify step, the
bonus token included. The cost model wants alpha, the per-token acceptance probability of the
i.i.d. model, tau = (1 - alpha^(k+1)) / (1 - alpha) for k chain-drafted tokens.

Nothing here reads a clock: every call takes `now` (seconds, any monotonic origin), so the same
estimator runs in the proxy (wall clock) and on the twin's virtual clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_HALF_LIFE_S = 1.5
"""Half-life of the acceptance estimate. 1.5 s follows a 0.7 -> 0.3 drop to within 0.05 in 5-7 s
of simulated time at half load (docs/routing.md), while a stationary estimate stays steady enough
that routing agrees with the true alpha on 99 % of decisions; 2 s took 7-11 s."""


def accept_length(alpha: float, k: int) -> float:
    """tau(alpha, k): expected tokens per verify step with k drafted tokens."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def verified_tokens(completion_tokens: int, verify_steps: int) -> int:
    """A finished request's tokens that came from verify steps: all but the first when there are
    more tokens than steps (the first comes from prefill, and SGLang's per-request figure is
    biased up by it)."""
    return completion_tokens - 1 if completion_tokens > verify_steps else completion_tokens


def alpha_from_accept_length(tau: float, k: int) -> float:
    """Invert tau(alpha, k) by bisection; tau is clamped to its range [1, k + 1]."""
    if k <= 0:
        return 0.0
    if tau <= 1.0:
        return 0.0
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    power = k + 1
    # tau is strictly increasing in alpha; 50 halvings are far below any useful precision. Each
    # step is accept_length(mid, k) written out (mid lies in (0, 1], where its clamp changes
    # nothing): the same floats, without 50 calls per snapshot (bench/prefix_decision.py).
    for _ in range(50):
        mid = (lo + hi) / 2
        tau_mid = float(power) if mid >= 1.0 else (1.0 - mid**power) / (1.0 - mid)
        if tau_mid < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(slots=True)
class SmoothedMean:
    """A mean of weighted evidence whose weight halves every `half_life_s` seconds.

    Evidence is weighted by how many verify steps it covers, so a 500-step counter window counts
    for more than one short request, and old evidence fades at the configured half-life.
    """

    half_life_s: float
    _mean: float | None = None
    _weight: float = 0.0
    _at: float | None = None

    def _decay(self, now: float) -> float:
        if self._at is None:
            return 0.0
        dt = max(now - self._at, 0.0)
        if self.half_life_s <= 0:
            return 0.0
        return self._weight * math.pow(0.5, dt / self.half_life_s)

    def observe(self, now: float, value: float, weight: float = 1.0) -> None:
        if weight <= 0 or not math.isfinite(value):
            return
        kept = self._decay(now)
        prior = self._mean if self._mean is not None else value
        self._weight = kept + weight
        self._mean = (prior * kept + value * weight) / self._weight
        self._at = now if self._at is None else max(now, self._at)

    def value(self) -> float | None:
        return self._mean

    def weight(self, now: float) -> float:
        """Evidence left after decay: near 0 means the estimate rests on old data."""
        return self._decay(now)


@dataclass(slots=True)
class CounterDelta:
    """Increments of two monotonic counters between polls: tokens generated and verify calls.

    Their ratio is SGLang's windowed accept length, rate(sglang:generation_tokens_total) /
    rate(sglang:spec_verify_calls_total), over the poll interval. A counter that goes backwards
    (a server restart) restarts the differencing instead of producing a negative rate.
    """

    _last: tuple[float, float] | None = None

    def goes_back(self, tokens_total: float, verify_total: float) -> bool:
        """Whether this sample has a counter below the previous sample's: the server restarted
        (never on the first sample, nor on counters that did not move)."""
        last = self._last
        return last is not None and (tokens_total < last[0] or verify_total < last[1])

    def first_total(self) -> float | None:
        """The first counter's last sample (None before one, or since a reset)."""
        return self._last[0] if self._last is not None else None

    def add(self, tokens_total: float, verify_total: float) -> tuple[float, float] | None:
        """(tokens, verify steps) since the previous sample, or None on the first or a reset."""
        last, self._last = self._last, (tokens_total, verify_total)
        if last is None or tokens_total < last[0] or verify_total < last[1]:
            return None
        return tokens_total - last[0], verify_total - last[1]


class AcceptanceEstimator:
    """One speculative pool's accept length: counter deltas and per-request evidence, smoothed.

    Sources: the server's recent-interval accept-length gauge (the freshest: it covers the last
    decode-log interval), its token/verify counters (each poll adds the steps since the last
    one; they count finished requests, so they lag by about half a request's decode time and
    are discounted by that age), and the proxy's own streams (tokens per verify step of each
    finished request, discounted by its age; the fleet model gives them only for a server whose
    counters are not read, which count those requests already). Each weighs by the verify steps
    it covers.
    """

    def __init__(
        self, num_draft_tokens: int, half_life_s: float = DEFAULT_HALF_LIFE_S, prior_accept_length: float | None = None
    ):
        self.k = num_draft_tokens
        self._mean = SmoothedMean(half_life_s)
        if prior_accept_length is not None:
            self._mean.observe(0.0, prior_accept_length, 1e-6)

    def observe_counters(self, now: float, d_tokens: float, d_verify: float, age_s: float = 0.0) -> None:
        """Counter increments since the previous poll (already differenced, reset-safe). They
        count requests that finished, whose steps ran on average `age_s` ago: discounted so."""
        if d_verify > 0 and d_tokens > 0:
            weight = d_verify * math.pow(0.5, max(age_s, 0.0) / self._mean.half_life_s)
            self._mean.observe(now, d_tokens / d_verify, weight)

    def observe_request(self, now: float, completion_tokens: int, verify_steps: int, age_s: float = 0.0) -> None:
        """One finished request: its tokens and verify steps (from spec details or chunk count).
        `age_s`: how long ago, on average, its steps ran (half its decode time): the evidence is
        discounted by that age, as if it had been observed then."""
        if verify_steps > 0 and completion_tokens > 0:
            tokens = verified_tokens(completion_tokens, verify_steps)
            weight = verify_steps * math.pow(0.5, max(age_s, 0.0) / self._mean.half_life_s)
            self._mean.observe(now, tokens / verify_steps, weight)

    def observe_gauge(self, now: float, accept_length: float, steps: float = 1.0) -> None:
        """The server's recent-interval gauge (sglang:spec_accept_length: the last decode-log
        interval, 40 iterations by default), covering about `steps` request-verify steps."""
        if accept_length >= 1.0:
            self._mean.observe(now, accept_length, max(steps, 1.0))

    def accept_length(self) -> float | None:
        return self._mean.value()

    def alpha(self) -> float | None:
        tau = self._mean.value()
        return None if tau is None else alpha_from_accept_length(tau, self.k)

    def evidence(self, now: float) -> float:
        return self._mean.weight(now)


SPREAD_MEMORY = 50
"""Responses the per-request spread is averaged over: a plain mean of the first ones, then a
moving one over about this many (as the output length's)."""
SPREAD_MIN_SAMPLES = 10
"""Responses needed before the spread is reported (fewer: 0, no spread assumed)."""


@dataclass(slots=True)
class RequestSpread:
    """How much a speculative pool's time per output token varies from request to request
    because each request's own acceptance does (prompts draft well or badly).

    A request's TPOT is the pool's step over its own accept length, so the pool's mean accept
    length predicts the mean TPOT while about half the requests run slower than that. Kept over
    each finished request's tokens per verify step, one request one sample (the SLO counts
    requests), whether or not the server's counters feed the pool's acceptance estimate."""

    memory: int = SPREAD_MEMORY
    samples: int = 0
    _mean: float = 0.0
    """Mean of 1 / accept length (TPOT relative to the step)."""
    _square: float = 0.0
    """Mean of its square."""

    def observe(self, completion_tokens: int, verify_steps: int) -> None:
        if verify_steps <= 0 or completion_tokens <= 1:
            return
        inverse = verify_steps / verified_tokens(completion_tokens, verify_steps)
        self.samples = min(self.samples + 1, self.memory)
        self._mean += (inverse - self._mean) / self.samples
        self._square += (inverse * inverse - self._square) / self.samples

    def cv(self) -> float:
        """Coefficient of variation of the requests' time per token at a given step (standard
        deviation over mean of 1 / accept length); 0 until SPREAD_MIN_SAMPLES responses."""
        if self.samples < SPREAD_MIN_SAMPLES or self._mean <= 0:
            return 0.0
        return math.sqrt(max(self._square - self._mean * self._mean, 0.0)) / self._mean


WORKLOAD_KEYS = 4096
"""Workload keys whose acceptance is kept (least recently used dropped first)."""
WORKLOAD_PRIOR_STEPS = 200.0
"""Verify steps of evidence (about two typical requests) at which a workload's own accept
length and the pool-wide estimate weigh the same: a key's estimate is shrunk toward the pool's
by n0 / (n + n0) while its evidence n is small."""


class WorkloadAcceptance:
    """Accept length per workload key of one speculative pool, shrunk toward the pool-wide one.

    Each key keeps a `SmoothedMean` of its own requests' tokens per verify step (weighed by the
    steps they cover, halving every `half_life_s` like the pool's estimate). Its accept length is
    (n x tau_key + n0 x tau_pool) / (n + n0), n its evidence left after decay, n0
    `prior_steps`: a key seen once or long ago stays near the pool's estimate, and one with
    hundreds of fresh verify steps speaks for itself. At most `max_keys` keys are kept, the least
    recently used dropped first, so a client that sends a new key per request costs bounded
    memory (and each such key, with no evidence of its own, gets the pool's estimate).
    """

    def __init__(
        self,
        num_draft_tokens: int,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        max_keys: int = WORKLOAD_KEYS,
        prior_steps: float = WORKLOAD_PRIOR_STEPS,
    ):
        self.k = num_draft_tokens
        self.half_life_s = half_life_s
        self.max_keys = max_keys
        self.prior_steps = prior_steps
        self._keys: OrderedDict[str, SmoothedMean] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def observe_request(
        self, key: str, now: float, completion_tokens: int, verify_steps: int, age_s: float = 0.0
    ) -> None:
        """One finished request of workload `key` (as AcceptanceEstimator.observe_request)."""
        if verify_steps <= 0 or completion_tokens <= 0 or self.max_keys <= 0:
            return
        mean = self._keys.get(key)
        if mean is None:
            while len(self._keys) >= self.max_keys:
                self._keys.popitem(last=False)
            mean = self._keys[key] = SmoothedMean(self.half_life_s)
        else:
            self._keys.move_to_end(key)
        weight = verify_steps * math.pow(0.5, max(age_s, 0.0) / self.half_life_s)
        mean.observe(now, verified_tokens(completion_tokens, verify_steps) / verify_steps, weight)

    def accept_length(self, key: str, now: float, pool_accept_length: float | None) -> float | None:
        """The key's accept length shrunk toward `pool_accept_length` (the pool-wide estimate);
        the pool's when the key is unknown, the key's own when the pool has none."""
        mean = self._keys.get(key)
        own = mean.value() if mean is not None else None
        if mean is None or own is None:
            return pool_accept_length
        if pool_accept_length is None:
            return own
        n = mean.weight(now)
        return (n * own + self.prior_steps * pool_accept_length) / (n + self.prior_steps)

    def evidence(self, key: str, now: float) -> float | None:
        """The key's own verify steps' worth (None: the key is not known)."""
        mean = self._keys.get(key)
        return None if mean is None else mean.weight(now)

    def alpha(self, key: str, now: float, pool_accept_length: float | None) -> float | None:
        tau = self.accept_length(key, now, pool_accept_length)
        return None if tau is None else alpha_from_accept_length(tau, self.k)

    def top(self, now: float, n: int, pool_accept_length: float | None) -> list[dict[str, float | str | None]]:
        """The `n` keys with the most evidence now: key, evidence (verify steps), its own accept
        length, and the shrunk estimate and alpha a request of it is routed on."""
        ranked = sorted(self._keys.items(), key=lambda item: item[1].weight(now), reverse=True)[: max(n, 0)]
        out: list[dict[str, float | str | None]] = []
        for key, mean in ranked:
            own = mean.value()
            tau = self.accept_length(key, now, pool_accept_length)
            out.append(
                {
                    "key": key,
                    "evidence_steps": round(mean.weight(now), 1),
                    "own_accept_length": None if own is None else round(own, 4),
                    "accept_length": None if tau is None else round(tau, 4),
                    "alpha": None if tau is None else round(alpha_from_accept_length(tau, self.k), 4),
                }
            )
        return out
