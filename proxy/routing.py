"""Routing glue: the one object that owns the pools, asks the policy, and keeps in-flight exact.

The request path asks `Router.choose` for a pool, `Router.pick` for an instance in it, and wraps
every upstream attempt in the `Attempt` that `Router.dispatch` returns: the attempt is told of
the first byte, each chunk, and how it ended, and it releases its instance exactly once whatever
the exit path (finish, failure, client disconnect, exception). Behind `snapshot()` is the fleet
model (fleet/model.py), which the pollers (proxy/poller.py) and the attempts feed; the policy
itself stays pure (policies/).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import secrets
import time
from asyncio import Task, current_task, gather, get_running_loop
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fleet.costmodel import seed_from_profile
from fleet.features import count_prompt_tokens, default_request_class, workload_key
from fleet.model import NO_MATCH, FleetModel, PrefixMatch
from fleet.readings import ResponseEvidence
from fleet.types import Decision, Features, PoolName, Snapshot
from policies import registry
from policies.admission import Admission, Refusal
from policies.base import Policy
from policies.flow import FlowControl
from policies.goodput import Goodput
from policies.goodput_params import GoodputParams
from proxy.holding import HoldQueue
from proxy.outliers import OutlierDetector
from proxy.poller import Pollers, found_again_within_s
from proxy.pools import Instance, Pool, other_pool, pools_from_settings
from proxy.settings import Settings
from proxy.state import DecisionLog, fleet_state
from proxy.suspects import Culprit, Suspects, request_may_cause

log = logging.getLogger("specroute.routing")

if TYPE_CHECKING:
    from proxy.scan import Summary

POOL_HEADER = "x-specroute-pool"
CLASS_HEADER = "x-specroute-class"
WORKLOAD_HEADER = "x-specroute-workload"
MAX_WORKLOAD_CHARS = 64
"""A client's workload key: 1-64 printable ASCII characters without spaces (it is a dictionary
key of the fleet model and shown by the state endpoint)."""
SESSION_HEADER = "x-specroute-session"
MAX_SESSION_CHARS = 64
"""A client's session name in the header: 1-64 printable ASCII characters without spaces."""
SESSION_FIELDS = ("prompt_cache_key", "user")
"""Body fields that name a session when the header does not, in this order: OpenAI's
`prompt_cache_key` (its field for cache routing), then `user` (which it replaces)."""
SESSION_KEY_CHARS = 32
"""Hex digits of SHA-256 kept as a session's key (128 bits): the name itself is never kept."""
POOL_OVERRIDES = ("spec", "base", "auto")
REQUEST_CLASSES = ("latency", "batch")
MAX_GAPS = 4096
"""Inter-chunk gaps kept per attempt for the cost model (their median is one engine step)."""


class RoutingInputError(ValueError):
    """A routing header has a value the proxy does not know (answered with 400)."""

    def __init__(
        self, header: str, value: str, allowed: tuple[str, ...] = (), expected: str = "", show_value: bool = True
    ) -> None:
        expected = expected or f"one of {', '.join(allowed)}"
        super().__init__(f"header {header} must be {expected}" + (f", not {value!r}" if show_value else ""))
        self.header = header


def features_of(
    body: Mapping[str, Any],
    request_class: str | None,
    workload: str | None = None,
    hash_key: bytes = b"",
    stream_tokens: int = 0,
) -> Features:
    """What the policy may know about a request: sizes and flags, never the text itself.
    `workload`: the client's key (x-specroute-workload), else one is derived from the body
    (fleet.features.workload_key: what it asks for and a hash of its system prompt, keyed with
    `hash_key`). `stream_tokens`: its prompt's length in the prefix blocks' unit."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    request_class = request_class or default_request_class(body)
    return Features(
        prompt_tokens=count_prompt_tokens(body),
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        stream=body.get("stream") is True,
        request_class="batch" if request_class == "batch" else "latency",
        ignore_eos=body.get("ignore_eos") is True,
        workload=workload if workload is not None else workload_key(body, hash_key),
        stream_tokens=stream_tokens,
    )


def read_overrides(headers: Mapping[str, str]) -> tuple[PoolName | None, str | None]:
    """(pool override, request class) from the request headers; RoutingInputError if unknown."""
    pool = headers.get(POOL_HEADER)
    if pool is not None:
        pool = pool.strip().lower()
        if pool not in POOL_OVERRIDES:
            raise RoutingInputError(POOL_HEADER, pool, POOL_OVERRIDES)
        if pool == "auto":
            pool = None
    pool_name: PoolName | None = pool  # type: ignore[assignment]
    request_class = headers.get(CLASS_HEADER)
    if request_class is not None:
        request_class = request_class.strip().lower()
        if request_class not in REQUEST_CLASSES:
            raise RoutingInputError(CLASS_HEADER, request_class, REQUEST_CLASSES)
    return pool_name, request_class


def read_workload(headers: Mapping[str, str]) -> str | None:
    """The client's workload key (x-specroute-workload), or None; RoutingInputError when it is
    empty, longer than MAX_WORKLOAD_CHARS or not printable ASCII without spaces."""
    return _read_token(headers, WORKLOAD_HEADER, MAX_WORKLOAD_CHARS)


def read_session(headers: Mapping[str, str]) -> str | None:
    """The session the client named in x-specroute-session, or None; RoutingInputError when it
    is empty, longer than MAX_SESSION_CHARS or not printable ASCII without spaces (the error
    names the header, never echoes the value: a session name may identify a user)."""
    return _read_token(headers, SESSION_HEADER, MAX_SESSION_CHARS, show_value=False)


def _read_token(headers: Mapping[str, str], header: str, limit: int, show_value: bool = True) -> str | None:
    value = headers.get(header)
    if value is None:
        return None
    key = value.strip()
    if not key or len(key) > limit or not all("!" <= c <= "~" for c in key):
        shown = key if len(key) <= limit else key[:limit] + "..."
        expected = f"1-{limit} printable ASCII characters without spaces"
        raise RoutingInputError(header, shown, expected=expected, show_value=show_value)
    return key


def session_key(name: str, owner: bytes | None = None) -> str:
    """What the fleet model keeps of a session name: a truncated SHA-256 of it, never the name.
    `owner`: the client's API key as the proxy knows it (a digest), so that one key's session
    names are its own: a client with another key naming the same `user` cannot move them."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass"))
    if owner:
        digest.update(b"\x00" + owner)
    return digest.hexdigest()[:SESSION_KEY_CHARS]


