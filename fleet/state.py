"""The one snapshot builder: polled load + our own dispatches since the poll -> a policy Snapshot.

Both the proxy (fed by HTTP polls, proxy/signals.py) and the virtual-clock evaluation (fed by
the twin's fleet view at a modelled poll interval, bench/routing_*) build their snapshots here,
so what was evaluated is what is served. Nothing reads a clock: every call takes `now` in seconds.

Between polls, each instance's last reading is adjusted by the dispatches and completions this
router saw since the reading was taken (sent after it: +1; finished after it: -1), so a burst is
seen at once, and other proxy replicas' load still shows through the server's own figures.
A reading older than `stale_after_s` marks its pool stale (policies then act conservatively).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from fleet.acceptance import DEFAULT_HALF_LIFE_S, AcceptanceEstimator, CounterDelta
from fleet.costmodel import StepCostModel
from fleet.types import InstanceState, PoolName, PoolState, Snapshot, StepCost

# The window of the dispatch rates: about how long a burst of prefills keeps stalling the decode
# steps of the requests already running.
RATE_WINDOW_S = 2.0
# Finished requests the mean output length covers (a moving mean over about as many after that).
OUTPUT_MEMORY = 50


@dataclass(slots=True)
class EventRate:
    """Events (or amounts) per second, exponentially weighted over RATE_WINDOW_S."""

    weighted: float = 0.0
    at: float = 0.0

    def add(self, now: float, amount: float = 1.0) -> None:
        self.weighted = self._decayed(now) + amount
        self.at = max(now, self.at)

    def remove(self, added_at: float, now: float, amount: float = 1.0) -> None:
        """Take back an amount added at `added_at` (what is left of it at `now`)."""
        left = amount * math.exp(-max(now - added_at, 0.0) / RATE_WINDOW_S)
        self.weighted = max(self._decayed(now) - left, 0.0)
        self.at = max(now, self.at)

    def per_s(self, now: float) -> float:
        return self._decayed(now) / RATE_WINDOW_S

    def _decayed(self, now: float) -> float:
        return self.weighted * math.exp(-max(now - self.at, 0.0) / RATE_WINDOW_S)


@dataclass(frozen=True, slots=True)
class Reading:
    """One instance's load as its server reported it."""

    at: float
    """When the poll was sent (a reading cannot be newer than that)."""
    running: float
    waiting: float
    max_running: int | None = None
    waiting_tokens: float | None = None
    """Prompt tokens not yet prefilled (/v1/loads num_waiting_uncached_tokens), if reported."""
    accept_length: float | None = None
    """The server's recent-interval accept-length gauge (sglang:spec_accept_length), if read."""
    accept_steps: float = 1.0
    """About how many request-verify steps that gauge covers (interval iterations x batch)."""
    tokens_total: float | None = None
    verify_total: float | None = None
    """Monotonic counters (generation tokens, spec verify calls), if the server exports them."""


@dataclass(slots=True)
class InstanceSignals:
    url: str
    pool: PoolName
    max_running: int
    healthy: bool = True
    """Reachable: its load polls (or the last connection) succeed."""
    ejected: bool = False
    """Answering, but answering badly: out of rotation for a while (proxy/outliers.py)."""
    reading: Reading | None = None
    local_in_flight: int = 0
    """Our requests on this instance now (the fallback load when it cannot be polled)."""
    events: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=65536))
    """(time, +1 dispatch / -1 completion, prompt tokens of a dispatch) since the current reading."""
    counters: CounterDelta = field(default_factory=CounterDelta)
    last_gauge: float | None = None
    polled: bool = True
    """False when the server answers no load endpoint: its load is our own in-flight count."""
    prompt_tokens_sent: EventRate = field(default_factory=EventRate)
    """Prompt tokens this router sent here per second (their prefill stalls the decode)."""
    sent: EventRate = field(default_factory=EventRate)
    """Requests this router sent here per second."""

    def adjusted(self) -> tuple[float, float]:
        """(running, waiting): the reading, less completions since it and plus dispatches since
        it. A request sent after the reading is counted as waiting (queued for prefill) and a
        completion frees a running slot; SGLang moves waiting requests in at its next prefill."""
        if self.reading is None or not self.polled:
            running = float(min(self.local_in_flight, self.max_running))
            return running, self.local_in_flight - running
        since = self.reading.at
        sent = sum(1 for at, sign, _ in self.events if at >= since and sign > 0)
        done = sum(1 for at, sign, _ in self.events if at >= since and sign < 0)
        running = self.reading.running - done
        waiting = self.reading.waiting + sent
        if running < 0:  # more completions than the reading had running: they came from the queue
            waiting += running
            running = 0.0
        waiting = max(waiting, 0.0)
        # The server frees a slot just before its last chunk reaches us, so a poll answered in
        # between no longer counts a request whose completion we then subtract again. Our own
        # open requests are a floor: the server holds at least those.
        missing = self.local_in_flight - (running + waiting)
        if missing > 0:
            to_running = min(missing, max(self.max_running - running, 0.0))
            running += to_running
            waiting += missing - to_running
        return running, waiting

    def waiting_tokens(self) -> float | None:
        """The reading's unprefilled prompt tokens plus those of our dispatches since it."""
        if self.reading is None or not self.polled or self.reading.waiting_tokens is None:
            return None
        since = self.reading.at
        return self.reading.waiting_tokens + sum(t for at, sign, t in self.events if at >= since and sign > 0)

    def adjusted_load(self) -> float:
        running, waiting = self.adjusted()
        return running + waiting

    def age(self, now: float) -> float:
        if not self.polled:
            return 0.0  # our own count is always current
        if self.reading is None:
            return math.inf
        return max(now - self.reading.at, 0.0)


