"""`specroute profile`: measure live servers through their public API and write a step-time profile.

    specroute profile --url http://gpu-a:30001 --url http://gpu-b:30002 --out fleet.json

Each server (real SGLang or vLLM, or the twin) is measured through what any client sees: the
OpenAI endpoints, and SGLang's /server_info, /v1/loads and /metrics (vLLM's /metrics):

- idle first: a server with running or waiting requests is refused unless --force (the gaps
  would measure someone else's batch);
- prefill: the time to first token of single streamed requests of a few prompt lengths while
  the server is idle (random token ids, so no prefix cache helps), the fastest of a few at each
  length, fitted fixed + per token;
- decode: B concurrent `ignore_eos` streams with the same prompt length and max_tokens, for B up
  to the server's cap; one engine step sends one chunk per stream (a spec server's chunk carries
  1..k+1 tokens), so the gaps between chunks, taken while all B streams decode (after the last
  first token, up to the first stream's end), are the step time at batch B; their median is it;
- acceptance (a speculative server): the accept length from its counters
  (sglang:generation_tokens_total / sglang:spec_verify_calls_total), else the streams' spec
  details, else tokens per chunk.

The spec step is recorded whole (draft steps, verify and the engine's overheads together; a
client cannot split them). The profile gets the `affine` step kind when one line reproduces
every measured step within AFFINE_TOLERANCE, else a `table` (a CSV beside the JSON) at the
measured context; with it, a `measured` block says what was measured, where and when.
A twin says its --time-scale in /server_info: its times are scaled back to the twin's physics.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

import httpx

from fleet.acceptance import alpha_from_accept_length
from fleet.profile import Profile, load_profile
from proxy.backends import Backend, load_paths, recognise
from proxy.backends.base import RANK_HEADER
from proxy.backends.prometheus import parse_prometheus
from proxy.backends.sglang import server_info_facts
from proxy.backends.vllm import VLLM_DEFAULT_MAX_NUM_SEQS
from proxy.settings import SettingsError, server_url_problem

DEFAULT_BUDGET_S = 240.0
DEFAULT_CONTEXT = 1024
"""Context per sequence while decode steps are measured (the router's cost model reads a profile
at 1,024 tokens)."""
DEFAULT_PREFILL_LENGTHS = (256, 1024, 2048, 4096)
PREFILL_REPEATS = 5
"""Requests per prompt length; the fastest is kept: whatever else the client's or the server's CPU
does only delays a first token (the median of three read 40 % long on a busy 2-core machine)."""
WINDOW_STEPS = 32
"""Steps wanted while all B streams decode; max_tokens leaves LEAD_STEPS more for the start."""
LEAD_STEPS = 8
AFFINE_TOLERANCE = 0.025
"""The affine kind is written when it reproduces every measured step within 2.5 % (about the
measurements' own noise), else the measured table."""
IDLE_WAIT_S = 10.0
BATCHED_READS = 0.5
"""A batch whose median gap is under half its mean gap reached the client in bursts: the client
(or the server's CPU) could not keep up, so its times are not the engine's; it is left out."""
COUNTERS = frozenset({"sglang:generation_tokens_total", "sglang:spec_verify_calls_total"})
EXIT_BUSY = 3


class ProfileError(Exception):
    """The run cannot go on (a server unreachable, refusing, or busy)."""


class BusyError(ProfileError):
    pass


def public_url(url: str) -> str:
    """The URL without credentials (user:password@) or query, as the profile records it."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]  # as written: an IPv6 address keeps its brackets
    return urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))


def batch_sizes(cap: int) -> list[int]:
    """Powers of two below the cap, and the cap."""
    sizes = [1]
    while sizes[-1] * 2 < cap:
        sizes.append(sizes[-1] * 2)
    if cap > 1:
        sizes.append(cap)
    return sizes


REMEASURE_ABOVE = 0.03
"""A batch's step this far above the chord between its neighbours' is measured again."""


def above_the_line(batches: Sequence[BatchResult]) -> list[BatchResult]:
    """The batches (between two others) whose step is over REMEASURE_ABOVE above the straight
    line between their neighbours' steps. A step curve rises and bends upward, so a point above
    its neighbours' chord is a bump, which only interference makes; the ends have no chord."""
    found = []
    for left, batch, right in zip(batches, batches[1:], batches[2:]):
        share = (batch.batch - left.batch) / (right.batch - left.batch)
        chord = left.step_ms + share * (right.step_ms - left.step_ms)
        if batch.step_ms > (1 + REMEASURE_ABOVE) * chord:
            found.append(batch)
    return found


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(a, b) of y = a + b x, least squares on relative errors (weights 1/y^2); a, b >= 0."""
    if len(xs) == 1:
        return ys[0], 0.0
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    if det <= 0:
        return sy / sw, 0.0
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if b < 0:
        return sy / sw, 0.0
    if a < 0:
        return 0.0, sxy / sxx
    return a, b


def relative(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def decode_sizes(
    cap: int, cap_reported: bool, batches: Sequence[int] | None, max_batch: int | None
) -> tuple[list[int], list[int]]:
    """The batch sizes to measure (`batches`, else 1, 2, 4 ... up to `max_batch` or the cap) and
    those asked for past the server's cap (left out). A cap the server did not report (vLLM's
    default, assumed) does not bound what the user asked for."""
    if not cap_reported:
        cap = max(cap, max_batch or 0, *(batches or ()))
    sizes = batches or batch_sizes(min(cap, max_batch or cap))
    return sorted({b for b in sizes if 1 <= b <= cap}), sorted({b for b in sizes if b > cap})


class Progress:
    """Progress lines on stderr: elapsed time against the budget, and what is being measured."""

    def __init__(self, budget_s: float, out: TextIO | None = None, quiet: bool = False):
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.out = out or sys.stderr
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def line(self, message: str) -> None:
        if self.quiet:
            return
        done = min(self.elapsed() / self.budget_s, 1.0)
        bar = "#" * round(done * 20)
        budget = f"{self.budget_s:.0f}" if self.budget_s >= 10 else f"{self.budget_s:.1f}"
        print(f"[{bar:<20}] {self.elapsed():5.0f}/{budget} s  {message}", file=self.out, flush=True)


@dataclass
class Server:
    url: str
    shown: str
    kind: str
    backend: Backend
    model: str
    speculative: bool
    num_steps: int
    cap: int
    time_scale: float = 1.0
    context_length: int | None = None
    twin_profile: str | None = None
    cap_reported: bool = False
    """The server said its cap (SGLang's /server_info, a load endpoint); else `cap` is vLLM's
    default, a guess that --batches or --max-batch may exceed."""
    ranks: int = 1
    """Its data-parallel ranks (SGLang --dp-size): each an engine of its own, with `cap`. Every
    stream is sent to rank 0 (`x-data-parallel-rank`), so a batch measured is one engine's (dealt
    in turn, 16 streams were two batches of 8, measured as one of 16)."""

    @property
    def role(self) -> str:
        return "spec" if self.speculative else "base"


@dataclass
class Trace:
    """One stream: when each content chunk came (perf_counter seconds) and its tokens."""

    sent: float
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    verify_ct: int | None = None
    completion_tokens: int | None = None


@dataclass
class BatchResult:
    batch: int
    step_ms: float
    """The step time at `batch`: the median over the streams of each one's mean gap while all
    `batch` streams decode ((last - first chunk of the window) / steps), in the server's time."""
    median_gap_ms: float
    """The median of all those gaps (recorded; skewed when steps catch up after a late one)."""
    gaps: int
    window_steps: int
    context: float
    """Mean context per sequence (prompt + tokens so far) at the window's gaps."""
    tokens_per_step: float
    seconds: float
    bursty: bool = False
    """The chunks came in bursts (median gap < BATCHED_READS x mean): not trusted, left out."""
    spec_tokens: int = 0
    spec_verify: int = 0
    """Completion tokens and verify steps of the streams whose spec details came."""


