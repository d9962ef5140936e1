"""One routing run on the twin's virtual clock, with the very policy objects the proxy serves.

The router sees the fleet the way the proxy does, through the same fleet model (fleet/model.py)
read on the same cadence (fleet/cadence.py): each engine's /v1/loads answer as it stood at the
last poll (every `poll_interval_s`, published on SGLang's own cadence, so it lags), parsed by
the proxy's SGLang backend and adjusted by the router's own dispatches and completions since;
the acceptance from the token/verify counters (read on the polls `reads_counters` picks, as the
proxy's poller does) and from each finished spec request; the step-cost model seeded from the
profile and corrected by observed decode steps.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.peers import PREFIX_LEAST_LOAD, PrefixLeastLoad
from fleet.acceptance import DEFAULT_HALF_LIFE_S, alpha_from_accept_length
from fleet.blocks import BLOCK_TOKENS, chain_ids
from fleet.cadence import POLL_INTERVAL_S, gauge_steps, reads_counters
from fleet.costmodel import Seed, seed_from_profile
from fleet.model import NO_MATCH, FleetModel, PrefixMatch
from fleet.profile import load_profile
from fleet.readings import Dispatch, ResponseEvidence
from fleet.types import Decision, Features, PoolName, Snapshot
from policies import registry
from policies.admission import Admission
from policies.base import Policy
from policies.flow import FlowControl, due_allowance, left_total
from policies.goodput import Goodput
from policies.goodput_params import GoodputParams
from proxy.backends import sglang
from sim.engine import Engine, EngineConfig
from sim.lengths import parse_output_lengths
from sim.virtual import HOLD, AlphaChange, Arrival, EngineView, Held, RequestRecord, StepObservation, simulate

POOL_OF_ENGINE: tuple[PoolName, PoolName] = ("spec", "base")
URLS = ("virtual://spec", "virtual://base")
"""The one-instance-per-pool fleet's engines (`Setup.pools()` and `Setup.urls()` in general)."""


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, r: RequestRecord) -> bool:
        return r.ttft <= self.ttft_s and r.tpot <= self.tpot_s


@dataclass(frozen=True)
class Setup:
    """A fleet: spec and base servers on the same profile (one of each by default)."""

    profile: str
    alpha: float
    slo: Slo
    num_steps: int = 3
    spec_max_running: int = 48
    base_max_running: int = 256
    seed: int = 0
    spec_instances: int = 1
    base_instances: int = 1
    """Servers per pool: the spec ones come first in `engines()`, then the base ones."""
    page_size: int = 1
    """Prefix-cache page of every engine (SGLang's --page-size; 512 serves Mooncake's blocks as
    pages). Only arrivals with a `prefix` use the cache."""
    context_length: int | None = None
    """The engines' context (None: the twin's default, 32,768; the Mooncake trace's prompts
    reach 123,000 tokens)."""
    workload_alpha: tuple[tuple[str, float], ...] = ()
    """Mean acceptance per workload key (an Arrival's `workload`); others draw around `alpha`."""
    cache_reports: bool = True
    """The engines report each request's cached tokens (SGLang's --enable-cache-report), which
    corrects the router's prefix index."""
    router_profile: str | None = ""
    """The profile the router's cost model is seeded with: "" the fleet's own (`profile`), None
    none (the generic prior, as the proxy without SPECROUTE_PROFILE), else another profile's
    name or path (a wrong one: bench/learning.py)."""
    router_lull_s: float | None = None
    """The longest gap between observations the router's cost model ages its corrections by
    (`StepCostModel.lull_s`): None one half-life, as the proxy runs; math.inf the wall clock
    (bench/lull.py)."""

    def pools(self) -> tuple[PoolName, ...]:
        """The pool of each engine, in `engines()` order."""
        spec: list[PoolName] = ["spec"] * self.spec_instances
        base: list[PoolName] = ["base"] * self.base_instances
        return (*spec, *base)

    def names(self) -> tuple[str, ...]:
        """Engine names: the pool's name alone with one instance per pool (as always), else
        `spec-0`, `spec-1`, ..., `base-0`, ..."""
        if self.spec_instances == 1 and self.base_instances == 1:
            return POOL_OF_ENGINE
        return tuple(f"spec-{i}" for i in range(self.spec_instances)) + tuple(
            f"base-{i}" for i in range(self.base_instances)
        )

    def urls(self) -> tuple[str, ...]:
        return tuple(f"virtual://{name}" for name in self.names())

    def index_block_tokens(self) -> int:
        """The router's prefix-index block: the engines' page when it is a block of the arrivals'
        `prefix` (Mooncake's 512, bench/sessions.py's 64), else the proxy's default."""
        return self.page_size if self.page_size > 1 else BLOCK_TOKENS

    def router_seed(self) -> Seed | None:
        if self.router_profile is None:
            return None
        return seed_from_profile(self.router_profile or self.profile)

    def engines(self) -> list[Engine]:
        prof = load_profile(self.profile)
        common = dict(
            profile=prof,
            num_steps=self.num_steps,
            mean_alpha=self.alpha,
            workload_alpha=dict(self.workload_alpha),
            output_lengths=parse_output_lengths("azure-conv"),
        )
        if self.page_size != 1:
            common["page_size"] = self.page_size
        if self.context_length is not None:
            common["context_length"] = self.context_length
        caps = {"spec": self.spec_max_running, "base": self.base_max_running}
        engines = []
        for pool, name in zip(self.pools(), self.names()):
            # The first instance of a pool draws as the one-instance fleet does; the others
            # draw their own acceptance and output lengths.
            nth = int(name.rpartition("-")[2]) if "-" in name else 0
            engines.append(
                Engine(
                    EngineConfig(mode=pool, max_running_requests=caps[pool], seed=self.seed + 7919 * nth, **common),  # type: ignore[arg-type]
                    name,
                )
            )
        return engines


