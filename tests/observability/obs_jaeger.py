"""A real Jaeger v2 for the trace tests (built from source once by tests/support/build_jaeger.sh).

It listens on 127.0.0.1 only, on free ports, with in-memory storage; tests read traces back
through its query API (/api/v3), polling with a bounded deadline.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "tests" / "support" / "build_jaeger.sh"

CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
  jaeger_query:
    # Jaeger's query service traces itself to localhost:4317 unless told not to: that would send
    # spans into another test's collector and spend 10 s at exit on a timed-out export.
    enable_tracing: false
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query_http}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:{health}
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{otlp_grpc}
      http:
        endpoint: 127.0.0.1:{otlp_http}
processors:
  batch:
    timeout: 50ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out for port 0 (all held open together, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def poll(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Return condition()'s first truthy value; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    """OTLP-JSON attributes as a plain dict (int64 arrive as strings; arrays as lists)."""

    def value(v: dict[str, Any]) -> Any:
        if "stringValue" in v:
            return v["stringValue"]
        if "intValue" in v:
            return int(v["intValue"])
        if "doubleValue" in v:
            return float(v["doubleValue"])
        if "boolValue" in v:
            return bool(v["boolValue"])
        if "arrayValue" in v:
            return [value(x) for x in v["arrayValue"].get("values", [])]
        return v

    return {item["key"]: value(item.get("value", {})) for item in items or []}


class Jaeger:
    def __init__(self, binary: str, workdir: Path) -> None:
        self.query_http, query_grpc, self.health, self.otlp_grpc, self.otlp_http = free_ports(5)
        config = workdir / "jaeger.yaml"
        config.write_text(
            CONFIG.format(
                query_http=self.query_http,
                query_grpc=query_grpc,
                health=self.health,
                otlp_grpc=self.otlp_grpc,
                otlp_http=self.otlp_http,
            )
        )
        self.log_path = workdir / "jaeger.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [binary, "--config", str(config)], stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.query_http}", timeout=10)
        poll(self._healthy, 60, "Jaeger to report healthy")

    @property
    def otlp_http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.otlp_http}"

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.otlp_grpc}"

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"Jaeger exited: {self.log_path.read_text()[-2000:]}")
        try:
            health = httpx.get(f"http://127.0.0.1:{self.health}/status", timeout=2)
            return health.status_code == 200 and self.http.get("/api/v3/services").status_code == 200
        except httpx.TransportError:
            return False

    def services(self) -> list[str]:
        return self.http.get("/api/v3/services").json().get("services", [])

    def spans(self, trace_id: str) -> list[dict[str, Any]]:
        """Every span of a trace, each with `service` (its resource's service.name) and `attrs`."""
        response = self.http.get(f"/api/v3/traces/{trace_id}")
        if response.status_code == 404:
            return []
        response.raise_for_status()
        spans = []
        for resource_spans in response.json()["result"]["resourceSpans"]:
            resource = attributes(resource_spans["resource"].get("attributes"))
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    span["service"] = resource.get("service.name")
                    span["resource"] = resource
                    span["attrs"] = attributes(span.get("attributes"))
                    spans.append(span)
        return spans

    def wait_for_spans(
        self, trace_id: str, ready: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30
    ) -> list[dict[str, Any]]:
        """The trace's spans once `ready(spans)` holds (exporters batch; Jaeger stores at once)."""
        found: list[dict[str, Any]] = []

        def check() -> bool:
            found[:] = self.spans(trace_id)
            return ready(found)

        try:
            poll(check, timeout_s, f"trace {trace_id} in Jaeger", interval_s=0.2)
        except AssertionError as exc:
            names = sorted((s["service"], s["name"]) for s in found)
            raise AssertionError(f"{exc}; it holds {names}") from None
        return found

    def traces_of(self, service: str, since_ns: int) -> list[dict[str, Any]]:
        """Spans of every trace of `service` that started after since_ns (the search API)."""

        def rfc3339(ns: int) -> str:
            return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 1_000_000_000)) + "Z"

        response = self.http.get(
            "/api/v3/traces",
            params={
                "query.service_name": service,
                "query.start_time_min": rfc3339(since_ns - 1_000_000_000),
                "query.start_time_max": rfc3339(time.time_ns() + 60_000_000_000),
                "query.num_traces": 100,
            },
        )
        if response.status_code == 404:
            return []
        response.raise_for_status()
        return [
            span
            for rs in response.json()["result"]["resourceSpans"]
            for ss in rs.get("scopeSpans", [])
            for span in ss.get("spans", [])
        ]

    def stop(self) -> None:
        self.http.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


def jaeger_binary() -> str:
    """The cached Jaeger build (made now if missing: `make test` builds it beforehand)."""
    built = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800)
    if built.returncode != 0:
        raise RuntimeError(f"building Jaeger failed:\n{built.stderr[-3000:]}")
    return built.stdout.strip().splitlines()[-1]


def by_name(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]
