"""The twin's HTTP face: SGLang's OpenAI-compatible and native endpoints over its engines.

One engine loop task per data-parallel rank (sim/loop.py; one rank unless --dp-size says more,
each a whole replica with its own batch, queue and cache, requests dealt to them in turn as
SGLang's round_robin load balancing does, or to the rank an `x-data-parallel-rank` header
names); each request owns an asyncio queue its rank's loop fills once per engine step, so a
stream gets one SSE chunk per step carrying every token that step produced. A client that goes
away aborts its request in the engine at once.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from opentelemetry.context import Context
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from fleet.features import count_prompt_tokens
from sim import vllm
from sim.engine import Engine, EngineConfig, Request, check_alpha
from sim.faults import DroppedOnPurpose, Faults
from sim.loop import EngineLoop
from sim.metrics import TwinMetrics
from sim.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TwinError,
    cache_namespace,
    object_name,
    parse_request,
    stop_strings,
    usage,
)
from sim.responses import Responses, ResponsesError
from sim.shape import ChoiceShape
from sim.tokens import prompt_token_ids
from sim.tracing import TwinSpan, TwinTracer

log = logging.getLogger("sim.server")

Headers = Sequence[tuple[bytes, bytes]]
"""Extra response headers, as ASGI sends them."""

SGLANG_VERSION = "0.5.23"
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT

RANK_HEADER = "x-data-parallel-rank"
"""The request header SGLang routes to one data-parallel rank by."""

WORKLOAD_HEADER = "x-specroute-workload"
"""The request header whose value the twin matches against its --workload-alpha table."""


@dataclass
class TwinOptions:
    """What `specroute sim` was started with (echoed in /server_info)."""

    mode: str
    profile: str
    host: str = "127.0.0.1"
    port: int = 30000
    time_scale: float = 1.0
    seed: int = 0
    model_path: str = "specroute/twin"
    served_model_name: str | None = None
    enable_metrics: bool = False
    enable_trace: bool = False
    otlp_traces_endpoint: str = "localhost:4317"
    speculative_algorithm: str | None = None
    output_len: str = "azure-conv"
    faults: Faults = field(default_factory=Faults)
    """Sickness on purpose (sim/faults.py); none by default."""
    server: str = "sglang"
    """Whose HTTP shapes the twin serves: sglang, or vllm (a base server; sim/vllm.py)."""
    enable_cache_report: bool = False
    """usage.prompt_tokens_details.cached_tokens (SGLang --enable-cache-report; vLLM
    --enable-prompt-tokens-details)."""
    enable_response_store: bool = False
    """Keep /v1/responses answers for GET by id, previous_response_id and background (SGLang
    --enable-response-store; off by default, as in SGLang)."""
    dp_size: int = 1
    """Data-parallel ranks (SGLang --dp-size without DP attention): whole replicas behind one
    HTTP front, each with its own scheduler, batch and load snapshot."""

    @property
    def vllm(self) -> bool:
        return self.server == "vllm"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


class Call:
    """One choice's view of its engine request: the engine loop puts one item per step into a
    queue (shared by the n choices of one HTTP request)."""

    __slots__ = ("req", "queue", "index", "shape", "last_time", "metrics", "streaming", "span")

    def __init__(
        self,
        req: Request,
        metrics: TwinMetrics | vllm.EngineMetrics,
        streaming: bool,
        shape: ChoiceShape,
        queue: asyncio.Queue[tuple[int, str, int, bool]] | None = None,
    ):
        self.req = req
        self.queue: asyncio.Queue[tuple[int, str, int, bool]] = queue if queue is not None else asyncio.Queue()
        """One item per engine step: (choice index, text, tokens, finished). A slow reader may find several."""
        self.shape = shape
        self.index = shape.index
        self.last_time = req.arrival
        self.metrics = metrics
        self.streaming = streaming
        self.span: TwinSpan | None = None
        req.listener = self.on_step

    def on_step(self, req: Request) -> None:
        """Called by the engine (inside the loop task) after each step that touched `req`."""
        n = req.last_emitted
        aborted = req.finish_reason == "abort"
        if n and not aborted:
            if req.output_tokens == n:
                self.metrics.observe_first_token(self.streaming, max(req.updated - req.arrival, 0.0))
            else:
                self.metrics.observe_chunk(max(req.updated - self.last_time, 0.0), n)
            self.last_time = req.updated
        if req.finished and not aborted:
            self.metrics.observe_finish(
                self.streaming,
                req.prompt_tokens,
                req.output_tokens,
                max(req.updated - req.arrival, 0.0),
                req.finish_reason or "stop",
                req.cached_tokens,
            )
        if req.finished and self.span is not None:
            span, self.span = self.span, None
            span.finish(req)
        text = req.text.take(final=req.finished) if req.text is not None else ""
        self.queue.put_nowait((self.index, text, n, req.finished))


class Generation:
    """One HTTP request's engine requests, submitted: its choices' calls, and how to abort them
    (`abort_rid`: as the server aborts a request whose client left, `Twin.abort_request`)."""

    __slots__ = ("rid", "calls", "abort_rid")

    def __init__(self, rid: str, calls: list[Call], abort_rid: Callable[[str], None]):
        self.rid = rid
        self.calls = calls
        self.abort_rid = abort_rid

    def abort(self) -> None:
        for call in self.calls:
            self.abort_rid(call.req.rid)


class Twin:
    """Everything one twin server holds: options, engines, loops and metrics (no globals)."""

    def __init__(self, options: TwinOptions, config: EngineConfig):
        self.options = options
        self.config = config
        self.engines = [Engine(config, name=options.mode, dp_rank=rank) for rank in range(options.dp_size)]
        self.engine = self.engines[0]
        """Rank 0's engine: what every rank shares (its configuration) is read from it."""
        self.loops: list[EngineLoop] = []
        """One per rank while the server runs; empty while it starts or stops."""
        self._turn = 0
        self.outputs = 0
        """Steps any rank has taken: the scheduler outputs the tokenizer heard."""
        self.heard = asyncio.Event()
        """Set after any rank's step."""
        self.metrics: TwinMetrics | vllm.VllmMetrics = (
            vllm.VllmMetrics(self.engines, options.model_name)
            if options.vllm
            else TwinMetrics(self.engines, options.model_name)
        )
        self.balancer = vllm.DataParallelBalancer(len(self.engines)) if options.vllm else None
        """vLLM's choice of engine (SGLang's is the turn in `_turn`)."""
        self.tracer = TwinTracer(options.otlp_traces_endpoint) if options.enable_trace else None
        self.started = time.time()
        self.faults = options.faults
        self.fault_rng = random.Random(options.seed)

    @property
    def loop(self) -> EngineLoop | None:
        """Rank 0's loop (None while the server starts or stops)."""
        return self.loops[0] if self.loops else None

    @property
    def running_loops(self) -> list[EngineLoop]:
        if not self.loops:
            raise TwinError("The server is starting.", status=503, err_type="ServiceUnavailable")
        return self.loops

    @property
    def running_loop(self) -> EngineLoop:
        return self.running_loops[0]

    def rank_for(self, headers: Mapping[str, str]) -> int:
        """The rank a new request goes to: the one its `x-data-parallel-rank` names, else the
        next in turn (SGLang's default round_robin), or vLLM's least loaded."""
        named = headers.get(RANK_HEADER)
        if isinstance(self.metrics, vllm.VllmMetrics) and self.balancer is not None:
            try:
                rank = vllm.named_rank(named, len(self.engines))
            except ValueError as exc:
                raise TwinError(str(exc)) from None
            return rank if rank is not None else self.balancer.pick(self.engine_now(), self.metrics.stats)
        if named is not None:
            try:
                rank = int(named)
            except ValueError:
                rank = -1
            if not 0 <= rank < len(self.engines):
                raise TwinError(f"Invalid data parallel rank {named!r}: the server has {len(self.engines)}.")
            return rank
        rank, self._turn = self._turn % len(self.engines), self._turn + 1
        return rank

    def start_loops(self) -> None:
        self.loops = [EngineLoop(engine, self.options.time_scale, on_step=self.on_output) for engine in self.engines]
        self.apply_wedges()
        for loop in self.loops:
            loop.start()

    async def stop_loops(self) -> None:
        loops, self.loops = self.loops, []
        for loop in loops:
            await loop.stop()

    def apply_wedges(self) -> None:
        """Wedge the loops the faults name (`wedged`: every rank; `wedged_rank`: that one)."""
        for rank, loop in enumerate(self.loops):
            wedged = self.faults.wedged or self.faults.wedged_rank == rank
            loop.wedge(wedged)
            if isinstance(self.metrics, vllm.VllmMetrics):
                self.metrics.freeze(rank, wedged)

    def engine_now(self) -> float:
        """The engines' clock (virtual seconds; each rank's loop keeps the same)."""
        return self.running_loops[0].now()

    def abort(self, rid: str) -> None:
        for loop in self.loops:
            loop.abort(rid)

    def abort_request(self, rid: str) -> None:
        """Abort as the server does for `/abort_request` and a client that left. vLLM: the
        request of that id. SGLang (TokenizerManager.abort_request): nothing unless a request of
        exactly that rid is running (one tokenizer worker); then its scheduler aborts every
        request whose rid begins with it (`req.rid.startswith(recv_req.rid)`), other clients'
        included."""
        if self.options.vllm:
            self.abort(rid)
        elif rid and any(engine.has_request(rid) for engine in self.engines):
            for loop in self.loops:
                loop.abort_prefixed(rid)

    def on_output(self) -> None:
        self.outputs += 1
        self.heard.set()

    # ---- tracing: the observability engineer's hook ------------------------------------------

    def trace_context(self, headers: Mapping[str, str]) -> Context | None:
        """W3C trace context of an incoming request (traceparent/tracestate), used only with
        --enable-trace; with tracing off the headers are ignored, as in SGLang."""
        return self.tracer.extract(headers) if self.tracer is not None else None

    # ---- generation ---------------------------------------------------------------------

    async def generate(self, kind: str, http: HttpRequest) -> Reply:
        if http.headers.get("content-type", "").lower().split(";", 1)[0] != "application/json":  # as SGLang
            raise TwinError("Content-Type must be application/json", err_type="Bad Request")
        try:
            body = json.loads(await http.body())
        except ValueError as exc:
            raise TwinError(f"JSON decode error: {exc}", err_type="Bad Request") from None
        request = parse_request("chat" if kind == "chat" else "completion", body, vllm=self.options.vllm)
        if self.options.vllm:
            if "model" not in body or not body["model"]:
                # vLLM serves a request that names no model with its served one (_is_model_supported)
                request = request.model_copy(update={"model": self.options.model_name})
            elif request.model != self.options.model_name:
                # vLLM serves only its --served-model-name (SGLang answers whatever model is named).
                raise TwinError(f"The model `{request.model}` does not exist.", status=404, err_type="NotFoundError")
        await self.show_faults()
        if kind == "chat":
            check_output_length(request.max_new_tokens, self.config.context_length)
        run = self.start(request, body, http.headers, request.rid or uuid.uuid4().hex)
        # vLLM's response id: its kind's prefix and the client's X-Request-Id, else a fresh one
        # (_base_request_id); SGLang's is the request's rid
        response_id = run.rid
        if self.options.vllm:
            prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
            response_id = prefix + (http.headers.get("x-request-id") or uuid.uuid4().hex)
        if request.stream:
            # SGLang answers a stream's status with its first chunk (it awaits the generator's
            # first item, after queueing and prefill: serving_chat.py's "kick-start"); vLLM at once.
            return self.sse(self._stream(kind, request, run.calls, response_id), run.abort, at_once=self.options.vllm)
        return await self._complete(kind, request, run, response_id, http.receive)

    async def show_faults(self) -> None:
        """The sickness every generation shows before it starts (--fault-first-token-delay-ms,
        --fault-error-rate)."""
        faults = self.faults
        if faults.first_token_delay_ms:
            await asyncio.sleep(faults.first_token_delay_ms / 1000.0)
        if faults.fails(self.fault_rng):
            raise TwinError(
                "Internal server error (a fault the twin was told to show)", status=500, err_type="InternalServerError"
            )

    def start(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        prompt_body: Mapping[str, Any],
        headers: Mapping[str, str],
        rid: str,
    ) -> Generation:
        """Count the prompt of `prompt_body` (chat `messages` or a completion `prompt`), check
        it against the context, and submit one engine request per choice of `request`."""
        parent = self.trace_context(headers)
        # The twin's own hook (a real server ignores it): the workload picks the request's mean
        # acceptance (--workload-alpha).
        workload = headers.get(WORKLOAD_HEADER, "").strip() or None
        prompt_tokens = max(count_prompt_tokens(prompt_body), 1)
        check_context(prompt_tokens, request.max_new_tokens, self.config.context_length)
        loops = self.running_loops
        rank = self.rank_for(headers)
        engine, loop = self.engines[rank], loops[rank]
        ids = prompt_token_ids(prompt_body) if engine.cache is not None else None
        namespace = cache_namespace(request, self.options.vllm)
        cache_key = engine.page_key(ids, namespace) if ids is not None and len(ids) == prompt_tokens else None
        # n > 1: one engine request per choice, as SGLang runs n sequences.
        rids = [rid] if request.n == 1 else [f"{rid}-{i}" for i in range(request.n)]
        for r in rids:
            if any(e.has_request(r) for e in self.engines):
                raise TwinError(f"Duplicate request id {r!r}.")
        queue: asyncio.Queue[tuple[int, str, int, bool]] = asyncio.Queue()
        calls = []
        for index, r in enumerate(rids):
            shape = ChoiceShape(request, index, rid)
            req = engine.new_request(
                prompt_tokens,
                now=loop.now(),
                max_new_tokens=request.max_new_tokens,
                ignore_eos=request.ignore_eos,
                output_len=shape.output_len,
                rid=r,
                stop=stop_strings(request),
                text_seed=request.seed + index if request.seed is not None else None,
                cache_key=cache_key,
                workload=workload,
            )
            shape.bind(req.target_len, req.ends_by_length)
            call = Call(req, self.metrics.for_rank(rank), request.stream, shape, queue)
            if self.tracer is not None:
                call.span = self.tracer.start(req, parent)
            calls.append(call)
        for call in calls:
            loop.submit(call.req)
        return Generation(rid, calls, self.abort_request)

    def sse(
        self, chunks: AsyncIterator[bytes], abort: Callable[[], None], headers: Headers = (), at_once: bool = True
    ) -> SseResponse:
        """A stream of `chunks`, sick as the faults say; a client that leaves calls `abort`.
        `at_once`: the status and headers go before the first chunk is ready, else with it."""
        faults = self.faults
        if faults.hang_after_chunks is not None or faults.drop_after_chunks is not None:
            chunks = sick_stream(chunks, faults)
        began = time.monotonic()
        return SseResponse(
            chunks,
            on_disconnect=lambda streaming: self.abort_as_sglang_does(abort, began, streaming),
            headers=headers,
            at_once=at_once,
        )

    def abort_as_sglang_does(self, abort: Callable[[], None], began: float, streaming: bool) -> None:
        """Abort a request whose client left when SGLang would (vLLM: at once). SGLang's stream,
        once started, is aborted by the response's background task after a 2 s sleep
        (tokenizer_manager.create_abort_task); a request with nothing sent yet (not streamed, or
        a stream still queued or in prefill) when its wait for output next times out and finds
        the client gone (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s; its waits restart at each
        output, and such a request has none). Meanwhile it keeps its place in the queue or its
        slot. Seconds of the real server: the twin's wall seconds times the time scale."""
        if self.options.vllm:
            abort()
            return
        scale = self.options.time_scale
        if streaming:
            delay = ABORT_AFTER_STREAM_S / scale
        else:
            period = STATE_WAIT_TIMEOUT_S / scale
            delay = period - (time.monotonic() - began) % period
        asyncio.get_running_loop().call_later(delay, abort)

    async def collect(self, run: Generation, receive: Receive) -> list[list[str]] | None:
        """Every choice's pieces once all are finished; None (and the engine requests aborted)
        when the client left first."""
        pieces: list[list[str]] = [[] for _ in run.calls]
        began = time.monotonic()
        finished = asyncio.ensure_future(self._drain(run.calls, pieces))
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not finished.done():
                self.abort_as_sglang_does(run.abort, began, streaming=False)
                finished.cancel()
        return pieces if finished.done() and not finished.cancelled() else None

    async def _complete(
        self,
        kind: str,
        request: ChatCompletionRequest | CompletionRequest,
        run: Generation,
        rid: str,
        receive: Receive,
    ) -> Response:
        calls = run.calls
        pieces = await self.collect(run, receive)
        reqs = [call.req for call in calls]
        if pieces is None:  # the client left (its engine requests are aborted as SGLang would, `collect`)
            raise TwinError("The request was aborted.", status=400)
        refused = next((req for req in reqs if req.abort_status), None)
        if refused is not None:
            # An abort with a status (a full queue): `_handle_abort_finish_reason` raises it, and
            # the handler answers it as `create_error_response(detail, str(status), status)`.
            raise TwinError(refused.abort_message, status=refused.abort_status, err_type=str(refused.abort_status))
        # A request aborted by `/abort_request` is answered as any other, its finish reason
        # `abort`: SGLang's `_handle_abort_finish_reason` raises only for an abort that carries
        # a status (400, 500, 503), and `FINISH_ABORT`'s is None.
        choices = [
            call.shape.render(kind, got, call.req.finish_reason, call.req.matched_stop, stream=False)
            for call, got in zip(calls, pieces)
        ]
        if self.options.vllm:
            choices = [vllm.as_vllm_choice(choice) for choice in choices]
        response: dict[str, Any] = {
            "id": rid,
            "object": object_name(kind, stream=False),
            "created": int(time.time()),
            "model": request.model,
            "choices": choices,
            "usage": self._usage(reqs),
        }
        if not self.options.vllm:
            response["metadata"] = {"weight_version": "default"}  # SGLang's _build_*_response
        meta = kind == "chat" and getattr(request, "return_meta_info", False)
        if self.config.speculative and request.return_spec_tokens_details:
            response["sglext"] = {"spec_tokens_details": self._spec_details(reqs)}
        if meta:
            for body, req in zip(choices, reqs):
                body["meta_info"] = self._meta_info(req)
                if self.config.speculative:
                    body["meta_info"] |= req.spec_details(self.config.num_steps)
        return JSONResponse(response)

    def _spec_details(self, reqs: list[Request]) -> dict[str, Any]:
        """sglext.spec_tokens_details of a request; with n > 1, summed over its sequences."""
        k = self.config.num_steps
        if len(reqs) == 1:
            return reqs[0].spec_details(k)
        parts = [req.spec_details(k) for req in reqs]
        total = parts[0]
        for part in parts[1:]:
            for key in ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts"):
                total[key] += part[key]
            hists = [h for h in (total["spec_correct_drafts_histogram"], part["spec_correct_drafts_histogram"]) if h]
            total["spec_correct_drafts_histogram"] = [sum(col) for col in zip(*hists)] if hists else []
        verify = total["spec_verify_ct"]
        total["spec_accept_length"] = sum(req.output_tokens for req in reqs) / verify if verify else 0.0
        total["spec_accept_rate"] = total["spec_num_correct_drafts"] / (verify * k) if verify else 0.0
        return total

    async def _drain(self, calls: list[Call], pieces: list[list[str]]) -> None:
        remaining = len(calls)
        aborted = False
        while remaining:
            index, text, _, done = await calls[0].queue.get()
            req = calls[index].req
            if done and req.finish_reason == "abort" and not aborted:
                # One choice aborted (`/abort_request`): every choice ends, as the stream's do.
                aborted = True
                for call in calls:
                    self.abort(call.req.rid)
            pieces[index] += calls[index].shape.feed(text, done, req.finish_reason)
            remaining -= done

    def _meta_info(self, req: Request) -> dict[str, Any]:
        return {
            "id": req.rid,
            "finish_reason": {"type": req.finish_reason, "matched": req.matched_stop},
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": req.output_tokens,
            "cached_tokens": req.cached_tokens,
            "e2e_latency": (req.finish_time or 0.0) - req.arrival,
        }

    def _usage(self, reqs: list[Request], completion_tokens: int | None = None) -> dict[str, Any]:
        """Usage of one HTTP request (its n sequences): the prompt once, every sequence's
        completion tokens and, with the cache report on, the prompt's cached tokens once (the
        first sequence's, as SGLang's UsageProcessor counts one per prompt)."""
        if completion_tokens is None:
            completion_tokens = sum(req.output_tokens for req in reqs)
        cached = reqs[0].cached_tokens if self.options.enable_cache_report else None
        body = usage(reqs[0].prompt_tokens, completion_tokens, cached, zero_cached=self.options.vllm)
        return vllm.as_vllm_usage(body) if self.options.vllm else body

    async def _stream(
        self, kind: str, request: ChatCompletionRequest | CompletionRequest, calls: list[Call], rid: str
    ) -> AsyncIterator[bytes]:
        reqs = [call.req for call in calls]
        created = int(time.time())
        obj = object_name(kind, stream=True)
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        # vLLM sends usage in every chunk only when the final usage is asked for too
        # (should_include_usage); SGLang for continuous_usage_stats alone
        continuous = bool(opts and opts.continuous_usage_stats and (opts.include_usage or not self.options.vllm))

        # SGLang writes a chat stream's chunks with msgspec (sse_utils.build_sse_content): the
        # delta always has `reasoning_content` first (null: declared without a default so that the
        # OpenAI SDK's `delta.reasoning_content` never raises), its other None fields and a None
        # usage are left out. Its tool-call chunks are pydantic's (every delta field, usage null).
        # Completions chunks are pydantic's too; vLLM writes usage null on every chunk.
        msgspec_chat = kind == "chat" and not self.options.vllm

        def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            chunk: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": request.model,
                "choices": choices,
            }
            if msgspec_chat:
                for choice in choices:
                    choice["delta"] = sglang_delta(choice["delta"])
                pydantic = any("tool_calls" in choice["delta"] for choice in choices)
                if usage is not None or pydantic:
                    chunk["usage"] = usage
            else:
                chunk["usage"] = usage
            return sse(chunk)

        # A chat stream opens with the role alone when the engine's first output (the first token,
        # after prefill) comes: nothing of the body goes out while a request waits. vLLM sends one
        # such event per choice at the first output of any and puts the finish reason on the last
        # text; SGLang sends one per choice at its own first output, then only text, then, once
        # every choice is done, one event per choice with an empty delta and its finish reason
        # (serving_chat.py: "Send finish_reason chunks for each index that completed"). A
        # completions stream has no opening and puts the reason on its last text, in both.
        chat = kind == "chat"
        vllm_opening = self.options.vllm and chat
        closing_events = chat and not self.options.vllm
        opened = [not closing_events] * len(calls)
        first = [True] * len(calls)
        finished: list[tuple[int, str | None, Any]] = []
        emitted = 0
        remaining = len(calls)
        while remaining:
            index, text, n, done = await calls[0].queue.get()
            call = calls[index]
            req = call.req
            if done and req.finish_reason == "abort":
                # Aborted (`/abort_request`): its choices all end, each with finish reason
                # `abort`, on the normal chunk path, as SGLang's (no error event).
                for other in reqs:
                    self.abort(other.rid)
                if req.abort_status:
                    # An abort with a status (a full queue) is a system error to SGLang: an error
                    # event instead, then only the usage and [DONE] (serving_chat's error_aborted).
                    failed = TwinError(req.abort_message, req.abort_status, HTTPStatus(req.abort_status).name)
                    yield b"data: " + json.dumps({"error": failed.body()}).encode() + b"\n\n"  # json.dumps's spacing
                    break
            if vllm_opening:
                vllm_opening = False
                for c in calls:
                    yield event([role_opening(c.index)])
            if not opened[index] and (n or done):
                opened[index] = True
                yield event([{**role_opening(index), "matched_stop": None}])
            emitted += n
            pieces = call.shape.feed(text, done, req.finish_reason)
            if closing_events:
                if done:
                    finished.append((index, req.finish_reason, req.matched_stop))
                send = any(pieces)  # SGLang sends text only when there is some
                reason, matched = None, None
            else:
                send = bool(n or done or pieces)
                reason, matched = (req.finish_reason, req.matched_stop) if done else (None, None)
            if send:
                choice = call.shape.render(kind, pieces, reason, matched, stream=True, first=first[index])
                first[index] = False
                usage = self._usage(reqs, emitted) if continuous else None
                yield event([vllm.as_vllm_choice(choice) if self.options.vllm else choice], usage)
            remaining -= done
        for index, reason, matched in finished if remaining == 0 else ():  # none after an error event
            closing = calls[index].shape.render(kind, [], reason, matched, stream=True) | {
                "delta": {},
                "logprobs": None,
            }
            yield event([closing], self._usage(reqs, emitted) if continuous else None)
        if self.config.speculative and request.return_spec_tokens_details and remaining == 0:
            yield sse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": request.model,
                    "choices": [],
                    "sglext": {"spec_tokens_details": self._spec_details(reqs)},
                }
            )
        if include_usage:
            final = self._usage(reqs)
            if kind != "chat" and not self.options.vllm:
                # SGLang's completions usage chunk is dumped with exclude_none: no null details
                final = {name: value for name, value in final.items() if value is not None}
            yield event([], final)
        yield b"data: [DONE]\n\n"

    # ---- other endpoints ------------------------------------------------------------------

    async def health_generate(self) -> Response:
        """A one-token generation sent to the next rank in turn: 200 once any rank's scheduler
        output arrives (SGLang's check: another request's tokens count, so a busy server answers
        at once, and one with a hung rank among busy ones passes), 503 after the timeout."""
        loops = self.running_loops
        rank = self.rank_for({})
        loop = loops[rank]
        req = self.engines[rank].new_request(
            1, now=loop.now(), max_new_tokens=1, output_len=1, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}"
        )
        before = self.outputs
        loop.submit(req)
        deadline = time.monotonic() + HEALTH_GENERATE_TIMEOUT_S
        while True:
            self.heard.clear()
            if self.outputs > before:
                return Response(status_code=200)
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self.heard.wait(), left)
            except TimeoutError:
                loop.abort(req.rid)
                return Response(status_code=503)

    def loads(self, include: str, dp_rank: int | None = None) -> dict[str, Any]:
        """Every rank's last published snapshot (one rank's with `dp_rank`; none for a rank the
        server does not have, as SGLang)."""
        loops = self.running_loops
        ranks = range(len(loops)) if dp_rank is None else [r for r in (dp_rank,) if 0 <= r < len(loops)]
        return {
            "timestamp": iso_timestamp(time.time()),
            "version": SGLANG_VERSION,
            "accelerator": "twin",
            "num_accelerators": 1,
            "loads": [self._snapshot(rank, include) for rank in ranks],
        }

    def _snapshot(self, rank: int, include: str) -> dict[str, Any]:
        snapshot = dict(self.engines[rank].load_snapshot)
        snapshot["timestamp"] = self.loops[rank].epoch(snapshot["timestamp"])
        if not self.options.enable_metrics:
            # Filled from the metrics stats object in SGLang: reads 0 without --enable-metrics.
            snapshot["gen_throughput"] = 0.0
            snapshot["utilization"] = 0.0
            snapshot["cache_hit_rate"] = 0.0
            if "speculative" in snapshot:
                snapshot["speculative"] = dict(snapshot["speculative"], accept_rate=0.0)
        sections = {part.strip() for part in include.split(",") if part.strip()}
        if "all" not in sections:
            for name in ("queues", "speculative"):
                key = "spec" if name == "speculative" else name
                if key not in sections:
                    snapshot.pop(name, None)
        return snapshot

    def internal_state(self, engine: Engine) -> dict[str, Any]:
        """One rank's entry of /server_info's internal_states."""
        cfg = self.config
        state: dict[str, Any] = {
            "world_size": 1,
            "startup_time": self.started,
            "effective_max_running_requests_per_dp": cfg.max_running_requests,
            "last_gen_throughput": engine.gauges.get("gen_throughput", 0.0),
            "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": cfg.max_total_num_tokens, "graph": 0.0},
            "disaggregation_mode": "null",
        }
        if cfg.speculative and engine.spec_num_forward_ct:
            state["avg_spec_accept_length"] = engine.accept_length
        return state

    def server_info(self) -> dict[str, Any]:
        cfg, opts, engine = self.config, self.options, self.engine
        spec = cfg.speculative
        return {
            "model_path": opts.model_path,
            "served_model_name": opts.model_name,
            "host": opts.host,
            "port": opts.port,
            "context_length": cfg.context_length,
            "max_running_requests": cfg.max_running_requests,
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "page_size": cfg.page_size,
            "disable_radix_cache": not cfg.enable_prefix_cache,
            "enable_cache_report": opts.enable_cache_report,
            "enable_metrics": opts.enable_metrics,
            "enable_trace": opts.enable_trace,
            "otlp_traces_endpoint": opts.otlp_traces_endpoint,
            "decode_log_interval": cfg.decode_log_interval,
            "load_snapshot_publish_interval": cfg.load_publish_interval,
            "random_seed": opts.seed,
            "speculative_algorithm": (opts.speculative_algorithm or "EAGLE3") if spec else None,
            "speculative_num_steps": cfg.num_steps if spec else None,
            "speculative_eagle_topk": 1 if spec else None,
            "speculative_num_draft_tokens": cfg.num_steps + 1 if spec else None,
            "disable_overlap_schedule": spec,
            "status": "ready",
            "max_req_input_len": cfg.context_length - 1,
            "version": SGLANG_VERSION,
            "frontend": "python",
            "dp_size": len(self.engines),
            "load_balance_method": "round_robin",
            "internal_states": [self.internal_state(e) for e in self.engines],
            # The twin's own options, beside SGLang's fields:
            "twin": True,
            "mode": opts.mode,
            "profile": opts.profile,
            "time_scale": opts.time_scale,
            "mean_alpha": engine.mean_alpha if spec else None,
            "workload_alpha": dict(cfg.workload_alpha) if spec else None,
            "output_len": opts.output_len,
        }

    def model_card(self) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": self.options.model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "vllm" if self.options.vllm else "sglang",
            "root": self.options.model_path,
            "parent": None,
            "max_model_len": self.config.context_length,
        }
        if self.options.vllm:
            card["permission"] = [
                {
                    "id": f"modelperm-{self.options.seed:032x}",
                    "object": "model_permission",
                    "created": int(self.started),
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ]
        return card


def check_output_length(max_new_tokens: int | None, context_length: int) -> None:
    """SGLang's chat check before the prompt is counted (serving_chat._validate_request)."""
    if max_new_tokens and max_new_tokens > context_length:
        raise TwinError(
            f"max_completion_tokens is too large: {max_new_tokens}."
            f"This model supports at most {context_length} completion tokens."
        )


def check_context(prompt_tokens: int, max_new_tokens: int | None, context_length: int) -> None:
    """SGLang's length checks (tokenizer_manager._validate_one_request, no auto-truncate)."""
    if prompt_tokens >= context_length:
        raise TwinError(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    if max_new_tokens is not None and max_new_tokens + prompt_tokens > context_length:
        raise TwinError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {max_new_tokens + prompt_tokens} tokens: {prompt_tokens} tokens from the "
            f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens "
            "in the input messages or the completion to fit within the limit."
        )


def iso_timestamp(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC).isoformat()


def sglang_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A chat stream delta as SGLang writes it: msgspec's StreamDelta (`reasoning_content` first,
    always; role and content only when set), or, carrying tool calls, pydantic's DeltaMessage
    (role, content and reasoning_content, null when unset, then the calls)."""
    if "tool_calls" in delta:
        return {"role": None, "content": None, "reasoning_content": None} | delta
    return {"reasoning_content": None} | delta


def role_opening(index: int) -> dict[str, Any]:
    """A chat stream's first event of choice `index`: the role, no text."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SseResponse:
    """An SSE stream that notices the client leaving even while no chunk is due (e.g. queued)."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        on_disconnect: Callable[[bool], object],
        headers: Headers = (),
        at_once: bool = True,
    ):
        self.chunks = chunks
        self.on_disconnect = on_disconnect
        self.headers = list(headers)
        self.at_once = at_once
        """The status and headers go at once (vLLM), else with the first chunk (SGLang's chat
        and completions: a queued request's client sees nothing until its prefill is done)."""
        self.started = False

    async def _start(self, send: Send) -> None:
        self.started = True
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                # Starlette's StreamingResponse(media_type="text/event-stream"), as SGLang's and vLLM's
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), *self.headers],
            }
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.at_once:
            await self._start(send)
        gone = asyncio.ensure_future(wait_disconnect(receive))
        writer = asyncio.ensure_future(self._write(send))
        try:
            await asyncio.wait({gone, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not writer.done():
                self.on_disconnect(self.started)  # the client left first: the engine request goes
                writer.cancel()
            gone.cancel()
            outcome, _ = await asyncio.gather(writer, gone, return_exceptions=True)
        if isinstance(outcome, Exception):
            self.on_disconnect(self.started)
            if not isinstance(outcome, OSError):  # OSError: the client went away mid-write
                log.error("stream failed", exc_info=outcome)

    async def _write(self, send: Send) -> None:
        try:
            async for chunk in self.chunks:
                if not self.started:
                    await self._start(send)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not self.started:
                await self._start(send)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except DroppedOnPurpose:
            # The drop fault cuts the connection; an ASGI app can do that only once its response
            # has started (else the server answers a 500 for it), so the status goes first.
            if not self.started:
                await self._start(send)
            raise
        finally:
            await self.chunks.aclose()  # type: ignore[attr-defined]


ABORT_AFTER_STREAM_S = 2.0
"""SGLang's create_abort_task: a started stream whose client left is aborted after this sleep."""
STATE_WAIT_TIMEOUT_S = 4.0
"""SGLang's SGLANG_REQUEST_STATE_WAIT_TIMEOUT: how often a request with no output yet checks
that its client is still there."""

Reply = Response | SseResponse
"""What a route returns: a Starlette response, or the ASGI stream above (Starlette calls either)."""


async def sick_stream(chunks: AsyncIterator[bytes], faults: Faults) -> AsyncIterator[bytes]:
    """`chunks` cut short as the faults say: hung (no further byte, no end) or dropped."""
    sent = 0
    try:
        async for chunk in chunks:
            if faults.drop_after_chunks is not None and sent >= faults.drop_after_chunks:
                raise DroppedOnPurpose("the twin drops this stream on purpose")
            if faults.hang_after_chunks is not None and sent >= faults.hang_after_chunks:
                await asyncio.Event().wait()  # until the client leaves (the task is cancelled)
            yield chunk
            sent += 1
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def loads_as_prometheus(loads: list[dict[str, Any]]) -> str:
    """/v1/loads?format=prometheus: flat gauges sglang_<field>{dp_rank="N"} (underscores, as SGLang)."""
    lines = []
    for load in loads:
        label = f'{{dp_rank="{load["dp_rank"]}"}}'
        flat = {k: v for k, v in load.items() if isinstance(v, (int, float)) and k not in ("dp_rank", "timestamp")}
        for section in ("speculative",):
            for k, v in load.get(section, {}).items():
                flat[f"spec_{k}"] = v
        lines += [f"sglang_{name}{label} {float(value)}" for name, value in flat.items()]
    return "\n".join(lines) + "\n"


def error_response(exc: TwinError, server: str = "sglang") -> JSONResponse:
    body = vllm.error_body(exc.message, exc.status) if server == "vllm" else exc.body()
    return JSONResponse(body, status_code=exc.status)


def create_app(options: TwinOptions, config: EngineConfig) -> Starlette:
    twin = Twin(options, config)

    def guarded(handler: Callable[[HttpRequest], Awaitable[Reply]]) -> Callable[[HttpRequest], Awaitable[Reply]]:
        async def endpoint(request: HttpRequest) -> Reply:
            try:
                return await handler(request)
            except TwinError as exc:
                return error_response(exc, options.server)

        return endpoint

    async def chat(request: HttpRequest) -> Reply:
        return await twin.generate("chat", request)

    responses = Responses(twin)

    def nested(handler: Callable[[HttpRequest], Awaitable[Reply]]) -> Callable[[HttpRequest], Awaitable[Reply]]:
        """/v1/responses answers errors with OpenAI's nested body (in both servers' shapes)."""

        async def endpoint(request: HttpRequest) -> Reply:
            try:
                return await handler(request)
            except ResponsesError as exc:
                return exc.response()
            except TwinError as exc:
                return ResponsesError(exc.message, exc.status, err_type=exc.err_type).response()

        return endpoint

    async def create_response(request: HttpRequest) -> Reply:
        return await responses.create(request)

    async def retrieve_response(request: HttpRequest) -> Reply:
        return responses.retrieve(request.path_params["response_id"])

    async def cancel_response(request: HttpRequest) -> Reply:
        return await responses.cancel(request.path_params["response_id"])

    async def completions(request: HttpRequest) -> Reply:
        return await twin.generate("completion", request)

    async def models(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [twin.model_card()]})

    async def model(request: HttpRequest) -> Response:
        name = request.path_params["model"]
        if name != options.model_name:
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model '{name}' does not exist",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
                status_code=404,
            )
        return JSONResponse(twin.model_card())

    async def health(request: HttpRequest) -> Response:
        # As SGLang with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false: no generation, so a
        # probe never takes a slot; /health_generate runs a real one-token generation.
        return Response(status_code=200 if twin.loop is not None else 503)

    async def health_generate(request: HttpRequest) -> Response:
        return await twin.health_generate()

    async def loads(request: HttpRequest) -> Response:
        if twin.faults.load_delay_ms:
            await asyncio.sleep(twin.faults.load_delay_ms / 1000.0)
        try:
            rank = int(request.query_params["dp_rank"]) if "dp_rank" in request.query_params else None
        except ValueError:
            raise TwinError("dp_rank must be a whole number.", err_type="Bad Request") from None
        answer = twin.loads(request.query_params.get("include", "all"), rank)
        if request.query_params.get("format") == "prometheus":
            return Response(loads_as_prometheus(answer["loads"]), media_type="text/plain; version=0.0.4")
        return JSONResponse(answer)

    async def server_info(request: HttpRequest) -> Response:
        return JSONResponse(twin.server_info())

    async def model_info(request: HttpRequest) -> Response:
        return JSONResponse(
            {
                "model_path": options.model_path,
                "served_model_name": options.model_name,
                "tokenizer_path": options.model_path,
                "is_generation": True,
                "weight_version": "default",
                "model_type": "twin",
                "architectures": ["TwinForCausalLM"],
            }
        )

    async def metrics(request: HttpRequest) -> Response:
        if not options.enable_metrics:
            return Response("Not Found", status_code=404)
        return Response(twin.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def abort_request(request: HttpRequest) -> Response:
        try:
            rid = (await request.json())["rid"]
        except (ValueError, KeyError, TypeError):
            raise TwinError("abort_request needs a JSON body with a rid.", err_type="Bad Request") from None
        twin.abort_request(str(rid))
        return Response(status_code=200)

    async def set_alpha(request: HttpRequest) -> Response:
        """Twin-only admin endpoint: change the server's mean acceptance alpha now."""
        if not config.speculative:
            raise TwinError("This twin runs in base mode: it has no acceptance rate to set.")
        try:
            alpha = float((await request.json())["alpha"])
            check_alpha(alpha)
        except (ValueError, KeyError, TypeError) as exc:
            raise TwinError(f'Send {{"alpha": <a number in [0, 1)>}}: {exc}', err_type="Bad Request") from None
        for engine in twin.engines:
            engine.set_mean_alpha(alpha)
        return JSONResponse({"alpha": alpha})

    async def set_faults(request: HttpRequest) -> Response:
        """Twin-only admin endpoint: make this server sick (or well again: {}) now."""
        try:
            faults = Faults.parse(await request.json())
            faults.check_ranks(len(twin.engines))
        except (ValueError, TypeError) as exc:
            raise TwinError(f"Send a JSON object of faults: {exc}", err_type="Bad Request") from None
        twin.faults = faults
        twin.apply_wedges()
        return JSONResponse(twin.faults.as_dict())

    async def root(request: HttpRequest) -> Response:
        return Response("SGLang is running (specroute twin)", media_type="text/plain")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        twin.start_loops()
        try:
            yield
        finally:
            await twin.stop_loops()
            if twin.tracer is not None:
                twin.tracer.shutdown()

    async def vllm_metrics(request: HttpRequest) -> Response:
        return Response(twin.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def vllm_version(request: HttpRequest) -> Response:
        return JSONResponse({"version": vllm.VLLM_VERSION})

    async def vllm_load(request: HttpRequest) -> Response:
        return JSONResponse({"server_load": 0})

    async def not_found(request: HttpRequest, exc: Exception) -> Response:
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    common = [
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/responses", nested(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", nested(retrieve_response), methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", nested(cancel_response), methods=["POST"]),
        Route("/health", guarded(health), methods=["GET"]),
        Route("/specroute/twin/faults", guarded(set_faults), methods=["POST"]),
    ]
    if options.vllm:
        routes = common + [
            Route("/metrics", guarded(vllm_metrics), methods=["GET"]),  # always on in vLLM
            Route("/ping", guarded(health), methods=["GET", "POST"]),
            Route("/version", guarded(vllm_version), methods=["GET"]),
            Route("/load", guarded(vllm_load), methods=["GET"]),
        ]
        app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found})
        app.state.twin = twin
        return app
    routes = common + [
        Route("/v1/models/{model:path}", guarded(model), methods=["GET"]),
        Route("/health_generate", guarded(health_generate), methods=["GET"]),
        Route("/v1/loads", guarded(loads), methods=["GET"]),
        Route("/server_info", guarded(server_info), methods=["GET"]),
        Route("/get_server_info", guarded(server_info), methods=["GET"]),
        Route("/model_info", guarded(model_info), methods=["GET"]),
        Route("/get_model_info", guarded(model_info), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/abort_request", guarded(abort_request), methods=["POST"]),
        # SGLang after 0.5.15: readiness (its tokenizer manager's), and SageMaker's ping.
        Route("/ready", guarded(health), methods=["GET"]),
        Route("/ping", guarded(health), methods=["GET", "POST"]),
        Route("/specroute/twin/alpha", guarded(set_alpha), methods=["POST"]),
        Route("/", guarded(root), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.twin = twin
    return app