class Split:
    """The oracle split's building block: each request to spec with a fixed probability."""

    def __init__(self, fraction: float, seed: int = 0):
        self.fraction = fraction
        self.name = f"split-{fraction:.1f}"
        self._rng = random.Random(seed)

    def decide(self, features: Features, snapshot: Snapshot) -> Decision:
        pool: PoolName = "spec" if self._rng.random() < self.fraction else "base"
        return Decision(pool=pool, reason="split")


HOLD_S = 120.0
"""The bound on a held request's wait the evaluations run flow control with (SPECROUTE_HOLD_MAX_S):
the proxy's default first-token timeout, so no request waits in the proxy longer than the proxy
waits for a server's first token."""
HOLD_SUFFIX = "+hold"
"""A policy name ending in it (`goodput+hold`) runs with flow control at HOLD_S (`run`)."""

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"goodput-nocache": ("goodput", {"cache_credit": False})}
"""Evaluation names for a policy with some parameters fixed."""


def make_policy(name: str, slo: Slo | None = None, **params: Any) -> Policy:
    """A policy by name, with the parameters it declares (policies/registry.py) at their defaults
    but for `params`; a policy that declares SLO targets (goodput's `slo_ttft_s`, `slo_tpot_ms`:
    SPECROUTE_GOODPUT_SLO_* in the proxy) is told the fleet's `slo`."""
    if name.startswith("split-"):
        return Split(float(name.removeprefix("split-")))
    if name in VARIANTS:
        base_name, fixed = VARIANTS[name]
        return make_policy(base_name, slo, **(fixed | params))
    if name == PREFIX_LEAST_LOAD:
        return PrefixLeastLoad(make_policy("goodput", slo, cache_credit=False))
    declared = registry.params_of(name)
    if slo is not None and declared is not None:
        targets = {"slo_ttft_s": slo.ttft_s, "slo_tpot_ms": slo.tpot_s * 1000}
        params = {key: value for key, value in targets.items() if key in declared.model_fields} | params
    return registry.create(name, params)


