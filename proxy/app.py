"""The ASGI application: completions on a raw hot path, everything else on FastAPI.

app = create_app(settings)            # settings from proxy.settings.load_settings()
uvicorn.run(app, ...)                 # proxy.server.serve does this with graceful shutdown
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import cachetools
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from proxy import openapi
from proxy.auth import KEY_SCOPE, Access, AuthRefused, KeyLimits, Role, without_authorization
from proxy.connection import CLOSE_EXTENSION
from proxy.errors import ProxyError, error_object, error_type_for
from proxy.hooks import Telemetry
from proxy.poller import found_again_within_s
from proxy.relay import (
    COMPLETION_PATHS,
    CompletionHandler,
    Receive,
    Scope,
    Send,
    request_headers,
    request_id_of,
)
from proxy.responses import Answer, HeadersFor
from proxy.routing import Router
from proxy.settings import Settings
from proxy.state import public_decisions
from proxy.telemetry.names import STORED_RESPONSES_PREFIX
from proxy.upstream import UPSTREAM_ERRORS, Upstream

log = logging.getLogger("specroute")

MODELS_TIMEOUT_S = 3.0


class SpecrouteApp:
    """Routes the two completion paths to CompletionHandler, the rest to the FastAPI app."""

    def __init__(self, settings: Settings, telemetry: Telemetry | None = None, router: Router | None = None) -> None:
        self.settings = settings
        self.telemetry = telemetry or Telemetry()
        self.router = router or Router.from_settings(settings, on_ejected=self.telemetry.upstream_ejected)
        self.upstream = Upstream(settings)
        self.access = Access.from_settings(settings)
        self.key_limits = KeyLimits(settings.key_max_concurrency)
        self.draining = False
        """Set on SIGTERM: /ready answers 503 while running requests finish."""
        self.completions = CompletionHandler(settings, self.router, self.upstream, self.telemetry)
        self.models_cache: cachetools.TTLCache[str, list[dict[str, Any]]] = cachetools.TTLCache(
            maxsize=1, ttl=settings.models_cache_s or 1e-9
        )
        self.api = management_api(self)
        self.telemetry.install(self.api)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.draining:
                # Every answer closes its connection: a kept-alive client would send its next
                # request on a connection the closing listener is about to drop.
                close = scope.get("extensions", {}).get(CLOSE_EXTENSION)
                if close is not None:
                    close()
            checked = self.access.check(scope["path"], scope["headers"])
            if isinstance(checked, AuthRefused):
                await self.refuse(scope, send, checked)
                return
            if self.access.enabled:
                # The client's key stops here: never forwarded, logged or traced. Its digest
                # scopes the client's session names (`proxy.routing.session_key`).
                scope["headers"] = without_authorization(scope["headers"])
                if checked is not None:
                    scope[KEY_SCOPE] = checked
            if scope["path"] in COMPLETION_PATHS or scope["path"].startswith(STORED_PREFIX):
                # Stored responses' GET and cancel count against a key's limit as completions do.
                handler = self.completions if scope["path"] in COMPLETION_PATHS else self.api
                if checked is None or not self.key_limits.limit:
                    await handler(scope, receive, send)
                    return
                if not self.key_limits.acquire(checked):
                    await self.refuse(scope, send, self.key_limits.refusal())
                    return
                try:
                    await handler(scope, receive, send)
                finally:
                    self.key_limits.release(checked)
                return
        await self.api(scope, receive, send)

    async def refuse(self, scope: Scope, send: Send, refusal: AuthRefused) -> None:
        """A 401/403/429 before the body is read (proxy.connection closes the connection when a
        body was announced and not read, an unanswered `Expect: 100-continue` included)."""
        request_id = request_id_of(request_headers(scope)[0])
        self.telemetry.auth_refused(refusal.reason, scope["method"], scope["path"], request_id, refusal.status)
        body = refusal.body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()),
            *refusal.headers,
        ]
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        await self.upstream.start()
        await self.telemetry.start()
        await self.router.start()
        self.completions.bodies.start()
        reloads_on_sighup = self.access.keys.path is not None and threading.current_thread() is threading.main_thread()
        if reloads_on_sighup:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.access.keys.reload)
        try:
            yield
        finally:
            if reloads_on_sighup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            # Each stops even if the one before failed (logged), the upstream session last.
            for stop in (
                self.completions.bodies.close,
                self.completions.aborts.close,
                self.router.stop,
                self.telemetry.stop,
                self.upstream.stop,
            ):
                try:
                    await stop()
                except Exception:
                    log.exception("stopping %s failed", getattr(stop, "__qualname__", stop))

    def readiness(self) -> dict[str, Any]:
        # Each server's health as the state endpoint and the metrics show it (a lagging one,
        # silent while a pool-mate answers, gets no requests: not healthy).
        shown = {state.url: state.healthy for pool in self.router.snapshot().pools.values() for state in pool.instances}
        pools = {
            name: [
                {"name": i.name, "healthy": shown.get(i.url, i.healthy), "in_flight": i.in_flight}
                for i in pool.instances
            ]
            for name, pool in self.router.pools.items()
        }
        return {"ready": self.router.ready and not self.draining, "draining": self.draining, "pools": pools}

    async def models(self) -> list[dict[str, Any]]:
        """The models the pools serve, one entry per id, from each instance's GET /v1/models."""
        cached = self.models_cache.get("models")
        if cached is not None:
            return cached
        # The servers that take requests (a stopped one held every answer for the timeout), or
        # every one when none does.
        instances = [i for i in self.router.instances() if i.healthy] or self.router.instances()
        answers = await asyncio.gather(
            *(
                self.upstream.get_json(i.url + "/v1/models", auth_headers(i.api_key), MODELS_TIMEOUT_S)
                for i in instances
            ),
            return_exceptions=True,
        )
        models: dict[str, dict[str, Any]] = {}
        reached = 0
        for answer in answers:
            if isinstance(answer, UPSTREAM_ERRORS) or not isinstance(answer, dict):
                continue
            reached += 1
            for card in answer.get("data") or ():
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    models.setdefault(card["id"], card)
        if not reached:
            retry_after = found_again_within_s(self.settings.poll_interval_ms / 1000)
            raise ProxyError(
                503,
                "no upstream server answered GET /v1/models",
                code="no_upstream",
                headers=[(b"retry-after", str(retry_after).encode())],
            )
        merged = list(models.values())
        self.models_cache["models"] = merged
        return merged


