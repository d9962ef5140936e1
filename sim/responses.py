"""SGLang's OpenAI Responses API (/v1/responses) over the twin's engine.

As SGLang 0.5.23 serves it for a model without the gpt-oss (harmony) format
(`srt/entrypoints/openai/serving_responses.py`, `protocol.py` ResponsesRequest/ResponsesResponse):

- the prompt is a chat: `instructions` as a leading system message, then the stored history of
  `previous_response_id` (its inputs and outputs), then `input` (a string is one user message);
  the system messages are merged into one at the front, as most chat templates want;
- generation runs through the twin's engine exactly as a chat does (`Twin.start`);
  `max_output_tokens` becomes max_new_tokens less 2 (SGLang keeps two tokens of headroom);
- a stream is named SSE events `event: <type>` / `data: <json>` with a running
  `sequence_number`, one `response.output_text.delta` per engine output that has text, ending
  with `response.completed` (or `.incomplete` when cut by length, `.failed` when aborted), and
  no `data: [DONE]`;
- errors are OpenAI's nested `{"error": {message, type, param, code}}`, not SGLang's flat shape;
- the store (`--enable-response-store`, off by default as in SGLang) keeps finished responses and
  their conversation for GET by id, `previous_response_id`, background requests and cancel.
  Without it those answer 400 "Response store is disabled". SGLang's store is unbounded; the
  twin's keeps the last `STORE_LIMIT` responses.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from sim.protocol import ChatCompletionRequest, TwinError

if TYPE_CHECKING:
    from sim.engine import Request
    from sim.server import Generation, Reply, Twin

STORE_LIMIT = 10_000
"""The most responses the twin's store keeps (the oldest go first)."""

HEADROOM_TOKENS = 2
"""SGLang's ResponsesRequest.to_sampling_params: max_new_tokens = max_output_tokens - 2."""

STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"connection", b"keep-alive"))
"""What SGLang's /v1/responses StreamingResponse adds to the event-stream content type."""

STORE_DISABLED = (
    "Response store is disabled. Stateful Responses require --enable-response-store on a standalone "
    "server; response storage is unavailable in PD mode."
)

ECHOED_EFFORTS = frozenset({"minimal", "low", "medium", "high"})
"""reasoning.effort values SGLang echoes in a response (ECHOABLE_REASONING_EFFORTS)."""


class ResponsesError(Exception):
    """A /v1/responses request answered with OpenAI's nested error body."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, err_type: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}
        return JSONResponse({"error": body}, status_code=self.status)


class ResponsesRequest(BaseModel):
    """The fields of SGLang's ResponsesRequest the twin reads; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, Any] | None = None
    model: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    parallel_tool_calls: bool | None = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    request_id: str = Field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    cache_salt: str | None = None
    extra_key: str | None = None


class ResponseStore:
    """Finished (or background) responses and the conversation each ends, the newest last."""

    def __init__(self, limit: int = STORE_LIMIT):
        self.limit = limit
        self.responses: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.histories: dict[str, list[dict[str, Any]]] = {}

    def get(self, response_id: str) -> dict[str, Any] | None:
        return self.responses.get(response_id)

    def history(self, response_id: str) -> list[dict[str, Any]]:
        return self.histories.get(response_id, [])

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        response_id = response["id"]
        self.responses[response_id] = response
        self.responses.move_to_end(response_id)
        self.histories[response_id] = history
        while len(self.responses) > self.limit:
            old, _ = self.responses.popitem(last=False)
            self.histories.pop(old, None)


# ---- the prompt -----------------------------------------------------------------------------


def chat_part(part: Any) -> Any:
    """A Responses content part as a chat one (input_text/output_text -> text)."""
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    return part


def chat_message(item: dict[str, Any]) -> dict[str, Any]:
    """One Responses input (or replayed output) message item as a chat message."""
    if item.get("type") not in (None, "message"):
        raise ResponsesError(f"Unsupported Responses API input item type: {item.get('type')!r}")
    if item.get("role") not in ("user", "assistant", "system", "developer"):
        # SGLang's request model validates each item (an EasyInputMessage needs its role): a 400.
        raise ResponsesError(f"Input item has no valid role: {str(item.get('role'))[:40]!r}", param="input")
    # A message item's role and content are what a chat template renders (its id, status, type
    # and phase are the item's bookkeeping, not prompt text).
    message = {k: item[k] for k in ("role", "content") if item.get(k) is not None}
    if message.get("role") == "developer":
        message["role"] = "system"
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = [chat_part(part) for part in content]
    return message


