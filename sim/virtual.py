"""The virtual-clock driver: a fleet of twin engines and an arrival list, simulated in-process.

    records = simulate(
        [Engine(spec_config, "spec"), Engine(base_config, "base")],
        arrivals,                         # Arrival(time, prompt_tokens, max_tokens, ...)
        router=lambda arrival, fleet: 0 if fleet[0].running < 32 else 1,
        on_step=observations.append,      # StepObservation per engine step
        alpha_changes=[AlphaChange(time=60.0, engine=0, alpha=0.32)],
    )

It is the same engine the HTTP server runs (sim/engine.py), driven by a discrete-event loop
instead of asyncio: each engine step ends at its start plus the profile's step time; arrivals
between steps join the next step, as they do on the server.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from sim.engine import Engine, Request, Step


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of an arrival process."""

    time: float
    """Seconds (simulated) since the start."""
    prompt_tokens: int
    max_tokens: int | None = None
    output_tokens: int | None = None
    """The natural output length (where "EOS" comes); None draws it from the engine's distribution."""
    ignore_eos: bool = False
    request_class: str = "latency"
    stream: bool = True
    prefix: tuple[Hashable, ...] | None = None
    """The prompt's blocks for the prefix cache, `prefix_block_tokens` tokens each, e.g. the
    Mooncake trace's `hash_ids` (equal leading ids are a shared prefix). None: the request neither
    uses nor fills the cache (token counts only, as the routing evaluation feeds them)."""
    prefix_block_tokens: int = 512
    """Tokens per block of `prefix` (Mooncake's: 512). Engines whose `page_size` equals it use
    the ids as pages directly (fast); a page size that divides it splits each block."""
    workload: str | None = None
    """Its workload key (what a client sends as x-specroute-workload): a spec engine draws its
    alpha around that workload's mean (EngineConfig.workload_alpha)."""


@dataclass(frozen=True, slots=True)
class AlphaChange:
    time: float
    engine: int
    alpha: float


@dataclass(frozen=True, slots=True)
class StepObservation:
    """What one engine step looked like, as a router could learn it from inter-token latency."""

    engine: int
    engine_name: str
    kind: str
    """"prefill" or "decode"."""
    batch: int
    tokens_per_seq: int
    """Decode: 1 (base) or k+1 (spec verify); prefill: prompt tokens in the iteration."""
    start: float
    duration_s: float
    tokens: int
    """Tokens the step committed, all sequences together."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int
    """Position of the request in the arrival list."""
    engine: int
    engine_name: str
    arrival: float
    first_token_time: float
    finish_time: float
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    verify_ct: int
    alpha: float
    """The request's own per-token acceptance probability (spec engines; 0 on base)."""
    request_class: str
    cached_tokens: int = 0
    """Prompt tokens the engine's prefix cache held at admission (not prefilled)."""
    workload: str | None = None
    """The arrival's workload key."""

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first (0 for a single token)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_time - self.first_token_time) / (self.output_tokens - 1)

    @property
    def accept_length(self) -> float:
        """completion_tokens / spec_verify_ct, as SGLang reports it per request (0 on base)."""
        return self.output_tokens / self.verify_ct if self.verify_ct else 0.0


