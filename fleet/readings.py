"""What the router learns from its servers, in their words translated: a load reading, a
server's description, and a finished response's evidence. Backends (proxy/backends/) and the
virtual clock's router (bench/routing_sim.py) produce these; the fleet model (fleet/model.py)
takes them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


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
    cache_tokens: int | None = None
    """Its KV capacity in tokens (SGLang's max_total_num_tokens), which bounds its prefix cache."""
    prefill_tokens_total: float | None = None
    prefill_busy_us_total: float | None = None
    """Monotonic counters of the uncached prompt tokens it prefilled and the microseconds its
    prefill steps took (SGLang's /v1/loads total_prefill_uncached_tokens, total_prefill_busy_us),
    if it reports them: its prefill speed under any load."""
    engine_mark: float | None = None
    """A number its engine changes as it works, if it reports one: SGLang's /v1/loads snapshot
    time (published every few decode steps and after each prefill, by the scheduler alone), or
    the prompt and generation token counters and KV usage of vLLM's /metrics (its engine's
    iteration and scheduler stats). Unchanged long after a request reached the server, the
    engine is stuck."""
    ranks: int = 0
    """How many data-parallel ranks the answer listed (SGLang's /v1/loads entries, vLLM's
    `engine` label values; 0: not said)."""
    rank_marks: tuple[float, ...] = ()
    rank_running: tuple[float, ...] = ()
    rank_waiting: tuple[float, ...] = ()
    rank_waiting_tokens: tuple[float, ...] = ()
    """With several data-parallel ranks (SGLang --dp-size, vLLM --data-parallel-size), each rank's
    own mark (SGLang's snapshot time, a hash of vLLM's engine counters), running and waiting
    requests and queued prompt tokens (0 from vLLM, which does not say them), in rank order: a rank whose
    mark holds still while it shows work and another rank goes on is a scheduler hung among
    working ones (InstanceSignals.hung_ranks), and what it holds is no one's to serve. Empty for
    a server of one rank."""

    def check(self) -> Reading:
        """This reading, if every number in it is one a server can mean; else ValueError naming
        the field. A NaN, an infinity, a negative count or one past MAX_COUNT (a poll answer is
        the upstream's to write) would otherwise reach the policy's arithmetic: one such reading
        made every unpinned request a 500."""
        for name in _READING_NUMBERS:
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_COUNT):  # NaN fails every comparison
                raise ValueError(f"{name} is not a count: {value!r}")
        return self


MAX_COUNT = 1e15
"""The largest number a reading or description may hold: counters of microseconds or tokens
over years stay far below it, and floats hold every integer up to it exactly."""
_READING_NUMBERS = (
    "running",
    "waiting",
    "max_running",
    "waiting_tokens",
    "accept_length",
    "accept_steps",
    "tokens_total",
    "verify_total",
    "cache_tokens",
    "prefill_tokens_total",
    "prefill_busy_us_total",
    "engine_mark",
)