@dataclass
class ServerResult:
    server: Server
    prefill_tokens: list[int] = field(default_factory=list)
    prefill_raw_ms: list[list[float]] = field(default_factory=list)
    batches: list[BatchResult] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    unreliable: list[BatchResult] = field(default_factory=list)
    """Batches measured but left out (their chunks came in bursts)."""
    accept_counters: float | None = None
    accept_details: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def prefill_ms(self) -> list[float]:
        """Each prompt length's fastest time to first token (`PREFILL_REPEATS`)."""
        return [min(raw) for raw in self.prefill_raw_ms]

    def prefill_fit(self) -> tuple[float, float] | None:
        if not self.prefill_tokens:
            return None
        return fit_line([float(n) for n in self.prefill_tokens], self.prefill_ms)

    @property
    def accept_length(self) -> float | None:
        if self.accept_counters:
            return self.accept_counters
        if self.accept_details:
            return self.accept_details
        decoded = [b.tokens_per_step for b in self.batches if b.tokens_per_step > 0]
        return statistics.median(decoded) if decoded else None


@dataclass
class Options:
    urls: list[str]
    out: Path
    budget_s: float = DEFAULT_BUDGET_S
    force: bool = False
    batches: list[int] | None = None
    max_batch: int | None = None
    context: int = DEFAULT_CONTEXT
    prefill_lengths: Sequence[int] = DEFAULT_PREFILL_LENGTHS
    window_steps: int = WINDOW_STEPS
    api_key: str | None = None
    name: str | None = None
    seed: int | None = None
    """The prompts' random source (None: new each run: a server that served a run's prompts
    holds them in its prefix cache, and a second run would time its prefill as nearly free)."""
    quiet: bool = False
    time_scale: float | None = None
    """A twin's --time-scale when it does not say it in /server_info (a vLLM twin has none)."""


