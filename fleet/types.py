"""The contract between the proxy (or the simulator) and a routing policy.

A policy sees only these values: what the request is (`Features`) and what the fleet looks like
now (`Snapshot`). It reads no clock, does no I/O and keeps no globals, so the very same object
is unit-tested on hand-built snapshots, swept on the twin's virtual clock, and served.

They are values: built once, never changed (a policy that wants another one builds it, e.g.
`Features.with_cached`, `Decision.on_instance`). They are plain slotted dataclasses, not frozen
ones, because a frozen dataclass's `__init__` sets each field through `object.__setattr__`
(about 1 us for `InstanceState`) and a decision builds about fifteen of them
(docs/routing.md, "Prefix index").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

PoolName = Literal["spec", "base"]
POOLS: tuple[PoolName, PoolName] = ("spec", "base")
RequestClass = Literal["latency", "batch"]


@dataclass(slots=True)
class Features:
    """What the router knows about one request before sending it."""

    prompt_tokens: int
    """Estimated prompt length (fleet.features.count_prompt_tokens; the twin counts alike)."""
    max_tokens: int | None = None
    """The client's cap on output tokens, if it set one."""
    stream: bool = True
    request_class: RequestClass = "latency"
    ignore_eos: bool = False
    """True when the request will run to max_tokens (SGLang's ignore_eos)."""
    workload: str | None = None
    """Its workload key (the client's x-specroute-workload, else fleet.features.workload_key of
    the body): acceptance is learned per key, and the snapshot a request is routed on carries
    its key's alpha. A key only, never text."""
    cached: Mapping[str, int] = field(default_factory=dict)
    """Prompt tokens each instance (by URL) likely holds in its prefix cache: the prefix index's
    match (fleet/prefix.py) scaled by its trust, or a named session's last prompt on its last
    instance (`FleetModel.cached`); always below `prompt_tokens`. Empty: nothing credited."""
    stream_tokens: int = 0
    """Its prompt's length in the prefix blocks' unit (fleet/blocks.py: 4 bytes of the UTF-8
    stream a token; 0: unknown). Credits, counted in that unit, are put in `prompt_tokens`'
    unit with it (`FleetModel.cached`)."""

    def with_cached(self, cached: Mapping[str, int]) -> Features:
        """These features with `cached` credited (`dataclasses.replace(self, cached=cached)`,
        without its generic field walk: this is on every decision's path)."""
        return Features(
            self.prompt_tokens,
            self.max_tokens,
            self.stream,
            self.request_class,
            self.ignore_eos,
            self.workload,
            cached,
            self.stream_tokens,
        )


@dataclass(slots=True)
class InstanceState:
    """One backend server as the router sees it now."""

    url: str
    running: float
    """Requests decoding: last polled value adjusted by the proxy's own dispatches since."""
    waiting: float
    """Requests queued behind the running batch (same adjustment)."""
    max_running: int
    """The server's max_running_requests cap (48 by default on an SGLang EAGLE-3 server)."""
    healthy: bool = True
    """Reachable and not ejected: the pool's capacity counts it."""
    ejected: bool = False
    """Taken out of rotation by the proxy's outlier detection (then also not healthy)."""
    age_s: float = 0.0
    """Seconds since this instance's load was last read from the server."""
    waiting_tokens: float | None = None
    """Prompt tokens waiting to be prefilled (same adjustment as `waiting`), if known."""
    prompt_tokens_per_s: float = 0.0
    """Prompt tokens this router sent the instance per second lately (exponentially weighted):
    its prefill work, which stalls the decode of everything running there."""
    dispatches_per_s: float = 0.0
    """Requests this router sent the instance per second lately (same weighting)."""
    lagging: bool = False
    """Reachable, but its load reading is stale while a pool-mate's is fresh (then also not
    healthy): a server that stopped answering (a stopped or hung process still accepts
    connections) gets no new requests while its pool has another (`FleetModel.snapshot`;
    `Router.pick` applies the same rule to its candidates)."""
    replicas: int = 1
    """Engines behind the server's one front (SGLang's data-parallel ranks serving), each with
    its own batch and queue: the figures above are one's, the server's total over `replicas`
    (a request joins one engine's batch, behind one engine's queue)."""
    hung_ranks: int = 0
    """Its data-parallel ranks judged hung among working ones (left out of the figures above)."""
    in_flight: int = 0
    """Requests this router sent the server (all its engines) that have not ended: its own part
    of the load, beside its own departures (flow control's fair share of a wait)."""

    @property
    def load(self) -> float:
        return self.running + self.waiting

    @property
    def free_slots(self) -> float:
        return self.max_running - self.load


