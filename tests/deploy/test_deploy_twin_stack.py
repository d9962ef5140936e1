"""The twin-only stack's commands, run outside Docker.

Commands and environments are what `docker compose -f docker-compose.twins.yml config` resolves
from the file and .env.example, run as local processes with the image's ENV (deploy_tools.Service).
Only what Docker itself would provide is supplied through the file's own variables: loopback
addresses and free ports instead of container networking (TWIN_HOST, SGLANG_*_PORT=0,
SPECROUTE_HOST/PORT, the pool URLs and trace endpoints). Jaeger is the real one the observability
tests use, on free ports, standing in for the jaeger container.
"""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest
from deploy_tools import PROXY_READY, TWIN_READY, Compose, Jaeger, Service, poll, stopped_cleanly

TWINS = "docker-compose.twins.yml"


def served_model_name(command: list[str]) -> str:
    (flag,) = [arg for arg in command if arg.startswith("--served-model-name=")]
    return flag.split("=", 1)[1]


@pytest.mark.timeout(1800)  # the first run builds Jaeger from source (cached afterwards)
def test_twin_stack_commands_serve_and_trace_outside_docker(compose: Compose, jaeger: Jaeger, tmp_path) -> None:
    network = {
        "TWIN_HOST": "127.0.0.1",
        "SGLANG_SPEC_PORT": "0",
        "SGLANG_BASE_PORT": "0",
        "SGLANG_OTLP_TRACES_ENDPOINT": f"127.0.0.1:{jaeger.otlp_grpc}",
    }
    services = compose.config(TWINS, env=network)["services"]
    model = served_model_name(services["sglang-spec"]["command"])
    started: list[Service] = []
    try:
        spec = Service.start("sglang-spec", services["sglang-spec"], tmp_path, TWIN_READY)
        started.append(spec)
        base = Service.start("sglang-base", services["sglang-base"], tmp_path, TWIN_READY)
        started.append(base)
        network |= {
            "SPECROUTE_HOST": "127.0.0.1",
            "SPECROUTE_PORT": "0",
            "SPECROUTE_SPEC_URLS": spec.url,
            "SPECROUTE_BASE_URLS": base.url,
            "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_http_endpoint,
        }
        proxy_service = compose.config(TWINS, env=network)["services"]["specroute"]
        proxy = Service.start("specroute", proxy_service, tmp_path, PROXY_READY)
        started.append(proxy)
        poll(lambda: httpx.get(proxy.url + "/ready", timeout=2).status_code == 200, 30, "the proxy to be ready")

        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [model]
        traces = {}
        for pool in ("spec", "base"):
            trace_id = traces[pool] = secrets.token_hex(16)
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=12,
                stream=True,
                extra_headers={"x-specroute-pool": pool, "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
            )
            chunks = list(stream)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        # The proxy's spans (OTLP/HTTP) and each twin's (OTLP/gRPC) meet in one trace per request.
        for pool, trace_id in traces.items():
            jaeger.wait_for_spans(
                trace_id,
                lambda spans: (
                    "specroute" in {s["service"] for s in spans}
                    and f"sglang-{pool}"
                    in {s["resource"].get("service.instance.id") for s in spans if s["service"] == "sglang"}
                ),
            )
    finally:
        codes = {service.name: service.stop() for service in reversed(started)}
    assert stopped_cleanly(codes["specroute"], proxy.log()), proxy.log()