@dataclass
class VirtualRouter:
    """The proxy's signal path, fed by the virtual fleet instead of HTTP polls."""

    policy: Policy
    setup: Setup
    poll_interval_s: float = POLL_INTERVAL_S
    stale_s: float = 1.0
    half_life_s: float = DEFAULT_HALF_LIFE_S
    replay: Callable[[float, Features, Snapshot], Decision] | None = None
    """Asked on each decision's features and snapshot as the decision is made (its answers in
    `replayed`): another policy's or alpha's verdict on the very same state. Asked then, not
    afterwards: a snapshot's cost model is the live one, which goes on learning."""
    admission: Admission | None = None
    """Admission control as the proxy runs it (policies/admission.py); None: every request admitted."""
    refusals: list[tuple[float, str, str]] = field(default_factory=list)
    """(time, rule, request class) per refused request."""
    flow: FlowControl | None = None
    """Flow control as the proxy runs it (policies/flow.py): requests lost on every pool wait in
    the router until one has room; None: every request sent at once."""
    released: list[tuple[float, float]] = field(default_factory=list)
    """(arrival, release time) per request flow control held, as it went."""
    released_by: dict[str, int] = field(default_factory=dict)
    """How many held requests each of flow control's rules let go."""
    per_workload: bool = True
    """Route each arrival on its workload's alpha and learn acceptance per workload, as the proxy
    does with x-specroute-workload; False: the pool-wide alpha only (workload keys ignored)."""
    fleet: FleetModel = field(init=False)
    decisions: list[tuple[float, PoolName, str, float | None]] = field(default_factory=list)
    """(time, pool, reason, the spec pool's alpha estimate) per request."""
    replayed: list[Decision] = field(default_factory=list)
    _sent: dict[tuple[float, int, int], deque[Dispatch]] = field(default_factory=dict)
    """Each request's dispatch record until it finishes, by (arrival time, prompt, engine)."""
    _polls: int = 0
    _steps: int = 0
    _next_look: float = 0.0
    """When flow control next looks for room (a poll interval after it last found none)."""
    _looking_at: float | None = None
    """The time of the look under way: the proxy's queue, having let one go, judges again at
    once (proxy/holding.py), so a look lets go as many as have room, one after another."""
    _due_left: int = 1
    """What `release-due` may still let go (policies.flow.due_allowance)."""
    _left_seen: int | None = None
    """The fleet's departures counted when the last look began."""
    _next_poll: float = 0.0
    _views: Sequence[EngineView] = ()
    _engines: Sequence[Engine] = ()
    urls: tuple[str, ...] = field(init=False)
    pool_of_engine: tuple[PoolName, ...] = field(init=False)
    _members: dict[PoolName, tuple[int, ...]] = field(init=False)
    _turn: Iterator[int] = field(init=False)

    def __post_init__(self) -> None:
        self.fleet = FleetModel(
            {"spec": self.setup.num_steps, "base": 0},
            stale_after_s=self.stale_s,
            half_life_s=self.half_life_s,
            seed=self.setup.router_seed(),
            costmodel_lull_s=self.setup.router_lull_s,
            prefix_block_tokens=self.setup.index_block_tokens(),
            # Measured attainment, as the proxy told the SLO measures it (flow control reads it).
            slo_ttft_s=self.setup.slo.ttft_s,
            slo_tpot_s=self.setup.slo.tpot_s,
            load_held=self.flow is not None,
        )
        self.urls = self.setup.urls()
        self.pool_of_engine = self.setup.pools()
        caps = {"spec": self.setup.spec_max_running, "base": self.setup.base_max_running}
        for url, pool in zip(self.urls, self.pool_of_engine):
            self.fleet.add_instance(url, pool, caps[pool])
        self._members = {
            pool: tuple(i for i, p in enumerate(self.pool_of_engine) if p == pool) for pool in ("spec", "base")
        }
        self._turn = itertools.count()

    def pick(self, pool: PoolName, prefer: str | None = None) -> int:
        """The engine of `pool` a request goes to: the one the decision named (`prefer`), else
        the least loaded relative to its cap, ties rotating, as the proxy's Router.pick
        (proxy/routing.py) chooses an instance."""
        members = self._members[pool]
        if prefer is not None:
            for i in members:
                if self.urls[i] == prefer:
                    return i
        if len(members) == 1:
            return members[0]
        start = next(self._turn) % len(members)
        rotated = members[start:] + members[:start]
        instances = self.fleet.instances
        return min(
            rotated,
            key=lambda i: instances[self.urls[i]].adjusted_load() / max(instances[self.urls[i]].max_running, 1),
        )

    def attach(self, engines: Sequence[Engine]) -> None:
        self._engines = engines
        self._views = [EngineView(e, i) for i, e in enumerate(engines)]

    def _poll_until(self, now: float) -> None:
        """Take the polls due by `now` (the last one wins; engines' published snapshots lag)."""
        if now < self._next_poll:
            return
        at = math.floor(now / self.poll_interval_s) * self.poll_interval_s
        self._polls += 1
        for url, view in zip(self.urls, self._views):
            reading = sglang.reading_from_loads({"loads": [view.load_snapshot]}, at)
            if view.speculative and reads_counters(self._polls):
                reading = replace(
                    reading,
                    accept_length=view.gauges.get("spec_accept_length"),
                    accept_steps=gauge_steps(reading.running),
                    tokens_total=float(view.generation_tokens_total),
                    verify_total=float(view.spec_verify_calls_total),
                )
            self.fleet.on_reading(url, reading)
        self._next_poll = at + self.poll_interval_s

    def on_step(self, step: StepObservation) -> None:
        self._poll_until(step.start + step.duration_s)
        if step.kind == "decode":
            # The proxy learns a decode step from each stream's median inter-chunk gap; here the
            # steps themselves are seen (every fourth, at the batch the router's view shows).
            self._steps += 1
            if self._steps % 4 == 0:
                self.fleet.on_step(self.urls[step.engine], step.start + step.duration_s, step.duration_s * 1000)

    def features(self, arrival: Arrival, now: float) -> tuple[Features, tuple[int, ...], PrefixMatch]:
        """What the router knows of an arrival at `now`: its features (the prefix the index
        credits then), its prompt's block ids and the index's match."""
        blocks: tuple[int, ...] = ()
        match = NO_MATCH
        if arrival.prefix:
            if arrival.prefix_block_tokens != self.fleet.prefix.block_tokens:
                raise ValueError(
                    f"arrival blocks of {arrival.prefix_block_tokens} tokens, index blocks of "
                    f"{self.fleet.prefix.block_tokens}: set Setup.page_size to the arrivals' block"
                )
            blocks = chain_ids(arrival.prefix)
            match = self.fleet.cached(blocks, arrival.prompt_tokens, now)
        features = Features(
            prompt_tokens=arrival.prompt_tokens,
            max_tokens=arrival.max_tokens,
            stream=arrival.stream,
            request_class=arrival.request_class,  # type: ignore[arg-type]
            ignore_eos=arrival.ignore_eos,
            workload=arrival.workload if self.per_workload else None,
            cached=match.credit,
        )
        return features, blocks, match

    def route(self, arrival: Arrival, views: Sequence[EngineView]) -> int | Held | None:
        self._poll_until(arrival.time)
        features, blocks, match = self.features(arrival, arrival.time)
        snapshot = self.fleet.snapshot(arrival.time, features.workload)
        if self.flow is not None and self.flow.holds(features, snapshot):
            return HOLD
        decision = self.policy.decide(features, snapshot)
        if self.admission is not None:
            refusal = self.admission.admit(features, snapshot, decision, arrival.time)
            if refusal is not None:
                self.refusals.append((arrival.time, refusal.rule, arrival.request_class))
                return None
        return self.send(arrival, arrival.time, features, snapshot, decision, blocks, match)

    def release(self, now: float, held: Sequence[Arrival]) -> tuple[int, int | None] | None:
        """Which held arrival (flow control, oldest first) goes at `now`, and to which engine,
        as the proxy's queue (proxy/holding.py) lets them go: the oldest once it has waited the
        bound, else the oldest past its fair share with room on some pool, else the newest with
        room (policies/flow.py, `FlowControl.judging_order`)."""
        assert self.flow is not None
        self._poll_until(now)
        position = 0 if self.flow.expired(now - held[0].time) else None
        rule = "release-bound"
        if position is None:
            new_look = now != self._looking_at
            if new_look and now < self._next_look:
                return None  # the proxy's queue looks at the fleet once a poll interval
            snapshot = self.fleet.snapshot(now, None)
            if new_look:
                self._next_look, self._looking_at = now + self.poll_interval_s, now
                left = left_total(snapshot)  # as many due ones as left since the last look
                self._due_left = due_allowance(
                    self._due_left, left - (left if self._left_seen is None else self._left_seen), snapshot
                )
                self._left_seen = left
            waits = [now - a.time for a in held]
            for i, judged_by in self.flow.judging_order(waits, snapshot):
                features, _, _ = self.features(held[i], now)
                if self.flow.room(
                    features, self.fleet.snapshot(now, features.workload) if features.workload else snapshot
                ):
                    if judged_by == "release-due":
                        if self._due_left < 1:
                            break  # it goes first, once as many have left the fleet
                        self._due_left -= 1
                    position, rule = i, judged_by
                    break
            if position is None:
                self._looking_at = None  # nothing had room: the next look is a poll interval on
                return None
        arrival = held[position]
        features, blocks, match = self.features(arrival, now)
        snapshot = self.fleet.snapshot(now, features.workload)
        decision = self.policy.decide(features, snapshot)
        self.released.append((arrival.time, now))
        self.released_by[rule] = self.released_by.get(rule, 0) + 1
        if self.admission is not None:  # judged as any other request once let go, as the proxy does
            refusal = self.admission.admit(features, snapshot, decision, now)
            if refusal is not None:
                self.refusals.append((now, refusal.rule, arrival.request_class))
                return position, None
        return position, self.send(arrival, now, features, snapshot, decision, blocks, match)

    def send(
        self,
        arrival: Arrival,
        now: float,
        features: Features,
        snapshot: Snapshot,
        decision: Decision,
        blocks: tuple[int, ...],
        match: PrefixMatch,
    ) -> int:
        self.decisions.append((now, decision.pool, decision.reason, snapshot.pools["spec"].alpha))
        if self.replay is not None:
            self.replayed.append(self.replay(now, features, snapshot))
        index = self.pick(decision.pool, decision.instance)
        sent = self.fleet.on_dispatch(
            self.urls[index],
            now,
            arrival.prompt_tokens,
            blocks=blocks,
            match=match,
            predicted_tpot_s=decision.predicted_tpot_s(self.pool_of_engine[index]),
        )
        self._sent.setdefault((arrival.time, arrival.prompt_tokens, index), deque()).append(sent)
        return index

    def on_finish(self, record: RequestRecord) -> None:
        if self.admission is not None and record.request_class == "latency":
            # As the proxy judges it (proxy.routing.Attempt.met_targets).
            cost = self.fleet.cost.at(record.finish_time)
            pool = self.pool_of_engine[record.engine]
            own_s = self.admission.alone_prefill_s(pool, record.prompt_tokens, record.cached_tokens, cost)
            self.admission.observe(self.admission.met(record.ttft, record.tpot, own_s), record.finish_time)
        url = self.urls[record.engine]
        spec = self.pool_of_engine[record.engine] == "spec"
        key = (record.arrival, record.prompt_tokens, record.engine)
        queued = self._sent.get(key)
        sent = queued.popleft() if queued else None
        if queued is not None and not queued:
            del self._sent[key]
        evidence = ResponseEvidence(
            tokens=record.output_tokens,
            verify_steps=record.verify_ct if spec else None,
            decode_s=record.finish_time - record.first_token_time,
            ttft_s=record.ttft,
            dispatch=sent,
            workload=record.workload if self.per_workload else None,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens if self.setup.cache_reports else None,
        )
        self.fleet.on_response(url, record.finish_time, evidence)
        self.fleet.on_complete(url, record.finish_time, sent)