def text_of(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return []


def chat_messages(instructions: str | None, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat SGLang renders: instructions and every system message of the history merged
    into one leading system message, then the rest; consecutive assistant turns as one."""
    messages = [chat_message(item) for item in history]
    merged: list[dict[str, Any]] = []
    for message in messages:
        if merged and message.get("role") == "assistant" and merged[-1].get("role") == "assistant":
            merged[-1] = {**merged[-1], "content": text_of(merged[-1].get("content")) + text_of(message.get("content"))}
            merged[-1]["content"] = [{"type": "text", "text": t} for t in merged[-1]["content"]]
        else:
            merged.append(message)
    system = [instructions] if instructions else []
    others = []
    for message in merged:
        if message.get("role") == "system":
            system += text_of(message.get("content"))
        else:
            others.append(message)
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + others


# ---- the answer -----------------------------------------------------------------------------


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant message output item with one output_text part (openai's model_dump order)."""
    content = [output_text(text)] if status == "completed" else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": "final_answer",
    }


def output_text(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def usage_of(req: Request) -> dict[str, Any]:
    """ResponsesResponse's usage (SGLang serves /v1/responses with prompt token details on)."""
    return {
        "input_tokens": req.prompt_tokens,
        "input_tokens_details": {"cached_tokens": req.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": req.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": req.prompt_tokens + req.output_tokens,
    }


def status_of(finish_reason: str | None) -> str:
    if finish_reason == "length":
        return "incomplete"
    if finish_reason == "abort":
        return "failed"
    return "completed"


def response_object(
    request: ResponsesRequest,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """SGLang's ResponsesResponse.from_request, serialized."""
    effort = (request.reasoning or {}).get("effort")
    text = request.text if request.text is not None else ({"format": {"type": "text"}} if output else None)
    return {
        "id": request.request_id,
        "object": "response",
        "created_at": created_at,
        "model": request.model,
        "output": output,
        "status": status,
        "usage": usage,
        "parallel_tool_calls": request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
        "tool_choice": request.tool_choice,
        "tools": request.tools,
        "error": {"code": "server_error", "message": "Generation aborted"} if status == "failed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": effort if effort in ECHOED_EFFORTS else None, "summary": None},
        "store": request.store,
        "temperature": request.temperature,
        "text": text,
        "top_p": request.top_p,
        "truncation": request.truncation,
        "user": request.user,
        "metadata": request.metadata or {},
    }


def event(kind: str, sequence_number: int, fields: dict[str, Any]) -> bytes:
    payload = {**fields, "sequence_number": sequence_number, "type": kind}
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


# ---- the endpoints --------------------------------------------------------------------------


class Responses:
    """/v1/responses, GET /v1/responses/{id} and POST /v1/responses/{id}/cancel of one twin."""

    def __init__(self, twin: Twin):
        self.twin = twin
        self.store: ResponseStore | None = ResponseStore() if twin.options.enable_response_store else None
        self.background: dict[str, tuple[Generation, asyncio.Task[None]]] = {}

    async def create(self, http: HttpRequest) -> Reply:
        if http.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise ResponsesError("Unsupported Media Type: Only 'application/json' is allowed", err_type="Bad Request")
        try:
            request = ResponsesRequest.model_validate(json.loads(await http.body()))
        except (ValueError, ValidationError) as exc:
            raise ResponsesError(str(exc), err_type="Bad Request") from None
        if self.store is None and request.previous_response_id is not None:
            raise ResponsesError(STORE_DISABLED, param="previous_response_id")
        if self.store is None and request.background:
            raise ResponsesError(STORE_DISABLED, param="background")
        if request.background and not request.store:
            raise ResponsesError("background=true requires store=true.", param="store")
        model = self.twin.options.model_name
        if request.model is not None and request.model != model and request.model.split(":", 1)[0] != model:
            raise ResponsesError(f"The model '{request.model}' does not exist", status=404, param="model")
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            assert self.store is not None
            self.lookup(request.previous_response_id)
            history = list(self.store.history(request.previous_response_id))
        history += [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
        messages = chat_messages(request.instructions, history)
        max_new_tokens = None
        if request.max_output_tokens is not None:
            # vLLM's to_sampling_params takes max_output_tokens as it is (no headroom).
            max_new_tokens = request.max_output_tokens - (0 if self.twin.options.vllm else HEADROOM_TOKENS)
            if max_new_tokens < 0:
                raise ResponsesError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        chat = ChatCompletionRequest.model_validate(
            {
                "model": request.model or model,
                "messages": messages,
                "stream": bool(request.stream),
                "temperature": request.temperature,
                "top_p": request.top_p,
                "stop": request.stop,
                "max_completion_tokens": max_new_tokens,
                "cache_salt": request.cache_salt,
                "extra_key": request.extra_key,
            }
        )
        twin = self.twin
        try:
            await twin.show_faults()
            if self.store is not None and self.store.get(request.request_id) is not None:
                raise TwinError(f"Duplicate request id {request.request_id!r}.")
            run = twin.start(chat, {"messages": messages}, http.headers, request.request_id)
        except TwinError as exc:
            raise ResponsesError(exc.message, status=exc.status, err_type=exc.err_type) from None
        created_at = int(time.time())
        persist = self.store is not None and bool(request.store)
        if request.background and not request.stream and persist:
            return self.run_in_background(request, run, history, created_at)
        if request.stream:
            return twin.sse(self.stream(request, run, history, created_at, persist), run.abort, STREAM_HEADERS)
        pieces = await twin.collect(run, http.receive)
        if pieces is None:  # the client left; nobody reads this
            return Response(status_code=499)
        response = self.finish(request, run, "".join(pieces[0]), history, created_at, persist)
        return JSONResponse(response)

    def lookup(self, response_id: str) -> dict[str, Any]:
        if not response_id.startswith("resp_"):
            raise ResponsesError(
                f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.", param="response_id"
            )
        response = self.store.get(response_id) if self.store is not None else None
        if response is None:
            raise ResponsesError(f"Response with id '{response_id}' not found.", status=404, param="response_id")
        return response

    def retrieve(self, response_id: str) -> Response:
        if self.store is None:
            raise ResponsesError(STORE_DISABLED, param="response_id")
        return JSONResponse(self.lookup(response_id))

    async def cancel(self, response_id: str) -> Response:
        if self.store is None:
            raise ResponsesError(STORE_DISABLED, param="response_id")
        response = self.lookup(response_id)
        if response["status"] in ("queued", "in_progress"):
            # Only a background response can be in progress in the store; a finished one is
            # answered as it is.
            response["status"] = "cancelled"
            running = self.background.pop(response_id, None)
            if running is not None:
                run, task = running
                run.abort()
                task.cancel()
        return JSONResponse(response)

    def finish(
        self,
        request: ResponsesRequest,
        run: Generation,
        text: str,
        history: list[dict[str, Any]],
        created_at: int,
        persist: bool,
        item_id: str | None = None,
    ) -> dict[str, Any]:
        """The final response of a finished generation, stored if it is to be (and not
        cancelled meanwhile)."""
        req = run.calls[0].req
        output = [output_message(item_id or f"msg_{uuid.uuid4().hex}", text, "completed")] if text else []
        response = response_object(request, created_at, status_of(req.finish_reason), output, usage_of(req))
        if persist and self.store is not None:
            stored = self.store.get(request.request_id)
            if stored is None or stored["status"] != "cancelled":
                self.store.put(response, history + output)
        return response

    def run_in_background(
        self, request: ResponsesRequest, run: Generation, history: list[dict[str, Any]], created_at: int
    ) -> Response:
        assert self.store is not None
        queued = response_object(request, created_at, "queued", [], None)
        self.store.put(dict(queued), history)

        async def work() -> None:
            stored = self.store.get(request.request_id) if self.store is not None else None
            if stored is not None:
                stored["status"] = "in_progress"
            pieces: list[list[str]] = [[]]
            await self.twin._drain(run.calls, pieces)
            self.background.pop(request.request_id, None)
            self.finish(request, run, "".join(pieces[0]), history, created_at, persist=True)

        task = asyncio.ensure_future(work())
        self.background[request.request_id] = (run, task)
        return JSONResponse(queued)

    async def stream(
        self,
        request: ResponsesRequest,
        run: Generation,
        history: list[dict[str, Any]],
        created_at: int,
        persist: bool,
    ) -> AsyncIterator[bytes]:
        """SGLang's non-harmony event stream: one text delta per engine output with text."""
        sequence = 0

        def send(kind: str, **fields: Any) -> bytes:
            nonlocal sequence
            chunk = event(kind, sequence, fields)
            sequence += 1
            return chunk

        opening = response_object(request, created_at, "in_progress", [], None)
        yield send("response.created", response=opening)
        yield send("response.in_progress", response=opening)
        call = run.calls[0]
        item_id = f"msg_{uuid.uuid4().hex}"
        text = ""
        opened = False
        done = False
        while not done:
            _, chunk, _, done = await call.queue.get()
            delta = "".join(call.shape.feed(chunk, done, call.req.finish_reason))
            if not delta:
                continue
            if not opened:
                opened = True
                yield send(
                    "response.output_item.added", item=output_message(item_id, "", "in_progress"), output_index=0
                )
                yield send(
                    "response.content_part.added",
                    content_index=0,
                    item_id=item_id,
                    output_index=0,
                    part=output_text(""),
                )
            text += delta
            yield send(
                "response.output_text.delta",
                content_index=0,
                delta=delta,
                item_id=item_id,
                logprobs=[],
                output_index=0,
            )
        if opened:
            part = output_text(text)
            yield send(
                "response.output_text.done", content_index=0, item_id=item_id, logprobs=[], output_index=0, text=text
            )
            yield send("response.content_part.done", content_index=0, item_id=item_id, output_index=0, part=part)
            yield send("response.output_item.done", item=output_message(item_id, text, "completed"), output_index=0)
        final = self.finish(request, run, text, history, created_at, persist, item_id)
        yield send(f"response.{final['status']}", response=final)