def session_of(body: Mapping[str, Any], named: str | None = None, owner: bytes | None = None) -> str | None:
    """The request's session key: the x-specroute-session header's name (`named`, an explicit
    routing intent) wins, then the body's `prompt_cache_key`, then its `user`, each when a
    non-empty string; None when nothing names one. Only a hash of the name (and of its
    `owner`'s key, with keys on) is returned."""
    if named is None:
        for field in SESSION_FIELDS:
            value = body.get(field)
            if isinstance(value, str) and value:
                named = value
                break
        else:
            return None
    return session_key(named, owner)


def running_task() -> Task[Any] | None:
    """The task running now, None outside an event loop (the router used synchronously)."""
    try:
        return current_task()
    except RuntimeError:
        return None


OWNER_REASON = "response-owner"
"""Why a request continuing a stored response went where it did: the server holding it."""
UNRESPONSIVE = "upstream_unresponsive"
"""An attempt its server left silent while it stopped answering its load polls."""
NO_PROGRESS = "upstream_no_progress"
"""An attempt left silent by a server that answers its load polls but sent no byte to any of our
requests for SPECROUTE_NO_PROGRESS_S (`Router.check_progress`)."""
HUNG_RANK = "upstream_rank_hung"
"""An attempt left silent by a data-parallel rank of its server judged hung while the server's
other ranks work (`Router.check_ranks`): it fails over, and the server keeps its place, its
requests sent to the other ranks. Not counted against the server by outlier detection."""
UNRESPONSIVE_MIN_S = 5.0
"""The shortest silence of a server's load endpoint (with another server answering) after which
requests left silent there as long fail over or end (`Router.abandon_silent`). SGLang's
/v1/loads reads a snapshot in shared memory and vLLM's /metrics its API process, so a live
server answers within milliseconds however busy its engine; a silence this long is a stopped
process or host (an engine hung behind a live front answers: `Router.check_progress`)."""


PREFILL_MARGIN = 3.0
"""The no-progress rule allows this many times the predicted prefill of the longest prompt
waiting on a server: the generic prior can be several times fast."""


def engine_share(instance: Instance) -> float:
    """How full one engine of the instance is (its running and waiting requests over its cap)."""
    running, waiting, _, _, cap = instance.signals.engine_load()
    return (running + waiting) / cap


def stalled(
    attempts: Collection[Attempt], progress_at: float, now: float, grace_s: float, engine_still_s: float | None
) -> bool:
    """Whether a server's `attempts` show it hung: no byte from it to any of them for `grace_s`
    (`progress_at`: its latest) while one has waited on it at least as long, and

    - its engine mark has not moved for as long (`engine_still_s`: SGLang's load snapshot time,
      vLLM's token counters and KV usage; a server given a request moves it within a prefill
      chunk, whatever other proxies send it), whatever waits: a JSON request is silent until it
      ends;
    - or, with no engine mark known to move (None), every attempt there is a stream waiting on
      it: a JSON request ahead, or a stream whose relay is blocked on a slow client (unread),
      can hold a stream back on a healthy server."""
    since = now - grace_s
    if progress_at > since:
        return False
    if not any(a.reading_since is not None and a.reading_since <= since for a in attempts):
        return False
    if engine_still_s is not None:
        return engine_still_s >= grace_s
    return all(a.stream and a.reading_since is not None for a in attempts)


