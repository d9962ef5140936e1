"""Observability: OpenTelemetry traces, Prometheus metrics and JSON request logs.

`SpecrouteTelemetry(settings, version)` is what the app installs (proxy.hooks.Telemetry); each
request gets a `RequestRecorder`. Names of spans, attributes and metrics live in `names`.
"""

from proxy.telemetry.request import RequestRecorder
from proxy.telemetry.service import SpecrouteTelemetry

__all__ = ["RequestRecorder", "SpecrouteTelemetry"]