def count_or_none(value: object, limit: float = MAX_COUNT) -> int | None:
    """A count a server wrote (JSON or Prometheus), as an int: None for what is not one (a bool, a
    string, NaN, an infinity, a negative number or one past `limit`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value <= limit):
        return None
    return int(value)


@dataclass(frozen=True, slots=True)
class ServerDescription:
    """What a server says about itself (SGLang's /server_info; a vLLM server by its metrics)."""

    kind: str
    """The backend kind that recognised it: "sglang", "vllm", "openai"."""
    speculative: bool = False
    num_draft_tokens: int = 0
    """Tokens drafted per verify step (speculative_num_steps with a chain draft)."""
    max_running: int | None = None
    """Its running cap, when it says (SGLang's max_running_requests, times its replicas)."""
    replicas: int = 1
    """Engines behind its one front, each with its own batch, queue and an equal part of the cap
    (SGLang's data-parallel ranks without DP attention, dealt requests in turn)."""
    ranks_separate: bool = False
    """Whatever ranks its load answers list are such engines, however many (vLLM's: it says
    nothing of them but in its metrics' `engine` label)."""
    time_scale: float = 1.0
    """A twin's --time-scale (its /server_info says; no real server does): it runs its GPU's
    physics this many times faster than the GPU would and counts busy time in the GPU's units,
    this many times the wall clock's that the router predicts in."""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A request as it was sent: what the instance held then (the model's view), for reading
    its time to first token later (`FleetModel.on_dispatch` returns it)."""

    url: str
    at: float
    prompt_tokens: int
    ahead_tokens: float | None
    """Prompt tokens queued for prefill ahead of it (None: the server does not report them
    and requests were waiting, so the queue ahead is unknown)."""
    running: float
    """Requests decoding there (a prefill waits for the decode step in flight)."""
    free_slot: bool
    """It found a running slot free: its first token waited for prefill only, not for a slot."""
    cached_tokens: int = 0
    """Prompt tokens the router credited the instance with holding (`Features.cached`)."""
    matched_tokens: int = 0
    """The prefix index's raw claim for it (matched blocks x block tokens, before trust): what
    the server's report of cached tokens is checked against."""
    predicted_tpot_s: float = 0.0
    """The time per output token the policy predicted for it there (the mean; 0: none)."""
    inserted: tuple[int, tuple[int, ...]] = (0, ())
    """Its prefix-index insert there: the insert's number and the blocks whose presence rests
    on it until it is answered (confirmed when it completes, taken back if it is refused)."""
    session: str | None = None
    """The session key it named, which now points at the instance (until it is refused)."""


@dataclass(frozen=True, slots=True)
class ResponseEvidence:
    """What one finished response taught: its tokens, its verify steps on a spec server, its
    typical inter-chunk gap (one engine decode step) and how long it decoded."""

    tokens: int | None = None
    """Completion tokens (the usage's count, else the content events)."""
    verify_steps: int | None = None
    step_ms: float | None = None
    """Its median inter-chunk gap: one decode step at about the instance's present batch (SGLang
    and the twin send one chunk per step; the median leaves out gaps other prefills stretched)."""
    decode_s: float = 0.0
    """From its first content chunk to its last."""
    ttft_s: float | None = None
    """From dispatch to its first byte, for a stream."""
    dispatch: Dispatch | None = None
    """How it was sent (with ttft_s: prefill evidence)."""
    workload: str | None = None
    """The request's workload key (its acceptance is learned per key too), if it had one."""
    prompt_tokens: int | None = None
    """Prompt tokens as the server counted them (its usage), if it said."""
    cached_tokens: int | None = None
    """Of them, found in its prefix cache (usage.prompt_tokens_details.cached_tokens), if it
    reports them (SGLang --enable-cache-report, vLLM --enable-prompt-tokens-details)."""
    cached_details_null: bool = False
    """Its usage had prompt_tokens_details: null: SGLang's report of no token cached when it
    reports them (it leaves out a zero count), and its every answer when it does not."""

    @classmethod
    def from_stream(
        cls,
        events: int,
        gaps_s: list[float],
        completion_tokens: int | None = None,
        verify_steps: int | None = None,
        ttft_s: float | None = None,
        dispatch: Dispatch | None = None,
        workload: str | None = None,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        decode_s: float = 0.0,
        cached_details_null: bool = False,
    ) -> ResponseEvidence:
        """A relayed response: `events` content events, `gaps_s` the gaps between the reads that
        carried them, and what its usage tail said (tokens; verify steps with SGLang's spec
        details). Without verify steps a spec stream's events stand for them: one event per
        verify step, less the first token's (from prefill; `proxy.scan.content_events` counts
        no usage event). `decode_s`: from the first token's event to the last, measured by the
        caller: the gaps kept are capped, their sum would cut a long stream short."""
        if verify_steps is None and completion_tokens and events >= 2:
            verify_steps = events - 1
        return cls(
            tokens=completion_tokens,
            verify_steps=verify_steps,
            step_ms=1000 * statistics.median(gaps_s) if gaps_s else None,
            decode_s=decode_s,
            ttft_s=ttft_s,
            dispatch=dispatch,
            workload=workload,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            cached_details_null=cached_details_null,
        )