@dataclass(slots=True)
class PoolState:
    """One pool (`spec` or `base`) of instances."""

    name: PoolName
    instances: tuple[InstanceState, ...]
    speculative: bool = False
    num_draft_tokens: int = 0
    """k: tokens drafted per verify step on a speculative pool (speculative_num_steps, topk=1)."""
    alpha: float | None = None
    """Per-token acceptance probability estimated from the pool's accept length; None if unknown."""
    alpha_evidence: float = 0.0
    """Verify steps' worth behind `alpha`: the request's workload key's own when the pool knows
    the key (its estimate is shrunk toward the pool's while that is small), else the pool's."""
    stale: bool = False
    """True when the freshest load reading is older than the configured staleness bound."""
    tpot_cv: float = 0.0
    """How much a request's time per output token varies around the pool's mean at a given step
    (standard deviation / mean; a speculative pool's, from its requests' own accept lengths;
    0: none known)."""
    tpot_bias: float = 1.0
    """Its recent requests' TPOT over the TPOT predicted for them, the median over the last
    minute (fleet/outcomes.py; 1.0 while there are too few)."""
    slo_share: float | None = None
    """The share of its requests finished within the SLO targets over the last minute, measured
    (fleet/attainment.py); None without targets or before half a minute of finished requests."""
    finished_per_s: float | None = None
    """This router's requests that left it per second over the last minute, however they ended
    (fleet/attainment.py `finished_rate`); None without targets or before half a minute of them."""
    left_total: int = 0
    """This router's requests that ever left it, however they ended (with SLO targets): flow
    control lets go as many requests past their fair share as left since its last look."""
    load_held: bool = False
    """The proxy holds the requests that would push this pool past its SLO targets (flow
    control): its load stays near them, so what its requests get past their predicted TPOT is
    the model's error (`tpot_bias`), not load that came after them and could not be refused."""
    _healthy: tuple[InstanceState, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Read several times per decision: taken once.
        self._healthy = tuple([i for i in self.instances if i.healthy])

    @property
    def healthy_instances(self) -> tuple[InstanceState, ...]:
        return self._healthy

    @property
    def available(self) -> bool:
        return bool(self.healthy_instances)

    def least_loaded(self) -> InstanceState | None:
        """The instance a new request would join (fewest requests relative to its cap)."""
        # min(healthy, key=lambda i: (i.load / max(i.max_running, 1), i.load)), written out: the
        # first of the smallest keys, as min keeps it.
        best: InstanceState | None = None
        best_key = (0.0, 0.0)
        for instance in self._healthy:
            load = instance.running + instance.waiting
            cap = instance.max_running
            key = (load / (1 if 1 > cap else cap), load)
            if best is None or key < best_key:
                best, best_key = instance, key
        return best

    @property
    def running(self) -> float:
        return sum(i.running * i.replicas for i in self.healthy_instances)

    @property
    def waiting(self) -> float:
        return sum(i.waiting * i.replicas for i in self.healthy_instances)

    @property
    def capacity(self) -> int:
        return sum(i.max_running * i.replicas for i in self.healthy_instances)

    @property
    def age_s(self) -> float:
        healthy = self.healthy_instances
        return min((i.age_s for i in healthy), default=float("inf"))


class StepCost(Protocol):
    """Milliseconds one engine step or prefill takes, learned online; implemented by fleet.costmodel."""

    def decode_step_ms(self, pool: PoolName, batch: int, tokens_per_seq: int) -> float: ...

    def prefill_ms(self, pool: PoolName, tokens: int) -> float: ...

    def evidence(self, pool: PoolName, batch: float, prefill: bool = False) -> float:
        """Observations' worth behind the prediction at `batch` (or prompt tokens per prefill
        iteration, with `prefill`); 0 when it is the seed's guess alone."""
        ...


@dataclass(slots=True)
class Snapshot:
    """The fleet at the moment of a decision."""

    pools: Mapping[str, PoolState]
    cost: StepCost | None = None
    """Step-cost model (learned online, seeded from a profile); None means a policy must not need it."""
    mean_output_tokens: float | None = None
    """Mean output tokens of recently finished requests (learned from the streams), if known."""
    output_samples: int = 0
    """How many finished requests that mean covers (capped): a policy weighs it against its prior."""

    def pool(self, name: PoolName) -> PoolState | None:
        return self.pools.get(name)


@dataclass(slots=True)
class Decision:
    pool: PoolName
    reason: str
    """A short, stable token saying why, e.g. "spec-sooner", "spec-full", "stale", "static"."""
    scores: Mapping[str, float] = field(default_factory=dict)
    """What the policy weighed, e.g. predicted seconds to completion per pool."""
    instance: str | None = None
    """The instance of `pool` the policy chose (its URL), e.g. the one holding the prompt's
    prefix; None leaves the choice to the router (the least loaded)."""

    def on_instance(self, instance: str) -> Decision:
        """This decision naming `instance` (`dataclasses.replace(self, instance=instance)`,
        without its generic field walk: this is on every decision's path)."""
        return Decision(self.pool, self.reason, self.scores, instance)

    def predicted_tpot_s(self, pool: str) -> float:
        """The time per output token the policy predicted on `pool` (its score `tpot_<pool>_ms`),
        0.0 when it predicted none: what the request's own TPOT is compared with there."""
        return self.scores.get(f"tpot_{pool}_ms", 0.0) / 1000