def process_state() -> dict[str, Any]:
    """Tasks on the event loop, open file descriptors, resident memory (Linux /proc)."""
    state: dict[str, Any] = {"asyncio_tasks": len(asyncio.all_tasks())}
    try:
        state["open_fds"] = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/status") as status:
            rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        state["rss_mb"] = round(rss_kb / 1024, 1)
    except (OSError, StopIteration, ValueError):
        pass  # not Linux: tasks only
    return state


def auth_headers(api_key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {api_key}")] if api_key else []


def error_response(
    status: int, message: str, code: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": error_object(message, error_type_for(status), code)}, status, headers=headers)


STORED_PREFIX = STORED_RESPONSES_PREFIX
"""Stored responses' GET and cancel (proxy.responses)."""
SERVED_PATHS = (
    "POST /v1/chat/completions, /v1/completions and /v1/responses (with GET /v1/responses/{id} and "
    "POST /v1/responses/{id}/cancel), and answers GET /v1/models"
)
READ_METHODS = ["GET", "HEAD"]
"""The read-only endpoints answer HEAD too (load balancers' and uptime checks' probes), as SGLang's
Starlette routes do; uvicorn sends a HEAD answer's headers without its body."""


def management_api(app: SpecrouteApp) -> FastAPI:
    api = FastAPI(title="specroute", lifespan=app.lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(ProxyError)
    async def _proxy_error(_: Request, exc: ProxyError) -> JSONResponse:
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in exc.headers}  # retry-after
        return JSONResponse({"error": error_object(exc.message, exc.type, exc.code, exc.param)}, exc.status, headers)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:  # OpenAI answers an unknown URL as an invalid request
            message = f"{where}: specroute does not serve this path; it routes {SERVED_PATHS}"
            body = error_object(message, "invalid_request_error", "unknown_url")
            request_id = request_id_of(request_headers(request.scope)[0])
            app.telemetry.unknown_path(request.method, request.url.path, request_id)
            return JSONResponse({"error": body}, 404, headers={**(exc.headers or {}), "x-request-id": request_id})
        code = "method_not_allowed" if exc.status_code == 405 else str(exc.status_code)
        return error_response(exc.status_code, f"{where}: {exc.detail}", code=code, headers=exc.headers)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc.errors()), code="invalid_request")

    description = openapi.describe()

    @api.api_route("/openapi.json", methods=READ_METHODS, include_in_schema=False)
    async def openapi_document() -> dict[str, Any]:
        """The OpenAPI description of the proxy's API (proxy/openapi.py)."""
        return description

    @api.api_route("/health", methods=READ_METHODS)
    async def health() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @api.api_route("/ready", methods=READ_METHODS)
    async def ready() -> JSONResponse:
        """Readiness: some pool can take work and the server is not draining."""
        state = app.readiness()
        return JSONResponse(state, 200 if state["ready"] else 503)

    @api.api_route("/v1/specroute/state", methods=READ_METHODS)
    async def routing_state(request: Request) -> dict[str, Any]:
        """The router's live view: snapshot, acceptance, cost estimates, recent decisions, and
        the process's own resources (what a leak would show). With keys on, only an operator
        reads the decisions' per-request fields (`proxy.state.PUBLIC_DECISION_FIELDS`)."""
        state = {**app.router.state(), "process": process_state()}
        if app.access.enabled and app.access.keys.role_of_digest(request.scope.get(KEY_SCOPE)) is not Role.OPERATOR:
            state["decisions"] = public_decisions(state["decisions"])
        return state

    @api.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> Response:
        """A stored response, from the server that holds it (proxy/responses.py)."""
        request_id, headers_for = client_headers(app, request)
        began = time.perf_counter()
        client = request.scope.get(KEY_SCOPE)
        answer = await app.completions.responses.get(response_id, headers_for, request_id, client, request.url.query)
        return answered(app, "get", answer, request_id, began)

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        """Cancel a background response, on the server running it."""
        # It takes no body (OpenAI's and SGLang's): one a client sends is read and dropped (left
        # unread, it could end the kept-alive connection), bounded as a completion's.
        limit = app.settings.max_body_bytes
        too_large = error_response(413, f"request body over {limit} bytes", "request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return too_large
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return too_large
        except ClientDisconnect:  # gone before its body was in: nothing to answer, nothing to cancel
            return Response(status_code=499)
        request_id, headers_for = client_headers(app, request)
        began = time.perf_counter()
        client = request.scope.get(KEY_SCOPE)
        answer = await app.completions.responses.cancel(response_id, headers_for, request_id, client, request.url.query)
        return answered(app, "cancel", answer, request_id, began)

    @api.api_route("/v1/models", methods=READ_METHODS)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": await app.models()}

    @api.api_route("/v1/models/{model_id:path}", methods=READ_METHODS)
    async def model(model_id: str) -> dict[str, Any]:
        for card in await app.models():
            if card["id"] == model_id:
                return card
        raise ProxyError(
            404,
            f"The model '{model_id}' does not exist",
            param="model",
            code="model_not_found",
            type="invalid_request_error",  # OpenAI's type for it, as SGLang's
        )

    return api


def client_headers(app: SpecrouteApp, request: Request) -> tuple[str, HeadersFor]:
    """The request id the client's headers give (else a new one), and what a request to an
    instance on its behalf carries (as its completions' would)."""
    headers, _ = request_headers(request.scope)
    request_id = request_id_of(headers)
    client = request.client.host if request.client else None
    return request_id, app.completions.headers_for(headers, request_id, client)


def answered(app: SpecrouteApp, operation: str, answer: Answer, request_id: str, began: float) -> Response:
    """The answer about a stored response, counted and logged as such."""
    # Its URL, as a completion's log line names where it went.
    url = answer.instance.url if answer.instance is not None else None
    app.telemetry.stored_response(operation, request_id, answer.status, url, time.perf_counter() - began)
    headers = {"x-request-id": request_id}
    if answer.instance is not None:
        headers["x-specroute-backend"] = answer.instance.name
        headers["x-specroute-pool"] = answer.instance.pool
    return Response(answer.body, answer.status, headers=headers, media_type=answer.content_type)


def create_app(settings: Settings, telemetry: Telemetry | None = None) -> SpecrouteApp:
    return SpecrouteApp(settings, telemetry)