@dataclass
class Workload:
    """Open arrivals (a list) or a closed loop of `clients` that each send again on completion."""

    arrivals: list[Arrival]
    clients: int = 0
    closed_total: int = 0
    lengths: Sequence[tuple[int, int]] = ()
    warmup_s: float = 0.0
    """Requests that arrive before this are not scored (a closed loop: also not before N finished)."""
    alpha_changes: Sequence[AlphaChange] = ()
    follow_up: Callable[[RequestRecord], Iterable[Arrival]] | None = None
    """Open arrivals that send more as requests finish (a session's next turn after its think
    time): called with each finished request's record; what it returns is numbered after the
    list's, in the order returned."""
    closed_extra_s: float = 0.0
    """A closed loop's requests sent before this time do not count toward `closed_total` (the
    loop runs `closed_total` requests past a warm-up of this length)."""


def closed_loop(clients: int, total: int, lengths: Sequence[tuple[int, int]]) -> Workload:
    first = [
        Arrival(time=0.0, prompt_tokens=lengths[i % len(lengths)][0], output_tokens=lengths[i % len(lengths)][1])
        for i in range(clients)
    ]
    return Workload(arrivals=first, clients=clients, closed_total=total, lengths=lengths)


@dataclass
class RunResult:
    policy: str
    records: list[RequestRecord]
    decisions: list[tuple[float, PoolName, str, float | None]]
    replayed: list[Decision]
    """`run(replay=...)`'s answer per decision (empty without it)."""
    slo: Slo
    warmup_s: float
    closed: bool
    refusals: list[tuple[float, str, str]] = field(default_factory=list)
    held: list[tuple[float, float]] = field(default_factory=list)
    """(arrival, release time) per request flow control held (`run(max_hold_s=...)`)."""
    released_by: dict[str, int] = field(default_factory=dict)
    """How many held requests each of flow control's rules let go."""
    running_mean: tuple[float, ...] = ()
    """Per engine, its running requests averaged over time from the warm-up to the last step
    (`run(track_running=True)`; empty otherwise)."""

    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if r.arrival >= self.warmup_s]

    def summary(self) -> dict[str, float]:
        return summarize([self])


