"""The telemetry seam: one hooks object per request, made by a Telemetry factory.

The request path calls these methods at fixed points; the default does nothing, so with telemetry
off the only cost is a few no-op method calls per request (none per chunk: the relay calls
`chunk` only when `wants_chunks` is true). proxy.telemetry (observability) subclasses both.
Prompts and completions are never handed over: only sizes, counts, statuses and headers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from fleet.types import Decision, Features


class RequestHooks:
    """Calls made on one request, in this order (attempt_* once per upstream attempt)."""

    wants_chunks: bool = False
    """Set True to be called for every relayed chunk (costs a call per chunk)."""

    def received(self, *, endpoint: str, request_id: str, headers: Mapping[str, str], body_bytes: int) -> None:
        """The request's headers arrived, before its body is read or anything refused; `headers`
        are the client's (lower-case names), `body_bytes` its declared Content-Length (0: none)."""

    def decided(
        self,
        *,
        decision: Decision,
        features: Features,
        model: str | None,
        override: str | None,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        """A pool was chosen (by the policy, or by the x-specroute-pool override). `body` is the
        parsed request: telemetry reads sampling parameters from it, and the prompt only when
        the user opted in (SPECROUTE_TRACE_CONTENT)."""

    def attempt_started(
        self,
        *,
        pool: str,
        instance: str,
        attempt: int,
        cached_tokens: int = 0,
        server_kind: str = "",
        resent: bool = False,
    ) -> None:
        """An upstream request is about to be sent (attempt counts from 1); `cached_tokens`: the
        prompt tokens the router credited `instance` with holding in its prefix cache;
        `server_kind`: what `instance` was learned as (proxy/backends), "" if not yet; `resent`:
        sent again to the same server without the `stream_options` the proxy added, which it
        refused (no retry)."""

    def outgoing_headers(self, headers: MutableMapping[str, str]) -> None:
        """Headers about to go upstream for the current attempt; add e.g. traceparent here."""

    def upstream_headers(self, *, status: int, headers: Mapping[str, str]) -> None:
        """The upstream answered with a status line and headers."""

    def response_headers(self, *, waited_s: float) -> list[tuple[bytes, bytes]]:
        """Extra headers for the response about to start; `waited_s` is the time spent so
        far waiting on upstream servers, flow control or the client (the rest is the proxy's own
        overhead)."""
        return []

    def first_chunk(self, data: bytes = b"") -> None:
        """The first body bytes of the response (`data`) are about to go to the client."""

    def chunk(self, *, size: int, events: int, tokens: int) -> None:
        """One relayed chunk: bytes, SSE events and (estimated) completion tokens in it."""

    def attempt_finished(self, *, status: int) -> None:
        """The current attempt ended normally (its response was fully relayed or judged)."""

    def attempt_failed(self, *, error: str, retryable: bool) -> None:
        """The current attempt failed; `error` is a short type token (connect, timeout, status_5xx...)."""

    def finished(
        self,
        *,
        status: int,
        error_type: str | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        finish_reasons: tuple[str, ...],
        client_disconnected: bool,
        waited_s: float = 0.0,
        cached_tokens: int | None = None,
        events: int | None = None,
    ) -> None:
        """The response to the client is complete (or abandoned); called exactly once.
        `waited_s`: all the request's time spent waiting on upstream servers, flow control or
        the client (its body, its reading);
        `cached_tokens`: the prompt tokens the server found in its prefix cache, as its usage
        reported them (usage.prompt_tokens_details.cached_tokens), if it did; `events`: a
        stream's text-carrying events relayed to the client (None: no stream)."""


NO_HOOKS = RequestHooks()


class Telemetry:
    """Factory of RequestHooks plus lifecycle; the default records nothing."""

    def install(self, app: FastAPI) -> None:
        """Add routes (GET /metrics) or middleware to the management app."""

    def request_hooks(self, endpoint: str) -> RequestHooks:
        return NO_HOOKS

    def auth_refused(self, reason: str, method: str, path: str, request_id: str, status: int) -> None:
        """A request was refused by client authentication (401/403) or its key's limit (429)
        before anything else ran; `reason` is a short token (missing, malformed, invalid,
        not_operator, pin_not_allowed, key_concurrency)."""

    def stored_response(
        self, operation: str, request_id: str, status: int, instance: str | None, duration_s: float
    ) -> None:
        """A request about a stored response was answered: `operation` is get, cancel, or lookup
        (a follow-up's previous response); `instance` the name of the server that answered."""

    def stored_response_asked(self) -> None:
        """The proxy sent a server one request about a stored response."""

    def upstream_abort(self, pool: str, outcome: str) -> None:
        """An abandoned attempt's abort (proxy/aborts.py) ended: `outcome` is sent, refused,
        failed or dropped."""

    def unknown_path(self, method: str, path: str, request_id: str) -> None:
        """A request to a path the proxy does not serve was answered 404 (`unknown_url`)."""

    def hold_released(self, rule: str, held_s: float) -> None:
        """Flow control let a held request go by `rule` after `held_s` seconds."""

    def watch_held(self, source: Callable[[], int]) -> None:
        """Give /metrics the number of requests flow control holds now."""

    def upstream_ejected(self, pool: str, instance: str, reason: str) -> None:
        """Outlier detection ejected `instance` (its URL) of `pool`; `reason` is the rule
        (proxy.outliers.RULES), without the failure kind."""

    async def start(self) -> None:
        """Called once at server start-up."""

    async def stop(self) -> None:
        """Called once at shutdown (flush exporters here)."""
