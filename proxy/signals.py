"""Live signals: poll each instance's load, learn step costs and acceptance, build snapshots.

Per instance, once it answers: GET /server_info (which instances speculate,
max_running_requests, the draft settings). Then every SPECROUTE_POLL_INTERVAL_MS one load probe,
the first of these that the server answers: GET /v1/loads (SGLang 0.5.15+), GET /metrics
(Prometheus text; SGLang with --enable-metrics, or vLLM), GET /get_load (older SGLang). A server
that answers none is counted by the proxy's own in-flight requests only (and checked for life on
GET /health). Spec instances that expose /metrics also give the token and verify-call counters,
whose increments are the windowed accept length.

Health: an instance the proxy cannot connect to (at start, on UNREACHABLE_AFTER polls in a row,
or on a request's connect error) is unhealthy, and skipped, until a poll reaches it again; one
not reached yet is learned again every RELEARN_EVERY polls (GPU servers often start minutes after
the proxy). A probe that keeps answering with an error status is learned again too (the server
behind the URL changed). Each instance is polled on its own loop, so a dead or slow host does
not delay the readings of the others.

All routing arithmetic lives in policies/ (fleet.FleetState builds the Snapshot); this module
only does the I/O and feeds it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import httpx

from fleet.costmodel import Seed, StepCostModel, seed_from_profile
from fleet.state import FleetState, Reading, learn_from_response
from fleet.types import Decision, Features, PoolName, Snapshot
from proxy.pools import Instance, Pool
from proxy.settings import Settings

log = logging.getLogger("specroute.signals")

LOAD_PROBES = ("/v1/loads", "/metrics", "/get_load")
METRICS_EVERY = 5
"""On a spec instance polled through /v1/loads, read /metrics' counters every this many polls."""
GAUGE_INTERVAL_STEPS = 40
"""Decode iterations behind sglang:spec_accept_length (SGLang's --decode-log-interval default)."""
UNREACHABLE_AFTER = 3
"""Failed connections in a row after which a polled instance is marked unhealthy."""
RELEARN_EVERY = 10
"""Polls between two tries to learn an instance not reached yet (1 s at the default interval)."""
VLLM_DEFAULT_MAX_NUM_SEQS = 256
"""A vLLM server's running cap until it is seen saturated: vLLM exposes no --max-num-seqs, so
requests kept waiting while the running count holds tell the cap in force (see vllm_cap)."""
VLLM_FULL_FOR_S = 1.0
"""How long a vLLM server must keep requests waiting without running more before its running
count is taken as its cap. Requests that arrive during a step wait for the next one on any server,
far below the cap; a prefill step on a large model lasts tens to hundreds of ms."""
REPROBE_AFTER = 10
"""Error answers in a row from an instance's load probe after which it is learned again."""
LIVENESS_EVERY = 5
"""Polls between two GET /health of an instance that answers no load probe."""
# A connection that cannot be made (refused, unresolvable, or not accepted in time): the host
# is down, not merely slow (a slow answer only ages the reading).
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def parse_prometheus(text: str, wanted: frozenset[str]) -> dict[str, float]:
    """Sum of each wanted metric over its label sets (the text format, comments skipped)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        if name not in wanted:
            continue
        rest = line[line.rfind("}") + 1 :] if line[name_end] == "{" else line[name_end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


METRIC_NAMES = frozenset(
    {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:max_running_requests",
        "sglang:generation_tokens_total",
        "sglang:spec_verify_calls_total",
        "sglang:spec_accept_length",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    }
)


def reading_from_loads(doc: Mapping[str, Any], at: float) -> Reading:
    """GET /v1/loads: summed over data-parallel ranks."""
    loads = [entry for entry in doc.get("loads", []) if isinstance(entry, Mapping)]
    if not loads:
        raise ValueError("no loads in /v1/loads answer")
    # Its speculative.accept_length is cumulative since start: too slow for routing, not used.
    return Reading(
        at=at,
        running=float(sum(e.get("num_running_reqs", 0) for e in loads)),
        waiting=float(sum(e.get("num_waiting_reqs", 0) for e in loads)),
        max_running=int(sum(e.get("max_running_requests", 0) for e in loads)) or None,
        waiting_tokens=float(sum(e.get("num_waiting_uncached_tokens", 0) for e in loads)),
    )


def reading_from_metrics(text: str, at: float) -> Reading:
    m = parse_prometheus(text, METRIC_NAMES)
    if "sglang:num_running_reqs" in m:
        running, waiting = m["sglang:num_running_reqs"], m.get("sglang:num_queue_reqs", 0.0)
    elif "vllm:num_requests_running" in m:
        running, waiting = m["vllm:num_requests_running"], m.get("vllm:num_requests_waiting", 0.0)
        # No cap in vLLM's gauges: Signals infers it over several readings (vllm_cap).
        return Reading(at=at, running=running, waiting=waiting, accept_steps=GAUGE_INTERVAL_STEPS * running)
    else:
        raise ValueError("no load gauges in /metrics")
    return Reading(
        at=at,
        running=running,
        waiting=waiting,
        max_running=int(m["sglang:max_running_requests"]) if m.get("sglang:max_running_requests") else None,
        accept_length=m.get("sglang:spec_accept_length") or None,
        accept_steps=GAUGE_INTERVAL_STEPS * running,
        # A labelled counter has no sample until its first child exists (no request finished).
        tokens_total=m.get("sglang:generation_tokens_total", 0.0) if "sglang:spec_verify_calls_total" in m else None,
        verify_total=m.get("sglang:spec_verify_calls_total"),
    )


def vllm_cap(
    full_since: tuple[float, float] | None, reading: Reading, cap: int
) -> tuple[int, tuple[float, float] | None]:
    """A vLLM server's running cap after `reading`, and since when (and at what running count) it
    has kept requests waiting. It is full, so running its cap (--max-num-seqs, or what its KV cache
    holds), once requests have waited VLLM_FULL_FOR_S with the running count unchanged; a server
    seen running more than the cap has a larger one."""
    if reading.waiting <= 0 or reading.running < 1:
        return max(cap, int(reading.running)), None
    if full_since is None or full_since[1] != reading.running:
        return max(cap, int(reading.running)), (reading.at, reading.running)
    if reading.at - full_since[0] >= VLLM_FULL_FOR_S:
        return int(reading.running), full_since
    return max(cap, int(reading.running)), full_since


def reading_from_get_load(doc: Any, at: float) -> Reading:
    entries = doc if isinstance(doc, list) else [doc]
    entries = [e for e in entries if isinstance(e, Mapping)]
    if not entries:
        raise ValueError("empty /get_load answer")
    total = sum(e.get("num_reqs", 0) for e in entries)
    waiting = sum(e.get("num_waiting_reqs", 0) for e in entries)
    return Reading(at=at, running=float(total - waiting), waiting=float(waiting))


def server_info_facts(doc: Mapping[str, Any]) -> dict[str, Any]:
    """What /server_info says about speculation and the running cap."""
    algorithm = doc.get("speculative_algorithm")
    steps = doc.get("speculative_num_steps") or 0
    return {
        "speculative": bool(algorithm),
        "speculative_algorithm": algorithm,
        "num_draft_tokens": int(steps) if algorithm else 0,
        "speculative_eagle_topk": doc.get("speculative_eagle_topk"),
        "speculative_num_draft_tokens": doc.get("speculative_num_draft_tokens"),
        "max_running_requests": doc.get("max_running_requests"),
    }


class Signals:
    """The proxy's live view of its fleet: polls into the Router's FleetState, learns costs."""

    def __init__(
        self,
        settings: Settings,
        fleet: FleetState,
        pools: Mapping[PoolName, Pool],
        clock: Callable[[], float] = time.monotonic,
        seed: Seed | None = None,
    ):
        self.settings = settings
        self.fleet = fleet
        self.clock = clock
        if seed is None and settings.profile:
            seed = seed_from_profile(settings.profile)
        self.cost = StepCostModel(
            seed, num_draft_tokens=settings.num_draft_tokens, half_life_s=settings.costmodel_half_life_s
        )
        self.by_url: dict[str, Instance] = {i.url: i for pool in pools.values() for i in pool.instances}
        self.probe: dict[str, str | None] = {}
        """Which load endpoint each instance answers (None: none, local counts only)."""
        self.info: dict[str, dict[str, Any]] = {}
        self.decisions: deque[dict[str, Any]] = deque(maxlen=settings.state_decisions)
        self.poll_errors: dict[str, str] = {}
        self.unlearned: set[str] = set(self.by_url)
        """Instances not reached yet: learned again every RELEARN_EVERY polls, not polled."""
        self._polls: dict[str, int] = dict.fromkeys(self.by_url, 0)
        self._failures: dict[str, int] = dict.fromkeys(self.by_url, 0)
        """Consecutive failed polls per instance (connection failures, or error answers)."""
        self._vllm_full_since: dict[str, tuple[float, float]] = {}
        """vLLM instances keeping requests waiting: since when, at what running count (vllm_cap)."""
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        timeout = httpx.Timeout(max(self.settings.stale_ms / 1000, 0.5))
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)
        await asyncio.gather(*(self._learn(url) for url in self.by_url))
        await self.poll_once()
        self._tasks = [asyncio.create_task(self._loop(url), name=f"specroute-signals {url}") for url in self.by_url]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _loop(self, url: str) -> None:
        interval = self.settings.poll_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await self._tick(url)
            except Exception:  # a bug in one poll must not stop polling (readings would go stale)
                log.exception("load poll of %s failed", url)

    async def _tick(self, url: str) -> None:
        """One poll period of one instance: learn it, poll its load, or check it is alive."""
        polls = self._polls[url] = self._polls[url] + 1
        if url in self.unlearned:
            if polls % RELEARN_EVERY == 0:
                await self._learn(url)
        elif self.probe.get(url) is not None:
            await self._poll(url)
        elif polls % LIVENESS_EVERY == 0:
            await self._liveness(url)

    # -- polling --------------------------------------------------------------------------------

    def _headers(self, url: str) -> dict[str, str]:
        key = self.by_url[url].api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def _get(self, url: str, path: str) -> httpx.Response:
        assert self._client is not None
        return await self._client.get(url + path, headers=self._headers(url))

    async def _learn(self, url: str) -> None:
        """GET /server_info, then find the first load probe the server answers. An instance that
        cannot be reached stays unlearned (and unhealthy) and is tried again later."""
        try:
            response = await self._get(url, "/server_info")
        except CONNECT_ERRORS as exc:
            self._unreachable(url, f"server_info: {type(exc).__name__}")
            return
        except httpx.HTTPError as exc:  # it answered, slowly or badly: learn what it has
            self.poll_errors[url] = f"server_info: {type(exc).__name__}"
            response = None
        self.unlearned.discard(url)
        self._reached(url)
        try:
            if response is not None and response.status_code == 200:
                facts = server_info_facts(response.json())
                self.info[url] = facts
                instance = self.by_url[url]
                if facts["max_running_requests"]:
                    self.fleet.instances[url].max_running = int(facts["max_running_requests"])
                if facts["speculative"] and instance.pool == "spec" and facts["num_draft_tokens"]:
                    self.fleet.set_draft_tokens(facts["num_draft_tokens"])
                    self.cost.set_draft_tokens("spec", facts["num_draft_tokens"])
                if facts["speculative"] != (instance.pool == "spec"):
                    log.warning(
                        "%s is in the %s pool but /server_info says speculative=%s",
                        url,
                        instance.pool,
                        facts["speculative"],
                    )
        except (ValueError, TypeError, AttributeError) as exc:
            self.poll_errors[url] = f"server_info: {type(exc).__name__}"
        for path in LOAD_PROBES:
            try:
                response = await self._get(url, path)
            except CONNECT_ERRORS as exc:
                self._unreachable(url, f"{path}: {type(exc).__name__}")
                return
            except httpx.HTTPError as exc:
                self.poll_errors[url] = f"{path}: {type(exc).__name__}"
                self.probe[url] = LOAD_PROBES[0]  # answering badly now: keep trying the best probe
                return
            if response.status_code == 200:
                self.probe[url] = path
                if path == "/metrics" and url not in self.info and "vllm:num_requests_running" in response.text:
                    self.info[url] = {"server": "vllm", "speculative": False}
                    self.fleet.instances[url].max_running = VLLM_DEFAULT_MAX_NUM_SEQS
                return
        self.probe[url] = None
        self.fleet.on_unpolled(url)

    def _unreachable(self, url: str, error: str) -> None:
        """No connection to `url`: unhealthy, and learned again (it may come back as anything)."""
        self.poll_errors[url] = error
        self.unlearned.add(url)
        self.fleet.set_health(url, False)

    def _reached(self, url: str) -> None:
        """The instance answered (whatever it said): it is up."""
        self.fleet.set_health(url, True)

    async def _liveness(self, url: str) -> None:
        """An instance with no load probe: any answer on /health means it is up."""
        try:
            await self._get(url, "/health")
        except CONNECT_ERRORS as exc:
            self._failed(url, f"/health: {type(exc).__name__}", connect=True)
            return
        except httpx.HTTPError as exc:
            self.poll_errors[url] = f"/health: {type(exc).__name__}"
            return
        self.poll_errors.pop(url, None)
        self._failures[url] = 0
        self._reached(url)

    def _failed(self, url: str, error: str, connect: bool) -> None:
        """A failed poll: connection failures in a row make the instance unreachable; error
        answers in a row send it back to be learned (the server behind the URL changed)."""
        self.poll_errors[url] = error
        failures = self._failures[url] = self._failures[url] + 1
        if connect and failures >= UNREACHABLE_AFTER:
            self._unreachable(url, error)
        elif not connect and failures >= REPROBE_AFTER:
            self._failures[url] = 0
            self.unlearned.add(url)

    async def poll_once(self) -> None:
        """Every instance once (at start, and in tests); the background loops do the rest."""
        await asyncio.gather(*(self._tick(url) for url in self.by_url))

    async def _poll(self, url: str) -> None:
        path = self.probe[url]
        assert path is not None
        at = self.clock()
        try:
            response = await self._get(url, path)
        except CONNECT_ERRORS as exc:
            self._failed(url, f"{path}: {type(exc).__name__}", connect=True)
            return
        except httpx.HTTPError as exc:  # it is up (it accepted the connection), but slow or broken
            self.poll_errors[url] = f"{path}: {type(exc).__name__}"
            return
        self._reached(url)
        if response.status_code != 200:
            self._failed(url, f"{path}: HTTP {response.status_code}", connect=False)
            return
        try:
            if path == "/v1/loads":
                reading = reading_from_loads(response.json(), at)
            elif path == "/metrics":
                reading = reading_from_metrics(response.text, at)
            else:
                reading = reading_from_get_load(response.json(), at)
            if (
                path == "/v1/loads"
                and self.fleet.instances[url].pool == "spec"
                and self._polls[url] % METRICS_EVERY == 1
            ):
                reading = await self._with_counters(url, reading)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            # The reading ages and turns stale; routing acts on that (see fleet/state.py).
            self.poll_errors[url] = f"{path}: {type(exc).__name__}"
            return
        self._failures[url] = 0
        self.poll_errors.pop(url, None)
        if path == "/metrics" and self.info.get(url, {}).get("server") == "vllm":
            cap, full_since = vllm_cap(self._vllm_full_since.get(url), reading, self.fleet.instances[url].max_running)
            if full_since is None:
                self._vllm_full_since.pop(url, None)
            else:
                self._vllm_full_since[url] = full_since
            reading = replace(reading, max_running=cap)
        self.fleet.on_reading(url, reading)

    async def _with_counters(self, url: str, reading: Reading) -> Reading:
        """Add /metrics' token and verify counters to a /v1/loads reading, if the server has them."""
        try:
            response = await self._get(url, "/metrics")
        except httpx.HTTPError:
            return reading
        if response.status_code != 200:
            return reading
        m = parse_prometheus(response.text, METRIC_NAMES)
        if "sglang:spec_verify_calls_total" not in m:
            return reading
        gauge = m.get("sglang:spec_accept_length") or None
        return Reading(
            at=reading.at,
            running=reading.running,
            waiting=reading.waiting,
            max_running=reading.max_running,
            waiting_tokens=reading.waiting_tokens,
            accept_length=gauge,
            accept_steps=GAUGE_INTERVAL_STEPS * reading.running,
            tokens_total=m.get("sglang:generation_tokens_total", 0.0),  # no sample before a request finished
            verify_total=m["sglang:spec_verify_calls_total"],
        )

    # -- evidence from the request path ---------------------------------------------------------

    def observe(
        self,
        instance: Instance,
        *,
        events: int,
        gaps_s: list[float],
        completion_tokens: int | None = None,
        verify_steps: int | None = None,
    ) -> None:
        """A finished response from `instance`: `events` SSE content events relayed, `gaps_s`
        the gaps between the reads that carried them, and what its usage tail said: completion
        tokens and (with SGLang's spec details) verify steps."""
        if verify_steps is None and completion_tokens and events >= 3:
            # One event per verify step, less the first token's (from prefill) and the usage one.
            verify_steps = events - 2
        learn_from_response(
            self.fleet,
            self.cost,
            instance.url,
            self.clock(),
            tokens=completion_tokens,
            verify_steps=verify_steps,
            step_ms=1000 * statistics.median(gaps_s) if gaps_s else None,
            decode_s=sum(gaps_s),
        )

    # -- what the router and the state endpoint read -------------------------------------------

    def snapshot(self) -> Snapshot:
        return self.fleet.snapshot(self.clock(), self.cost)

    def explain(self, features: Features, decision: Decision, snapshot: Snapshot) -> Decision:
        """The decision with what it saw added to its scores (for telemetry and the state
        endpoint), recorded in the ring of recent decisions."""
        scores = {**decision_inputs(snapshot), **decision.scores}
        explained = Decision(pool=decision.pool, reason=decision.reason, scores=scores)
        self.decisions.append(
            {
                "at": round(self.clock(), 3),
                "pool": decision.pool,
                "reason": decision.reason,
                "class": features.request_class,
                "prompt_tokens": features.prompt_tokens,
                "scores": scores,
            }
        )
        return explained

    def state(self) -> dict[str, Any]:
        snap = self.snapshot()
        return {
            "policy": self.settings.policy,
            "poll_interval_ms": self.settings.poll_interval_ms,
            "stale_ms": self.settings.stale_ms,
            "pools": {
                name: {
                    "speculative": pool.speculative,
                    "num_draft_tokens": pool.num_draft_tokens,
                    "alpha": pool.alpha,
                    "stale": pool.stale,
                    "age_s": None if math.isinf(pool.age_s) else round(pool.age_s, 3),
                    "instances": [
                        {
                            "url": i.url,
                            "name": self.by_url[i.url].name,
                            "running": i.running,
                            "waiting": i.waiting,
                            "max_running": i.max_running,
                            "healthy": i.healthy,
                            "reached": i.url not in self.unlearned,
                            "age_s": None if math.isinf(i.age_s) else round(i.age_s, 3),
                            "probe": self.probe.get(i.url),
                            "error": self.poll_errors.get(i.url),
                            "server_info": self.info.get(i.url),
                        }
                        for i in pool.instances
                    ],
                }
                for name, pool in snap.pools.items()
            },
            "acceptance": {
                "accept_length": self.fleet.acceptance.accept_length(),
                "alpha": self.fleet.acceptance.alpha(),
                "evidence_steps": round(self.fleet.acceptance.evidence(self.clock()), 1),
                "half_life_s": self.settings.acceptance_half_life_s,
            },
            "cost_model": {
                "profile": self.settings.profile,
                "decode_step_ms": self.cost.estimates(now=self.clock()),
                "half_life_s": self.settings.costmodel_half_life_s,
            },
            "decisions": list(self.decisions),
        }


def decision_inputs(snapshot: Snapshot) -> dict[str, float]:
    """Flat numbers of what a decision saw: `<pool>.load`, `<pool>.capacity`, `<pool>.age_s`
    (omitted before any reading), `<pool>.stale` (1.0 or 0.0), `spec.alpha` (once estimated)."""
    out: dict[str, float] = {}
    for name, pool in snapshot.pools.items():
        out[f"{name}.load"] = pool.running + pool.waiting
        out[f"{name}.capacity"] = float(pool.capacity)
        if not math.isinf(pool.age_s):
            out[f"{name}.age_s"] = round(pool.age_s, 4)
        out[f"{name}.stale"] = 1.0 if pool.stale else 0.0
        if pool.speculative and pool.alpha is not None:
            out[f"{name}.alpha"] = round(pool.alpha, 4)
    return out