def is_spec(record: RequestRecord) -> bool:
    """Whether a request ran on a spec server (`Setup.names()`: spec, or spec-0, spec-1, ...)."""
    return record.engine_name.startswith("spec")


def summarize(results: Sequence[RunResult]) -> dict[str, float]:
    """One summary of several runs of the same cell (other seeds), their requests pooled:
    means and p99 over every measured request, rates over the runs' summed windows.

    A run's window is its arrival window: from the first measured arrival to the last arrival
    (open arrivals), or to the last request the loop sends (a closed loop: until then every
    client is busy, so the load is what the run is named for). SLO goodput counts the measured
    requests that met the SLO, of open arrivals all of them (the offered load is the same for
    every policy), of a closed loop every request that finished within the window (after its
    start: the one finishing at the start sent the first scored request), those sent before it
    included (its rate is how fast the fleet turns over requests that meet it; counting
    only the window's own requests left out the N in flight at its start: 128 of the 513 that
    finished in h200's window at 128 clients). Throughput is the output of a closed loop's
    requests that finished within the window, per second of it, and of open arrivals all the
    output per second from the first arrival to the last completion (how fast the fleet clears
    a fixed amount of work; an overloaded run of 600 requests is still ramping up when its last
    request arrives). Scoring a closed loop over its whole makespan measured its drain (the last
    round, at ever lower concurrency), which the few long requests that finish last decide."""
    measured = [(r, r.measured()) for r in results]
    rs = [rec for _, recs in measured for rec in recs]
    if not rs:
        return {}
    e2e = sorted(r.e2e for r in rs)
    window = span = tokens = met = 0.0
    for result, recs in measured:
        if not recs:
            continue
        start, end = min(r.arrival for r in recs), max(r.arrival for r in recs)
        window += max(end - start, 1e-9)
        if result.closed:
            span += max(end - start, 1e-9)
            tokens += sum(r.output_tokens for r in result.records if start < r.finish_time <= end)
        else:
            span += max(max(r.finish_time for r in recs) - start, 1e-9)
            tokens += sum(r.output_tokens for r in recs)
        if result.closed:
            met += sum(1 for r in result.records if start < r.finish_time <= end and result.slo.met(r))
        else:
            met += sum(1 for r in recs if result.slo.met(r))
    return {
        "requests": float(len(rs)),
        "mean_e2e_s": statistics.fmean(e2e),
        "p99_e2e_s": e2e[min(int(0.99 * len(e2e)), len(e2e) - 1)],
        "mean_ttft_s": statistics.fmean(r.ttft for r in rs),
        "mean_tpot_ms": 1000 * statistics.fmean(r.tpot for r in rs),
        "throughput_tok_s": tokens / span,
        "slo_goodput_rps": met / window,
        "slo_attainment": sum(1 for result, recs in measured for r in recs if result.slo.met(r)) / len(rs),
        "spec_share": sum(1 for r in rs if is_spec(r)) / len(rs),
        "held_share": sum(1 for result in results for arrival, _ in result.held if arrival >= result.warmup_s)
        / len(rs),
    }