class Profiler:
    def __init__(self, options: Options, progress: Progress | None = None):
        self.options = options
        self.progress = progress or Progress(options.budget_s, quiet=options.quiet)
        self.rng = random.Random(options.seed)
        headers = {"authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self.client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(120.0, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )

    async def close(self) -> None:
        await self.client.aclose()

    # ---- probing ------------------------------------------------------------------------

    async def _get(self, server_url: str, path: str) -> httpx.Response:
        try:
            return await self.client.get(server_url + path, timeout=10.0)
        except httpx.HTTPError as exc:
            raise ProfileError(f"{public_url(server_url)}{path}: {type(exc).__name__}: {exc}") from None

    async def probe(self, url: str) -> Server:
        url = url.rstrip("/")
        shown = public_url(url)
        models = await self._get(url, "/v1/models")
        if models.status_code != 200:
            hint = " (a key: --api-key-file)" if models.status_code in (401, 403) else ""
            raise ProfileError(f"{shown}/v1/models answered {models.status_code}{hint}")
        try:
            model = str(models.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ProfileError(f"{shown}/v1/models answered no list of models: is it an LLM server's URL?") from None
        backend: Backend | None = None
        reported_cap: int | None = None
        listed_ranks = 0
        for path in load_paths():
            answer = await self._get(url, path)
            if answer.status_code == 200:
                backend = recognise(path, answer.text)
                if backend is not None and backend.kind != "openai":
                    try:
                        reading = backend.read(answer.text, time.time())
                        reported_cap, listed_ranks = reading.max_running, reading.ranks
                    except (ValueError, KeyError, TypeError):
                        pass
                    break
        if backend is None or backend.kind == "openai":
            raise ProfileError(
                f"{shown}: no load endpoint answered (SGLang /v1/loads or /metrics, vLLM /metrics): "
                "its idleness cannot be checked"
            )
        # /v1/loads or SGLang's /metrics may say it; vLLM's reading carries its assumed default
        # (a cap learned only once it is seen full), not one it said.
        cap = reported_cap or VLLM_DEFAULT_MAX_NUM_SEQS
        server = Server(
            url,
            shown,
            backend.kind,
            backend,
            model,
            False,
            0,
            cap,
            cap_reported=reported_cap is not None and backend.kind != "vllm",
            ranks=max(listed_ranks, 1),
        )
        if reported_cap is not None:
            server.cap = max(reported_cap // server.ranks, 1)  # /v1/loads sums its ranks' caps
        scale_said = False
        if backend.info_path:
            info = await self._get(url, backend.info_path)
            try:
                doc = info.json() if info.status_code == 200 else None
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                facts = server_info_facts(doc)
                server.speculative = facts["speculative"]
                server.num_steps = facts["num_draft_tokens"]
                server.ranks = facts["replicas"] if doc.get("dp_size") is not None else server.ranks
                states = doc.get("internal_states") or [{}]
                effective = states[0].get("effective_max_running_requests_per_dp") if states else None
                server.cap = int(facts["max_running_requests"] or effective or server.cap)
                server.cap_reported = server.cap_reported or bool(facts["max_running_requests"] or effective)
                server.context_length = doc.get("context_length")
                if doc.get("twin"):  # the twin says how much faster than its physics it runs
                    scale_said = True
                    server.time_scale = float(doc.get("time_scale") or 1.0)
                    server.twin_profile = doc.get("profile")
        if self.options.time_scale and not scale_said:
            server.time_scale = self.options.time_scale  # a twin that says its own scale is taken at its word
        return server

    async def load(self, server: Server) -> tuple[float, float]:
        assert server.backend.load_path is not None
        answer = await self._get(server.url, server.backend.load_path)
        reading = server.backend.read(answer.text, time.time())
        return reading.running, reading.waiting

    async def wait_idle(self, server: Server, what: str) -> None:
        """Refuse (BusyError) a server with requests running or waiting, unless forced; between
        our own batches, give its gauges a moment to drain first."""
        if self.options.force:
            return
        deadline = time.monotonic() + (IDLE_WAIT_S if what == "between" else 0.0)
        while True:
            running, waiting = await self.load(server)
            if running + waiting <= 0:
                return
            if time.monotonic() >= deadline:
                when = "during the run" if what == "between" else "before the run"
                raise BusyError(
                    f"{server.shown} is busy with other traffic {when} ({running:g} running, {waiting:g} waiting): "
                    "measurements would be someone else's batch; stop the traffic or pass --force"
                )
            await asyncio.sleep(0.2)

    async def counters(self, server: Server) -> dict[str, float]:
        if server.kind != "sglang":
            return {}
        answer = await self._get(server.url, "/metrics")
        return parse_prometheus(answer.text, COUNTERS) if answer.status_code == 200 else {}

    # ---- requests -----------------------------------------------------------------------

    def prompt(self, tokens: int) -> list[int]:
        # Random token ids, new each run (`Options.seed`): no two prompts share a prefix, so no
        # prefix cache shortens a prefill, a repeated run's included (a review measured a second
        # run's prefill 70x too fast when every run sent the same prompts).
        return [self.rng.randrange(1000, 30000) for _ in range(tokens)]

    async def stream(self, server: Server, prompt_tokens: int, max_tokens: int) -> Trace:
        body: dict[str, Any] = {
            "model": server.model,
            "prompt": self.prompt(prompt_tokens),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if server.kind == "sglang" and server.speculative:
            body["return_spec_tokens_details"] = True
        try:
            return await self._stream(server, body)
        except httpx.HTTPError as exc:  # the server went away, or cut the stream
            raise ProfileError(f"{server.shown}/v1/completions: {type(exc).__name__}: {exc}") from None
        except ValueError:  # json: an event that is no JSON
            raise ProfileError(f"{server.shown}/v1/completions answered a stream that is not an OpenAI one") from None

    async def _stream(self, server: Server, body: dict[str, Any]) -> Trace:
        trace = Trace(time.perf_counter())
        seen = 0
        headers = {RANK_HEADER: "0"} if server.ranks > 1 else None
        async with self.client.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                raise ProfileError(f"{server.shown}/v1/completions answered {response.status_code}: {text}")
            buffer = b""
            async for data in response.aiter_bytes():
                now = time.perf_counter()
                buffer += data.replace(b"\r\n", b"\n")
                while (end := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:end], buffer[end + 2 :]
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        doc = json.loads(payload)
                        if not isinstance(doc, dict):
                            raise ValueError("an event that is no JSON object")
                        if "error" in doc:
                            raise ProfileError(f"{server.shown} stream error: {str(doc['error'])[:300]}")
                        usage = doc.get("usage") or {}
                        details = (doc.get("sglext") or {}).get("spec_tokens_details")
                        if isinstance(details, list):
                            details = details[0] if details else None
                        if isinstance(details, dict) and details.get("spec_verify_ct") is not None:
                            trace.verify_ct = int(details["spec_verify_ct"])
                        choices = doc.get("choices") or []
                        if not choices:
                            if usage.get("completion_tokens") is not None:
                                trace.completion_tokens = int(usage["completion_tokens"])
                            continue
                        if usage.get("completion_tokens") is not None:
                            n = int(usage["completion_tokens"]) - seen
                        else:
                            n = 1 if choices[0].get("text") else 0
                        if n > 0:
                            seen += n
                            trace.times.append(now)
                            trace.tokens.append(n)
        if trace.completion_tokens is None:
            trace.completion_tokens = seen
        if not trace.times:
            raise ProfileError(f"{server.shown}: a stream ended without tokens")
        return trace

    # ---- prefill ------------------------------------------------------------------------

    async def measure_prefill(self, server: Server, result: ServerResult, deadline: float) -> None:
        lengths = [
            n for n in self.options.prefill_lengths if not server.context_length or n < server.context_length - 8
        ]
        dropped = [n for n in self.options.prefill_lengths if n not in lengths]
        if dropped:
            result.notes.append(
                f"prefill lengths {', '.join(map(str, dropped))} left out: past its context length {server.context_length}"
            )
        await self.wait_idle(server, "before")
        await self.stream(server, 16, 1)  # warm the connection
        for n in lengths:
            raw: list[float] = []
            for _ in range(PREFILL_REPEATS):
                if time.monotonic() > deadline and raw:
                    break
                await self.wait_idle(server, "between")  # another's request would be timed as ours
                trace = await self.stream(server, n, 1)
                raw.append((trace.times[0] - trace.sent) * 1000.0 * server.time_scale)
            result.prefill_tokens.append(n)
            result.prefill_raw_ms.append(raw)
            self.progress.line(f"{server.role} {server.shown}: prefill {n} tokens: {min(raw):.2f} ms")
            if time.monotonic() > deadline:
                result.notes.append(f"prefill stopped at {n} tokens: out of time")
                break

    # ---- decode -------------------------------------------------------------------------

    async def measure_batch(self, server: Server, batch: int, lead_steps: int) -> tuple[BatchResult | None, int]:
        """B streams at once; the step time while all decode, or None if that window was shorter
        than half the steps wanted; and the steps the first streams decoded before the last one's
        first token (the lead the next try must leave room for)."""
        per_step = server.num_steps + 1 if server.speculative else 1
        max_tokens = (self.options.window_steps + lead_steps) * per_step
        prompt = max(self.options.context - (self.options.window_steps * per_step) // 3, 16)
        if server.context_length:
            prompt = min(prompt, server.context_length - max_tokens - 8)
        started = time.monotonic()
        traces = await asyncio.gather(*(self.stream(server, prompt, max_tokens) for _ in range(batch)))
        seconds = time.monotonic() - started
        all_in = max(t.times[0] for t in traces)  # the last stream's first token: all decode from here
        first_end = min(t.times[-1] for t in traces)  # the first stream's last chunk: the batch shrinks after
        lead = max(sum(1 for at in t.times if at < all_in) for t in traces)

        def window(tol: float) -> list[list[int]]:
            return [[i for i, at in enumerate(t.times) if all_in - tol <= at <= first_end + tol] for t in traces]

        def gaps_of(indices: list[list[int]]) -> list[float]:
            return [t.times[b] - t.times[a] for t, idx in zip(traces, indices) for a, b in zip(idx, idx[1:])]

        strict = gaps_of(window(0.0))
        if not strict:
            return None, lead
        # Chunks of one step reach the client a little apart: widen the window by a quarter step.
        indices = window(0.25 * statistics.median(strict))
        steps = max(len(idx) for idx in indices) - 1
        if steps < self.options.window_steps // 2:
            return None, lead
        gaps = gaps_of(indices)
        spans = [
            (t.times[idx[-1]] - t.times[idx[0]]) / (len(idx) - 1) for t, idx in zip(traces, indices) if len(idx) > 1
        ]
        tokens = sum(t.tokens[i] for t, idx in zip(traces, indices) for i in idx[1:])
        contexts = [prompt + sum(t.tokens[: i + 1]) for t, idx in zip(traces, indices) for i in idx[:-1]]
        scale = server.time_scale * 1000.0
        result = BatchResult(
            batch=batch,
            step_ms=statistics.median(spans) * scale,
            median_gap_ms=statistics.median(gaps) * scale,
            gaps=len(gaps),
            window_steps=steps,
            context=statistics.fmean(contexts) if contexts else float(prompt),
            tokens_per_step=tokens / len(gaps) if gaps else 0.0,
            seconds=seconds,
            bursty=statistics.median(gaps) < BATCHED_READS * statistics.median(spans),
            spec_tokens=sum(t.completion_tokens or 0 for t in traces if t.verify_ct),
            spec_verify=sum(t.verify_ct or 0 for t in traces),
        )
        return result, lead

    async def measure_decode(self, server: Server, result: ServerResult, deadline: float) -> None:
        sizes, above = decode_sizes(server.cap, server.cap_reported, self.options.batches, self.options.max_batch)
        if above:
            note = f"batches {above} left out: above the server's cap of {server.cap}"
            result.notes.append(note)
            self.progress.line(f"{server.role} {server.shown}: {note}")
        before = await self.counters(server)
        last: BatchResult | None = None
        lead = LEAD_STEPS
        for i, b in enumerate(sizes):
            if last is not None:
                # The next batch costs about what the last did, times the growth of its prefill.
                estimate = last.seconds * max(b / last.batch, 1.0)
                if time.monotonic() + estimate > deadline:
                    result.skipped = sizes[i:]
                    result.notes.append(f"batches {result.skipped} skipped: out of time (--budget-s)")
                    self.progress.line(f"{server.role} {server.shown}: out of time, skipping batches {result.skipped}")
                    break
            measured: BatchResult | None = None
            for attempt in range(3):
                await self.wait_idle(server, "between")
                tried = time.monotonic()
                measured, seen = await self.measure_batch(server, b, lead)
                took = time.monotonic() - tried
                # The first streams decode while later prompts are prefilled: leave room for that
                # (a stream that ended before the last first token only shows a lower bound).
                grown = round(1.25 * seen) + LEAD_STEPS
                lead = max(lead, grown) if measured is not None else max(2 * lead, grown)
                if measured is not None or attempt == 2 or time.monotonic() + 2 * took > deadline:
                    break
                self.progress.line(
                    f"{server.role} {server.shown}: batch {b}: too few steps with all streams decoding, "
                    f"again with {lead} steps of lead"
                )
            if measured is None:
                result.notes.append(f"batch {b}: too few steps with all {b} streams decoding")
                continue
            last = measured
            self.progress.line(
                f"{server.role} {server.shown}: batch {b}: step {last.step_ms:.2f} ms "
                f"(median gap {last.median_gap_ms:.2f}, {last.gaps} gaps, {last.tokens_per_step:.2f} tokens/step, "
                f"{last.seconds:.1f} s)"
            )
            if last.bursty:
                result.unreliable.append(last)
                result.skipped = sizes[i + 1 :]
                skipped = (
                    f", and larger batches skipped ({', '.join(map(str, result.skipped))})" if result.skipped else ""
                )
                note = (
                    f"batch {b}: chunks came in bursts (median gap {last.median_gap_ms:.2f} ms against a mean of "
                    f"{last.step_ms:.2f} ms): this client or the server's CPU could not keep up; left out{skipped}: "
                    "profile from a less busy machine or lower --max-batch"
                )
                result.notes.append(note)
                self.progress.line(f"{server.role} {server.shown}: {note}")
                break
            result.batches.append(last)
        await self.remeasure_outliers(server, result, lead, deadline)
        largest = max((b.batch for b in result.batches), default=0)
        if 0 < largest < server.cap:
            # The router predicts every batch up to the cap: past the largest measured, from the
            # last two measured (a curve measured to 4 put spec's step at 256 at a quarter of it).
            cap = "the server's cap" if server.cap_reported else "its assumed cap"
            note = f"batches above {largest} not measured ({cap} is {server.cap}): extrapolated"
            result.notes.append(note)
            self.progress.line(f"{server.role} {server.shown}: {note}")
        if server.speculative:
            await self.wait_idle(server, "between")
            after = await self.counters(server)
            d_tokens = after.get("sglang:generation_tokens_total", 0.0) - before.get(
                "sglang:generation_tokens_total", 0.0
            )
            d_verify = after.get("sglang:spec_verify_calls_total", 0.0) - before.get(
                "sglang:spec_verify_calls_total", 0.0
            )
            if d_verify > 0:
                result.accept_counters = d_tokens / d_verify
            verify = sum(b.spec_verify for b in result.batches)
            if verify > 0:
                result.accept_details = sum(b.spec_tokens for b in result.batches) / verify

    async def remeasure_outliers(self, server: Server, result: ServerResult, lead: int, deadline: float) -> None:
        """Batches whose step lies above the line through the others' are measured once more
        (time permitting) and the faster kept: what else runs on the client's or the server's CPU
        only ever adds time (a busy 2-core machine read one batch 13 % long)."""
        for suspect in above_the_line(result.batches):
            if time.monotonic() + IDLE_WAIT_S + 2 * suspect.seconds > deadline:
                result.notes.append(
                    f"batch {suspect.batch}: off the line through the others, not measured again (time)"
                )
                continue
            await self.wait_idle(server, "between")
            again, _ = await self.measure_batch(server, suspect.batch, lead)
            kept = suspect if again is None or again.bursty or again.step_ms >= suspect.step_ms else again
            self.progress.line(
                f"{server.role} {server.shown}: batch {suspect.batch}: measured again (off the line through the "
                f"others): {suspect.step_ms:.2f} then {again.step_ms if again else float('nan'):.2f} ms, "
                f"kept {kept.step_ms:.2f}"
            )
            result.batches[result.batches.index(suspect)] = kept

    async def measure(self, server: Server, deadline: float) -> ServerResult:
        result = ServerResult(server)
        if self.options.force:
            running, waiting = await self.load(server)
            if running + waiting > 0:
                result.notes.append(
                    f"measured with --force while {running:g} other requests ran and {waiting:g} waited:"
                    " its batches were larger than their sizes say"
                )
        prefill_deadline = time.monotonic() + 0.2 * (deadline - time.monotonic())
        await self.measure_prefill(server, result, prefill_deadline)
        await self.measure_decode(server, result, deadline)
        return result


async def measure_all(options: Options, progress: Progress | None = None) -> list[ServerResult]:
    profiler = Profiler(options, progress)
    try:
        servers = [await profiler.probe(url) for url in options.urls]
        roles = [s.role for s in servers]
        for role in ("spec", "base"):
            if roles.count(role) > 1:
                raise ProfileError(
                    f"{roles.count(role)} {role} servers given: a profile has one {role} side; profile them one at a time"
                )
        for server in servers:
            await profiler.wait_idle(server, "before")
            profiler.progress.line(
                f"{server.role} {server.shown}: {server.kind}, model {server.model!r}, cap {server.cap}"
                + (f", {server.num_steps} draft steps" if server.speculative else "")
                + (f", twin at time scale {server.time_scale:g}" if server.time_scale != 1.0 else "")
            )
        results = []
        start = time.monotonic()
        for i, server in enumerate(servers):
            left = options.budget_s - (time.monotonic() - start)
            deadline = time.monotonic() + left / (len(servers) - i)
            results.append(await profiler.measure(server, deadline))
        return results
    finally:
        await profiler.close()


# ---- the profile ------------------------------------------------------------------------


def _sides(results: list[ServerResult]) -> tuple[ServerResult | None, ServerResult | None]:
    spec = next((r for r in results if r.server.speculative and r.batches), None)
    base = next((r for r in results if not r.server.speculative and r.batches), None)
    return spec, base


def _points(result: ServerResult | None) -> tuple[list[float], list[float]]:
    if result is None:
        return [], []
    return [float(b.batch) for b in result.batches], [b.step_ms for b in result.batches]


def build_profile(
    results: list[ServerResult], name: str, when: datetime, seconds: float, budget_s: float
) -> tuple[dict, list[list[Any]] | None]:
    """The profile document, and the table rows when the step kind is `table`."""
    spec, base = _sides(results)
    if spec is None and base is None:
        raise ProfileError("no decode step was measured")
    k = spec.server.num_steps if spec else 3
    notes: list[str] = []
    if k < 1:  # a spec server whose /server_info named no draft steps
        k = 3
        notes.append("the spec server said no draft steps per verify step: 3 assumed (SGLang's default)")
    for server_result in results:
        notes += [f"{server_result.server.role} {server_result.server.shown}: {note}" for note in server_result.notes]
        if server_result.unreliable:  # the profile then rests on smaller batches: more than a progress line
            largest = max((b.batch for b in server_result.batches), default=0)
            left = ", ".join(str(b) for b in [u.batch for u in server_result.unreliable] + server_result.skipped)
            shown = f"{server_result.server.role} {server_result.server.shown}"
            notes.append(
                f"{shown}: batches {left} left out (chunks came in bursts: this client or "
                f"the server was busy), steps past batch {largest} extrapolated: measure again on a quieter machine"
            )
    if base is None:
        notes.append("no base server measured: the base side is derived from the spec side's fit, not measured")
    if spec is None:
        notes.append("no spec server measured: the spec side is the base step's fit at k+1 tokens, not measured")

    # Prefill: the base server's, with the spec server's ratio as spec_prefill_factor.
    base_fit = base.prefill_fit() if base else None
    spec_fit = spec.prefill_fit() if spec else None
    factor = 1.0
    if base_fit and spec_fit and spec:
        ns = spec.prefill_tokens
        factor = sum(spec_fit[0] + spec_fit[1] * n for n in ns) / sum(base_fit[0] + base_fit[1] * n for n in ns)
    prefill_fit = base_fit or spec_fit or (0.0, 0.0)
    if base_fit is None and spec_fit is not None:
        notes.append("prefill measured on the spec server only (spec_prefill_factor 1)")

    # The affine candidate: base = fixed + per_token * B; spec = base at k+1 tokens + overheads.
    sb, sm = _points(spec)
    bb, bm = _points(base)
    if base is not None:
        fixed, per_token = fit_line(bb, bm)
    else:
        a_s, b_s = fit_line(sb, sm)
        fixed, per_token = a_s, b_s / (k + 1)
    verify_ms = per_request_ms = 0.0
    if spec is not None and base is not None:
        a_s, b_s = fit_line(sb, sm)
        verify_ms = max(a_s - fixed, 0.0)
        per_request_ms = max(b_s - per_token * (k + 1), 0.0)

    def affine_spec(b: float) -> float:
        return fixed + per_token * b * (k + 1) + verify_ms + per_request_ms * b

    residuals = [relative(fixed + per_token * b, m) for b, m in zip(bb, bm)]
    residuals += [relative(affine_spec(b), m) for b, m in zip(sb, sm)]
    affine_worst = max(abs(r) for r in residuals)
    use_affine = affine_worst <= AFFINE_TOLERANCE

    contexts = [b.context for r in (spec, base) if r for b in r.batches]
    context = round(statistics.fmean(contexts))
    alpha = None
    if spec is not None and spec.accept_length:
        alpha = alpha_from_accept_length(spec.accept_length, k)
    when_text = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    urls = ", ".join(r.server.shown for r in results)
    doc: dict[str, Any] = {
        "name": name,
        "description": f"measured by `specroute profile` on {when_text} from {urls}",
    }
    rows: list[list[Any]] | None = None
    if use_affine:
        doc["step"] = {"kind": "affine", "fixed_ms": round(fixed, 4), "per_token_ms": round(per_token, 5)}
    else:
        rows = []
        for r, t in ((base, 1), (spec, k + 1)):
            for measured in r.batches if r else []:
                rows.append(["target", measured.batch, t, context, round(measured.step_ms, 4)])

        # A side not measured is the measured step scaled by the ratio of the two sides' lines at
        # that batch, as the affine kind derives them: the measured curve's shape is kept, and
        # the spec step stays above the base step (a table of one side used to repeat it for the
        # other: a base-only table made speculation free; the line alone, off a curve, put base
        # above spec at small batches).
        def base_line(b: float) -> float:
            return fixed + per_token * b

        if spec is None and base is not None:
            rows += [
                ["target", b.batch, k + 1, context, round(b.step_ms * affine_spec(b.batch) / base_line(b.batch), 4)]
                for b in base.batches
            ]
        if base is None and spec is not None:
            rows += [
                ["target", b.batch, 1, context, round(b.step_ms * base_line(b.batch) / affine_spec(b.batch), 4)]
                for b in spec.batches
            ]
        # The spec step is measured whole: its draft steps are inside the T=k+1 rows.
        for batch in sorted({m.batch for r in (spec, base) if r for m in r.batches}):
            rows.append(["draft", batch, 1, context, 0.0])
        doc["step"] = {"kind": "table", "file": ""}  # set by write_profile
    doc["draft_step_ms"] = 0.0
    doc["prefill"] = {"fixed_ms": round(prefill_fit[0], 4), "per_token_ms": round(prefill_fit[1], 6)}
    doc["spec_prefill_factor"] = round(factor, 4)
    if use_affine:
        doc["overheads"] = {
            "spec": {"per_verify_step_ms": round(verify_ms, 4), "per_request_ms": round(per_request_ms, 5)},
            "base": {},
        }
    doc["defaults"] = {"mean_alpha": round(alpha, 4) if alpha is not None else 0.64, "num_steps": k}
    doc["measured"] = {
        "by": "specroute profile",
        "at": when_text,
        "seconds": round(seconds, 1),
        "budget_s": budget_s,
        "context_tokens": context,
        "step_kind": "affine" if use_affine else "table",
        "affine_worst_residual_pct": round(100 * affine_worst, 2),
        "why": (
            f"one line reproduces every measured step within {100 * AFFINE_TOLERANCE:g} %"
            if use_affine
            else f"the best line misses a measured step by {100 * affine_worst:.1f} % (> {100 * AFFINE_TOLERANCE:g} %): the measured table"
        ),
        "split": "the spec step is measured whole: draft steps, verify and engine overheads together",
        # The router's acceptance estimate starts here, until its own evidence speaks.
        "alpha": round(alpha, 4) if alpha is not None else None,
        "notes": notes,
        "servers": [_server_block(r) for r in results],
    }
    return doc, rows


def _server_block(r: ServerResult) -> dict[str, Any]:
    s = r.server
    block: dict[str, Any] = {
        "url": s.shown,
        "kind": s.kind,
        "role": s.role,
        "model": s.model,
        "max_running_requests": s.cap,
    }
    if s.ranks > 1:
        block["data_parallel_ranks"] = {"ranks": s.ranks, "measured": "rank 0 (x-data-parallel-rank)"}
    if s.speculative:
        block["num_steps"] = s.num_steps
    if s.time_scale != 1.0 or s.twin_profile:
        block["twin"] = {"profile": s.twin_profile, "time_scale": s.time_scale, "times": "scaled back to the twin's"}
    fit = r.prefill_fit()
    if fit:
        block["prefill"] = {
            "prompt_tokens": r.prefill_tokens,
            "ttft_ms_min": [round(v, 3) for v in r.prefill_ms],
            "ttft_ms_raw": [[round(v, 3) for v in raw] for raw in r.prefill_raw_ms],
            "fit": {"fixed_ms": round(fit[0], 4), "per_token_ms": round(fit[1], 6)},
            "residual_pct": [
                round(100 * relative(fit[0] + fit[1] * n, m), 2) for n, m in zip(r.prefill_tokens, r.prefill_ms)
            ],
        }
    block["decode"] = {
        "batches": [b.batch for b in r.batches],
        "step_ms_median": [round(b.step_ms, 4) for b in r.batches],
        "median_gap_ms": [round(b.median_gap_ms, 4) for b in r.batches],
        "gaps": [b.gaps for b in r.batches],
        "window_steps": [b.window_steps for b in r.batches],
        "context_tokens": [round(b.context, 1) for b in r.batches],
        "tokens_per_step": [round(b.tokens_per_step, 3) for b in r.batches],
        "skipped_batches": r.skipped,
        "left_out": [
            {"batch": b.batch, "mean_gap_ms": round(b.step_ms, 4), "median_gap_ms": round(b.median_gap_ms, 4)}
            for b in r.unreliable
        ],
    }
    if s.speculative:
        block["accept_length"] = {
            "counters": round(r.accept_counters, 4) if r.accept_counters else None,
            "spec_details": round(r.accept_details, 4) if r.accept_details else None,
            "used": round(r.accept_length, 4) if r.accept_length else None,
        }
    if r.notes:
        block["notes"] = r.notes
    return block


def write_profile(doc: dict[str, Any], rows: list[list[Any]] | None, out: Path) -> Profile:
    """Write the JSON (and its table CSV beside it), then load it back as the router would, and
    put each measured step's residual against the written profile in the `measured` block."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if rows is not None:
        table = out.with_name(out.stem + "-step-ms.csv")
        doc["step"]["file"] = table.name
        with table.open("w", newline="") as f:
            f.write(f"# {doc['description']}; the spec step (T=k+1) measured whole, its draft steps included\n")
            writer = csv.writer(f)
            writer.writerow(["kind", "B", "T", "L", "ms"])
            writer.writerows(rows)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    profile = load_profile(str(out))
    measured = doc["measured"]
    k = int(doc["defaults"]["num_steps"])
    fit: dict[str, list[float]] = {}
    for block in measured["servers"]:
        decode = block["decode"]
        values = []
        for b, ms, ctx in zip(decode["batches"], decode["step_ms_median"], decode["context_tokens"]):
            predicted = profile.spec_step_ms(b, k, ctx) if block["role"] == "spec" else profile.base_step_ms(b, ctx)
            values.append(round(100 * relative(predicted, ms), 2))
        fit[block["role"]] = values
    measured["profile_residual_pct"] = fit
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return profile


def cannot_write(out: Path) -> str | None:
    """Why the profile and its table could not be written at `out` (None: they can): its
    folder is created if missing, as the write would."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where a folder of the path should be
        return f"{out.parent} is not a folder"
    except OSError as exc:
        return exc.strerror or str(exc)
    if not out.parent.is_dir():
        return f"{out.parent} is not a folder"
    for target in (out, out.with_name(out.stem + "-step-ms.csv")):
        if target.is_dir():
            return f"{target} is a folder"
        if target.exists() and not os.access(target, os.W_OK):
            return f"{target} is not writable"
    try:  # a real file: permissions say nothing of /proc, /sys or a read-only mount for root
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".specroute-profile-"):
            pass
    except OSError as exc:
        return f"{out.parent} is not writable ({exc.strerror or type(exc).__name__})"
    return None


def run(options: Options) -> int:
    """`specroute profile`: 0 written, 3 a server busy (no --force), 1 another failure."""
    if options.out.suffix != ".json":
        print("specroute profile: --out must name a .json file", file=sys.stderr)
        return 2
    for url in options.urls:
        problem = server_url_problem(url)
        if problem is not None:
            print(f"specroute profile: --url {problem}", file=sys.stderr)
            return 2
    unwritable = cannot_write(options.out)
    if unwritable is not None:  # said now, not after minutes of measuring
        print(f"specroute profile: cannot write {options.out}: {unwritable}", file=sys.stderr)
        return 2
    progress = Progress(options.budget_s, quiet=options.quiet)
    when = datetime.now(UTC)
    try:
        results = asyncio.run(measure_all(options, progress))
        doc, rows = build_profile(results, options.name or options.out.stem, when, progress.elapsed(), options.budget_s)
        write_profile(doc, rows, options.out)
        for note in doc["measured"]["notes"]:
            print(f"specroute profile: note: {note}", file=sys.stderr)  # --quiet or not
    except BusyError as exc:
        print(f"specroute profile: {exc}", file=sys.stderr)
        return EXIT_BUSY
    except ProfileError as exc:
        print(f"specroute profile: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the file became unwritable while measuring (a full disk, say)
        print(f"specroute profile: cannot write {options.out}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # asyncio.run has cancelled the streams, which closes them on the servers
        print(f"specroute profile: interrupted after {progress.elapsed():.0f} s; nothing written", file=sys.stderr)
        return 130
    measured = doc["measured"]
    progress.line(
        f"wrote {options.out} ({measured['step_kind']}; residuals {measured['profile_residual_pct']}) "
        f"in {progress.elapsed():.0f} s"
    )
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _ints(text: str) -> list[int]:
    values = [_positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("no value given")
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--url", action="append", required=True, help="a server's base URL (repeat: one spec and one base server)"
    )
    parser.add_argument("--out", required=True, type=Path, help="profile JSON to write (a table CSV may go beside it)")
    parser.add_argument(
        "--budget-s",
        type=_positive_float,
        default=DEFAULT_BUDGET_S,
        help=f"time budget in seconds (default {DEFAULT_BUDGET_S:g})",
    )
    parser.add_argument("--force", action="store_true", help="measure even if a server has other requests")
    parser.add_argument(
        "--batches", type=_ints, help="batch sizes to measure, comma-separated (default: 1, 2, 4 ... cap)"
    )
    parser.add_argument("--max-batch", type=_positive_int, help="largest batch to measure (default: the server's cap)")
    parser.add_argument(
        "--context",
        type=_positive_int,
        default=DEFAULT_CONTEXT,
        help=f"tokens per sequence while decoding (default {DEFAULT_CONTEXT})",
    )
    parser.add_argument(
        "--prefill-lengths",
        type=_ints,
        default=list(DEFAULT_PREFILL_LENGTHS),
        help="prompt lengths whose time to first token is measured (default 256,1024,2048,4096)",
    )
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="bearer key the servers want (their --api-key); shows in ps and shell history")
    key.add_argument(
        "--api-key-file",
        type=Path,
        help="a file whose first non-empty line is that key (kept out of ps and shell history)",
    )
    parser.add_argument("--name", help="the profile's name (default: the file's stem)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--time-scale",
        type=_positive_float,
        help="a twin's --time-scale, for a twin that does not report it in /server_info (a vLLM twin)",
    )


def read_key_file(path: Path) -> str:
    """The first non-empty line of a key file."""
    try:
        lines = path.read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"--api-key-file: cannot read {str(path)!r} ({type(exc).__name__})") from None
    key = next((line.strip() for line in lines if line.strip()), "")
    if not key:
        raise SettingsError(f"--api-key-file: {str(path)!r} holds no key")
    return key


def main_from_args(args: Any) -> int:
    api_key = read_key_file(args.api_key_file) if args.api_key_file is not None else args.api_key
    return run(
        Options(
            urls=list(args.url),
            out=args.out,
            budget_s=args.budget_s,
            force=args.force,
            batches=args.batches,
            max_batch=args.max_batch,
            context=args.context,
            prefill_lengths=args.prefill_lengths,
            api_key=api_key,
            name=args.name,
            quiet=args.quiet,
            time_scale=args.time_scale,
        )
    )
