"""specroute's Telemetry: traces (when configured), Prometheus metrics and JSON request logs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Response

from policies import registry
from proxy.hooks import Telemetry
from proxy.settings import without_password
from proxy.telemetry import names as n
from proxy.telemetry.logs import RequestLog
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.request import RequestRecorder
from proxy.telemetry.tracing import Tracing

if TYPE_CHECKING:
    from fastapi import FastAPI

    from fleet.types import Snapshot
    from proxy.settings import Settings

log = logging.getLogger("specroute.telemetry")


class SpecrouteTelemetry(Telemetry):
    """Makes one RequestRecorder per request; owns the tracer provider, metrics and log."""

    def __init__(self, settings: Settings, version: str, tracing: Tracing | None = None) -> None:
        self.policy = settings.policy
        self.trace_content = settings.trace_content
        if tracing is None and settings.traces_enabled:
            tracing = Tracing(
                settings.otlp_protocol,
                version,
                export_process=settings.trace_export == "process",
                log_format=settings.log_format,
            )
        if tracing is not None and not tracing.enabled:  # OTEL_SDK_DISABLED=true
            tracing.shutdown()
            tracing = None
        self.tracing = tracing
        self.trace_endpoint = (
            without_password(settings.otlp_endpoint) if settings.otlp_endpoint else "the SDK's default"
        )
        """Where traces go, as the start-up line names it (a password in it masked)."""
        self.metrics = Metrics(
            {"spec": settings.spec_urls, "base": settings.base_urls},
            settings.policy,
            registry.decisions_of(settings.policy),
        )
        if tracing is not None:
            self.metrics.watch_dropped(lambda: tracing.dropped_requests)
        self.request_log = RequestLog() if settings.request_log else None

    def install(self, app: FastAPI) -> None:
        metrics = self.metrics

        # async: rendering reads the fleet snapshot, which only the event loop may touch.
        @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
        async def prometheus_metrics() -> Response:
            return Response(metrics.render(), media_type=metrics.content_type)

    def auth_refused(self, reason: str, method: str, path: str, request_id: str, status: int) -> None:
        self.metrics.auth_refused.labels(reason).inc()
        self._path_line(method, path, request_id, status, "auth_refused", reason=reason)  # never the key

    def stored_response(
        self, operation: str, request_id: str, status: int, instance: str | None, duration_s: float
    ) -> None:
        outcome = (
            "ok" if status < 400 else "not_found" if status == 404 else "client_error" if status < 500 else "error"
        )
        self.metrics.stored.labels(operation, outcome).inc()
        if self.request_log is not None and operation != "lookup":  # a lookup is its request's
            self.request_log.write(
                {
                    "ts": round(time.time(), 3),
                    "request_id": request_id,
                    "endpoint": f"{'GET' if operation == 'get' else 'POST'} /v1/responses/{{id}}"
                    + ("/cancel" if operation == "cancel" else ""),
                    "status": status,
                    "outcome": outcome,
                    "instance": instance,
                    "duration_ms": round(duration_s * 1000, 3),
                }
            )

    def stored_response_asked(self) -> None:
        self.metrics.stored_asked.inc()

    def upstream_abort(self, pool: str, outcome: str) -> None:
        self.metrics.upstream_aborts.labels(pool, outcome).inc()

    def unknown_path(self, method: str, path: str, request_id: str) -> None:
        self.metrics.unknown_path.inc()
        self._path_line(method, path, request_id, 404, "unknown_url")

    def _path_line(self, method: str, path: str, request_id: str, status: int, outcome: str, **extra: str) -> None:
        """The log line of a request answered before routing: its path as `loggable_path` has
        it, never its query string."""
        if self.request_log is not None:
            line = {
                "ts": round(time.time(), 3),
                "request_id": request_id,
                "endpoint": f"{method} {loggable_path(path)}",
                "status": status,
                "outcome": outcome,
            }
            self.request_log.write(line | extra)

    def hold_released(self, rule: str, held_s: float) -> None:
        self.metrics.released(rule, held_s)

    def watch_held(self, source: Callable[[], int]) -> None:
        self.metrics.watch_held(source)

    def upstream_ejected(self, pool: str, instance: str, reason: str) -> None:
        self.metrics.upstream_ejected(pool, instance, reason)

    def watch_snapshot(self, source: Callable[[], Snapshot | None]) -> None:
        """Give /metrics the fleet's current snapshot (alpha and reading age at scrape time)."""
        self.metrics.watch_snapshot(source)

    def request_hooks(self, endpoint: str) -> RequestRecorder:
        return RequestRecorder(self, endpoint)

    async def start(self) -> None:
        if self.tracing is not None:
            self.tracing.start()
            log.info("exporting traces over OTLP %s to %s", self.tracing.protocol, self.trace_endpoint)

    async def stop(self) -> None:
        if self.tracing is not None:
            await self.tracing.stop()


def loggable_path(path: str) -> str:
    """A path as a log line may carry it: a stored response's id (which reads the conversation
    back) as `{id}`, as the stored-response lines write it, and no more than
    MAX_LOGGED_PATH_CHARS of the rest (the client chose it)."""
    if path.startswith(n.STORED_RESPONSES_PREFIX):
        rest = path[len(n.STORED_RESPONSES_PREFIX) :]
        return n.STORED_RESPONSES_PREFIX + "{id}" + ("/cancel" if rest.endswith("/cancel") else "")
    return path[: n.MAX_LOGGED_PATH_CHARS]