class EngineView:
    """Read-only view of one engine for a router: what an SGLang server exposes, live.

    `load_snapshot` is what /v1/loads would return right now (published on SGLang's cadence,
    so it can lag); the other properties are the live values.
    """

    __slots__ = ("_engine", "index")

    def __init__(self, engine: Engine, index: int):
        self._engine = engine
        self.index = index

    @property
    def name(self) -> str:
        return self._engine.name

    @property
    def mode(self) -> str:
        return self._engine.config.mode

    @property
    def speculative(self) -> bool:
        return self._engine.config.speculative

    @property
    def running(self) -> int:
        return self._engine.num_running

    @property
    def waiting(self) -> int:
        return self._engine.num_waiting

    @property
    def max_running_requests(self) -> int:
        return self._engine.config.max_running

    @property
    def num_draft_tokens(self) -> int:
        """k, draft tokens per verify step (0 on a base engine)."""
        return self._engine.config.num_steps if self.speculative else 0

    @property
    def accept_length(self) -> float:
        """Cumulative accept length, as /v1/loads speculative.accept_length (0 before any verify)."""
        return self._engine.accept_length

    @property
    def spec_num_accept_tokens(self) -> int:
        return self._engine.spec_num_accept_tokens

    @property
    def spec_num_forward_ct(self) -> int:
        return self._engine.spec_num_forward_ct

    @property
    def generation_tokens_total(self) -> int:
        """sglang:generation_tokens_total (counts finished requests)."""
        return self._engine.finished_generation_tokens

    @property
    def spec_verify_calls_total(self) -> int:
        """sglang:spec_verify_calls_total (counts finished requests)."""
        return self._engine.finished_verify_ct

    @property
    def gauges(self) -> dict[str, float]:
        """The /metrics scheduler gauges as last refreshed (spec_accept_length: last 40 decode steps)."""
        return dict(self._engine.gauges)

    @property
    def load_snapshot(self) -> dict:
        return dict(self._engine.load_snapshot)

    def cached_tokens(self, arrival: Arrival) -> int:
        """Tokens of the arrival's prefix this engine's cache holds now (an oracle: a real
        router only approximates it); 0 without a prefix or a cache. Touches nothing."""
        engine = self._engine
        if arrival.prefix is None or engine.cache is None:
            return 0
        key = engine.block_key(arrival.prefix, arrival.prefix_block_tokens)
        page = engine.config.page_size
        return min(engine.cache.peek(key) * page, max(arrival.prompt_tokens - 1, 0)) // page * page

    @property
    def cache_size(self) -> int:
        """Tokens in the engine's prefix cache (locked and evictable)."""
        cache = self._engine.cache
        return cache.total_size if cache is not None else 0


class Held:
    """A router's answer that keeps a request in the router (a proxy's flow-control queue)."""

    def __repr__(self) -> str:
        return "HOLD"


HOLD = Held()
Router = Callable[[Arrival, Sequence[EngineView]], "int | str | Held | None"]
"""Picks the engine of an arrival (an index or a name), None to refuse it (admission control:
it is never sent), or HOLD to keep it (`simulate`'s `release`)."""
Release = Callable[[float, Sequence[Arrival]], "tuple[int, int | str | None] | None"]
"""Asked at a time which of the held arrivals (oldest first) goes now: its position and its
engine (None: refused), or None while every one stays."""
IDLE_RELEASE_S = 0.1
"""With requests held and nothing else to happen, they are offered again this much later..."""
MAX_IDLE_HOLD_S = 3600.0
"""...for at most this long: a `release` that never lets a request go on an idle fleet is a bug."""


