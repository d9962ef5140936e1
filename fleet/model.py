"""The fleet model: every observation the router makes goes in, a policy Snapshot comes out.

Both the proxy (its pollers and request path, proxy/) and the virtual-clock evaluation (bench/
routing_sim.py) feed this one object, so what was evaluated is what is served. It takes:
- a server's description (`on_server`): speculative or not, its draft width, its running cap;
- a load reading (`on_reading`): running, waiting, unprefilled tokens, acceptance counters;
- our own traffic (`on_dispatch`, `on_complete`, `on_refused`), which adjusts the last reading
  until the next one (fleet/instance.py);
- a finished response's evidence (`on_response`): its inter-chunk gap corrects the step-cost
  model, its tokens per verify step the acceptance estimate (its workload's when the request had
  a workload key; the pool's only when the server's acceptance counters are not read, which
  count the request already), its length the output mean;
- a decode step seen directly (`on_step`, the virtual clock's shortcut for the chunk gaps);
- health and ejection (`set_health`, `set_ejected`);
and gives `snapshot(now)`, or `snapshot(now, workload)` for one request: the speculative pools'
alpha is then that workload's (shrunk toward the pool's while the key has little evidence).

It also keeps the prefix index (fleet/prefix.py: which prompt prefixes each instance likely
holds, learned from what was dispatched there and corrected by the cached tokens servers
report) and the named sessions (fleet/sessions.py); `cached(blocks, prompt_tokens, now)` is a
request's credit per instance, which goes into its `Features.cached`. Dispatches and rates
count a request's uncached prompt tokens only: the prefill it causes.
Nothing reads a clock: every call takes `now` in seconds.

Pools are data: each has a name and a draft width (0: not speculative); the mission's two,
"spec" and "base", are only the default. A reading older than `stale_after_s` marks its pool
stale (policies then act conservatively).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from fleet.acceptance import (
    DEFAULT_HALF_LIFE_S,
    WORKLOAD_KEYS,
    AcceptanceEstimator,
    CounterDelta,
    RequestSpread,
    WorkloadAcceptance,
    accept_length,
)
from fleet.attainment import SloAttainment
from fleet.blocks import BLOCK_TOKENS, PromptBlocks
from fleet.costmodel import DEFAULT_HALF_LIFE_S as COST_HALF_LIFE_S
from fleet.costmodel import Seed, StepCostModel
from fleet.instance import RATE_WINDOW_S, CacheStats, InstanceSignals
from fleet.outcomes import TpotOutcomes
from fleet.prefix import DEFAULT_MAX_BLOCKS, PrefixIndex
from fleet.readings import Dispatch, Reading, ResponseEvidence, ServerDescription
from fleet.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S, SessionTable
from fleet.types import InstanceState, PoolState, Snapshot

# Finished requests the mean output length covers (a moving mean over about as many after that).
OUTPUT_MEMORY = 50
PREFILL_CHUNK_TOKENS = 8192
"""Prompt tokens one prefill iteration takes at most (SGLang's --chunked-prefill-size default)."""
COUNTERS_SILENT_HALF_LIVES = 4.0
"""Acceptance half-lives after its last counter reading during which an instance's counters speak
for it (FleetModel._counts_acceptance): by then that reading weighs 1/16 of what it did."""
RESTART_EVIDENCE_TOKENS = 1_000_000.0
"""Prefill tokens a server's counters must have counted for an outage not to forget its cache:
restarted, it counts from 0, and before its next reading (one poll after it answers again: about
a second) it cannot prefill as many, even for other proxies. Fewer (a young server), a restart
could climb past them unseen."""
DEFAULT_POOLS: Mapping[str, int] = {"spec": 3, "base": 0}
"""Pool name -> tokens drafted per verify step (0: a plain pool)."""


@dataclass(slots=True)
class PrefixMatch:
    """A request's prefix credit per instance (`FleetModel.cached`)."""

    credit: dict[str, int]
    """Tokens each instance likely holds, trust applied, below the prompt's length: what the
    policy credits (`Features.cached`)."""
    matched: dict[str, int]
    """The raw claims behind them (before trust): what a server's report is checked against."""


NO_MATCH = PrefixMatch({}, {})


@dataclass(slots=True)
class PoolSignals:
    """What the model learns per pool (beyond its instances)."""

    name: str
    num_draft_tokens: int
    role: bool
    """Configured to speculate (its servers should say so; it drafts once num_draft_tokens > 0)."""
    acceptance: AcceptanceEstimator | None
    """The pool's acceptance estimate (speculative pools only)."""
    workloads: WorkloadAcceptance | None = None
    """Its acceptance per workload key (speculative pools only)."""
    decode_s: float = 0.0
    """Mean decode time of its recent requests (how far the server's counters lag)."""
    spread: RequestSpread = field(default_factory=RequestSpread)
    """How its requests' time per token varies with their own acceptance (speculative pools)."""
    outcomes: TpotOutcomes = field(default_factory=TpotOutcomes)
    """Its requests' TPOT against the TPOT predicted for them (`Dispatch.predicted_tpot_s`)."""
    attainment: SloAttainment = field(default_factory=SloAttainment)
    """Its requests finished within the SLO targets (none measured without targets)."""

    @property
    def speculative(self) -> bool:
        return self.role and self.num_draft_tokens > 0


class FleetModel:
    """Per-instance readings and events, per-pool acceptance, the step-cost model and the
    output-length mean; builds Snapshots on demand."""

    def __init__(
        self,
        pools: Mapping[str, int] = DEFAULT_POOLS,
        *,
        speculative: Collection[str] | None = None,
        stale_after_s: float = 1.0,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        seed: Seed | None = None,
        costmodel_half_life_s: float = COST_HALF_LIFE_S,
        costmodel_lull_s: float | None = None,
        workload_keys: int = WORKLOAD_KEYS,
        prefix_block_tokens: int = BLOCK_TOKENS,
        prefix_max_blocks: int = DEFAULT_MAX_BLOCKS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        slo_ttft_s: float = 0.0,
        slo_tpot_s: float = 0.0,
        prior_alpha: float | None = None,
        load_held: bool = False,
    ):
        self.stale_after_s = stale_after_s
        self.load_held = load_held
        """Flow control holds what would push a pool past its targets (`PoolState.load_held`)."""
        self.prior_alpha = prior_alpha
        """Where a speculative pool's acceptance estimate starts (a measured profile's), until
        its evidence speaks; None: unknown (the policy assumes its default)."""
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        """The SLO targets finished requests are counted against (`PoolSignals.attainment`; 0: none)."""
        self.workload_keys = workload_keys
        """Workload keys whose acceptance each speculative pool keeps (0: none, pool-wide only)."""
        self.half_life_s = half_life_s
        """The acceptance estimate's half-life."""
        self.pools: dict[str, PoolSignals] = {}
        self.instances: dict[str, InstanceSignals] = {}
        self.cost = StepCostModel(seed, pools=pools, half_life_s=costmodel_half_life_s, lull_s=costmodel_lull_s)
        self.mean_output_tokens: float | None = None
        self.output_samples = 0
        """Running mean of finished requests' output tokens (the traffic's typical length)."""
        self.prefix = PrefixIndex(block_tokens=prefix_block_tokens, max_blocks=prefix_max_blocks)
        self.sessions = SessionTable(max_sessions, session_ttl_s)
        for name, num_draft_tokens in pools.items():
            self.add_pool(name, num_draft_tokens, None if speculative is None else name in speculative)

    def add_pool(self, name: str, num_draft_tokens: int = 0, speculative: bool | None = None) -> PoolSignals:
        """A pool drafting `num_draft_tokens` per verify step; `speculative`: its role (default:
        it drafts), which a server's description may fill in with its own draft width."""
        role = num_draft_tokens > 0 if speculative is None else speculative
        estimator = self._acceptance(num_draft_tokens) if role else None
        workloads = self._workloads(num_draft_tokens) if role else None
        attainment = SloAttainment(self.slo_ttft_s, self.slo_tpot_s)
        pool = self.pools[name] = PoolSignals(name, num_draft_tokens, role, estimator, workloads, attainment=attainment)
        self.cost.set_draft_tokens(name, num_draft_tokens)
        return pool

    def _acceptance(self, num_draft_tokens: int) -> AcceptanceEstimator:
        prior = self.prior_alpha
        start = accept_length(prior, num_draft_tokens) if prior is not None and num_draft_tokens > 0 else None
        return AcceptanceEstimator(num_draft_tokens, self.half_life_s, prior_accept_length=start)

    def _workloads(self, num_draft_tokens: int) -> WorkloadAcceptance:
        return WorkloadAcceptance(num_draft_tokens, self.half_life_s, max_keys=self.workload_keys)

    def add_instance(self, url: str, pool: str, max_running: int) -> InstanceSignals:
        if pool not in self.pools:
            self.add_pool(pool)
        signals = InstanceSignals(url=url, pool=pool, max_running=max_running)
        self.instances[url] = signals
        return signals

    def acceptance(self, pool: str = "spec") -> AcceptanceEstimator | None:
        known = self.pools.get(pool)
        return known.acceptance if known is not None else None

    # -- what servers say -----------------------------------------------------------------------

    def on_server(self, url: str, description: ServerDescription) -> bool:
        """A server's description; False when it contradicts its pool's role (a speculative
        server in a plain pool, or the reverse): it is then taken as configured."""
        signals = self.instances[url]
        if description.max_running:
            signals.max_running, signals.cap_reported = description.max_running, True
        signals.separate_ranks = description.replicas > 1 or description.ranks_separate
        self.set_replicas(signals, description.replicas)
        signals.time_scale = description.time_scale
        pool = self.pools[signals.pool]
        if description.speculative and pool.role and description.num_draft_tokens:
            self.set_draft_tokens(pool.name, description.num_draft_tokens)
        return description.speculative == pool.role

    def set_draft_tokens(self, pool: str, num_draft_tokens: int) -> None:
        """A speculative pool's k (from /server_info); a change restarts its acceptance estimate
        and the cost model's verify width."""
        known = self.pools[pool]
        if num_draft_tokens != known.num_draft_tokens:
            known.num_draft_tokens = num_draft_tokens
            known.acceptance = self._acceptance(num_draft_tokens)
            known.workloads = self._workloads(num_draft_tokens)
            known.spread = RequestSpread()
        self.cost.set_draft_tokens(pool, num_draft_tokens)

    def on_reading(self, url: str, reading: Reading) -> None:
        signals = self.instances[url]
        if signals.reading is not None and reading.at < signals.reading.at:
            return  # an answer overtaken by a newer one
        queued = signals.reading is not None and signals.reading.waiting > 0
        signals.reading = reading
        signals.polled = True
        signals.unresponsive = False
        signals.on_engine_mark(reading.engine_mark, reading.at)
        signals.on_ranks(reading)
        if reading.max_running:
            signals.max_running, signals.cap_reported = reading.max_running, True
        if signals.separate_ranks and reading.ranks:
            self.set_replicas(signals, reading.ranks)  # its ranks as it lists them now (a restart may change them)
        if signals.outage_mark is not None and (
            reading.prefill_tokens_total is None or reading.prefill_busy_us_total is None
        ):
            self._forget_cache(url, signals.outage_mark)  # back without its counters: nothing tells
            signals.outage_mark = None
        if reading.prefill_tokens_total is not None and reading.prefill_busy_us_total is not None:
            busy_us_total = reading.prefill_busy_us_total / signals.time_scale
            if signals.prefill_counters.goes_back(reading.prefill_tokens_total, busy_us_total):
                # Counters started again: the server restarted (between two polls, or during an
                # outage `set_health` was told of), and its prefix cache is empty; what was sent
                # there since it was back from an outage is held.
                self._forget_cache(url, signals.outage_mark)
            signals.outage_mark = None
            work = signals.on_prefill_counters(reading.prefill_tokens_total, busy_us_total)
            if work is not None:
                signals.prefilled.add(reading.at, work[0])
                self._on_prefill_work(signals, reading.at, *work, queued=queued)
        if reading.cache_tokens and reading.cache_tokens != signals.cache_tokens:
            signals.cache_tokens = reading.cache_tokens
            self.prefix.set_capacity(url, reading.cache_tokens)
        while signals.events and signals.events[0][0] < reading.at:
            signals.events.popleft()
        pool = self.pools[signals.pool]
        if pool.acceptance is None:
            return
        if reading.tokens_total is not None and reading.verify_total is not None:
            signals.counters_at = reading.at
            delta = signals.counters.add(reading.tokens_total, reading.verify_total)
            if delta is not None:
                pool.acceptance.observe_counters(reading.at, *delta, age_s=pool.decode_s / 2)
        # The gauge is refreshed once per decode-log interval: a value seen before adds nothing,
        # and an idle server's gauge still holds an old interval's value (SGLang keeps it).
        if reading.accept_length is not None and reading.accept_length != signals.last_gauge:
            signals.last_gauge = reading.accept_length
            if reading.running > 0:
                pool.acceptance.observe_gauge(reading.at, reading.accept_length, reading.accept_steps)

    def on_unpolled(self, url: str) -> None:
        """The server has no load endpoint: fall back to our own in-flight count for it."""
        self.instances[url].polled = False

    def set_health(self, url: str, healthy: bool) -> None:
        """Reachable or not. An instance turning unreachable may be restarting, which empties its
        prefix cache. With its prefill counters read, and past RESTART_EVIDENCE_TOKENS (a restart
        cannot climb back past them before its next reading), that reading tells (they start
        again after a restart: `on_reading`), so a failed connection or a few lost polls of a busy
        server keep what its cache holds; else the index and the sessions forget it."""
        signals = self.instances[url]
        if signals.healthy and not healthy:
            counted = signals.prefill_counters.first_total()
            if counted is not None and counted >= RESTART_EVIDENCE_TOKENS:
                if signals.outage_mark is None:
                    signals.outage_mark = self.prefix.seq
            else:
                self._forget_cache(url)
        signals.healthy = healthy

    def _forget_cache(self, url: str, through: int | None = None) -> None:
        """The instance's prefix cache is gone (it restarted, or may be restarting): the index
        forgets its blocks (those put there by inserts up to `through` only, when given: the
        server was back since) and its trust, and no session credits it or returns there."""
        self.prefix.forget(url, through)
        self.sessions.forget_instance(url)
        # Its counters start again too: a reading after it is back is not compared with one
        # from before, which would read as a second restart and forget what it cached since.
        self.instances[url].prefill_counters = CounterDelta()

    def unresponsive(self, url: str, now: float, after_s: float) -> bool:
        """The instance is reachable and polled, its load reading is older than `after_s`, and
        another instance's is fresh (so the silence is the server's, not this process's nor the
        network's): it accepts connections but has stopped answering (a stopped process or
        host)."""
        signals = self.instances[url]
        if not (signals.healthy and signals.polled) or signals.age(now) <= after_s:
            return False
        bound = self.stale_after_s
        return any(
            other.healthy and other.polled and other.age(now) <= bound
            for key, other in self.instances.items()
            if key != url
        )

    def set_unresponsive(self, url: str, unresponsive: bool) -> None:
        """Its polls go unanswered while another's are (`unresponsive`), or it answers again."""
        self.instances[url].unresponsive = unresponsive

    @staticmethod
    def set_replicas(signals: InstanceSignals, replicas: int) -> None:
        """Its engines; without a cap said by the server, each has the configured one."""
        if replicas != signals.replicas and not signals.cap_reported:
            signals.max_running = signals.max_running // max(signals.replicas, 1) * replicas
        signals.replicas = replicas

    def set_out_ranks(self, url: str, ranks: tuple[int, ...]) -> None:
        """Its data-parallel ranks judged hung (none: every rank serves)."""
        self.instances[url].out_ranks = ranks

    def set_ejected(self, url: str, ejected: bool) -> None:
        self.instances[url].ejected = ejected

    # -- our own traffic ------------------------------------------------------------------------

    def cached(
        self,
        blocks: Sequence[int],
        prompt_tokens: int,
        now: float,
        session: str | None = None,
        *,
        stream_tokens: int | None = None,
    ) -> PrefixMatch:
        """Per healthy instance, the prompt tokens of a request (its chained block hashes,
        fleet/blocks.py) it likely holds in its prefix cache: the index's match, scaled by the
        instance's trust; and for a named `session`, at least its last prompt on the instance
        that served it, when the index does not contradict that the prompt extends it
        (`_extends`). Below `prompt_tokens`: a server prefills at least the last token.
        Instances holding nothing are left out. `stream_tokens`: the prompt's length in the
        blocks' unit (`Features.stream_tokens`; by default the blocks', when they are
        `PromptBlocks`), which puts the matched blocks in `prompt_tokens`' unit
        (`credit_scale`)."""
        if prompt_tokens <= 1:
            return NO_MATCH
        top = prompt_tokens - 1
        credit: dict[str, int] = {}
        matched: dict[str, int] = {}
        if blocks:
            prefix = self.prefix
            healthy = [url for url, s in self.instances.items() if s.healthy and not s.ejected]
            size = prefix.block_tokens * credit_scale(blocks, prompt_tokens, stream_tokens)
            for url, depth in prefix.match(blocks, now, raw=True, instances=healthy).items():
                if depth:
                    tokens = int(depth * size)
                    matched[url] = top if top < tokens else tokens  # min(tokens, top)
                    trusted = int(tokens * prefix.trust(url, now))
                    credit[url] = top if top < trusted else trusted
        if session is not None:
            entry = self.sessions.get(session, now)
            signals = self.instances.get(entry.instance) if entry is not None else None
            if (
                entry is not None
                and signals is not None
                and signals.healthy
                and not signals.ejected
                and self._extends(entry.prompt_tokens, blocks, matched.get(entry.instance, 0), top)
            ):
                held = min(entry.prompt_tokens, top)
                if held > matched.get(entry.instance, 0):
                    matched[entry.instance] = held
                    credit[entry.instance] = max(
                        credit.get(entry.instance, 0), int(held * self.prefix.trust(entry.instance, now))
                    )
        for tokens in credit.values():
            if tokens <= 0:
                credit = {url: tokens for url, tokens in credit.items() if tokens > 0}
                break
        return PrefixMatch(credit, matched) if credit or matched else NO_MATCH

    def _extends(self, last_prompt_tokens: int, blocks: Sequence[int], indexed_tokens: int, top: int) -> bool:
        """Whether a session's new prompt may extend its last one, as far as the index can tell:
        when the prompt has blocks, the index must hold on the session's instance all the last
        prompt's whole blocks (a name such as `user` may cover several conversations, and a
        different one shares no more than its system prompt). The index cannot tell for a last
        prompt shorter than a block, nor for a prompt it has no blocks of (a shorter prompt may
        still be the last one's prefix: a regenerated or edited turn), so such a credit stays
        under a block, and the trust learned from its report moves in proportion to it
        (`PrefixIndex.observe_hit`)."""
        size = self.prefix.block_tokens
        if not blocks or last_prompt_tokens < size:
            return True
        return indexed_tokens >= min((last_prompt_tokens // size) * size, top)

    def on_dispatch(
        self,
        url: str,
        now: float,
        prompt_tokens: int = 0,
        *,
        blocks: Sequence[int] = (),
        match: PrefixMatch = NO_MATCH,
        session: str | None = None,
        predicted_tpot_s: float = 0.0,
    ) -> Dispatch:
        """A request sent to `url`; the returned record, handed back with its response's
        evidence, lets its time to first token teach the prefill cost and its TPOT the pool's
        bias (against `predicted_tpot_s`, what the policy predicted there; 0: nothing).
        `blocks`: its prompt's block hashes, now the instance's most recent in the index;
        `match`: its credit (`cached`); `session`: the session it named. Its load counts its
        uncached tokens."""
        signals = self.instances[url]
        cached = match.credit.get(url, 0)
        uncached = max(prompt_tokens - cached, 0)
        running, waiting, waiting_tokens = signals.load_state()
        ahead = waiting_tokens if waiting > 0 else 0.0
        inserted = self.prefix.insert(url, blocks, now) if blocks else (0, ())
        if session is not None:
            self.sessions.put(session, url, prompt_tokens, now)
        sent = Dispatch(
            url,
            now,
            prompt_tokens,
            ahead,
            running,
            running + waiting + 1 <= signals.max_running,
            cached_tokens=cached,
            matched_tokens=match.matched.get(url, 0),
            predicted_tpot_s=predicted_tpot_s,
            inserted=inserted,
            session=session,
        )
        signals.recent_dispatches.append(now)
        signals.local_in_flight += 1
        signals.prompt_tokens_sent.add(now, uncached)
        signals.uncached_sent.add(now, uncached)
        signals.sent.add(now)
        if signals.polled:
            signals.events.append((now, +1, uncached))
        return sent

    def on_answered(self, sent: Dispatch) -> None:
        """The server took the request `sent` (its response began): the prefix blocks and the
        session move it claimed stand, whatever becomes of other unanswered requests that
        claimed them too."""
        seq, claimed = sent.inserted
        if claimed:
            self.prefix.settle(sent.url, seq, claimed)
        if sent.session is not None:
            self.sessions.settle(sent.session, sent.url, sent.at)

    def on_complete(self, url: str, now: float, sent: Dispatch | None = None) -> None:
        """A request sent to `url` is over (answered, failed or left). `sent`, its dispatch
        record: what it claimed stands (`on_answered`). A request that ended before any byte of
        its response is `on_unanswered` instead."""
        if sent is not None:
            self.on_answered(sent)
        signals = self.instances[url]
        signals.local_in_flight = max(signals.local_in_flight - 1, 0)
        if signals.polled:
            signals.events.append((now, -1, 0))
        self.pools[signals.pool].attainment.left(now)

    def on_unanswered(self, sent: Dispatch, now: float, streamed: bool = True) -> None:
        """The request `sent` ended before the first byte of its response (its client left, or
        it failed, before its first token): it is over, as `on_complete` counts it (it may have
        loaded the server), but its claims on the server's cache are withdrawn, and its session
        restored, as a refused one's are (`on_refused`). Nothing shows the server prefilled it
        (a server drops a request whose client left, often before its prefill), and claims kept
        unverified would let a client plant credit without loading any server. A request not
        `streamed` shows nothing before its whole answer: its claims stand once it was out long
        enough to have been prefilled (`_prefilled_by`), as a stream's would at its first token."""
        if not streamed and self._prefilled_by(sent, now):
            self.on_answered(sent)
            self.on_complete(sent.url, now)
            return
        seq, claimed = sent.inserted
        if claimed:
            self.prefix.withdraw(sent.url, seq, claimed)
        if sent.session is not None:
            self.sessions.restore(sent.session, sent.url, sent.at)
        self.on_complete(sent.url, now)

    def _prefilled_by(self, sent: Dispatch, now: float) -> bool:
        """Whether the request `sent` was out long enough for its server to prefill it: the
        prompt tokens queued ahead of it and its own uncached ones at the cost model's prefill
        speed (the queue taken as none when the server does not report it)."""
        signals = self.instances.get(sent.url)
        if signals is None:
            return False
        tokens = (sent.ahead_tokens or 0.0) + max(sent.prompt_tokens - sent.cached_tokens, 0)
        return (now - sent.at) * 1000 >= self.cost.at(now).prefill_ms(signals.pool, int(tokens))

    def on_refused(self, sent: Dispatch, now: float) -> None:
        """The server refused the request `sent` (a 4xx): it never ran, so its dispatch is undone
        rather than completed. Its prompt tokens would otherwise count as prefill work sent there
        (five refused 1 MB prompts moved the next requests to base), and its memory of caches is
        taken back too: the server holds none of its prompt (after a refused turn, its whole
        prompt was credited there) and its session points where it did before (it had moved to
        the server that refused it)."""
        url, dispatched_at = sent.url, sent.at
        prompt_tokens = max(sent.prompt_tokens - sent.cached_tokens, 0)  # as its dispatch counted them
        seq, claimed = sent.inserted
        if claimed:
            self.prefix.withdraw(url, seq, claimed)
        if sent.session is not None:
            self.sessions.restore(sent.session, url, dispatched_at)
        signals = self.instances[url]
        signals.local_in_flight = max(signals.local_in_flight - 1, 0)
        signals.prompt_tokens_sent.remove(dispatched_at, now, prompt_tokens)
        signals.uncached_sent.remove(dispatched_at, now, prompt_tokens)
        signals.sent.remove(dispatched_at, now)
        if signals.polled:
            try:
                signals.events.remove((dispatched_at, +1, prompt_tokens))
            except ValueError:
                signals.events.append((now, -1, 0))  # aged out of the window: count it as done

    # -- evidence -------------------------------------------------------------------------------

    def on_response(self, url: str, now: float, evidence: ResponseEvidence) -> None:
        """What one finished response teaches: its step gap corrects the cost model at about the
        instance's present batch, its tokens per verify step (a speculative pool's) are
        acceptance evidence as old as half its decode time: for its workload, and for the pool
        unless the instance's counters are read (`_counts_acceptance`). Call it before the completion is
        counted (on_complete): the batch includes the request."""
        signals = self.instances[url]
        if evidence.tokens:
            self._on_output(evidence.tokens)
        if evidence.step_ms is not None and evidence.step_ms > 0:
            self.on_step(url, now, evidence.step_ms)
        if evidence.dispatch is not None:
            self._on_cache_report(url, now, evidence, evidence.dispatch)
        if evidence.ttft_s is not None and evidence.dispatch is not None:
            self._on_first_token(signals, now, evidence.ttft_s, evidence.dispatch, evidence)
        pool = self.pools[signals.pool]
        tpot_s = (
            evidence.decode_s / (evidence.tokens - 1) if evidence.tokens is not None and evidence.tokens > 1 else None
        )
        if evidence.dispatch is not None and tpot_s is not None:
            pool.outcomes.observe(now, tpot_s, evidence.dispatch.predicted_tpot_s)
        if evidence.ttft_s is not None:
            pool.attainment.observe(now, evidence.ttft_s, tpot_s)
        if pool.acceptance is None:
            return
        if evidence.tokens and evidence.verify_steps:
            age_s = evidence.decode_s / 2
            pool.spread.observe(evidence.tokens, evidence.verify_steps)
            if not self._counts_acceptance(signals, now):
                pool.acceptance.observe_request(now, evidence.tokens, evidence.verify_steps, age_s)
            if evidence.workload is not None and pool.workloads is not None:
                pool.workloads.observe_request(evidence.workload, now, evidence.tokens, evidence.verify_steps, age_s)
            # A running mean of the pool's decode time: how far the counters lag.
            pool.decode_s += 0.1 * (2 * age_s - pool.decode_s)

    def _counts_acceptance(self, signals: InstanceSignals, now: float) -> bool:
        """Whether the instance's own acceptance counters are being read: they count every request
        it finishes, ours among them, so a response of ours adds nothing the pool's estimate will
        not get from the counters' next delta. Taken again as well, our requests' evidence (as old
        as the counters') would weigh twice against the fresh gauge, and the estimate would rest
        on how many requests we happen to send there. Counters silent for longer than
        COUNTERS_SILENT_HALF_LIVES half-lives (their last delta has all but faded from the
        estimate) no longer speak for the instance: our responses are taken again."""
        at = signals.counters_at
        return at is not None and now - at <= COUNTERS_SILENT_HALF_LIVES * self.half_life_s

    def on_step(self, url: str, now: float, step_ms: float) -> None:
        """One decode step of the instance seen to take `step_ms`, at the batch the model holds."""
        signals = self.instances[url]
        # One engine's batch: a server of several data-parallel ranks steps each on its own.
        running, waiting, _, _, cap = signals.engine_load()
        batch = min(max(running + waiting, 1.0), float(cap))
        self.cost.observe(signals.pool, batch, step_ms, now=now)

    def _on_cache_report(self, url: str, now: float, evidence: ResponseEvidence, sent: Dispatch) -> None:
        """A server's report of the request's cached tokens: the instance's hit statistics, and
        the index's trust in it when the index had claimed a prefix there."""
        stats = self.instances[url].cache
        cached = reported_cached(evidence, stats)
        if cached is None:
            return
        stats.responses += 1
        stats.prompt_tokens += evidence.prompt_tokens or sent.prompt_tokens
        stats.cached_tokens += cached
        stats.credited_tokens += sent.cached_tokens
        if sent.matched_tokens > 0:
            self.prefix.observe_hit(
                url,
                sent.matched_tokens,
                cached,
                now,
                estimated_prompt_tokens=sent.prompt_tokens,
                reported_prompt_tokens=evidence.prompt_tokens,
            )

    def _on_first_token(
        self, signals: InstanceSignals, now: float, ttft_s: float, sent: Dispatch, evidence: ResponseEvidence
    ) -> None:
        """A stream's time to first token as prefill evidence, when it is the prefill alone: the
        request found the instance idle (nothing running, nothing queued) and no request of ours
        followed it there before its first token (one that may have joined its prefill batch).

        A busy server's first token also waits for the step in flight, whose length a reading
        cannot tell (a decode step, or the prefill of a request the last reading already counted
        as running): taking those samples with half a decode step for the wait taught prefills
        1.2-2x too slow with the right profile (kimi-moe at 110 % lost 10 % of its SLO goodput);
        any sample with a request of ours following taught 9 missed targets against 3. An idle
        instance is common enough: at low load, in lulls, and in every run's first seconds.

        Only the prompt's uncached tokens were prefilled: what the server reported cached, else
        what the router credited (in the estimate's units)."""
        cached = float(sent.cached_tokens)
        reported = reported_cached(evidence, signals.cache)
        if reported is not None:
            cached = float(reported)
            if evidence.prompt_tokens:
                cached *= sent.prompt_tokens / evidence.prompt_tokens
        prompt = int(round(sent.prompt_tokens - cached))
        if not sent.free_slot or sent.running >= 1 or sent.ahead_tokens != 0 or prompt < 1:
            return
        first_token_at = sent.at + ttft_s
        # Ours is one of those sent from its dispatch on; another (even one sent the same instant
        # after it: a closed loop's clients all start at once) may have joined its prefill.
        if sum(1 for at in signals.recent_dispatches if sent.at <= at <= first_token_at) > 1:
            return
        chunks = math.ceil(prompt / PREFILL_CHUNK_TOKENS)
        self.cost.observe_prefill(signals.pool, prompt / chunks, 1000 * ttft_s / chunks, now)

    def _prompts_per_iteration(self, signals: InstanceSignals, now: float, prompts: float) -> float:
        """How many of ours shared each prefill iteration among the last `prompts` sent to the
        instance by `now` (those its counters just prefilled, some sent before its previous
        reading). SGLang prefills together what waits when an iteration starts; iterations come
        a decode step apart (at one engine's batch), at a phase we do not see, so two prompts
        sent `gap` apart shared one with probability 1 - gap / step: the iterations expected
        are 1 + the sum of min(gap / step, 1). Several data-parallel engines each prefill their
        share. At least 1."""
        count = min(math.ceil(prompts), len(signals.recent_dispatches))
        if count < 2:
            return 1.0
        running, _, _, engines, _ = signals.engine_load()
        step_ms = self.cost.decode_step_ms(signals.pool, max(int(running), 1), self.cost.tokens_per_seq(signals.pool))
        times = [at for at in signals.recent_dispatches if at <= now][-count:]
        step_s = step_ms / 1000
        groups = 1.0 + sum(min((later - earlier) / step_s, 1.0) for earlier, later in zip(times, times[1:]))
        return max(len(times) / groups / engines, 1.0)

    def _on_prefill_work(
        self, signals: InstanceSignals, now: float, tokens: float, busy_us: float, *, queued: bool
    ) -> None:
        """A server's prefill work since its previous reading (its counters' delta) as prefill
        evidence, whatever its load. The counters give tokens and busy time, not how many
        iterations shared them, so the iterations are inferred from the queue: a server that
        had prompts waiting at the previous reading (`queued`) packs each prefill iteration to its
        chunk budget (SGLang's chunked_prefill_size), so the tokens are taken as full chunks;
        one with none prefills prompts as they come, so as iterations of the instance's recent
        mean uncached prompt per dispatch of ours (capped at a chunk). Each iteration gets the
        busy time's share and the delta weighs as that many iterations. No queue and nothing
        sent here lately, or more prompt tokens prefilled since the last reading than twice what
        we sent in the last seconds (another client's prompts, of a size we do not know: taken
        as ours, a profiler's 1,024-token prompts taught base's prefill at a third of its time):
        no step size to attribute, no evidence. Fewer prefilled over the last half-minute than
        we sent uncached (`prefilled_share`): the server had cached what the router did not
        credit (after a restart, or another replica's turns), and each prompt's prefill is that
        share of ours (taken as ours, a review saw spec's prefill learned 3-20x too slow).
        With no queue, prompts sent less than a decode step apart may have shared an iteration
        (`_prompts_per_iteration`): taken one iteration each, 18 prompts sent at once taught
        spec's prefill at a seventh of the twin's."""
        if busy_us <= 0:
            return
        if queued:
            step = min(tokens, PREFILL_CHUNK_TOKENS)
        else:
            per_s = signals.sent.per_s(now)
            if per_s <= 0:
                return
            ours = signals.prompt_tokens_sent.per_s(now)
            if tokens > 2 * ours * RATE_WINDOW_S:  # the rate's window holds what we sent lately
                return
            per_prompt = ours / per_s * signals.prefilled_share(now)
            if per_prompt <= 0:
                return
            together = self._prompts_per_iteration(signals, now, tokens / per_prompt)
            step = min(per_prompt * together, PREFILL_CHUNK_TOKENS)
        if step < 1:
            return
        steps = tokens / step
        self.cost.observe_prefill(signals.pool, step, busy_us / 1000 / steps, now, weight=steps)

    def _on_output(self, tokens: int) -> None:
        # The plain mean of the first OUTPUT_MEMORY responses, then a moving one over about as
        # many (output lengths are heavy-tailed: a few samples say little).
        self.output_samples = min(self.output_samples + 1, OUTPUT_MEMORY)
        mean = self.mean_output_tokens or 0.0
        self.mean_output_tokens = mean + (tokens - mean) / self.output_samples

    # -- the snapshot ---------------------------------------------------------------------------

    def snapshot(self, now: float, workload: str | None = None) -> Snapshot:
        """The fleet at `now`; the cost model as it predicts then (its corrections' trust aged).
        `workload`: the key of the request it is taken for; each speculative pool's alpha is
        then that workload's estimate (the pool's own while the key is unknown)."""
        states: dict[str, list[InstanceState]] = {}
        for signals in self.instances.values():
            members = states.get(signals.pool)
            if members is None:
                members = states[signals.pool] = []
            members.append(signals.state(now))
        pools: dict[str, PoolState] = {}
        bound = self.stale_after_s
        for pool in self.pools.values():
            members = states.get(pool.name)
            if not members:
                continue
            healthy_ages = [st.age_s for st in members if st.healthy]
            if healthy_ages and min(healthy_ages) <= bound < max(healthy_ages):
                members = [
                    replace(st, healthy=False, lagging=True) if st.healthy and st.age_s > bound else st
                    for st in members
                ]
            pools[pool.name] = PoolState(
                name=pool.name,  # type: ignore[arg-type]
                instances=tuple(members),
                speculative=pool.speculative,
                num_draft_tokens=pool.num_draft_tokens,
                alpha=self._alpha(pool, now, workload),
                alpha_evidence=self._alpha_evidence(pool, now, workload),
                stale=bool(healthy_ages) and min(healthy_ages) > self.stale_after_s,
                tpot_cv=pool.spread.cv() if pool.speculative else 0.0,
                tpot_bias=pool.outcomes.bias(now),
                slo_share=pool.attainment.share(now),
                finished_per_s=pool.attainment.finished_rate(now),
                left_total=pool.attainment.left_total,
                load_held=self.load_held,
            )
        return Snapshot(
            pools=pools,
            cost=self.cost.at(now),
            mean_output_tokens=self.mean_output_tokens,
            output_samples=self.output_samples,
        )

    def _alpha(self, pool: PoolSignals, now: float, workload: str | None) -> float | None:
        if pool.acceptance is None:
            return None
        if workload is None or pool.workloads is None:
            return pool.acceptance.alpha()
        return pool.workloads.alpha(workload, now, pool.acceptance.accept_length())

    def _alpha_evidence(self, pool: PoolSignals, now: float, workload: str | None) -> float:
        if pool.acceptance is None:
            return 0.0
        own = pool.workloads.evidence(workload, now) if workload is not None and pool.workloads is not None else None
        return pool.acceptance.evidence(now) if own is None else own

    def workload_acceptance(self, pool: str = "spec") -> WorkloadAcceptance | None:
        known = self.pools.get(pool)
        return known.workloads if known is not None else None


def credit_scale(blocks: Sequence[int], prompt_tokens: int, stream_tokens: int | None) -> float:
    """Prompt tokens (the estimate's unit) per token of the blocks' unit, at most 1.

    The blocks count 4 bytes of a UTF-8 stream a token (fleet/blocks.py: closer to a real
    tokenizer for non-ASCII text, and what keeps block boundaries independent of the rest of
    the prompt), the estimate 4 characters (fleet/features.py); a credit is taken from the
    estimate (the prefill left, the load), so the matched blocks are put in its unit by the
    prompt's own ratio of the two: the same share of the prompt is credited. Left in the
    blocks' unit, a 3-byte-a-character prompt was credited whole when only its system prompt,
    a third of it, was held. For ASCII chat text the two are equal (ratio 1); framing the
    estimate leaves out (a message's other fields, image parts) only lowers the credit. Block
    ids given as such (the virtual clock's, `chain_ids`) are in the estimate's unit already."""
    if stream_tokens is None and isinstance(blocks, PromptBlocks):
        stream_tokens = blocks.stream_tokens
    if not stream_tokens or stream_tokens <= prompt_tokens:
        return 1.0
    return prompt_tokens / stream_tokens


def reported_cached(evidence: ResponseEvidence, stats: CacheStats) -> int | None:
    """The prompt tokens a server reported cached for a response, if it reported: a null count is
    a miss only from a server seen to report some (SGLang leaves out a zero, and a server without
    its cache report says null to everything)."""
    if evidence.cached_tokens is not None:
        return evidence.cached_tokens
    return 0 if evidence.cached_details_null and stats.cached_tokens > 0 else None
