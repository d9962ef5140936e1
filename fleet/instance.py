"""One instance as the router tracks it: its last reading and our own traffic to it since.

Between polls, an instance's last reading is adjusted by the dispatches and completions this
router saw since the reading was taken (sent after it: +1; finished after it: -1), so a burst is
seen at once, and other proxy replicas' load still shows through the server's own figures.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from fleet.acceptance import CounterDelta
from fleet.readings import Reading
from fleet.types import InstanceState

# Prefill tokens the measured prefill speed is averaged over (a moving mean after that).
PREFILL_MEMORY_TOKENS = 65_536
# The window of the dispatch rates: about how long a burst of prefills keeps stalling the decode
# steps of the requests already running.
RATE_WINDOW_S = 2.0


# The window over which a server's counted prefill tokens are compared with the uncached tokens
# this router sent it: long beside the lag between a dispatch and its prefill being counted.
PREFILLED_WINDOW_S = 30.0


@dataclass(slots=True)
class EventRate:
    """Events (or amounts) per second, exponentially weighted over `window_s`."""

    weighted: float = 0.0
    at: float = 0.0
    window_s: float = RATE_WINDOW_S

    def add(self, now: float, amount: float = 1.0) -> None:
        self.weighted = self._decayed(now) + amount
        self.at = max(now, self.at)

    def remove(self, added_at: float, now: float, amount: float = 1.0) -> None:
        """Take back an amount added at `added_at` (what is left of it at `now`)."""
        left = amount * math.exp(-max(now - added_at, 0.0) / self.window_s)
        self.weighted = max(self._decayed(now) - left, 0.0)
        self.at = max(now, self.at)

    def per_s(self, now: float) -> float:
        return self._decayed(now) / self.window_s

    def _decayed(self, now: float) -> float:
        return self.weighted * math.exp(-max(now - self.at, 0.0) / self.window_s)


def long_rate() -> EventRate:
    return EventRate(window_s=PREFILLED_WINDOW_S)


@dataclass(slots=True)
class CacheStats:
    """One instance's prompt tokens as its servers' usage reported them, and how many of them
    were cached; and what the router credited it with."""

    responses: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    credited_tokens: int = 0
    """Tokens credited at dispatch to the requests in `responses`, in the router's estimate's units."""

    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(slots=True)
class InstanceSignals:
    url: str
    pool: str
    max_running: int
    healthy: bool = True
    """Reachable: its load polls (or the last connection) succeed."""
    ejected: bool = False
    """Answering, but answering badly: out of rotation for a while (proxy/outliers.py)."""
    time_scale: float = 1.0
    """Its busy-time counters' units per wall-clock unit (ServerDescription.time_scale: a twin's)."""
    replicas: int = 1
    """Engines behind its front (ServerDescription.replicas: SGLang's data-parallel ranks)."""
    separate_ranks: bool = False
    """Its description said several engines (data-parallel ranks without DP attention): their
    number then follows the ranks its load answers list."""
    cap_reported: bool = False
    """Its cap came from the server (a description or a reading), not the configured default."""
    out_ranks: tuple[int, ...] = ()
    """Its data-parallel ranks judged hung (the proxy's `Router.check_ranks`): their requests
    and cap are not the server's to serve."""
    unresponsive: bool = False
    """Reachable, but its load polls go unanswered while another server's are answered
    (FleetModel.unresponsive: a stopped process or host): out of rotation until one is."""

    @property
    def in_rotation(self) -> bool:
        """Reachable, answering its polls (or none is answered), and not ejected."""
        return self.healthy and not self.ejected and not self.unresponsive

    reading: Reading | None = None
    local_in_flight: int = 0
    """Our requests on this instance now (the fallback load when it cannot be polled)."""
    events: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=65536))
    """(time, +1 dispatch / -1 completion, prompt tokens of a dispatch) since the current reading."""
    counters: CounterDelta = field(default_factory=CounterDelta)
    counters_at: float | None = None
    """When its acceptance counters (generation tokens, verify calls) were last read (None: never)."""
    last_gauge: float | None = None
    engine_mark: float | None = None
    """Its latest reading's engine mark (Reading.engine_mark), None before one."""
    engine_mark_at: float = -math.inf
    """The time of the reading whose engine mark changed, or was first seen."""
    engine_moved: bool = False
    """Its engine mark has been seen to change: one that never does (vLLM's stats turned off)
    says nothing of its engine."""
    rank_marks: tuple[float, ...] = ()
    """Its data-parallel ranks' marks as last read (Reading.rank_marks); empty for one rank."""
    rank_running: tuple[float, ...] = ()
    rank_waiting: tuple[float, ...] = ()
    rank_waiting_tokens: tuple[float, ...] = ()
    rank_moved_at: list[float] = field(default_factory=list)
    """When each rank's mark last changed, or was first seen."""
    polled: bool = True
    """False when the server answers no load endpoint: its load is our own in-flight count."""
    prompt_tokens_sent: EventRate = field(default_factory=EventRate)
    """Prompt tokens this router sent here per second (their prefill stalls the decode)."""
    sent: EventRate = field(default_factory=EventRate)
    """Requests this router sent here per second."""
    uncached_sent: EventRate = field(default_factory=long_rate)
    """`prompt_tokens_sent` over PREFILLED_WINDOW_S, beside `prefilled`."""
    prefilled: EventRate = field(default_factory=long_rate)
    """Prompt tokens its prefill counters counted, over PREFILLED_WINDOW_S."""
    cache_tokens: int | None = None
    """Its KV capacity in tokens as last read (the prefix index's cap for it)."""
    cache: CacheStats = field(default_factory=CacheStats)
    """What its responses reported of its prefix cache."""
    prefill_counters: CounterDelta = field(default_factory=CounterDelta)
    """Its cumulative prefill tokens and busy microseconds, differenced between readings."""
    outage_mark: int | None = None
    """The prefix index's insert sequence number when it turned unhealthy with its prefill
    counters read (None: it did not, or a reading since settled it): whether it restarted is
    told by its next reading, and what the index put there up to the mark goes only then."""
    prefill_ms_per_token: float | None = None
    """Its measured prefill time per uncached prompt token, under whatever load it had: busy
    time over tokens, weighted by tokens over about PREFILL_MEMORY_TOKENS (None: not reported)."""
    prefill_tokens_measured: float = 0.0

    def on_prefill_counters(self, tokens_total: float, busy_us_total: float) -> tuple[float, float] | None:
        """Difference the cumulative counters: (uncached tokens, busy microseconds) since the
        previous reading, or None (the first reading, a reset, or no prefill since)."""
        delta = self.prefill_counters.add(tokens_total, busy_us_total)
        if delta is None:  # the first reading or a restarted server: both counts start again here
            self.uncached_sent, self.prefilled = long_rate(), long_rate()
            return None
        if delta[0] <= 0:
            return None
        tokens, busy_us = delta
        rate = busy_us / 1000 / tokens
        self.prefill_tokens_measured = min(self.prefill_tokens_measured + tokens, PREFILL_MEMORY_TOKENS)
        mean = self.prefill_ms_per_token if self.prefill_ms_per_token is not None else rate
        self.prefill_ms_per_token = mean + (rate - mean) * tokens / self.prefill_tokens_measured
        return delta

    def prefilled_share(self, now: float) -> float:
        """The tokens its counters prefilled over the uncached tokens this router sent it, at
        most 1: under 1, it held in its prefix cache more of our prompts than the router credited
        (another proxy replica's or a restarted router's turns); 1 while either is unknown."""
        ours = self.uncached_sent.per_s(now)
        if ours <= 0 or self.prefilled.weighted <= 0:
            return 1.0
        return min(self.prefilled.per_s(now) / ours, 1.0)

    recent_dispatches: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    """When our latest requests were sent here (kept across readings): a request sent while
    another one's prefill had not started may have joined it."""

    def adjusted(self) -> tuple[float, float]:
        """(running, waiting): the reading, less completions since it and plus dispatches since
        it. A request sent after the reading is counted as waiting (queued for prefill) and a
        completion frees a running slot; SGLang moves waiting requests in at its next prefill."""
        running, waiting, _ = self.load_state()
        return running, waiting

    def waiting_tokens(self) -> float | None:
        """The reading's unprefilled prompt tokens plus those of our dispatches since it."""
        return self.load_state()[2]

    def load_state(self) -> tuple[float, float, float | None]:
        """`adjusted()` and `waiting_tokens()` in one pass over the events (what a snapshot
        reads of each instance)."""
        reading = self.reading
        if reading is None or not self.polled:
            running = float(min(self.local_in_flight, self.max_running))
            return running, self.local_in_flight - running, None
        since = reading.at
        sent = done = 0
        tokens = 0
        for at, sign, t in self.events:
            if at >= since:
                if sign > 0:
                    sent += 1
                    tokens += t
                elif sign < 0:
                    done += 1
        running = reading.running - done
        waiting = reading.waiting + sent
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
        return running, waiting, None if reading.waiting_tokens is None else reading.waiting_tokens + tokens

    def state(self, now: float) -> InstanceState:
        """The instance as a policy sees it at `now` (what a snapshot holds): `load_state()`,
        `age(now)` and the two rates' `per_s(now)`, written out here (a snapshot takes one per
        instance per decision)."""
        running, waiting, waiting_tokens = self.load_state()
        reading = self.reading
        age = 0.0 if not self.polled else math.inf if reading is None else max(now - reading.at, 0.0)
        tokens, sent = self.prompt_tokens_sent, self.sent
        tokens_per_s = tokens.weighted * math.exp(-max(now - tokens.at, 0.0) / RATE_WINDOW_S) / RATE_WINDOW_S
        sent_per_s = sent.weighted * math.exp(-max(now - sent.at, 0.0) / RATE_WINDOW_S) / RATE_WINDOW_S
        if self.replicas <= 1 and not self.out_ranks:
            return InstanceState(
                self.url,
                running,
                waiting,
                self.max_running,
                self.in_rotation,
                self.ejected,
                age,
                waiting_tokens,
                tokens_per_s,
                sent_per_s,
                in_flight=self.local_in_flight,
            )
        # One engine's view: each has its part of the load, of the queue, of what we send and
        # of the cap. A hung rank's requests and cap are left out (it serves none of them).
        running, waiting, waiting_tokens, serving, cap = self.engine_load((running, waiting, waiting_tokens))
        return InstanceState(
            self.url,
            running,
            waiting,
            cap,
            self.in_rotation,
            self.ejected,
            age,
            waiting_tokens,
            tokens_per_s / serving,
            sent_per_s / serving,
            replicas=serving,
            hung_ranks=len(self.out_ranks),
            in_flight=self.local_in_flight,
        )

    def engine_load(
        self, load: tuple[float, float, float | None] | None = None
    ) -> tuple[float, float, float | None, int, int]:
        """One engine's running and waiting requests and queued tokens, the engines serving and
        one's cap: `load_state()` (or `load`) less what hung ranks hold, over the serving engines.
        The server's own figures for a server of one engine."""
        running, waiting, waiting_tokens, serving, cap = self.serving_load(load)
        tokens = None if waiting_tokens is None else waiting_tokens / serving
        return running / serving, waiting / serving, tokens, serving, cap

    def serving_load(
        self, load: tuple[float, float, float | None] | None = None
    ) -> tuple[float, float, float | None, int, int]:
        """`engine_load` before the division: what the serving engines hold in all, how many
        serve, and one's cap. Ranks that share one batch (DP attention: `replicas` 1) are one
        engine, a hung rank's figures taken out all the same."""
        running, waiting, waiting_tokens = self.load_state() if load is None else load
        replicas = max(self.replicas, 1)
        serving = max(replicas - len(self.out_ranks), 1)
        for rank in self.out_ranks:
            if rank < len(self.rank_running):
                running -= self.rank_running[rank]
                waiting -= self.rank_waiting[rank]
                if waiting_tokens is not None:
                    waiting_tokens -= self.rank_waiting_tokens[rank]
        tokens = None if waiting_tokens is None else max(waiting_tokens, 0.0)
        return max(running, 0.0), max(waiting, 0.0), tokens, serving, max(self.max_running // replicas, 1)

    def adjusted_load(self) -> float:
        running, waiting = self.adjusted()
        return running + waiting

    def on_engine_mark(self, mark: float | None, at: float) -> None:
        if mark is None:
            return  # not reported this time: the last one stands
        if mark != self.engine_mark:
            self.engine_moved = self.engine_moved or self.engine_mark is not None
            self.engine_mark, self.engine_mark_at = mark, at

    def on_ranks(self, reading: Reading) -> None:
        """A reading's per-rank figures (Reading.rank_marks)."""
        marks, at = reading.rank_marks, reading.at
        if len(marks) != len(self.rank_marks):  # the first reading, or a server restarted with other ranks
            self.rank_moved_at = [at] * len(marks)
        else:
            for rank, (before, mark) in enumerate(zip(self.rank_marks, marks)):
                if mark != before:
                    self.rank_moved_at[rank] = at
        self.rank_marks = marks
        self.rank_running, self.rank_waiting = reading.rank_running, reading.rank_waiting
        self.rank_waiting_tokens = reading.rank_waiting_tokens

    def hung_ranks(self, now: float, still_s: float) -> tuple[int, ...]:
        """Its data-parallel ranks that show work but whose mark has held still for `still_s`
        while another rank is not so (it moves, or has no work): schedulers hung among working
        ones. SGLang deals requests to its ranks in turn (vLLM to the least loaded as it last
        heard, a hung engine's counts frozen), so such a rank holds its share of requests until
        the first-token timeout, while the server's own mark (of all ranks) moves and its other
        requests stream. Empty when every rank is so (the whole engine is stuck:
        `engine_still_s` says it) or the server has one rank."""
        if len(self.rank_marks) < 2 or len(self.rank_running) != len(self.rank_marks):
            return ()
        hung = tuple(
            rank
            for rank, moved_at in enumerate(self.rank_moved_at)
            if self.rank_running[rank] + self.rank_waiting[rank] > 0 and now - moved_at >= still_s
        )
        return hung if len(hung) < len(self.rank_marks) else ()

    def idle_still_ranks(self, now: float, still_s: float) -> tuple[int, ...]:
        """Its data-parallel ranks that show no work and whose mark has held still for `still_s`:
        idle, or hung in the first prefill after idling (SGLang publishes a rank's snapshot once
        when it goes idle and next after a prefill batch; a hung vLLM core sends no more stats),
        which its figures cannot tell apart (`Router.check_ranks` asks the rank itself)."""
        if len(self.rank_marks) < 2 or len(self.rank_running) != len(self.rank_marks):
            return ()
        return tuple(
            rank
            for rank, moved_at in enumerate(self.rank_moved_at)
            if self.rank_running[rank] + self.rank_waiting[rank] <= 0 and now - moved_at >= still_s
        )

    def rank_moved_since(self, rank: int, at: float) -> bool:
        """Whether the rank's mark moved after `at` (a rank it no longer lists counts as moved)."""
        return rank >= len(self.rank_moved_at) or self.rank_moved_at[rank] > at

    def engine_still_s(self, now: float) -> float | None:
        """Seconds since its engine mark last moved (None: not known to move). An idle engine's
        mark holds still too; a busy one's moves within a step or a prefill chunk."""
        if not self.engine_moved:
            return None
        return max(now - self.engine_mark_at, 0.0)

    def age(self, now: float) -> float:
        if not self.polled:
            return 0.0  # our own count is always current
        if self.reading is None:
            return math.inf
        return max(now - self.reading.at, 0.0)