class Attempt:
    """One upstream attempt's hold on an instance. `finished`/`failed` release it exactly once."""

    __slots__ = (
        "fleet",
        "instance",
        "started",
        "tokens",
        "open",
        "chunks",
        "first_at",
        "last_at",
        "gaps",
        "outliers",
        "stream",
        "dispatched_at",
        "ttft_s",
        "admission",
        "prompt_tokens",
        "sent",
        "workload",
        "task",
        "abandoned",
        "reading_since",
        "culprit",
        "rank",
    )

    def __init__(
        self,
        fleet: FleetModel,
        instance: Instance,
        prompt_tokens: int = 0,
        outliers: OutlierDetector | None = None,
        stream: bool = False,
        admission: Admission | None = None,
        workload: str | None = None,
        *,
        blocks: Sequence[int] = (),
        match: PrefixMatch = NO_MATCH,
        session: str | None = None,
        predicted_tpot_s: float = 0.0,
        culprit: Culprit | None = None,
    ) -> None:
        self.fleet = fleet
        self.culprit = culprit
        """The request's failures that it may have caused (`proxy.suspects`), across its attempts."""
        self.instance = instance
        self.workload = workload
        """The request's workload key: its acceptance evidence teaches that key's estimate too."""
        self.outliers = outliers
        self.stream = stream
        self.admission = admission
        """Told whether this stream met the targets (latency-class streams, admission on)."""
        self.dispatched_at = time.monotonic()
        self.prompt_tokens = prompt_tokens
        self.ttft_s: float | None = None
        self.started = False
        """Its response's first bytes came (`first_byte`): its claims on caches are settled."""
        self.tokens = 0
        self.open = True
        # Stream evidence for the cost model and the acceptance estimate (fleet/model.py).
        self.chunks = 0
        self.first_at = 0.0
        self.last_at = 0.0
        self.gaps: list[float] = []
        instance.dispatched_total += 1
        # The prompt's blocks become the instance's most recent in the prefix index, the session
        # (a key, never its name) points at it; the load counts the uncached tokens only.
        self.sent = fleet.on_dispatch(
            instance.url,
            self.dispatched_at,
            prompt_tokens,
            blocks=blocks,
            match=match,
            session=session,
            predicted_tpot_s=predicted_tpot_s,
        )
        if outliers is not None:
            outliers.dispatched(instance)
        self.task = running_task()
        """The request's task, which `Router.abandon_silent` and `Router.check_progress` cancel
        when its server left it silent."""
        self.abandoned: str | None = None
        """Why its server was judged to have left it silent (UNRESPONSIVE, NO_PROGRESS): the task
        was cancelled for that (the relay fails it over, or ends its stream with an error event),
        not because the client left."""
        self.rank: int | None = None
        """The data-parallel rank it was sent to by `x-data-parallel-rank` (None: the server's choice)."""
        self.reading_since: float | None = self.dispatched_at
        """Since when its task has been waiting on the server (for its first byte, or a stream's
        next bytes), or None while it is not (relaying to the client, or done). Only a wait on the
        server is the server's silence: a relay blocked by a slow client is not."""
        instance.attempts.add(self)

    def heard(self) -> None:
        """Bytes came from the server: it is making progress (`Router.check_progress`)."""
        self.reading_since = None
        self.instance.progress_at = time.monotonic()

    def first_byte(self) -> None:
        """Its response's first bytes came (a stream's first token): the server prefilled the
        prompt, so what it claimed of the server's cache stands (`FleetModel.on_answered`),
        whatever becomes of other unanswered requests that claimed it too. Not at the 2xx
        status: a stream's headers come before its prefill, which a client leaving may cut
        short."""
        self.heard()
        if self.open and not self.started:
            self.started = True
            self.fleet.on_answered(self.sent)
            self.instance.streaming += 1
            if self.stream:
                self.ttft_s = time.monotonic() - self.dispatched_at

    def chunk(self, tokens: int) -> None:
        self.tokens += tokens
        if tokens > 0:
            now = time.monotonic()
            if self.chunks and len(self.gaps) < MAX_GAPS:
                self.gaps.append(now - self.last_at)
            if not self.chunks:
                self.first_at = now
            self.last_at = now
            self.chunks += 1

    def finished(self, summary: Summary | None = None, complete: bool = False) -> None:
        """The attempt ended without an upstream failure; `complete`: its response was relayed
        to the end (else the client left, the upstream refused it with a 4xx, or the proxy is
        stopping); `summary` is its usage tail when the relay kept one."""
        if self.open:
            evidence = ResponseEvidence.from_stream(
                self.tokens,
                self.gaps,
                completion_tokens=summary.completion_tokens if summary else None,
                verify_steps=summary.spec_verify_ct if summary else None,
                ttft_s=self.ttft_s,
                decode_s=self.last_at - self.first_at,
                dispatch=self.sent,
                workload=self.workload,
                prompt_tokens=summary.prompt_tokens if summary else None,
                cached_tokens=summary.cached_tokens if summary else None,
                cached_details_null=summary.cached_details_null if summary else False,
            )
            self.fleet.on_response(self.instance.url, time.monotonic(), evidence)
        if self.open and complete and self.admission is not None and self.ttft_s is not None:
            tokens = summary.completion_tokens if summary and summary.completion_tokens else self.tokens
            self.admission.observe(self.met_targets(self.admission, tokens), time.monotonic())
        if self.open and self.outliers is not None:
            if complete and self.started:
                self.outliers.succeeded(self.instance, self.ttft_s, dispatched_at=self.dispatched_at)
            else:  # says nothing of the server
                self.outliers.released(self.instance, dispatched_at=self.dispatched_at)
        self._release()

    def met_targets(self, admission: Admission, tokens: int) -> bool:
        """Whether this stream met the admission targets (`Admission.met`): its first byte in
        time (for a long prompt, the time its own prefill allows), and its `tokens` after the
        first at the target pace on average (the usage's count when the stream carried one;
        else its content events, which undercount a spec stream's tokens, so the pace errs
        slow)."""
        assert self.ttft_s is not None
        now = time.monotonic()
        cost = self.fleet.cost.at(now)
        own_s = admission.alone_prefill_s(self.instance.pool, self.prompt_tokens, self.sent.cached_tokens, cost)
        decode_s = now - self.dispatched_at - self.ttft_s
        tpot_s = decode_s / (tokens - 1) if tokens > 1 else 0.0
        return admission.met(self.ttft_s, tpot_s, own_s)

    def refused(self) -> None:
        """The upstream refused the request (a 4xx): it never ran there; undo its dispatch."""
        if self.open and self.outliers is not None:
            self.outliers.released(self.instance, dispatched_at=self.dispatched_at)
        self._release(refused=True)

    def failed(self, error: str, refused: bool = False) -> None:
        """The attempt failed with `error`; `refused`: the upstream answered without running
        it (its credentials refused), so its dispatch is undone as a refusal's is."""
        if self.open:
            self.instance.failed_total += 1
            if self.outliers is not None:
                culprit = self.culprit if self.culprit is not None and request_may_cause(error) else None
                self.outliers.failed(self.instance, error, culprit, dispatched_at=self.dispatched_at)
        self._release(refused=refused)

    def _release(self, refused: bool = False) -> None:
        if not self.open:
            return
        self.open = False
        self.instance.attempts.discard(self)
        if refused:
            self.fleet.on_refused(self.sent, time.monotonic())
        elif not self.started:
            # Failed or left before any byte of its response: its claims are withdrawn.
            self.fleet.on_unanswered(self.sent, time.monotonic(), streamed=self.stream)
        else:  # its claims were settled at its first byte
            self.fleet.on_complete(self.instance.url, time.monotonic())
        if self.started:
            self.instance.streaming -= 1