def slo_predictor(slo: Slo) -> Goodput:
    """Goodput's predictions told the fleet's SLO (what admission and flow control judge by)."""
    return Goodput(GoodputParams(slo_ttft_s=slo.ttft_s, slo_tpot_ms=slo.tpot_s * 1000))


def run(
    setup: Setup,
    workload: Workload,
    policy_name: str,
    replay: Callable[[float, Features, Snapshot], Decision] | None = None,
    poll_interval_s: float = 0.1,
    admission: Admission | None = None,
    track_running: bool = False,
    per_workload: bool = True,
    max_hold_s: float | None = None,
) -> RunResult:
    """`admission`: refuse requests up front as the proxy does (policies/admission.py);
    `track_running`: average each engine's running requests over time (open arrivals, from
    `workload.warmup_s`), into `RunResult.running_mean`; `per_workload`: learn and route on
    acceptance per workload key (VirtualRouter.per_workload); `max_hold_s`: flow control as the
    proxy runs it (policies/flow.py) with this bound on a held request's wait."""
    if policy_name.endswith(HOLD_SUFFIX):
        max_hold_s = HOLD_S if max_hold_s is None else max_hold_s
    engines = setup.engines()
    router = VirtualRouter(
        make_policy(policy_name.removesuffix(HOLD_SUFFIX), setup.slo),
        setup,
        poll_interval_s=poll_interval_s,
        replay=replay,
        admission=admission,
        per_workload=per_workload,
        flow=None if max_hold_s is None else FlowControl(slo_predictor(setup.slo), max_hold_s),
    )
    router.attach(engines)
    sent = len(workload.arrivals)
    counted = 0 if workload.closed_extra_s > 0 else sent

    def on_finish(record: RequestRecord) -> Iterable[Arrival]:
        nonlocal sent, counted
        router.on_finish(record)
        if workload.follow_up is not None:
            return tuple(workload.follow_up(record))
        if workload.clients and counted < workload.closed_total:
            prompt, output = workload.lengths[sent % len(workload.lengths)]
            sent += 1
            if record.finish_time >= workload.closed_extra_s:
                counted += 1
            return (Arrival(time=record.finish_time, prompt_tokens=prompt, output_tokens=output),)
        return ()

    on_step: Callable[[StepObservation], None] = router.on_step
    area = [0.0] * len(engines)
    clock = [workload.warmup_s, workload.warmup_s]  # (since, last step end)
    if track_running:

        def on_step(step: StepObservation) -> None:
            router.on_step(step)
            # Running counts change only at step ends (admission with a prefill step, finish at
            # a step's end); each engine's count holds from the previous step end to this one.
            end = step.start + step.duration_s
            if end > clock[1]:
                for i, engine in enumerate(engines):
                    area[i] += engine.num_running * (end - clock[1])
                clock[1] = end

    records = simulate(
        engines,
        workload.arrivals,
        router.route,
        on_step=on_step,
        on_finish=on_finish,
        alpha_changes=workload.alpha_changes,
        release=router.release if router.flow is not None else None,
    )
    warmup_s = workload.warmup_s
    if workload.clients:
        # A closed loop starts with every client's request at once; it has warmed up once as many
        # requests as there are clients have finished (about a round each).
        finished = sorted(r.finish_time for r in records)
        warmup_s = max(finished[min(workload.clients, len(finished)) - 1], workload.warmup_s)
    return RunResult(
        policy_name,
        records,
        router.decisions,
        router.replayed,
        setup.slo,
        warmup_s,
        closed=workload.clients > 0,
        refusals=router.refusals,
        held=router.released,
        released_by=router.released_by,
        running_mean=tuple(a / max(clock[1] - clock[0], 1e-9) for a in area) if track_running else (),
    )


def with_alpha(snapshot: Snapshot, alpha: float) -> Snapshot:
    """The same snapshot with the spec pool's alpha replaced (every other field kept: the
    acceptance drop's told policy must differ from the served one in alpha alone)."""
    pools = dict(snapshot.pools)
    pools["spec"] = replace(pools["spec"], alpha=alpha)
    return replace(snapshot, pools=pools)


def effective_alpha(records: Sequence[RequestRecord], k: int) -> float:
    """The acceptance the spec engine actually delivered to these requests: alpha of their pooled
    tokens per verify step (per-request alphas vary, so this is not the configured mean)."""
    tokens = sum(r.output_tokens - 1 for r in records if is_spec(r) and r.verify_ct)
    steps = sum(r.verify_ct for r in records if is_spec(r))
    return alpha_from_accept_length(tokens / steps, k) if steps else math.nan