class FleetState:
    """Per-instance readings and events, per-pool acceptance; builds Snapshots on demand."""

    def __init__(
        self,
        stale_after_s: float = 1.0,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        num_draft_tokens: int = 3,
    ):
        self.stale_after_s = stale_after_s
        self.half_life_s = half_life_s
        self.instances: dict[str, InstanceSignals] = {}
        self.num_draft_tokens: dict[PoolName, int] = {"spec": num_draft_tokens, "base": 0}
        self.acceptance = AcceptanceEstimator(num_draft_tokens, half_life_s)
        self.spec_decode_s = 0.0
        """Mean decode time of recent spec requests (the lag of the server's counters)."""
        self.mean_output_tokens: float | None = None
        self.output_samples = 0
        """Running mean of finished requests' output tokens (the traffic's typical length)."""

    def add_instance(self, url: str, pool: PoolName, max_running: int) -> InstanceSignals:
        signals = InstanceSignals(url=url, pool=pool, max_running=max_running)
        self.instances[url] = signals
        return signals

    def set_draft_tokens(self, num_draft_tokens: int) -> None:
        """The spec pool's k (from /server_info); a change restarts the acceptance estimate."""
        if num_draft_tokens != self.num_draft_tokens["spec"]:
            self.num_draft_tokens["spec"] = num_draft_tokens
            self.acceptance = AcceptanceEstimator(num_draft_tokens, self.half_life_s)

    # -- events ---------------------------------------------------------------------------------

    def on_reading(self, url: str, reading: Reading) -> None:
        signals = self.instances[url]
        if signals.reading is not None and reading.at < signals.reading.at:
            return  # an answer overtaken by a newer one
        signals.reading = reading
        signals.polled = True
        if reading.max_running:
            signals.max_running = reading.max_running
        while signals.events and signals.events[0][0] < reading.at:
            signals.events.popleft()
        if signals.pool != "spec":
            return
        if reading.tokens_total is not None and reading.verify_total is not None:
            delta = signals.counters.add(reading.tokens_total, reading.verify_total)
            if delta is not None:
                self.acceptance.observe_counters(reading.at, *delta, age_s=self.spec_decode_s / 2)
        # The gauge is refreshed once per decode-log interval: a value seen before adds nothing,
        # and an idle server's gauge still holds an old interval's value (SGLang keeps it).
        if reading.accept_length is not None and reading.accept_length != signals.last_gauge:
            signals.last_gauge = reading.accept_length
            if reading.running > 0:
                self.acceptance.observe_gauge(reading.at, reading.accept_length, reading.accept_steps)

    def on_unpolled(self, url: str) -> None:
        """The server has no load endpoint: fall back to our own in-flight count for it."""
        self.instances[url].polled = False

    def on_dispatch(self, url: str, now: float, prompt_tokens: int = 0) -> None:
        signals = self.instances[url]
        signals.local_in_flight += 1
        signals.prompt_tokens_sent.add(now, prompt_tokens)
        signals.sent.add(now)
        if signals.polled:
            signals.events.append((now, +1, prompt_tokens))

    def on_complete(self, url: str, now: float) -> None:
        signals = self.instances[url]
        signals.local_in_flight = max(signals.local_in_flight - 1, 0)
        if signals.polled:
            signals.events.append((now, -1, 0))

    def on_refused(self, url: str, dispatched_at: float, now: float, prompt_tokens: int = 0) -> None:
        """The server refused a request dispatched at `dispatched_at` (a 4xx): it never ran, so
        its dispatch is undone rather than completed. Its prompt tokens would otherwise count as
        prefill work sent there (five refused 1 MB prompts moved the next requests to base)."""
        signals = self.instances[url]
        signals.local_in_flight = max(signals.local_in_flight - 1, 0)
        signals.prompt_tokens_sent.remove(dispatched_at, now, prompt_tokens)
        signals.sent.remove(dispatched_at, now)
        if signals.polled:
            try:
                signals.events.remove((dispatched_at, +1, prompt_tokens))
            except ValueError:
                signals.events.append((now, -1, 0))  # aged out of the window: count it as done

    def on_request_evidence(self, now: float, completion_tokens: int, verify_steps: int, age_s: float = 0.0) -> None:
        """A finished spec request's own tokens and verify steps (stream chunks or spec details);
        `age_s` is half its decode time (its evidence is that old on average)."""
        self.acceptance.observe_request(now, completion_tokens, verify_steps, age_s)
        # A running mean of spec requests' decode time: how far the counters lag.
        self.spec_decode_s += 0.1 * (2 * age_s - self.spec_decode_s)

    def on_output(self, tokens: int) -> None:
        """A finished request's completion tokens (any pool)."""
        if tokens > 0:
            # The plain mean of the first OUTPUT_MEMORY responses, then a moving one over about
            # as many (output lengths are heavy-tailed: a few samples say little).
            self.output_samples = min(self.output_samples + 1, OUTPUT_MEMORY)
            mean = self.mean_output_tokens or 0.0
            self.mean_output_tokens = mean + (tokens - mean) / self.output_samples

    def set_health(self, url: str, healthy: bool) -> None:
        self.instances[url].healthy = healthy

    def set_ejected(self, url: str, ejected: bool) -> None:
        self.instances[url].ejected = ejected

    # -- the snapshot ---------------------------------------------------------------------------

    def snapshot(self, now: float, cost: StepCost | None = None) -> Snapshot:
        """The fleet at `now`; a learned cost model is read as it predicts at `now` (its
        corrections' trust aged to then)."""
        if isinstance(cost, StepCostModel):
            cost = cost.at(now)
        pools: dict[str, PoolState] = {}
        for name in ("spec", "base"):
            members = [s for s in self.instances.values() if s.pool == name]
            if not members:
                continue
            states = tuple(self._instance_state(s, now) for s in members)
            healthy_ages = [st.age_s for st in states if st.healthy]
            speculative = name == "spec" and self.num_draft_tokens["spec"] > 0
            pools[name] = PoolState(
                name=name,  # type: ignore[arg-type]
                instances=states,
                speculative=speculative,
                num_draft_tokens=self.num_draft_tokens["spec"] if speculative else 0,
                alpha=self.acceptance.alpha() if speculative else None,
                stale=bool(healthy_ages) and min(healthy_ages) > self.stale_after_s,
            )
        return Snapshot(
            pools=pools, cost=cost, mean_output_tokens=self.mean_output_tokens, output_samples=self.output_samples
        )

    def _instance_state(self, signals: InstanceSignals, now: float) -> InstanceState:
        running, waiting = signals.adjusted()
        return InstanceState(
            url=signals.url,
            running=running,
            waiting=waiting,
            max_running=signals.max_running,
            healthy=signals.healthy and not signals.ejected,
            ejected=signals.ejected,
            age_s=signals.age(now),
            waiting_tokens=signals.waiting_tokens(),
            prompt_tokens_per_s=signals.prompt_tokens_sent.per_s(now),
            dispatches_per_s=signals.sent.per_s(now),
        )


def learn_from_response(
    fleet: FleetState,
    cost: StepCostModel,
    url: str,
    now: float,
    *,
    tokens: int | None = None,
    verify_steps: int | None = None,
    step_ms: float | None = None,
    decode_s: float = 0.0,
) -> None:
    """What one finished response teaches. `step_ms`: its typical (median) inter-chunk gap, one
    engine decode step at about the instance's present batch (SGLang and the twin send one chunk
    per step; the median leaves out the gaps that other requests' prefills stretched). On a
    spec instance its `tokens` per `verify_steps` are acceptance evidence, as old as half its
    `decode_s`. Call it before the completion is counted (on_complete): the batch includes the
    request."""
    signals = fleet.instances[url]
    if tokens:
        fleet.on_output(tokens)
    if step_ms is not None and step_ms > 0:
        batch = min(max(signals.adjusted_load(), 1.0), float(signals.max_running))
        cost.observe(signals.pool, batch, step_ms, now=now)
    if signals.pool != "spec":
        return
    if tokens and verify_steps:
        fleet.on_request_evidence(now, tokens, verify_steps, decode_s / 2)