class Router:
    """Owns the pools and the fleet model, asks the policy, and keeps in-flight exact."""

    def __init__(
        self,
        settings: Settings,
        fleet: FleetModel,
        pools: Mapping[PoolName, Pool],
        policy: Policy,
        outliers: OutlierDetector,
        admission: Admission | None = None,
        flow: FlowControl | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.pools = dict(pools)
        self.policy = policy
        self.outliers = outliers
        self.admission = admission if admission is not None and admission.enabled else None
        poll_s, poll_timeout_s = settings.poll_interval_ms / 1000, max(settings.stale_ms / 1000, 0.5)
        self.unresponsive_after_s = max(UNRESPONSIVE_MIN_S, 3 * poll_s + poll_timeout_s)
        """A server whose load reading is this old while another's is fresh has stopped
        answering (three polls missed at least, and never under UNRESPONSIVE_MIN_S)."""
        self.by_url = {instance.url: instance for instance in self.instances()}
        self.pollers = Pollers(
            self.instances(),
            fleet,
            interval_s=poll_s,
            timeout_s=poll_timeout_s,
            on_back=outliers.restarted,
            on_unresponsive=self.abandon_silent,
            unresponsive_after_s=self.unresponsive_after_s,
            on_polled=self.check_progress,
        )
        self.decisions = DecisionLog(settings.state_decisions)
        self.holding = None if flow is None else HoldQueue(flow, self.snapshot, poll_s)
        """Flow control's queue (SPECROUTE_HOLD_MAX_S), None when off."""
        self.hash_key = secrets.token_bytes(16)
        """Keys the system-prompt hash of derived workload keys: random per process, so the keys
        the state endpoint shows cannot confirm a guessed prompt."""
        self._turn = itertools.count()
        self.probes: set[Task[None]] = set()
        """Rank probes under way (`probe_ranks`)."""
        self.stopping = False

    @classmethod
    def from_settings(cls, settings: Settings, on_ejected: Callable[[str, str, str], None] | None = None) -> Router:
        """`on_ejected(pool, url, rule)`: told of every outlier ejection (see OutlierDetector)."""
        seed = seed_from_profile(settings.profile) if settings.profile else None
        fleet = FleetModel(
            {"spec": settings.num_draft_tokens, "base": 0},
            speculative=("spec",),
            stale_after_s=settings.stale_ms / 1000,
            half_life_s=settings.acceptance_half_life_s,
            seed=seed,
            prior_alpha=seed.profile.measured_alpha if seed is not None else None,
            costmodel_half_life_s=settings.costmodel_half_life_s,
            costmodel_lull_s=settings.costmodel_lull_s,
            prefix_max_blocks=settings.prefix_max_blocks,
            max_sessions=settings.max_sessions,
            session_ttl_s=settings.session_ttl_s,
            slo_ttft_s=settings.slo_targets[0],
            slo_tpot_s=settings.slo_targets[1],
            load_held=settings.hold_max_s > 0,
        )
        policy = registry.create(settings.policy, settings.policy_params())
        pools = pools_from_settings(settings, fleet)
        outliers = OutlierDetector(
            pools.values(),
            fleet,
            consecutive_failures=settings.outlier_consecutive_failures,
            ejection_s=settings.outlier_ejection_s,
            max_ejection_s=settings.outlier_max_ejection_s,
            slow_factor=settings.outlier_slow_factor,
            suspects=Suspects(settings.query_of_death_servers, settings.query_of_death_s),
            on_ejected=on_ejected,
        )
        admission = Admission(*settings.admission_limits)
        flow = None
        if settings.hold_max_s > 0:
            # Lost or not is goodput's SLO check, whatever policy routes (as admission's predictions).
            flow = FlowControl(Goodput(GoodputParams(**settings.policy_params("goodput"))), settings.hold_max_s)
        return cls(settings, fleet, pools, policy, outliers, admission, flow)

    # -- lifecycle (polling starts and stops here) ----------------------------------------------
    async def start(self) -> None:
        """Learn each instance, poll once, then keep polling in the background."""
        await self.pollers.start()

    async def stop(self) -> None:
        """End background work."""
        self.stopping = True  # a poll answered meanwhile starts no probe
        for probe in list(self.probes):
            probe.cancel()
        await gather(*self.probes, return_exceptions=True)
        await self.pollers.stop()
        if self.holding is not None:
            await self.holding.stop()

    def state(self) -> dict[str, Any]:
        """GET /v1/specroute/state: the live snapshot, alpha, cost estimates, last decisions."""
        state = fleet_state(self.settings, self.fleet, self.pollers, self.decisions, time.monotonic())
        for pool in state["pools"].values():
            for instance in pool["instances"]:
                instance["outlier"] = self.outliers.state_of(instance["url"])
        if self.admission is not None:
            state["admission"] = {
                "ttft_limit_s": self.admission.ttft_limit_s,
                "tpot_limit_ms": self.admission.tpot_limit_s * 1000,
                "scale": round(self.admission.scale_now(time.monotonic()), 4),
            }
        if self.holding is not None:
            state["flow_control"] = {
                "max_hold_s": self.holding.max_hold_s,
                "held": len(self.holding.held),
                "oldest_held_s": round(self.holding.oldest_s(time.monotonic()), 3),
                # Held past this, a request goes first into room (`release-due`); null until
                # the fleet's finishing rate is measured.
                "fair_wait_s": self.holding.fair_wait_s(),
            }
        return state

    # -- questions --------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True when some pool can take work."""
        return any(pool.available for pool in self.pools.values())

    def instances(self) -> list[Instance]:
        return [i for pool in self.pools.values() for i in pool.instances]

    def snapshot(self, workload: str | None = None) -> Snapshot:
        """The fleet now, as a request of `workload` sees it (its key's alpha on the spec pool)."""
        self.outliers.refresh()  # an ejection that ended makes its server available again
        return self.fleet.snapshot(time.monotonic(), workload)

    def choose(self, features: Features, override: PoolName | None, snapshot: Snapshot | None = None) -> Decision:
        """The pool for a request: the override when given, else the policy's pick; a pool with
        no available instance is swapped for the other one. `snapshot`: the fleet as the caller
        just took it (`snapshot(features.workload)`), else taken here."""
        return self.decide(features, override, snapshot)[0]

    def decide(
        self,
        features: Features,
        override: PoolName | None,
        snapshot: Snapshot | None = None,
        owner: Instance | None = None,
    ) -> tuple[Decision, dict[str, Any]]:
        """`choose`, and the decision's entry in the state endpoint's ring (the request path
        notes there where the request went: `proxy.state.dispatched`). `owner`: the server that
        holds what the request continues (a stored response): it goes there, whatever the pool."""
        if snapshot is None:
            snapshot = self.snapshot(features.workload)
        if owner is not None:
            decision = Decision(pool=owner.pool, reason=OWNER_REASON, instance=owner.url)
        elif override is not None:
            decision = Decision(pool=override, reason="override", instance=self.cache_best(override, features.cached))
        else:
            decision = self.policy.decide(features, snapshot)
            if not self.pools[decision.pool].available and self.pools[other_pool(decision.pool)].available:
                reason = "ejected" if self.all_ejected(decision.pool) else "unavailable"
                pool = other_pool(decision.pool)
                decision = Decision(
                    pool=pool, reason=reason, scores=decision.scores, instance=self.cache_best(pool, features.cached)
                )
        return self.decisions.record(features, decision, snapshot)

    def prefix_blocks(self) -> int:
        """The most blocks of a prompt worth hashing: what the prefix index can hold for one
        instance (its cache capacity, else the index's global cap); blocks past it earn nothing,
        so a huge prompt costs bounded work."""
        index = self.fleet.prefix
        return max((index.capacity_blocks(url) for url in self.fleet.instances), default=index.max_blocks)

    def cached(self, blocks: Sequence[int], features: Features, session: str | None = None) -> PrefixMatch:
        """The request's prefix credit per instance (`FleetModel.cached`): the prefix index's
        match of its blocks, and its session's last instance. `blocks` given as PromptBlocks
        are hashed only as far as some instance holds them; keep the object for the dispatch."""
        if not blocks and session is None:
            return NO_MATCH
        return self.fleet.cached(
            blocks, features.prompt_tokens, time.monotonic(), session, stream_tokens=features.stream_tokens or None
        )

    def with_credit(self, features: Features, match: PrefixMatch) -> Features:
        """`features` carrying the match's credit per instance (what the policy reads)."""
        return features.with_cached(match.credit) if match.credit else features

    def cache_best(self, pool: PoolName, cached: Mapping[str, int]) -> str | None:
        """For a decision the policy did not make (a pinned pool, or a pool swapped for an
        unavailable one): the instance of `pool` credited with the most of the prompt, if it has
        a free running slot (a full one would queue the request behind its batch, which a cached
        prefix rarely pays for); None leaves the router's least-loaded pick."""
        best: Instance | None = None
        for instance in self.pools[pool].instances:
            credit = cached.get(instance.url, 0)
            if credit <= 0 or not instance.healthy:
                continue
            running, waiting, _, _, cap = instance.signals.engine_load()
            if running + waiting + 1 > cap:
                continue
            if best is None or credit > cached.get(best.url, 0):
                best = instance
        return best.url if best is not None else None

    def admit(self, features: Features, decision: Decision, snapshot: Snapshot) -> Refusal | None:
        """None when the request may go on; a refusal (429) when the fleet cannot serve it in
        time, judged on the snapshot the decision was made on. A pinned request is judged on the
        pool it pinned (its decision)."""
        if self.admission is None:
            return None
        return self.admission.admit(features, snapshot, decision, time.monotonic())

    def all_ejected(self, pool: PoolName) -> bool:
        """Whether outlier detection, not unreachability, left `pool` without an instance."""
        return any(i.signals.ejected for i in self.pools[pool].instances) and all(
            not i.healthy for i in self.pools[pool].instances
        )

    def back_within_s(self, pools: Collection[PoolName]) -> int:
        """Whole seconds (at least 1) before an instance of `pools` may take requests again: the
        `retry-after` of a 503 `no_upstream`. An ejected instance is back when its ejection
        ends; any other (unreachable, or half-open with its one probe running) may be back as
        soon as a poll finds it (`found_again_within_s`). Telling clients of a pool ejected for
        five minutes to retry within a second only multiplied the 503s."""
        polled = found_again_within_s(self.settings.poll_interval_ms / 1000)
        soonest: float | None = None
        for pool in pools:
            for instance in self.pools[pool].instances:
                left = self.outliers.ejected_for_s(instance.url) or polled
                soonest = left if soonest is None or left < soonest else soonest
        return polled if soonest is None else max(1, math.ceil(soonest))

    def pick(self, pool: PoolName, exclude: Collection[Instance] = (), prefer: str | None = None) -> Instance | None:
        """The healthy instance of `pool` not in `exclude` that the decision named (`prefer`, a
        URL: e.g. the one holding the prompt's prefix), else the least loaded (load relative to
        its cap); ties rotate so that a quiet fleet still spreads its requests. Outlier detection
        may hold an instance back (ejected, or half-open with its one probe running), the
        preferred one too: then the least loaded of the others takes the request."""
        outliers = self.outliers
        # admits() first: it ends an ejection whose time is up, which makes the instance healthy.
        candidates = [i for i in self.pools[pool].instances if i not in exclude and outliers.admits(i) and i.healthy]
        if len(candidates) > 1:
            # Lagging ones (InstanceState.lagging) wait while another candidate answers its polls.
            now, bound = time.monotonic(), self.fleet.stale_after_s
            answering = [i for i in candidates if i.signals.age(now) <= bound]
            if answering:
                candidates = answering
        if prefer is not None:
            for instance in candidates:
                if instance.url == prefer:
                    return instance
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=engine_share)

    def next_instance(
        self, pool: PoolName, tried: Collection[Instance], pinned: bool, prefer: str | None = None
    ) -> Instance | None:
        """Where the next attempt goes: an untried instance of the same pool (`prefer`, the
        decision's instance, while it is untried and admitted), then (unless the client pinned
        the pool) one of the other pool."""
        instance = self.pick(pool, tried, prefer)
        if instance is None and not pinned:
            instance = self.pick(other_pool(pool), tried)
        return instance

    # -- events -----------------------------------------------------------------------------
    def abandon_silent(self, url: str) -> None:
        """The server at `url` stopped answering (`FleetModel.unresponsive`, told by its poller):
        its attempts that have waited on it for `unresponsive_after_s` are cancelled. One still
        waiting for its first byte fails over; a stream under way ends with an error event (bytes
        reached its client). A stopped process or host would hold each for the first-token
        timeout, the chunk timeout, or a JSON request's total one."""
        instance = self.by_url.get(url)
        if instance is None:
            return
        self.abandon(instance, time.monotonic() - self.unresponsive_after_s, UNRESPONSIVE)

    def abandon(self, instance: Instance, since: float, why: str, ranks: Collection[int] | None = None) -> None:
        """Cancel `instance`'s attempts that have waited on it since `since` or longer, for `why`;
        with `ranks`, only those sent to one of them or left to the server's choice."""
        for attempt in list(instance.attempts):
            waiting = attempt.reading_since
            if ranks is not None and attempt.rank is not None and attempt.rank not in ranks:
                continue
            if waiting is not None and waiting <= since and attempt.task is not None and attempt.abandoned is None:
                attempt.abandoned = why
                attempt.task.cancel()

    def check_progress(self, url: str) -> None:
        """Called after each poll the server at `url` answered. One whose reading is fresh again
        is told to outlier detection (`OutlierDetector.answering`). A server that answers its
        polls while its engine is stuck (a scheduler hung in a forward pass: SGLang's /v1/loads
        reads shared memory and vLLM's /metrics its front process, so both answer) held every
        request sent to it for the first-token timeout, every stream under way for the chunk
        timeout and a JSON request for the total one. Judged hung (`stalled`, after
        SPECROUTE_NO_PROGRESS_S plus PREFILL_MARGIN times the predicted prefill of the longest
        prompt waiting there; without an engine mark or with vLLM's, the chunk timeout at least),
        it is ejected (rule no-progress) and every request waiting on it is cancelled: those with
        no byte yet fail over, streams under way end with an error event."""
        instance = self.by_url.get(url)
        if instance is None:
            return
        now = time.monotonic()
        signals = instance.signals
        if signals.healthy and signals.age(now) <= self.fleet.stale_after_s:
            self.outliers.answering(url)
        limit_s = self.settings.no_progress_s
        if limit_s <= 0:
            return
        # The longest prompt waiting for its first byte: a healthy server sends some byte within
        # one such prefill; the sum would grow with every request sent to a hung one.
        longest = max((a.prompt_tokens - a.sent.cached_tokens for a in instance.attempts if not a.started), default=0)
        prefill_s = self.fleet.cost.prefill_ms(instance.pool, max(longest, 0), now) / 1000.0
        grace_s = limit_s + PREFILL_MARGIN * prefill_s
        if instance.kind == "vllm":
            # A margin on vLLM's marks: its counters count a prompt as its prefill ends, and only
            # its KV usage moves through another client's long lone prefill.
            grace_s = max(grace_s, self.settings.chunk_timeout_s)
        self.check_ranks(instance, now, grace_s)
        if not instance.attempts:
            return
        still_s = signals.engine_still_s(now)
        if still_s is None:
            grace_s = max(grace_s, self.settings.chunk_timeout_s)
        if not stalled(instance.attempts, instance.progress_at, now, grace_s, still_s):
            return
        log.warning(
            "upstream %s (%s pool) sent nothing to any of its %d requests for %.0f s%s: judged hung; those"
            " waiting on it fail over, or their streams end",
            instance.url,
            instance.pool,
            len(instance.attempts),
            now - max(instance.progress_at, min(a.dispatched_at for a in instance.attempts)),
            "" if still_s is None else f" and its engine's progress mark has not moved for {still_s:.0f} s",
        )
        self.outliers.hung(instance)
        self.abandon(instance, now, NO_PROGRESS)

    def check_ranks(self, instance: Instance, now: float, grace_s: float) -> None:
        """A data-parallel rank hung among working ones (`InstanceSignals.hung_ranks`: its
        progress mark, SGLang's load snapshot time or vLLM's engine counters, held still for
        `grace_s` while it shows work and another rank does not) leaves the requests dealt to
        it silent, while the server's other requests stream, so neither the no-progress rule
        nor outlier detection sees it. Its requests left silent as long fail over (their streams
        under way end with an error event), and the server's next requests name its other ranks
        (`x-data-parallel-rank`, which SGLang and vLLM read), in turn, until the rank's mark
        moves again.

        A rank hung in the first prefill after it idled shows no work (its last figures are
        an idle rank's), so it is asked: while one of our requests left to the server's choice
        has waited that long without a byte, each rank that shows no work and has held still
        as long is sent a one-token completion named to it (`probe_rank`); one that does not
        answer within `grace_s`, its mark still, is judged hung too, until its mark moves or
        such a request, sent again each `grace_s`, is answered."""
        signals = instance.signals
        for rank, judged_at in list(instance.silent_ranks.items()):
            if signals.rank_moved_since(rank, judged_at):  # it published: it served something
                del instance.silent_ranks[rank]
        hung = signals.hung_ranks(now, grace_s)
        # Judged only while one of ours waits there as long: a snapshot alone may hold still on
        # a healthy rank (a forward pass longer than the limit, a raised publish interval).
        since = now - grace_s
        silent = [a for a in instance.attempts if a.reading_since is not None and a.reading_since <= since]
        judged_by_work = set(signals.out_ranks) - set(instance.silent_ranks)
        if hung and not judged_by_work and not any(a.rank is None or a.rank in hung for a in silent):
            hung = ()
        out = tuple(sorted(set(hung) | set(instance.silent_ranks)))
        if out != signals.out_ranks:
            newly = [rank for rank in hung if rank not in signals.out_ranks]
            if newly:
                log.warning(
                    "upstream %s (%s pool): data-parallel rank(s) %s of %d hold their progress mark still with work"
                    " while another rank serves: judged hung; requests go to the other ranks by x-data-parallel-rank",
                    instance.url,
                    instance.pool,
                    ", ".join(map(str, newly)),
                    len(signals.rank_marks),
                )
            if not out:
                log.info("upstream %s (%s pool): every data-parallel rank serves again", instance.url, instance.pool)
            self.fleet.set_out_ranks(instance.url, out)
        if out:
            # Those sent to a working rank are its queue's, not the hung rank's.
            self.abandon(instance, since, HUNG_RANK, ranks=out)
        if any(a.rank is None and not a.started for a in silent):
            self.probe_ranks(instance, signals.idle_still_ranks(now, grace_s), now, grace_s)
        if instance.silent_ranks:
            self.probe_ranks(instance, tuple(instance.silent_ranks), now, grace_s)

    def probe_ranks(self, instance: Instance, ranks: Collection[int], now: float, timeout_s: float) -> None:
        """Ask each of `ranks` (`Pollers.probe_rank`) not asked within `timeout_s`."""
        if self.stopping:
            return
        for rank in ranks:
            if rank in instance.probing or now - instance.probed_at.get(rank, -math.inf) < timeout_s:
                continue
            instance.probing.add(rank)
            instance.probed_at[rank] = now
            task = get_running_loop().create_task(self.probe_rank(instance, rank, now, timeout_s))
            self.probes.add(task)
            task.add_done_callback(self.probes.discard)

    async def probe_rank(self, instance: Instance, rank: int, sent_at: float, timeout_s: float) -> None:
        try:
            answered = await self.pollers.probe_rank(instance.url, rank, timeout_s)
        finally:
            instance.probing.discard(rank)
        if answered and instance.silent_ranks.pop(rank, None) is not None:
            log.info(
                "upstream %s (%s pool): data-parallel rank %d answered a request named to it: it serves again",
                instance.url,
                instance.pool,
                rank,
            )
        elif (
            answered is False
            and rank not in instance.silent_ranks
            and not instance.signals.rank_moved_since(rank, sent_at)  # busy since: no verdict
        ):
            instance.silent_ranks[rank] = time.monotonic()
            log.warning(
                "upstream %s (%s pool): data-parallel rank %d of %d showed no work and answered no one-token request"
                " named to it within %.0f s while one of ours waited on the server: judged hung; requests go to"
                " the other ranks by x-data-parallel-rank",
                instance.url,
                instance.pool,
                rank,
                len(instance.signals.rank_marks),
                timeout_s,
            )

    def unreachable(self, instance: Instance) -> None:
        """A connection to `instance` failed: skip it until a load poll reaches it again."""
        self.fleet.set_health(instance.url, False)

    def dispatch(
        self,
        instance: Instance,
        prompt_tokens: int = 0,
        stream: bool = False,
        request_class: str = "latency",
        workload: str | None = None,
        *,
        blocks: Sequence[int] = (),
        match: PrefixMatch = NO_MATCH,
        session: str | None = None,
        predicted_tpot_s: float = 0.0,
        culprit: Culprit | None = None,
    ) -> Attempt:
        """Start an attempt on `instance`; the caller must end it (finished/failed) on every path.
        `blocks`, `match`, `session`: the request's prompt blocks, prefix credit and session key
        (the same objects for every attempt of a request: nothing is hashed twice);
        `predicted_tpot_s`: the decision's TPOT on the instance's pool (its outcome teaches the
        pool's bias); `culprit`: the request's failures that it may have caused, across
        its attempts (`proxy.suspects`)."""
        admission = self.admission if stream and request_class == "latency" else None
        return Attempt(
            self.fleet,
            instance,
            prompt_tokens,
            self.outliers,
            stream,
            admission,
            workload,
            blocks=blocks,
            match=match,
            session=session,
            predicted_tpot_s=predicted_tpot_s,
            culprit=culprit,
        )
