"""One SGLang server's scheduler and GPU, as a model with no clock and no I/O.

A driver (the HTTP server in sim/server.py, or the virtual clock in sim/virtual.py) repeats:

    step = engine.begin_step(now)          # picks the batch, says how long the step takes
    ... time passes: step.duration_s ...
    done = engine.finish_step(step, now)   # commits the tokens the step produced

Scheduling follows SGLang with speculation's defaults (overlap and mixed-chunk off):
- a new prefill batch, when one can be formed, runs before the next decode step (prefill
  priority; decode stalls while it runs);
- a prefill batch admits waiting requests first come, first served, while running requests
  stay under `max_running_requests` and the batch stays within `chunked_prefill_size` prompt
  tokens; a prompt that does not fit is split: its first chunk fills the budget and the rest
  is prefilled in the following iterations (chunked prefill), one chunk per iteration;
- a prefill produces each finished prompt's first token; a decode step produces one token per
  sequence (base) or 1 + the accepted drafts (spec: k draft steps, then a verify step of k+1);
- a prefix cache (SGLang's RadixCache, sim/radix.py) holds the prompts of past and running
  requests that carry a cache key, within the KV pool (`max_total_num_tokens`): a new prompt's
  cached prefix is not prefilled again; unlocked pages are evicted least recently used first when
  the pool needs the room; requests without a key (the virtual clock fed token counts only) never
  touch it;
- KV memory does not limit admission: `token_usage` is reported, never enforced (docs/twin.md).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet.profile import Profile
from sim.lengths import OutputLengths, parse_output_lengths
from sim.radix import RadixCache, RadixNode
from sim.text import TextStream

Mode = Literal["spec", "base"]
SPEC_MAX_RUNNING_DEFAULT = 48  # SGLang forces this with EAGLE/EAGLE3 unless set
BASE_MAX_RUNNING_DEFAULT = 256  # SGLang derives it from the KV pool; a throughput-tuned server runs this many
# SGLang's eos token of Llama-3 chat models; `matched_stop` reports it when the drawn length ends a stream.
EOS_TOKEN_ID = 128009


@dataclass
class EngineConfig:
    mode: Mode
    profile: Profile
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    """SGLang's --max-queued-requests: a request arriving to a waiting queue this long is refused
    (a 503 abort; None: no limit, SGLang's default)."""
    num_steps: int = 3
    """k: draft tokens per verify step (speculative_num_steps, topk 1)."""
    mean_alpha: float = 0.64
    alpha_concentration: float = 20.0
    """Per-request alpha ~ Beta(mean*c, (1-mean)*c): larger c, less spread."""
    alpha_decay: float = 1.0
    """Per-position decay gamma: draft j is accepted with alpha*gamma^(j-1); 1 is i.i.d."""
    workload_alpha: Mapping[str, float] = field(default_factory=dict)
    """Mean acceptance per workload (a request's x-specroute-workload, an Arrival's `workload`):
    a request of a listed workload draws its alpha around that mean, any other around
    `mean_alpha` (code and structured output accept far more draft tokens than open chat)."""
    chunked_prefill_size: int = 8192
    context_length: int = 32768
    max_total_num_tokens: int = 1_000_000
    """KV pool size in tokens: bounds the prefix cache (with the running requests' contexts)."""
    page_size: int = 1
    """Tokens per prefix-cache page (SGLang's --page-size, default 1; only full pages are cached)."""
    enable_prefix_cache: bool = True
    """SGLang's radix cache is on unless --disable-radix-cache."""
    output_lengths: OutputLengths = field(default_factory=lambda: parse_output_lengths("azure-conv"))
    decode_log_interval: int = 40
    load_publish_interval: int = 15
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_running_requests is None:
            self.max_running_requests = SPEC_MAX_RUNNING_DEFAULT if self.mode == "spec" else BASE_MAX_RUNNING_DEFAULT
        if self.mode not in ("spec", "base"):
            raise ValueError(f"mode must be spec or base, not {self.mode!r}")
        if self.max_running_requests < 1 or self.num_steps < 1 or self.chunked_prefill_size < 1:
            raise ValueError("max_running_requests, num_steps and chunked_prefill_size must be >= 1")
        if self.page_size < 1 or self.max_total_num_tokens < 1:
            raise ValueError("page_size and max_total_num_tokens must be >= 1")
        check_alpha(self.mean_alpha)
        for alpha in self.workload_alpha.values():
            check_alpha(alpha)

    @property
    def speculative(self) -> bool:
        return self.mode == "spec"

    @property
    def max_running(self) -> int:
        """max_running_requests, the mode's default filled in (__post_init__ does it)."""
        assert self.max_running_requests is not None
        return self.max_running_requests


def check_alpha(alpha: float) -> None:
    if not (0.0 <= alpha < 1.0) or math.isnan(alpha):
        raise ValueError(f"alpha must be in [0, 1), got {alpha}")


class Request:
    """One generation request inside the engine."""

    __slots__ = (
        "rid",
        "prompt_tokens",
        "max_new_tokens",
        "target_len",
        "ends_by_length",
        "alpha",
        "workload",
        "arrival",
        "prefilled",
        "output_tokens",
        "verify_ct",
        "correct_drafts",
        "accept_hist",
        "first_token_time",
        "finish_time",
        "finish_reason",
        "matched_stop",
        "text",
        "last_emitted",
        "updated",
        "listener",
        "tag",
        "cache_key",
        "cached_tokens",
        "cache_node",
        "cache_locked",
        "abort_status",
        "abort_message",
    )

    def __init__(
        self,
        rid: str,
        prompt_tokens: int,
        target_len: int,
        ends_by_length: bool,
        max_new_tokens: int | None,
        arrival: float,
        text: TextStream | None,
    ):
        self.abort_status = 0
        """An abort's HTTP status (0: none, as `/abort_request`'s and a gone client's): SGLang
        answers an abort with one as an error."""
        self.abort_message = ""
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.target_len = target_len
        self.ends_by_length = ends_by_length
        self.alpha = 0.0
        self.workload: str | None = None
        """Its workload (EngineConfig.workload_alpha picks its mean acceptance), if it has one."""
        self.arrival = arrival
        self.prefilled = 0
        self.output_tokens = 0
        self.verify_ct = 0
        self.correct_drafts = 0
        self.accept_hist: list[int] = []
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        """None while running; then "stop", "length" or "abort" (OpenAI spelling)."""
        self.matched_stop: str | int | None = None
        self.text = text
        self.last_emitted = 0
        self.updated = arrival
        """Simulated time of the last step that touched this request."""
        self.listener: Callable[[Request], None] | None = None
        self.tag: object = None
        self.cache_key: tuple | None = None
        """Prefix-cache pages of the prompt (full pages only); None: the request is not cached."""
        self.cached_tokens = 0
        """Prompt tokens found in the prefix cache at admission (usage's cached_tokens)."""
        self.cache_node: RadixNode | None = None
        """The deepest cache node this request holds locked."""
        self.cache_locked = 0
        """Tokens of the prompt this request holds locked in the cache."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def spec_details(self, num_steps: int) -> dict:
        """SGLang's per-request spec fields (meta_info / sglext.spec_tokens_details)."""
        verify = self.verify_ct
        return {
            "spec_verify_ct": verify,
            "spec_accept_length": (self.output_tokens / verify) if verify else 0.0,
            "spec_accept_rate": (self.correct_drafts / (verify * num_steps)) if verify else 0.0,
            "spec_num_correct_drafts": self.correct_drafts,
            "spec_num_proposed_drafts": verify * num_steps,
            "spec_correct_drafts_histogram": list(self.accept_hist),
            # DSpark-only fields in SGLang: present, null for EAGLE.
            "spec_cap_length": None,
            "spec_block_accept_length": None,
            "spec_cap_lens_histogram": None,
        }


@dataclass
class Step:
    kind: Literal["prefill", "decode"]
    requests: list[Request]
    duration_s: float
    batch: int
    tokens_per_seq: int
    """Decode: 1 (base) or k+1 (spec verify); prefill: prompt tokens in the iteration."""
    start: float
    chunks: list[int] = field(default_factory=list)
    """Prefill only: prompt tokens of each request prefilled in this iteration."""


class Engine:
    def __init__(self, config: EngineConfig, name: str = "engine", dp_rank: int = 0):
        self.config = config
        self.name = name
        self.dp_rank = dp_rank
        """Its data-parallel rank in a server of several (SGLang --dp-size): its own draws."""
        self.rng = random.Random(config.seed if dp_rank == 0 else f"{config.seed}:{dp_rank}")
        self.mean_alpha = config.mean_alpha
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.prefilling: Request | None = None
        """A request whose prompt is being prefilled in chunks (holds a running slot)."""
        self.in_prefill: dict[str, Request] = {}
        """The requests of the prefill step in flight (they hold running slots)."""
        self._context_sum = 0  # sum of context tokens over `running`
        self.cache = RadixCache(config.page_size) if config.enable_prefix_cache else None
        self._running_locked = 0  # sum of cache_locked over `running` (their tokens the cache holds)
        self.cached_tokens_total = 0  # sglang:cached_tokens_total (finished requests)
        # /v1/loads' cumulative prefill counters (SGLang's scheduler step ledger): uncached prompt
        # tokens prefilled, and the microseconds its prefill steps took.
        self.total_prefill_uncached_tokens = 0
        self.total_prefill_busy_us = 0
        self.prefix_cache_queries = 0  # vllm:prefix_cache_queries (prompt tokens looked up at admission)
        self.prefix_cache_hits = 0  # vllm:prefix_cache_hits (of those, tokens found cached)
        self.cache_hit_rate = 0.0  # of the last prefill batch, as SGLang's prefill stats
        self._seq = 0
        # Server-side counters (SGLang scheduler + tokenizer manager)
        self.spec_num_accept_tokens = 0
        self.spec_num_forward_ct = 0
        self.spec_num_correct_drafts = 0
        self.decode_iterations = 0
        self.finished_requests = 0
        self.finished_prompt_tokens = 0
        self.finished_generation_tokens = 0  # sglang:generation_tokens_total (on finish)
        # vLLM's iteration counters (vllm:prompt_tokens, vllm:generation_tokens): a request's
        # prompt once its prefill ends, and every token as a step emits it.
        self.prefilled_prompt_tokens = 0
        self.emitted_tokens = 0
        self.finished_verify_ct = 0  # sglang:spec_verify_calls_total (on finish)
        self.aborted_requests = 0
        # Interval counters behind the gauges refreshed every decode_log_interval iterations
        self._interval_start = 0.0
        self._interval_tokens = 0
        self._interval_accept = 0
        self._interval_forward = 0
        self._interval_correct = 0
        self.gauges: dict[str, float] = {"gen_throughput": 0.0}
        if config.speculative:
            self.gauges.update(spec_accept_length=0.0, spec_accept_rate=0.0)
        self.load_snapshot: dict = {}
        self._publish(0.0, "idle")

    # ---- requests in and out -------------------------------------------------------------

    def new_request(
        self,
        prompt_tokens: int,
        *,
        now: float,
        max_new_tokens: int | None = None,
        ignore_eos: bool = False,
        output_len: int | None = None,
        rid: str | None = None,
        stop: tuple[str, ...] | None = None,
        text_seed: int | None = None,
        cache_key: tuple | None = None,
        workload: str | None = None,
    ) -> Request:
        """A request as the server would create it; `output_len` overrides the drawn length.

        `stop` None means no text is generated (the virtual clock counts tokens only).
        `cache_key` (pages, see `page_key`/`block_key`) lets the prefix cache serve and keep the
        prompt; None leaves the cache out of it. `workload` picks its mean acceptance
        (EngineConfig.workload_alpha).
        """
        self._seq += 1
        room = max(self.config.context_length - prompt_tokens, 0)
        cap = room if max_new_tokens is None else min(max_new_tokens, room)
        if output_len is not None:
            natural = output_len
        elif text_seed is not None:
            # A request with a seed gets the same answer every time: where it stops too, not
            # only its text (drawn from the shared state, the same request stopped at 12
            # tokens once and 20 the next).
            natural = self.config.output_lengths.draw(random.Random(text_seed))
        else:
            natural = self.config.output_lengths.draw(self.rng)
        if ignore_eos or natural >= cap:
            target, by_length = cap, True
        else:
            target, by_length = natural, False
        text = None
        if stop is not None:
            seed = text_seed if text_seed is not None else self.config.seed * 1_000_003 + self._seq
            text = TextStream(seed, stop)
        own = f"{self.name}-{self._seq}" if self.dp_rank == 0 else f"{self.name}-r{self.dp_rank}-{self._seq}"
        req = Request(rid or own, prompt_tokens, target, by_length, max_new_tokens, now, text)
        if cache_key is not None and self.cache is not None:
            req.cache_key = tuple(cache_key)
        req.workload = workload
        return req

    def page_key(self, token_ids: list[int], namespace: str | None = None) -> tuple:
        """Token ids as the cache's pages: the ids themselves with page size 1, else tuples of
        `page_size` ids (a partial last page is not cached). Under a `namespace` (a request's
        cache salt, `sim.protocol.cache_namespace`) each page is paired with it: no page matches
        another namespace's, or the shared cache's."""
        p = self.config.page_size
        pages: tuple = (
            tuple(token_ids)
            if p == 1
            else tuple(tuple(token_ids[i : i + p]) for i in range(0, len(token_ids) - p + 1, p))
        )
        return pages if namespace is None else tuple((namespace, page) for page in pages)

    def block_key(self, blocks: tuple, block_tokens: int) -> tuple:
        """Block ids of `block_tokens` tokens each (e.g. Mooncake's 512-token hash_ids) as pages:
        the ids themselves when a block is a page, else (block, i) for its i-th page."""
        p = self.config.page_size
        if block_tokens == p:
            return tuple(blocks)
        if block_tokens % p:
            raise ValueError(f"blocks of {block_tokens} tokens do not split into pages of {p}")
        per = block_tokens // p
        return tuple((b, i) for b in blocks for i in range(per))

    def add(self, req: Request) -> None:
        req.alpha = self._draw_alpha(req.workload) if self.config.speculative else 0.0
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) + 1 > limit:
            # SGLang's scheduler refuses the newcomer (Scheduler._abort_on_queued_limit).
            req.abort_status, req.abort_message = 503, "The request queue is full."
            self._finish(req, "abort", req.arrival)
            return
        self.waiting[req.rid] = req

    def abort(self, rid: str, now: float) -> bool:
        """Drop a request wherever it is (queued, in a prefill step, chunked, decoding); its slot
        is free for the next step, and a step in flight discards its tokens. False if unknown."""
        req = self.waiting.pop(rid, None) or self.in_prefill.pop(rid, None)
        if req is None:
            req = self.running.pop(rid, None)
            if req is not None:
                self._context_sum -= req.context
                self._running_locked -= req.cache_locked
        if self.prefilling is not None and self.prefilling.rid == rid:
            req, self.prefilling = self.prefilling, None
        if req is None or req.finished:
            return False
        self.aborted_requests += 1
        self._finish(req, "abort", now)
        return True

    def set_mean_alpha(self, alpha: float) -> None:
        """Change the server's mean acceptance; every request, running ones too, redraws its alpha
        (a drafter or domain shift hits all sequences at once). Requests of a workload with its
        own mean (EngineConfig.workload_alpha) redraw around that one."""
        check_alpha(alpha)
        self.mean_alpha = alpha
        for group in (self.running.values(), self.waiting.values(), self.in_prefill.values()):
            for req in group:
                req.alpha = self._draw_alpha(req.workload)
        if self.prefilling is not None and self.prefilling.rid not in self.in_prefill:
            self.prefilling.alpha = self._draw_alpha(self.prefilling.workload)

    def _draw_alpha(self, workload: str | None = None) -> float:
        mean = self.mean_alpha
        if workload is not None:
            mean = self.config.workload_alpha.get(workload, mean)
        c = self.config.alpha_concentration
        if mean <= 0.0:
            return 0.0
        return min(self.rng.betavariate(mean * c, (1.0 - mean) * c), 0.999)

    def abort_prefixed(self, rid: str, now: float) -> int:
        """SGLang's scheduler abort (`AbortReq`): every request whose rid begins with `rid`,
        wherever it is; how many were aborted."""
        named = [r for group in (self.waiting, self.in_prefill, self.running) for r in group if r.startswith(rid)]
        if self.prefilling is not None and self.prefilling.rid.startswith(rid):
            named.append(self.prefilling.rid)
        return sum(self.abort(r, now) for r in dict.fromkeys(named))

    def has_request(self, rid: str) -> bool:
        return (
            rid in self.waiting
            or rid in self.running
            or rid in self.in_prefill
            or (self.prefilling is not None and self.prefilling.rid == rid)
        )

    # ---- load --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        # A chunked prompt is part of the prefill step in flight, if there is one.
        return len(self.running) + (len(self.in_prefill) or (1 if self.prefilling is not None else 0))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.prefilling)

    @property
    def accept_length(self) -> float:
        """Cumulative tokens per request per verify step, bonus included (0 before any verify)."""
        return self.spec_num_accept_tokens / self.spec_num_forward_ct if self.spec_num_forward_ct else 0.0

    # ---- steps --------------------------------------------------------------------------

    def begin_step(self, now: float) -> Step | None:
        """Pick the next iteration's batch, or None when idle."""
        cfg = self.config
        if self.prefilling is not None or (self.waiting and self.num_running < cfg.max_running):
            return self._prefill_step(now)
        if not self.running:
            return None
        batch = len(self.running)
        context = self._context_sum / batch
        if cfg.speculative:
            ms = cfg.profile.spec_step_ms(batch, cfg.num_steps, context)
            tokens_per_seq = cfg.num_steps + 1
        else:
            ms = cfg.profile.base_step_ms(batch, context)
            tokens_per_seq = 1
        return Step("decode", list(self.running.values()), ms / 1000.0, batch, tokens_per_seq, now)

    def _prefill_step(self, now: float) -> Step:
        cfg = self.config
        budget = cfg.chunked_prefill_size
        reqs: list[Request] = []
        chunks: list[int] = []
        open_chunk = False  # a prompt is left unfinished: nothing else joins behind it
        if self.prefilling is not None:
            req = self.prefilling
            rest = req.prompt_tokens - req.prefilled
            take = min(rest, budget)
            reqs.append(req)
            chunks.append(take)
            budget -= take
            open_chunk = take < rest
        slots = cfg.max_running - len(self.running) - len(reqs)
        hit = 0
        while budget > 0 and slots > 0 and self.waiting and not open_chunk:
            req = self.waiting.pop(next(iter(self.waiting)))
            if req.cache_key is not None:
                self._match(req)
                hit += req.cached_tokens
            rest = req.prompt_tokens - req.prefilled
            take = min(rest, budget)
            reqs.append(req)
            chunks.append(take)
            budget -= take
            slots -= 1
            if take < rest:
                self.prefilling = req  # the rest follows in the next iterations
                open_chunk = True
        tokens = sum(chunks)
        if hit:
            self.cache_hit_rate = hit / (hit + tokens)
            self._fit_cache(tokens)
        elif self.cache is not None and self.cache.total_size:
            self.cache_hit_rate = 0.0
            self._fit_cache(tokens)
        ms = cfg.profile.prefill_ms(tokens, speculative=cfg.speculative)
        self.in_prefill = {req.rid: req for req in reqs}
        return Step("prefill", reqs, ms / 1000.0, len(reqs), tokens, now, chunks)

    def finish_step(self, step: Step, now: float) -> list[Request]:
        """Commit the step's results at time `now`; returns the requests that got tokens or
        finished (each with `last_emitted` set)."""
        if step.kind == "prefill":
            touched = self._finish_prefill(step, now)
        else:
            touched = self._finish_decode(step, now)
        for req in touched:
            if req.listener is not None:
                req.listener(req)
        return touched

    def _finish_prefill(self, step: Step, now: float) -> list[Request]:
        self.in_prefill = {}
        self.total_prefill_uncached_tokens += step.tokens_per_seq
        self.total_prefill_busy_us += round(step.duration_s * 1e6)
        touched = []
        for req, chunk in zip(step.requests, step.chunks):
            if req.finished:
                continue  # aborted while its prefill ran
            req.prefilled += chunk
            if req.cache_key is not None:
                self._cache_prefilled(req)
            if req.prefilled < req.prompt_tokens:
                continue
            if self.prefilling is req:
                self.prefilling = None
            self.prefilled_prompt_tokens += req.prompt_tokens
            # The prefill forward samples the first token.
            n = 1 if req.target_len > 0 else 0
            req.first_token_time = now
            self._emit(req, n, now)
            touched.append(req)
            if not req.finished:
                self.running[req.rid] = req
                self._context_sum += req.context
                self._running_locked += req.cache_locked
        self._publish(now, "prefill" if self.has_work else "idle")
        return touched

    def _finish_decode(self, step: Step, now: float) -> list[Request]:
        cfg = self.config
        rand = self.rng.random
        k = cfg.num_steps
        spec = cfg.speculative
        decay = cfg.alpha_decay
        touched = []
        step_tokens = 0
        for req in step.requests:
            if req.finished:
                continue  # aborted during the step
            if spec:
                accepted = 0
                a = req.alpha
                while accepted < k and rand() < a:
                    accepted += 1
                    if decay != 1.0:
                        a *= decay
                n = min(accepted + 1, req.target_len - req.output_tokens)
                hist = req.accept_hist
                if not hist:
                    hist.extend([0] * (k + 1))
                hist[n - 1] += 1
                req.verify_ct += 1
                req.correct_drafts += n - 1
                self.spec_num_accept_tokens += n
                self.spec_num_forward_ct += 1
                self.spec_num_correct_drafts += n - 1
                self._interval_accept += n
                self._interval_forward += 1
                self._interval_correct += n - 1
            else:
                n = 1
            self._context_sum += n
            step_tokens += n
            self._emit(req, n, now)
            touched.append(req)
            if req.finished:
                del self.running[req.rid]
                self._context_sum -= req.context
                self._running_locked -= req.cache_locked
        self._interval_tokens += step_tokens
        if self.cache is not None and self.cache.total_size:
            self._fit_cache(0)
        self.decode_iterations += 1
        it = self.decode_iterations
        if it % cfg.decode_log_interval == 0:
            self._publish(now, "decode")
        elif not self.has_work:
            self._publish(now, "idle")
        elif it % cfg.load_publish_interval == 0:
            self._publish(now, None)
        return touched

    def _emit(self, req: Request, n: int, now: float) -> None:
        if req.text is not None and n:
            n = req.text.extend(n)
        req.last_emitted = n
        req.updated = now
        req.output_tokens += n
        self.emitted_tokens += n
        if req.text is not None and req.text.stopped:
            req.matched_stop = req.text.matched_stop
            self._finish(req, "stop", now)
        elif req.output_tokens >= req.target_len:
            if req.ends_by_length:
                self._finish(req, "length", now)
            else:
                req.matched_stop = EOS_TOKEN_ID
                self._finish(req, "stop", now)

    def _finish(self, req: Request, reason: str, now: float) -> None:
        req.finish_reason = reason
        req.finish_time = now
        req.updated = now
        if req.cache_node is not None:
            self._release(req)
        if reason == "abort":
            if req.listener is not None:
                req.last_emitted = 0
                req.listener(req)
            return
        self.finished_requests += 1
        self.finished_prompt_tokens += req.prompt_tokens
        self.cached_tokens_total += req.cached_tokens
        self.finished_generation_tokens += req.output_tokens
        self.finished_verify_ct += req.verify_ct

    # ---- what the server publishes ---------------------------------------------------------

    def _publish(self, now: float, gauges: Literal["prefill", "decode", "idle"] | None) -> None:
        """Republish the /v1/loads snapshot and, when `gauges` says why, refresh the metric gauges
        as SGLang's prefill, decode-interval and idle reports do."""
        cfg = self.config
        if gauges is not None:
            self.gauges.update(
                num_running_reqs=self.num_running, num_queue_reqs=self.num_waiting, token_usage=self.token_usage
            )
        if gauges == "decode":
            span = now - self._interval_start
            self.gauges["gen_throughput"] = self._interval_tokens / span if span > 0 else 0.0
            if cfg.speculative and self._interval_forward:
                self.gauges["spec_accept_length"] = self._interval_accept / self._interval_forward
                self.gauges["spec_accept_rate"] = self._interval_correct / (self._interval_forward * cfg.num_steps)
            self._interval_start = now
            self._interval_tokens = self._interval_accept = self._interval_forward = self._interval_correct = 0
        elif gauges == "idle":
            self.gauges["gen_throughput"] = 0.0  # spec gauges keep their last value while idle
        used = self.num_used_tokens
        snapshot: dict[str, Any] = {
            "timestamp": now,
            "dp_rank": self.dp_rank,
            "num_running_reqs": self.num_running,
            "num_waiting_reqs": self.num_waiting,
            "num_waiting_uncached_tokens": self.waiting_uncached_tokens(),
            "num_used_tokens": used,
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "max_running_requests": cfg.max_running_requests,
            "token_usage": self.token_usage,
            "gen_throughput": self.gauges.get("gen_throughput", 0.0),
            "cache_hit_rate": round(self.cache_hit_rate, 4),
            "utilization": min(self.num_running / cfg.max_running, 1.0),
            "total_prefill_uncached_tokens": self.total_prefill_uncached_tokens,
            "total_prefill_busy_us": self.total_prefill_busy_us,
            "queues": {"waiting": self.num_waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
        }
        if cfg.speculative and self.spec_num_forward_ct:
            snapshot["speculative"] = {
                "accept_length": round(self.accept_length, 4),
                "accept_rate": round(self.gauges.get("spec_accept_rate", 0.0), 4),
            }
        self.load_snapshot = snapshot

    @property
    def num_used_tokens(self) -> int:
        """KV tokens in use: the running requests' contexts, their cached prefixes counted once
        (the cache's locked pages), as SGLang's max_total - (available + evictable)."""
        if self.cache is None:
            return self._context_sum
        return self._context_sum - self._running_locked + self.cache.protected_size

    @property
    def token_usage(self) -> float:
        return round(self.num_used_tokens / self.config.max_total_num_tokens, 4)

    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens of the waiting requests that the cache does not hold now."""
        total = 0
        cache, page = self.cache, self.config.page_size
        for r in self.waiting.values():
            total += r.prompt_tokens
            if r.cache_key is not None and cache is not None:
                total -= min(cache.peek(r.cache_key) * page, r.prompt_tokens - 1)
        return total

    # ---- the prefix cache --------------------------------------------------------------------

    def _match(self, req: Request) -> None:
        """Admission: lock the prompt's longest cached prefix; that much needs no prefill. At
        least the last prompt token is computed (its logits give the first output token)."""
        cache = self.cache
        assert cache is not None and req.cache_key is not None
        pages, node = cache.match_prefix(req.cache_key)
        page = self.config.page_size
        cached = min(pages * page, req.prompt_tokens - 1)
        usable = cached // page
        if usable < pages:  # keep only whole pages within the usable prefix
            pages, node = cache.match_prefix(req.cache_key[:usable])
        cached = pages * page
        cache.lock(node)
        req.cache_node = node
        req.cache_locked = cached
        req.cached_tokens = req.prefilled = cached
        self.prefix_cache_queries += req.prompt_tokens
        self.prefix_cache_hits += cached

    def _cache_prefilled(self, req: Request) -> None:
        """After a prefill chunk: the prompt's computed full pages go into the cache and the
        request holds them instead of its old prefix (SGLang's cache_unfinished_req)."""
        cache = self.cache
        assert cache is not None and req.cache_key is not None
        pages = min(req.prefilled // self.config.page_size, len(req.cache_key))
        if pages * self.config.page_size <= req.cache_locked:
            return
        _, node = cache.insert(req.cache_key[:pages])
        cache.lock(node)
        if req.cache_node is not None:
            cache.unlock(req.cache_node)
        req.cache_node = node
        req.cache_locked = pages * self.config.page_size

    def _release(self, req: Request) -> None:
        """A request ends: its prefix stays cached (refreshed), unlocked (cache_finished_req)."""
        cache = self.cache
        assert cache is not None and req.cache_node is not None and req.cache_key is not None
        cache.insert(req.cache_key[: req.cache_locked // self.config.page_size])
        cache.unlock(req.cache_node)
        req.cache_node = None

    def _fit_cache(self, incoming: int) -> None:
        """Evict unlocked pages, least recently used first, until the cache, the running
        requests' own tokens and `incoming` new ones fit in the KV pool."""
        cache = self.cache
        assert cache is not None
        over = cache.total_size + self._context_sum - self._running_locked + incoming
        over -= self.config.max_total_num_tokens
        if over > 0:
            cache.evict(over)