def simulate(
    engines: Sequence[Engine],
    arrivals: Iterable[Arrival],
    router: Router,
    *,
    on_step: Callable[[StepObservation], None] | None = None,
    on_finish: Callable[[RequestRecord], Iterable[Arrival] | None] | None = None,
    alpha_changes: Sequence[AlphaChange] = (),
    until: float = math.inf,
    release: Release | None = None,
) -> list[RequestRecord]:
    """Run the fleet until every request finished (or simulated time `until`); returns one record
    per finished request, in finishing order. The router returns an engine index or name (None: refused, never sent).
    `on_finish` sees each record as its request finishes and may return follow-up arrivals (a
    closed-loop client sends its next request then); they are numbered after the list's.
    A request the router answers HOLD waits in the router: `release` is asked which held one
    goes at every event (and, with nothing else left to happen, every IDLE_RELEASE_S) until it
    lets none go; a released request reaches its engine with its arrival time unchanged, so
    the wait counts in its time to first token."""
    if not engines:
        raise ValueError("simulate needs at least one engine")
    views = [EngineView(e, i) for i, e in enumerate(engines)]
    by_name = {e.name: i for i, e in enumerate(engines)}
    if len(by_name) != len(engines):
        raise ValueError("engine names must be unique")
    pending = [(a.time, index, a) for index, a in enumerate(arrivals)]
    heapq.heapify(pending)
    next_index = len(pending)
    held: list[tuple[int, Arrival]] = []
    held_arrivals: list[Arrival] = []
    changes = sorted(alpha_changes, key=lambda c: c.time)
    in_flight: list[tuple[float, int, int]] = []  # (end, seq, engine index)
    steps: list[Step | None] = [None] * len(engines)
    seq = 0
    records: list[RequestRecord] = []
    classes: dict[int, str] = {}
    ci = 0
    inf = math.inf
    last = idle_since = 0.0

    def start_idle(t: float) -> None:
        nonlocal seq
        for i, engine in enumerate(engines):
            if steps[i] is None and engine.has_work:
                step = engine.begin_step(t)
                if step is not None:
                    steps[i] = step
                    seq += 1
                    heapq.heappush(in_flight, (t + step.duration_s, seq, i))

    def send(index: int, arrival: Arrival, choice: int | str) -> None:
        i = by_name[choice] if isinstance(choice, str) else int(choice)
        engine = engines[i]
        req = engine.new_request(
            arrival.prompt_tokens,
            now=arrival.time,
            max_new_tokens=arrival.max_tokens,
            ignore_eos=arrival.ignore_eos,
            output_len=arrival.output_tokens,
            rid=f"r{index}",
            cache_key=(
                None if arrival.prefix is None else engine.block_key(arrival.prefix, arrival.prefix_block_tokens)
            ),
            workload=arrival.workload,
        )
        req.tag = index
        classes[index] = arrival.request_class
        engine.add(req)

    def release_held(t: float) -> None:
        assert release is not None
        while held:
            answer = release(t, held_arrivals)
            if answer is None:
                return
            position, choice = answer
            index, arrival = held.pop(position)
            del held_arrivals[position]
            if choice is not None:
                send(index, arrival, choice)

    while True:
        t_arrival = pending[0][0] if pending else inf
        t_step = in_flight[0][0] if in_flight else inf
        t_change = changes[ci].time if ci < len(changes) else inf
        t = min(t_arrival, t_step, t_change)
        if t == inf and held:
            # Nothing else will happen: the held see time pass (a bound on their wait ends it).
            if last - idle_since > MAX_IDLE_HOLD_S:
                raise RuntimeError(f"{len(held)} requests held on an idle fleet for {MAX_IDLE_HOLD_S:.0f} s")
            t = last + IDLE_RELEASE_S
        else:
            idle_since = t
        if t == inf or t > until:
            break
        last = t
        while in_flight and in_flight[0][0] <= t:
            end, _, i = heapq.heappop(in_flight)
            step = steps[i]
            assert step is not None  # in_flight holds an entry only for an engine with a step
            steps[i] = None
            engine = engines[i]
            touched = engine.finish_step(step, end)
            if on_step is not None:
                on_step(
                    StepObservation(
                        i,
                        engine.name,
                        step.kind,
                        step.batch,
                        step.tokens_per_seq,
                        step.start,
                        step.duration_s,
                        sum(r.last_emitted for r in touched),
                    )
                )
            for req in touched:
                if req.finished:
                    assert isinstance(req.tag, int)  # the arrival's index, set in `send`
                    record = _record(req, req.tag, i, engine.name, classes.pop(req.tag, "latency"))
                    records.append(record)
                    for follow_up in (on_finish(record) or ()) if on_finish is not None else ():
                        heapq.heappush(pending, (follow_up.time, next_index, follow_up))
                        next_index += 1
        while ci < len(changes) and changes[ci].time <= t:
            change = changes[ci]
            engines[change.engine].set_mean_alpha(change.alpha)
            ci += 1
        if held:
            release_held(t)
        while pending and pending[0][0] <= t:
            _, index, arrival = heapq.heappop(pending)
            choice = router(arrival, views)
            if isinstance(choice, Held):
                if release is None:
                    raise ValueError("a router that holds requests needs `release`")
                held.append((index, arrival))
                held_arrivals.append(arrival)
            elif choice is not None:
                send(index, arrival, choice)
        start_idle(t)
    return records


def _record(req: Request, index: int, engine: int, name: str, request_class: str) -> RequestRecord:
    return RequestRecord(
        index=index,
        engine=engine,
        engine_name=name,
        arrival=req.arrival,
        first_token_time=req.first_token_time if req.first_token_time is not None else req.finish_time,  # type: ignore[arg-type]
        finish_time=req.finish_time,  # type: ignore[arg-type]
        prompt_tokens=req.prompt_tokens,
        output_tokens=req.output_tokens,
        finish_reason=req.finish_reason,  # type: ignore[arg-type]
        verify_ct=req.verify_ct,
        alpha=req.alpha,
        request_class=request_class,
        cached_tokens=req.cached_tokens,
        workload=req.workload,
    )
